//! The envelope's fast path: a scan of the envelopes producers write (the library's, the SDKs', the ones
//! `docs/PROTOCOL.md` shows): the decode was half of a worker's instructions per no-op task.
//!
//! serde_json's decoding (`Deserialize for Envelope`) is the definition; this scan is only a shortcut to the
//! same result. It reads the object's keys, strings, integers and booleans itself and hands each raw JSON value
//! (`data`, unknown fields) to serde_json, which checks and delimits it. It gives up (`None`) on anything it
//! does not read exactly as serde_json would: an escape or a control character in a key or string, a number
//! that is not a plain integer in range, a repeated known key, a missing or empty `type`, anything after the
//! object. The caller then decodes with serde_json, which accepts the payload or says what is wrong with it.
//! So the scan never accepts what serde_json rejects, and what it accepts decodes to the same envelope
//! (`tests::the_scan_agrees_with_serde_json`, and the `envelope` fuzzer compares both on every input).
//!
//! A decode by the scan takes about 1,800 instructions for an envelope of 100 bytes, serde_json's 2,800
//! (callgrind, docs/PERFORMANCE.md, "The envelope's fast path").

use std::borrow::Cow;

use serde_json::value::RawValue;

use super::{Envelope, Fields};

/// The envelope in `text`, or `None` when the scan cannot be sure of it (the caller decodes with serde_json). A
/// repeated known key ends the scan, as a missing or empty type does (`Fields::envelope`).
pub(super) fn envelope(text: &str) -> Option<Envelope<'_>> {
    let mut scan = Scan { text, at: 0 };
    let mut fields = Fields::default();
    scan.skip_space();
    scan.expect(b'{')?;
    scan.skip_space();
    // An empty object has no type: `string` gives up on its `}`.
    loop {
        let key = scan.string()?;
        scan.skip_space();
        scan.expect(b':')?;
        scan.skip_space();
        fields.read(key, &mut scan)?;
        scan.skip_space();
        match scan.next()? {
            b',' => scan.skip_space(),
            b'}' => break,
            _ => return None,
        }
    }
    scan.skip_space();
    if scan.at != text.len() {
        return None;
    }
    fields.envelope()
}

impl<'a> Fields<'a> {
    /// Reads the value of `key` at the scan's position.
    fn read(&mut self, key: &'a str, scan: &mut Scan<'a>) -> Option<()> {
        let text = |scan: &mut Scan<'a>| scan.string().map(Cow::Borrowed);
        match key {
            "id" => once(&mut self.id, text(scan)?),
            "type" => once(&mut self.kind, text(scan)?),
            "data" => once(&mut self.data, scan.raw()?),
            "created_at" => once(&mut self.created_at, scan.nullable(Scan::integer)?),
            "attempt" => once(&mut self.attempt, scan.count()?),
            "priority" => once(&mut self.priority, scan.nullable(text)?),
            "unique" => once(&mut self.unique, scan.boolean()?),
            "last_error" => once(&mut self.last_error, scan.nullable(text)?),
            "recovered" => once(&mut self.recovered, scan.count()?),
            "crashes" => once(&mut self.crashes, scan.count()?),
            "v" => once(&mut self.version, scan.count()?),
            _ => {
                self.extra
                    .push((Cow::Borrowed(key), Cow::Borrowed(scan.raw()?)));
                Some(())
            }
        }
    }
}

/// The offset of the first byte of `bytes` that ends or interrupts a JSON string: a quote, a backslash, or a
/// control character (below 0x20). Eight bytes at a time: the strings are mostly ids of 36 bytes, and a byte loop
/// was half of the scan's instructions (callgrind). Each mask below flags, in its byte's top bit, the bytes that
/// are zero (after an XOR with the byte looked for) or below 0x20; a flag can be wrong only above a byte that is
/// rightly flagged (the borrow of the subtraction runs upwards), so the lowest flag of a word is exact.
fn string_end(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const TOPS: u64 = 0x8080_8080_8080_8080;
    let below = |word: u64, limit: u8| word.wrapping_sub(ONES * u64::from(limit)) & !word & TOPS;
    let mut words = bytes.chunks_exact(8);
    let mut at = 0;
    for chunk in &mut words {
        let word = u64::from_le_bytes(chunk.try_into().expect("a chunk of 8"));
        let flags = below(word ^ (ONES * u64::from(b'"')), 1)
            | below(word ^ (ONES * u64::from(b'\\')), 1)
            | below(word, 0x20);
        if flags != 0 {
            return Some(at + flags.trailing_zeros() as usize / 8);
        }
        at += 8;
    }
    let tail = words.remainder();
    tail.iter()
        .position(|&byte| byte == b'"' || byte == b'\\' || byte < 0x20)
        .map(|offset| at + offset)
}

/// Fills an absent field; `None` (give up) when it is there already: serde_json rejects a repeated field.
fn once<T>(slot: &mut Option<T>, value: T) -> Option<()> {
    slot.is_none().then(|| *slot = Some(value))
}

/// A position in the envelope's text.
struct Scan<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Scan<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.at += 1;
        Some(byte)
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        (self.next()? == byte).then_some(())
    }

    /// JSON's whitespace: space, tab, line feed, carriage return.
    fn skip_space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// A string without escapes or control characters, as the text between its quotes. The quotes are ASCII, so
    /// the slice starts and ends at character boundaries.
    fn string(&mut self) -> Option<&'a str> {
        self.expect(b'"')?;
        let rest = &self.text.as_bytes()[self.at..];
        let end = string_end(rest)?;
        if rest[end] != b'"' {
            return None;
        }
        let start = self.at;
        self.at += end + 1;
        Some(&self.text[start..start + end])
    }

    /// `null`, or what `value` reads.
    fn nullable<T>(&mut self, value: impl FnOnce(&mut Self) -> Option<T>) -> Option<Option<T>> {
        if self.text[self.at..].starts_with("null") {
            self.at += 4;
            return Some(None);
        }
        value(self).map(Some)
    }

    /// An integer written plainly: an optional minus, then digits without a leading zero. A fraction or an
    /// exponent (which serde_json reads as a float, and rejects for an integer field) gives up.
    fn integer(&mut self) -> Option<i64> {
        let negative = self.peek()? == b'-';
        if negative {
            self.at += 1;
        }
        let start = self.at;
        let mut magnitude: i64 = 0;
        while let Some(digit @ b'0'..=b'9') = self.peek() {
            magnitude = magnitude
                .checked_mul(10)?
                .checked_add(i64::from(digit - b'0'))?;
            self.at += 1;
        }
        let digits = &self.text.as_bytes()[start..self.at];
        if digits.is_empty()
            || (digits.len() > 1 && digits[0] == b'0')
            || matches!(self.peek(), Some(b'.' | b'e' | b'E'))
        {
            return None;
        }
        Some(if negative { -magnitude } else { magnitude })
    }

    /// A count: a plain integer that fits a `u32`.
    fn count(&mut self) -> Option<u32> {
        if self.peek()? == b'-' {
            return None;
        }
        u32::try_from(self.integer()?).ok()
    }

    fn boolean(&mut self) -> Option<bool> {
        let rest = &self.text[self.at..];
        let (value, length) = if rest.starts_with("true") {
            (true, 4)
        } else if rest.starts_with("false") {
            (false, 5)
        } else {
            return None;
        };
        self.at += length;
        Some(value)
    }

    /// Any JSON value, checked and delimited by serde_json, borrowed from the text.
    fn raw(&mut self) -> Option<&'a RawValue> {
        let rest = &self.text[self.at..];
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<&RawValue>();
        let value = values.next()?.ok()?;
        // The stream reads one value and stops right after it (past no whitespace): the caller reads on.
        self.at += values.byte_offset();
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    use super::*;

    /// The scan's result, if any, is serde_json's; returns whether the scan took the payload.
    fn agrees(text: &str) -> bool {
        let Some(scanned) = envelope(text) else {
            return false;
        };
        match Envelope::decode_with_serde_json(text) {
            // Envelope's equality compares raw JSON as text, byte for byte.
            Ok(decoded) => assert_eq!(
                scanned, decoded,
                "the scan and serde_json differ on {text:?}"
            ),
            // A version too new is refused after either decoder; anything else the scan must not accept.
            Err(error) => assert!(
                scanned.version > crate::task::ENVELOPE_VERSION,
                "the scan took {text:?}, which serde_json refuses: {error}"
            ),
        }
        true
    }

    proptest! {
        #[test]
        fn a_string_ends_where_a_byte_loop_says(bytes in prop::collection::vec(
            prop_oneof![4 => 0x20u8..0x7f, 1 => any::<u8>(), 1 => prop::sample::select(vec![b'"', b'\\', 0, 0x1f, 0x20, 0x80, 0xff])],
            0..40,
        )) {
            let naive = bytes.iter().position(|&byte| byte == b'"' || byte == b'\\' || byte < 0x20);
            prop_assert_eq!(string_end(&bytes), naive);
        }
    }

    #[test]
    fn the_scan_takes_what_producers_write() {
        for text in [
            r#"{"id":"0b7e3c1e-6d2f-4a57-9f3e-8f1d2c3b4a5e","type":"email.send","data":{"to":"a@b.c"},"created_at":1764700000000,"attempt":0}"#,
            r#"{"type":"t"}"#,
            r#" { "type" : "t" , "data" : [1, 2.5e3, "x", null, true, {"a": {}}] , "attempt" : 3 } "#,
            "{\n\t\"type\":\"t\",\r\n\"id\":\"é中😀\"}",
            r#"{"id":"i","type":"t","data":null,"created_at":null,"attempt":2,"priority":"high","unique":true,"last_error":"boom","recovered":1,"crashes":1,"v":1}"#,
            r#"{"type":"t","priority":null,"last_error":null,"unique":false,"created_at":-5}"#,
            r#"{"type":"t","trace":{"span":"abc"},"n":12,"trace2":"\u0041"}"#,
            r#"{"type":"t","x":1,"x":2}"#,
            r#"{"type":"t","v":2}"#,
            r#"{"type":"t","attempt":4294967295,"created_at":9223372036854775807}"#,
        ] {
            assert!(agrees(text), "the scan gave up on {text:?}");
        }
    }

    #[test]
    fn the_scan_leaves_to_serde_json_what_it_does_not_read_exactly() {
        for text in [
            // Escapes, in keys and in the strings the scan reads.
            r#"{"\u0074ype":"t"}"#,
            r#"{"type":"a\"b"}"#,
            r#"{"type":"t","id":"a\nb"}"#,
            // Numbers that are no plain integer in range.
            r#"{"type":"t","attempt":1.0}"#,
            r#"{"type":"t","attempt":1e2}"#,
            r#"{"type":"t","attempt":01}"#,
            r#"{"type":"t","attempt":-0}"#,
            r#"{"type":"t","attempt":4294967296}"#,
            r#"{"type":"t","created_at":-9223372036854775808}"#,
            r#"{"type":"t","created_at":92233720368547758070}"#,
            // Repeated known fields, a missing or empty type, wrong types, anything after the object.
            r#"{"type":"t","type":"u"}"#,
            r#"{"type":"t","data":1,"data":2}"#,
            r#"{"id":"i"}"#,
            r#"{}"#,
            r#"{"type":""}"#,
            r#"{"type":null}"#,
            r#"{"type":"t","unique":1}"#,
            r#"{"type":"t","id":5}"#,
            r#"{"type":"t"} x"#,
            r#"{"type":"t"}{}"#,
            r#"{"type":"t",}"#,
            r#"{"type":"t" "id":"i"}"#,
            r#"{"type":"t","data":}"#,
            r#"{"type":"t","data":[1,]}"#,
            r#"{"type":"t","data":nul}"#,
            r#"{"type":"t","unique":truex}"#,
            "\u{feff}{\"type\":\"t\"}",
            "[]",
            "",
            r#"{"type":"t""#,
        ] {
            assert!(!agrees(text), "the scan took {text:?}");
        }
    }

    /// A JSON value for a generated envelope's field: often the type the field wants, sometimes another.
    fn value() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_string()),
            Just("true".to_string()),
            Just("false".to_string()),
            any::<i64>().prop_map(|n| n.to_string()),
            any::<u32>().prop_map(|n| n.to_string()),
            prop::sample::select(vec![
                "0",
                "-0",
                "01",
                "1.5",
                "1e3",
                "-",
                "4294967296",
                "9223372036854775808"
            ])
            .prop_map(str::to_string),
            "[a-z\\\\\"é\n]{0,6}".prop_map(|text| format!("\"{text}\"")),
            "[a-z]{0,6}".prop_map(|text| format!("\"{text}\"")),
        ];
        leaf.prop_recursive(2, 8, 3, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3)
                    .prop_map(|items| format!("[{}]", items.join(","))),
                prop::collection::vec(("[a-z]{1,3}", inner), 0..3).prop_map(|fields| {
                    let fields: Vec<String> = fields
                        .into_iter()
                        .map(|(key, value)| format!("\"{key}\":{value}"))
                        .collect();
                    format!("{{{}}}", fields.join(","))
                }),
            ]
        })
    }

    /// A value of the type `key` wants (any value for an unknown key), as a producer would write it.
    fn typed(key: &'static str) -> BoxedStrategy<String> {
        let text = "[a-zé]{0,6}".prop_map(|text| format!("\"{text}\""));
        match key {
            "id" | "type" => text.boxed(),
            "priority" | "last_error" => prop_oneof![text, Just("null".to_string())].boxed(),
            "created_at" => prop_oneof![
                any::<i64>().prop_map(|n| n.to_string()),
                Just("null".to_string())
            ]
            .boxed(),
            "attempt" | "recovered" | "crashes" => any::<u32>().prop_map(|n| n.to_string()).boxed(),
            "v" => (0..3u32).prop_map(|n| n.to_string()).boxed(),
            "unique" => any::<bool>().prop_map(|b| b.to_string()).boxed(),
            _ => value().boxed(),
        }
    }

    /// An envelope-like object: known and unknown keys (some repeated, some escaped), mostly with values of the
    /// type they want and sometimes with any value, and whitespace between the tokens.
    fn object() -> impl Strategy<Value = String> {
        let key = prop::sample::select(vec![
            "id",
            "data",
            "created_at",
            "attempt",
            "priority",
            "unique",
            "last_error",
            "recovered",
            "crashes",
            "v",
            "trace",
            "\\u0074ype",
            "typ",
        ]);
        let field =
            key.prop_flat_map(|key| (Just(key), prop_oneof![4 => typed(key), 1 => value()]));
        let space = prop::sample::select(vec!["", "", "", " ", "\n\t", "\r"]);
        (
            prop::collection::vec((field, space.clone()), 0..5),
            "[a-z]{1,4}",
            0..10u8,
            space,
        )
            .prop_map(|(fields, kind, typed_at, space)| {
                let mut fields: Vec<String> = fields
                    .into_iter()
                    .map(|((key, value), space)| {
                        format!("{space}\"{key}\"{space}:{space}{value}{space}")
                    })
                    .collect();
                // Mostly one `type`, somewhere among the fields; sometimes none.
                if typed_at < 9 {
                    let at = usize::from(typed_at) % (fields.len() + 1);
                    fields.insert(at, format!("\"type\":\"{kind}\""));
                }
                format!("{space}{{{}}}{space}", fields.join(","))
            })
    }

    #[test]
    fn the_scan_agrees_with_serde_json() {
        let mut runner = TestRunner::new(Config {
            cases: 2000,
            ..Config::default()
        });
        let taken = std::cell::Cell::new(0);
        runner
            .run(&object(), |text| {
                taken.set(taken.get() + usize::from(agrees(&text)));
                Ok(())
            })
            .unwrap();
        // Neither side vacuous: the generator makes envelopes the scan takes and ones it leaves to serde_json.
        let taken = taken.get();
        assert!(
            (200..1800).contains(&taken),
            "the scan took {taken} of 2000"
        );
    }
}
