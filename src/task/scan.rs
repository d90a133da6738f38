//! The envelope's fast path: a scan of the envelopes producers write (the library's, the SDKs', the ones
//! `docs/PROTOCOL.md` shows): the decode was half of a worker's instructions per no-op task.
//!
//! serde_json's decoding (`Deserialize for Envelope`) is the definition; this scan is only a shortcut to the
//! same result. It reads the object's keys, strings, integers and booleans itself, and delimits the raw JSON
//! values (`data`, unknown fields) itself when they are of the shapes producers write (literals, numbers,
//! strings, and arrays and objects of them, nested a few levels), leaving any other value to serde_json, which
//! checks and delimits it. It gives up (`None`) on anything it does not read exactly as serde_json would: an
//! escape or a control character in a key or string, a number that is not a plain integer in range, a repeated
//! known key, a missing or empty `type`, anything after the object. The caller then decodes with serde_json,
//! which accepts the payload or says what is wrong with it. So the scan never accepts what serde_json rejects,
//! and what it accepts decodes to the same envelope (`tests::the_scan_agrees_with_serde_json`, and the
//! `envelope` fuzzer compares both on every input).
//!
//! A decode by the scan, the UTF-8 check of the payload included, takes about 1,400 instructions for an envelope
//! of 105 bytes (2,090 when serde_json delimited every raw value), serde_json's 2,800 (callgrind,
//! `examples/decode.rs`; docs/PERFORMANCE.md, "The envelope's fast path").

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::value::BorrowedStrDeserializer;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::Fields;

/// Reads the envelope in `text` into `fields` (empty), or `None` when the scan cannot be sure of it (the caller
/// decodes with serde_json). A repeated known key ends the scan; a missing or empty type is for the caller to
/// see (`Envelope::decode`).
pub(super) fn envelope<'a>(text: &'a str, fields: &mut Fields<'a>) -> Option<()> {
    let mut scan = Scan { text, at: 0 };
    scan.skip_space();
    scan.eat(b'{')?;
    scan.skip_space();
    // An empty object has no type: the key's quote is not there.
    loop {
        scan.eat(b'"')?;
        let key = scan.key()?;
        scan.skip_space();
        scan.eat(b':')?;
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
    (scan.at == text.len()).then_some(())
}

/// A key of the envelope: one of the known ones, or another, as its text. Not `task::Field`, serde_json's, whose
/// unknown key is a `Cow`: the scan's keys are borrowed, and the larger enum cost 40 to 50 instructions a task
/// (scripts/drain-instructions, 3,876 -> 3,889-3,922 safe, 3,711 -> 3,763 default).
enum Key<'a> {
    Id,
    Type,
    Data,
    CreatedAt,
    Attempt,
    Priority,
    Unique,
    LastError,
    Recovered,
    Crashes,
    Version,
    Other(&'a str),
}

impl<'a> Fields<'a> {
    /// Reads the value of `key` at the scan's position.
    fn read(&mut self, key: Key<'a>, scan: &mut Scan<'a>) -> Option<()> {
        let text = |scan: &mut Scan<'a>| scan.string().map(Cow::Borrowed);
        match key {
            Key::Id => self.once(Fields::ID)?.id = Some(text(scan)?),
            Key::Type => self.once(Fields::TYPE)?.kind = text(scan)?,
            Key::Data => self.once(Fields::DATA)?.data = Cow::Borrowed(scan.raw()?),
            Key::CreatedAt => {
                self.once(Fields::CREATED_AT)?.created_at = scan.nullable(Scan::integer)?;
            }
            Key::Attempt => self.once(Fields::ATTEMPT)?.attempt = scan.count()?,
            Key::Priority => self.once(Fields::PRIORITY)?.priority = scan.nullable(text)?,
            Key::Unique => self.once(Fields::UNIQUE)?.unique = scan.boolean()?,
            Key::LastError => self.once(Fields::LAST_ERROR)?.last_error = scan.nullable(text)?,
            Key::Recovered => self.once(Fields::RECOVERED)?.recovered = scan.count()?,
            Key::Crashes => self.once(Fields::CRASHES)?.crashes = scan.count()?,
            Key::Version => self.once(Fields::VERSION)?.version = scan.count()?,
            Key::Other(key) => {
                let value = scan.raw()?;
                self.envelope
                    .extra
                    .push((Cow::Borrowed(key), Cow::Borrowed(value)));
            }
        }
        Some(())
    }
}

/// The offset of the first byte of `bytes`, from `at` on, that ends or interrupts a JSON string: a quote, a
/// backslash, or a control character (below 0x20). Eight bytes at a time: the strings are mostly ids of 36 bytes,
/// and a byte loop was half of the scan's instructions (callgrind). Each mask below flags, in its byte's top bit,
/// the bytes that are zero (after an XOR with the byte looked for) or below 0x20; a flag can be wrong only above a
/// byte that is rightly flagged (the borrow of the subtraction runs upwards), so the lowest flag of a word is
/// exact.
fn string_end(bytes: &[u8], mut at: usize) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const TOPS: u64 = 0x8080_8080_8080_8080;
    let below = |word: u64, limit: u8| word.wrapping_sub(ONES * u64::from(limit)) & !word;
    while let Some(chunk) = bytes.get(at..at + 8) {
        let word = u64::from_le_bytes(chunk.try_into().expect("a chunk of 8"));
        let flags = (below(word ^ (ONES * u64::from(b'"')), 1)
            | below(word ^ (ONES * u64::from(b'\\')), 1)
            | below(word, 0x20))
            & TOPS;
        if flags != 0 {
            return Some(at + flags.trailing_zeros() as usize / 8);
        }
        at += 8;
    }
    while let Some(&byte) = bytes.get(at) {
        if byte == b'"' || byte == b'\\' || byte < 0x20 {
            return Some(at);
        }
        at += 1;
    }
    None
}

/// How deep the scan follows arrays and objects in a raw value; serde_json delimits a deeper one.
const NESTING: u32 = 8;

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

    fn eat(&mut self, byte: u8) -> Option<()> {
        (self.peek()? == byte).then(|| self.at += 1)
    }

    /// Whether the text goes on with `word` (then skipped). Of a constant length, so that the comparison is a
    /// load or two, not a call of `memcmp`.
    fn word<const N: usize>(&mut self, word: &[u8; N]) -> bool {
        let found = self.text.as_bytes().get(self.at..self.at + N) == Some(word.as_slice());
        if found {
            self.at += N;
        }
        found
    }

    /// JSON's whitespace: space, tab, line feed, carriage return.
    fn skip_space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// A key, after its opening quote. A known key is matched with its closing quote (so `"id"` and not
    /// `"idle"`), without finding the end of the string first; any other key is read as a string.
    fn key(&mut self) -> Option<Key<'a>> {
        Some(match self.peek()? {
            b'i' if self.word(b"id\"") => Key::Id,
            b't' if self.word(b"type\"") => Key::Type,
            b'd' if self.word(b"data\"") => Key::Data,
            b'c' if self.word(b"created_at\"") => Key::CreatedAt,
            b'c' if self.word(b"crashes\"") => Key::Crashes,
            b'a' if self.word(b"attempt\"") => Key::Attempt,
            b'p' if self.word(b"priority\"") => Key::Priority,
            b'u' if self.word(b"unique\"") => Key::Unique,
            b'l' if self.word(b"last_error\"") => Key::LastError,
            b'r' if self.word(b"recovered\"") => Key::Recovered,
            b'v' if self.word(b"v\"") => Key::Version,
            _ => return self.rest_of_string().map(Key::Other),
        })
    }

    /// A string without escapes or control characters, as the text between its quotes.
    fn string(&mut self) -> Option<&'a str> {
        self.eat(b'"')?;
        self.rest_of_string()
    }

    /// The rest of a string whose opening quote was read. The quotes are ASCII, so the slice starts and ends at
    /// character boundaries.
    fn rest_of_string(&mut self) -> Option<&'a str> {
        let start = self.at;
        self.skip_rest_of_string()?;
        self.text.get(start..self.at - 1)
    }

    /// Skips the rest of a string without escapes or control characters, its closing quote included.
    fn skip_rest_of_string(&mut self) -> Option<()> {
        let bytes = self.text.as_bytes();
        let end = string_end(bytes, self.at)?;
        (bytes[end] == b'"').then(|| self.at = end + 1)
    }

    /// `null`, or what `value` reads.
    fn nullable<T>(&mut self, value: impl FnOnce(&mut Self) -> Option<T>) -> Option<Option<T>> {
        if self.word(b"null") {
            return Some(None);
        }
        value(self).map(Some)
    }

    /// An integer written plainly: an optional minus, then at most 19 digits (which cannot overflow a `u64`)
    /// without a leading zero, in the range of an `i64` whatever the sign. A fraction or an exponent, and `-0`
    /// (all of which serde_json reads as a float, and rejects for an integer field) give up.
    fn integer(&mut self) -> Option<i64> {
        let bytes = self.text.as_bytes();
        let negative = self.peek()? == b'-';
        let start = self.at + usize::from(negative);
        let mut at = start;
        let mut magnitude: u64 = 0;
        while let Some(&byte) = bytes.get(at) {
            let digit = byte.wrapping_sub(b'0');
            if digit > 9 {
                break;
            }
            magnitude = magnitude.wrapping_mul(10).wrapping_add(u64::from(digit));
            at += 1;
        }
        let digits = at - start;
        if !(1..=19).contains(&digits)
            || (digits > 1 && bytes[start] == b'0')
            || matches!(bytes.get(at), Some(b'.' | b'e' | b'E'))
        {
            return None;
        }
        let magnitude = i64::try_from(magnitude).ok()?;
        if negative && magnitude == 0 {
            return None;
        }
        self.at = at;
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
        if self.word(b"true") {
            Some(true)
        } else if self.word(b"false") {
            Some(false)
        } else {
            None
        }
    }

    /// Any JSON value, borrowed from the text: delimited by the scan when it is of a shape [`Scan::skip_value`]
    /// reads, else checked and delimited by serde_json.
    fn raw(&mut self) -> Option<&'a RawValue> {
        let start = self.at;
        if self.skip_value(NESTING).is_some()
            && let Some(value) = self.text.get(start..self.at).and_then(borrowed_raw)
        {
            return Some(value);
        }
        self.at = start;
        let rest = &self.text[start..];
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<&RawValue>();
        let value = values.next()?.ok()?;
        // The stream reads one value and stops right after it (past no whitespace): the caller reads on.
        self.at += values.byte_offset();
        Some(value)
    }

    /// Skips one JSON value, as serde_json's `ignore_value` reads it: `None` when it is not one, or of a shape
    /// this does not read (a string with an escape; arrays and objects nested deeper than `depth`). A scalar is
    /// skipped inline, a container by a call.
    #[inline(always)]
    fn skip_value(&mut self, depth: u32) -> Option<()> {
        match self.peek()? {
            b'"' => {
                self.at += 1;
                self.skip_rest_of_string()
            }
            b'-' | b'0'..=b'9' => self.skip_number(),
            b'n' => self.word(b"null").then_some(()),
            b't' => self.word(b"true").then_some(()),
            b'f' => self.word(b"false").then_some(()),
            b'[' => self.skip_array(depth.checked_sub(1)?),
            b'{' => self.skip_object(depth.checked_sub(1)?),
            _ => None,
        }
    }

    /// Skips an array (at its `[`) whose values are nested at most `depth` deep.
    #[inline(never)]
    fn skip_array(&mut self, depth: u32) -> Option<()> {
        self.at += 1;
        self.skip_space();
        if self.eat(b']').is_some() {
            return Some(());
        }
        loop {
            self.skip_value(depth)?;
            self.skip_space();
            match self.next()? {
                b',' => self.skip_space(),
                b']' => return Some(()),
                _ => return None,
            }
        }
    }

    /// Skips an object (at its `{`) whose values are nested at most `depth` deep.
    #[inline(never)]
    fn skip_object(&mut self, depth: u32) -> Option<()> {
        self.at += 1;
        self.skip_space();
        if self.eat(b'}').is_some() {
            return Some(());
        }
        loop {
            self.eat(b'"')?;
            self.skip_rest_of_string()?;
            self.skip_space();
            self.eat(b':')?;
            self.skip_space();
            self.skip_value(depth)?;
            self.skip_space();
            match self.next()? {
                b',' => self.skip_space(),
                b'}' => return Some(()),
                _ => return None,
            }
        }
    }

    /// Skips a number in JSON's grammar: `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`.
    fn skip_number(&mut self) -> Option<()> {
        let _ = self.eat(b'-');
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => self.skip_digits(),
            _ => return None,
        }
        if self.eat(b'.').is_some() {
            self.digit()?;
            self.skip_digits();
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.at += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.at += 1;
            }
            self.digit()?;
            self.skip_digits();
        }
        // A digit after a leading zero (`01`) ends the number here, and whatever reads on refuses it: after a value
        // comes a space, a comma or a closing bracket.
        Some(())
    }

    fn digit(&mut self) -> Option<()> {
        self.next()?.is_ascii_digit().then_some(())
    }

    fn skip_digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.at += 1;
        }
    }
}

/// `text`, which the scan has read as one JSON value, as serde_json's borrowed raw value, without parsing it
/// again: `None` if serde_json does not take it so (then the scan has it delimited by serde_json).
///
/// serde_json has no public constructor of a borrowed `RawValue`: its `Deserialize` asks the deserializer for a
/// newtype struct, and takes a map of one entry, whose key is the struct's name and whose value is the JSON text
/// as a borrowed string. [`RawText`] is that deserializer, and nothing else: should serde_json ask for anything
/// else, the answer is an error, and the value is delimited by serde_json as before
/// (`tests::a_raw_value_is_borrowed_without_serde_json` says so loudly).
fn borrowed_raw(text: &str) -> Option<&RawValue> {
    <&RawValue>::deserialize(RawText(text)).ok()
}

/// A deserializer of one borrowed raw JSON value: see [`borrowed_raw`].
struct RawText<'a>(&'a str);

impl<'de> Deserializer<'de> for RawText<'de> {
    type Error = de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("not a raw value"))
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        visitor.visit_map(RawEntry {
            name,
            text: Some(self.0),
        })
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option unit
        unit_struct seq tuple tuple_struct map struct enum identifier ignored_any
    }
}

/// The one entry of [`RawText`]'s map: the struct's name, then the text.
struct RawEntry<'a> {
    name: &'static str,
    text: Option<&'a str>,
}

impl<'de> MapAccess<'de> for RawEntry<'de> {
    type Error = de::value::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        if self.text.is_none() {
            return Ok(None);
        }
        seed.deserialize(BorrowedStrDeserializer::new(self.name))
            .map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        let text = self
            .text
            .take()
            .ok_or_else(|| de::Error::custom("one value"))?;
        seed.deserialize(BorrowedStrDeserializer::new(text))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    use super::*;
    use crate::task::Envelope;

    /// `Envelope::decode`'s result is serde_json's (the same envelope, or the same error); returns whether the
    /// scan took the payload (read it whole, with a non-empty type).
    fn agrees(text: &str) -> bool {
        let mut fields = Fields::new();
        let taken = envelope(text, &mut fields).is_some() && !fields.envelope.kind.is_empty();
        // Envelope's equality compares raw JSON as text, byte for byte.
        assert_eq!(
            Envelope::decode(text),
            Envelope::decode_with_serde_json(text),
            "the scan and serde_json differ on {text:?} (the scan took it: {taken})"
        );
        taken
    }

    proptest! {
        #[test]
        fn a_string_ends_where_a_byte_loop_says(bytes in prop::collection::vec(
            prop_oneof![4 => 0x20u8..0x7f, 1 => any::<u8>(), 1 => prop::sample::select(vec![b'"', b'\\', 0, 0x1f, 0x20, 0x80, 0xff])],
            0..40,
        )) {
            let naive = bytes.iter().position(|&byte| byte == b'"' || byte == b'\\' || byte < 0x20);
            prop_assert_eq!(string_end(&bytes, 0), naive);
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
            r#"{"type":"t","data":{"a":"\n","b":[[[[[[[[[[1]]]]]]]]]]},"x":"\u00e9","y":[[[[[[[[[{}]]]]]]]]]}"#,
        ] {
            assert!(agrees(text), "the scan gave up on {text:?}");
        }
    }

    #[test]
    fn a_raw_value_is_borrowed_without_serde_json() {
        // Shapes producers write for `data`, delimited by the scan; and ones left to serde_json's stream.
        let delimited = |text: &str| {
            let mut scan = Scan { text, at: 0 };
            scan.skip_value(NESTING).is_some() && scan.at == text.len()
        };
        for text in [
            "1",
            "-0",
            "-12.5e+3",
            "0.25E-2",
            "{}",
            "{ }",
            "[]",
            "null",
            "true",
            "false",
            r#""x""#,
            r#""é中😀""#,
            r#"{"to":"a@b.c","n":3,"tags":["a","b"],"ok":true,"x":null}"#,
            "{ \"a\" : [ 1 , { \"b\" : { } } ] }",
            "[[[[[[[[1]]]]]]]]",
        ] {
            assert!(delimited(text), "the scan does not delimit {text}");
            let raw =
                borrowed_raw(text).expect("serde_json takes a borrowed raw value from RawText");
            assert_eq!(raw.get(), text);
        }
        for text in [
            r#""a\nb""#,
            "[[[[[[[[[1]]]]]]]]]",
            "01",
            "1.",
            "[1,]",
            "{\"a\"}",
            "nul",
        ] {
            assert!(!delimited(text), "the scan delimits {text}");
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
            r#"{"type":"t","created_at":-0}"#,
            r#"{"type":"t","attempt":4294967296}"#,
            r#"{"type":"t","created_at":-9223372036854775808}"#,
            r#"{"type":"t","created_at":92233720368547758070}"#,
            r#"{"type":"t","created_at":18446744073709551617}"#,
            r#"{"type":"t","attempt":18446744073709551616}"#,
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

    /// A JSON value for a generated envelope's field: often the type the field wants, sometimes another; often
    /// valid JSON, of the shapes the scan delimits itself and of others (escapes, deep nesting), sometimes not.
    fn value() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_string()),
            Just("true".to_string()),
            Just("false".to_string()),
            any::<i64>().prop_map(|n| n.to_string()),
            any::<u32>().prop_map(|n| n.to_string()),
            any::<f64>().prop_map(|n| n.to_string()),
            prop::sample::select(vec![
                "0",
                "-0",
                "01",
                "1.5",
                "1e3",
                "-",
                "4294967296",
                "9223372036854775808",
                "18446744073709551617",
                "-18446744073709551617",
                "-1.25e-3",
                "2E+10",
                "0.0",
                "0e0",
                "1.",
                ".5",
                "1e",
                "1e+",
                "00",
                "1.5.5",
                "--1",
                "+1",
                "nul",
                "truex",
                "[1,]",
                "{\"a\":}",
                "{\"a\" 1}",
                "{1:2}",
            ])
            .prop_map(str::to_string),
            "[a-z\\\\\"é\n]{0,6}".prop_map(|text| format!("\"{text}\"")),
            "[a-z]{0,6}".prop_map(|text| format!("\"{text}\"")),
            prop::sample::select(vec![
                "\\n",
                "\\\"",
                "\\/",
                "\\u00e9",
                "\\uD83D\\uDE00",
                "\\ud800",
                "\\x",
                "\\u12",
                "\\",
                "\u{7f}",
                "\t",
            ])
            .prop_map(|text| format!("\"a{text}b\"")),
            (0..12usize).prop_map(|depth| format!("{}1{}", "[".repeat(depth), "]".repeat(depth))),
        ];
        let space = prop::sample::select(vec!["", "", " ", "\n "]);
        leaf.prop_recursive(3, 12, 3, move |inner| {
            prop_oneof![
                (prop::collection::vec(inner.clone(), 0..3), space.clone()).prop_map(
                    |(items, space)| format!(
                        "[{space}{}{space}]",
                        items.join(&format!("{space},{space}"))
                    )
                ),
                (
                    prop::collection::vec(("[a-z]{1,3}", inner), 0..3),
                    space.clone()
                )
                    .prop_map(|(fields, space)| {
                        let fields: Vec<String> = fields
                            .into_iter()
                            .map(|(key, value)| format!("\"{key}\"{space}:{space}{value}"))
                            .collect();
                        format!("{{{space}{}{space}}}", fields.join(&format!("{space},")))
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
                Just("null".to_string()),
                Just("-0".to_string())
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
