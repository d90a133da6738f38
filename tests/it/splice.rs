//! The enqueue scripts splice `created_at` into the producer's text (push.lua, and fire.lua for the schedules):
//! a JSON object without a top-level `created_at` gets one (Redis's clock at the push), anything else is stored
//! byte for byte, so that a malformed payload is dead-lettered with exactly the bytes its producer sent.
//!
//! Property tests over generated payloads: JSON objects with random whitespace everywhere JSON allows it, with or
//! without a top-level `created_at`, with `created_at` nested in `data`, inside strings, in longer keys or
//! written with escapes; empty objects; and payloads that are not JSON objects (other JSON values, arbitrary
//! bytes, text that starts with `{` but is not JSON). What counts as a JSON object is serde_json's verdict, the
//! decoder kmqd's daemon uses.
//!
//! The scripts decode a payload only when the text `"created_at"` is in it (push is a hot path; docs/PROTOCOL.md),
//! so two kinds of payload get the stamp though they should not, and the test holds them to exactly that (the stamp
//! right after the opening brace, the rest unchanged): text shaped like an object (`{"` ... `}`) that is not JSON,
//! and an object that spells its top-level `created_at` key with `\u` escapes.

use std::cell::RefCell;
use std::fmt::Write as _;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::Value;

use crate::support::*;

const PUSH: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/src/broker/scripts/push.lua"
));
/// fire.lua as the broker runs it, with its prelude (checks.lua).
const FIRE: &str = kmqd::broker::sources::FIRE;

/// Generated cases per test (PROPTEST_CASES overrides it); each pushes up to `BATCH` payloads in one call.
/// About 4,000 payloads per test run in a couple of seconds against a debug build.
const CASES: u32 = 160;
const BATCH: usize = 48;

/// A JSON value to render as text, with whitespace and escapes chosen while rendering.
#[derive(Clone, Debug)]
enum Json {
    Null,
    Bool(bool),
    Int(i64),
    /// Integers past i64 and u64, which a producer may send and kmqd must not round.
    Big(String),
    Float(f64),
    Str(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

/// How a value is written: `seed` picks the whitespace at each place JSON allows it and which characters of a
/// string are written as `\uXXXX` escapes.
#[derive(Clone, Debug)]
struct Rendering {
    seed: u64,
    /// Percent of the places that get whitespace, and of the characters that get escaped.
    space: u8,
    escape: u8,
}

/// One payload and the category it was generated in (the test counts categories to prove it is not vacuous).
#[derive(Clone, Debug)]
struct Payload {
    kind: &'static str,
    bytes: Vec<u8>,
}

fn text() -> impl Strategy<Value = String> {
    let chars = prop_oneof![
        4 => prop::char::range('a', 'z'),
        1 => prop::sample::select(vec![
            '"', '\\', '/', '{', '}', '[', ']', ':', ',', ' ', '\n', '\t', '\u{0}', '\u{1f}', '\u{7f}', 'é',
            'ß', '中', '\u{2028}', '\u{feff}', '😀', '\u{10ffff}',
        ]),
        1 => any::<char>(),
    ];
    let created_at = prop::sample::select(vec![
        "created_at",
        "\"created_at\"",
        "say \"created_at\": 1",
        "{\"created_at\":1}",
    ])
    .prop_map(str::to_string);
    prop_oneof![
        4 => prop::collection::vec(chars, 0..8).prop_map(|chars| chars.into_iter().collect()),
        1 => created_at,
    ]
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "id", "type", "data", "attempt", "xcreated_at", "created_atx", "created_at ", "CREATED_AT",
            "created", "_at", "a\"created_at\"", "created_at\"", "", "\u{e9}", "😀",
        ])
        .prop_map(str::to_string),
        1 => text(),
    ]
}

fn scalar() -> impl Strategy<Value = Json> {
    prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        any::<i64>().prop_map(Json::Int),
        prop::sample::select(vec![
            "12345678901234567890",
            "-9223372036854775809",
            "123456789012345678901234567890",
        ])
        .prop_map(|n| Json::Big(n.to_string())),
        any::<f64>()
            .prop_filter("JSON numbers are finite", |f| f.is_finite())
            .prop_map(Json::Float),
        text().prop_map(Json::Str),
    ]
}

/// Any JSON value, `created_at` keys allowed anywhere in nested objects.
fn value() -> impl Strategy<Value = Json> {
    scalar().prop_recursive(3, 24, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Json::Array),
            prop::collection::vec(
                (
                    prop_oneof![3 => key(), 1 => Just("created_at".to_string())],
                    inner
                ),
                0..4
            )
            .prop_map(Json::Object),
        ]
    })
}

/// A top-level object. `created_at`: whether it has a top-level `created_at` (at a random place among its keys).
fn object(created_at: bool) -> impl Strategy<Value = Vec<(String, Json)>> {
    let fields = prop::collection::vec((key(), value()), 0..5).prop_map(|fields| {
        // Keep the top level free of "created_at": whether it has one is this generator's choice.
        fields
            .into_iter()
            .filter(|(key, _)| key != "created_at")
            .collect::<Vec<_>>()
    });
    (fields, scalar(), any::<prop::sample::Index>()).prop_map(move |(mut fields, stamp, at)| {
        if created_at {
            let stamp = match stamp {
                Json::Float(_) | Json::Bool(_) => Json::Int(1_700_000_000_000),
                other => other,
            };
            let at = at.index(fields.len() + 1);
            fields.insert(at, ("created_at".to_string(), stamp));
        }
        fields
    })
}

fn rendering() -> impl Strategy<Value = Rendering> {
    (
        any::<u64>(),
        prop_oneof![Just(0u8), 0u8..=100],
        prop_oneof![Just(0u8), 0u8..=30],
    )
        .prop_map(|(seed, space, escape)| Rendering {
            seed,
            space,
            escape,
        })
}

fn payload() -> impl Strategy<Value = Payload> {
    let rendered = |kind: &'static str, json: BoxedStrategy<Json>| {
        (json, rendering()).prop_map(move |(json, how)| Payload {
            kind,
            bytes: how.render(&json).into_bytes(),
        })
    };
    let object_json = |created_at| object(created_at).prop_map(Json::Object).boxed();
    prop_oneof![
        6 => rendered("object", object_json(false)),
        3 => rendered("object with created_at", object_json(true)),
        1 => rendered("empty object", Just(Json::Object(vec![])).boxed()),
        1 => rendered(
            "object with data",
            (object(false), value())
                .prop_map(|(mut fields, data)| {
                    fields.push(("data".to_string(), data));
                    Json::Object(fields)
                })
                .boxed()
        ),
        2 => rendered(
            "other JSON",
            value()
                .prop_filter("not an object", |json| !matches!(json, Json::Object(_)))
                .boxed()
        ),
        1 => prop::collection::vec(any::<u8>(), 0..40).prop_map(|bytes| Payload {
            kind: "bytes",
            bytes,
        }),
        2 => (rendered("", object_json(false)), any::<prop::sample::Index>(), 0usize..8).prop_map(
            |(object, at, how)| Payload {
                kind: "not JSON, from {",
                bytes: broken(object.bytes, at, how),
            }
        ),
    ]
}

/// An object's text made invalid, still starting with `{` (after its leading whitespace, if any).
fn broken(mut bytes: Vec<u8>, at: prop::sample::Index, how: usize) -> Vec<u8> {
    let open = bytes.iter().position(|b| *b == b'{').unwrap();
    let close = bytes.iter().rposition(|b| *b == b'}').unwrap();
    match how {
        // Truncated anywhere before its closing brace.
        0 => bytes.truncate(open + 1 + at.index(close - open)),
        // Text after the object.
        1 => bytes.extend_from_slice(b" x"),
        2 => bytes.extend_from_slice(b"{}"),
        3 => bytes.push(0),
        // A trailing comma.
        4 => bytes.insert(close, b','),
        // An unquoted or single-quoted key, or a bare word.
        5 => drop(bytes.splice(open + 1..open + 1, *b"id: 1, ")),
        6 => drop(bytes.splice(open + 1..open + 1, *b"'id': 1, ")),
        _ => drop(bytes.splice(open + 1..open + 1, *b"nope ")),
    }
    bytes
}

impl Rendering {
    fn render(&self, json: &Json) -> String {
        let mut out = String::new();
        let mut state = self.seed | 1;
        self.space(&mut out, &mut state);
        self.value(json, &mut out, &mut state);
        self.space(&mut out, &mut state);
        out
    }

    /// xorshift64: whitespace and escapes are picked from the seed, so a failing case shrinks to a seed.
    fn roll(state: &mut u64, percent: u8) -> bool {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state % 100 < u64::from(percent)
    }

    fn space(&self, out: &mut String, state: &mut u64) {
        while Rendering::roll(state, self.space / 2) {
            out.push([' ', '\t', '\n', '\r'][(*state >> 20) as usize % 4]);
        }
    }

    fn value(&self, json: &Json, out: &mut String, state: &mut u64) {
        match json {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Int(n) => write!(out, "{n}").unwrap(),
            Json::Big(n) => out.push_str(n),
            Json::Float(f) => out.push_str(&serde_json::to_string(f).unwrap()),
            Json::Str(text) => self.string(text, out, state),
            Json::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.space(out, state);
                        out.push(',');
                    }
                    self.space(out, state);
                    self.value(item, out, state);
                }
                self.space(out, state);
                out.push(']');
            }
            Json::Object(fields) => {
                out.push('{');
                for (i, (key, value)) in fields.iter().enumerate() {
                    if i > 0 {
                        self.space(out, state);
                        out.push(',');
                    }
                    self.space(out, state);
                    self.string(key, out, state);
                    self.space(out, state);
                    out.push(':');
                    self.space(out, state);
                    self.value(value, out, state);
                }
                self.space(out, state);
                out.push('}');
            }
        }
    }

    fn string(&self, text: &str, out: &mut String, state: &mut u64) {
        out.push('"');
        for c in text.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                c if (c as u32) < 0x20 || Rendering::roll(state, self.escape) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        write!(out, "\\u{unit:04x}").unwrap();
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// JSON's whitespace.
fn is_space(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\r')
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

/// Text the scripts cannot tell from a non-empty JSON object without decoding it, which they do only when the
/// text `"created_at"` is in it (docs/PROTOCOL.md): `{"` ... `}`, with JSON whitespace around and between.
fn object_shaped(bytes: &[u8]) -> bool {
    let mut inner = bytes.iter().copied().filter(|b| !is_space(*b));
    inner.next() == Some(b'{')
        && inner.next() == Some(b'"')
        && bytes.iter().rev().find(|b| !is_space(**b)) == Some(&b'}')
}

/// If `stored` is `sent` with `"created_at":N` (and a comma unless the object is empty) right after its first
/// `{`, N.
fn stamp_in(sent: &[u8], stored: &[u8]) -> Option<i64> {
    let open = sent.iter().position(|b| *b == b'{')? + 1;
    let rest = stored
        .strip_prefix(&sent[..open])?
        .strip_prefix(b"\"created_at\":")?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let stamp: i64 = std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()?;
    let rest = &rest[digits..];
    let empty = sent[open..].iter().find(|b| !is_space(**b)) == Some(&b'}');
    let rest = if empty {
        rest
    } else {
        rest.strip_prefix(b",")?
    };
    (rest == &sent[open..]).then_some(stamp)
}

/// What a script must have stored for `sent`, pushed at a time within `window` (ms, Redis's clock). Returns
/// which rule applied, for the counts.
fn check(sent: &Payload, stored: &[u8], window: (i64, i64)) -> Result<&'static str, TestCaseError> {
    let shown = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    let plainly = contains(&sent.bytes, b"\"created_at\"");
    let stamped = |rule: &'static str| -> Result<&'static str, TestCaseError> {
        let stamp = stamp_in(&sent.bytes, stored);
        prop_assert!(
            stamp.is_some_and(|ms| window.0 <= ms && ms <= window.1),
            "{}: expected the stamp (Redis's clock within {:?}) right after the opening brace and the rest \
             unchanged: sent {:?}, stored {:?}",
            sent.kind,
            window,
            shown(&sent.bytes),
            shown(stored)
        );
        Ok(rule)
    };
    let unchanged = |rule: &'static str| -> Result<&'static str, TestCaseError> {
        prop_assert_eq!(shown(stored), shown(&sent.bytes), "{}: {}", sent.kind, rule);
        prop_assert_eq!(stored, &sent.bytes[..], "{}: {}", sent.kind, rule);
        Ok(rule)
    };
    let Ok(Value::Object(object)) = serde_json::from_slice::<Value>(&sent.bytes) else {
        // Not a JSON object: stored as it came, but for text shaped like one that the script did not decode.
        return if object_shaped(&sent.bytes) && !plainly {
            stamped("not a JSON object, shaped like one: stamped")
        } else {
            unchanged("not a JSON object: stored as it came")
        };
    };
    if object.contains_key("created_at") {
        // A top-level `created_at` whose key is spelled with \u escapes is not seen without decoding.
        return if plainly {
            unchanged("a JSON object with created_at: stored as it came")
        } else {
            stamped("a JSON object with an escaped created_at key: stamped")
        };
    }
    let rule = stamped("a JSON object without created_at: stamped")?;
    let mut back = match serde_json::from_slice::<Value>(stored) {
        Ok(Value::Object(back)) => back,
        other => {
            return Err(TestCaseError::fail(format!(
                "{}: stored {:?}, which is not a JSON object: {other:?}",
                sent.kind,
                shown(stored)
            )));
        }
    };
    let stamp = back.remove("created_at");
    prop_assert!(
        stamp.as_ref().is_some_and(Value::is_i64),
        "{}: created_at {:?}",
        sent.kind,
        stamp
    );
    prop_assert_eq!(
        &back,
        &object,
        "{}: the stamp changed the value: sent {:?}, stored {:?}",
        sent.kind,
        shown(&sent.bytes),
        shown(stored)
    );
    Ok(rule)
}

fn redis_ms(connection: &mut kmqd::broker::Conn) -> i64 {
    let (seconds, micros): (i64, i64) = redis::cmd("TIME").query(connection).unwrap();
    seconds * 1000 + micros / 1000
}

/// Runs `store` (which stores a batch of payloads in `kmq:{q}:ready:normal`) on generated batches, and checks
/// what it stored, in order.
fn stores_only_what_it_may(store: impl Fn(&mut kmqd::broker::Conn, &[Payload])) {
    let redis = RedisServer::start();
    let connection = RefCell::new(redis.connection());
    let counts = RefCell::new(std::collections::BTreeMap::<&str, usize>::new());
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok());
    let mut runner = TestRunner::new(Config {
        cases: cases.unwrap_or(CASES),
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&prop::collection::vec(payload(), 1..=BATCH), |payloads| {
        let connection = &mut *connection.borrow_mut();
        let before = redis_ms(connection);
        store(connection, &payloads);
        let after = redis_ms(connection);
        let stored: Vec<Vec<u8>> = redis::cmd("LRANGE")
            .arg("kmq:{q}:ready:normal")
            .arg(0)
            .arg(-1)
            .query(connection)
            .unwrap();
        let _: () = redis::cmd("DEL")
            .arg("kmq:{q}:ready:normal")
            .query(connection)
            .unwrap();
        prop_assert_eq!(stored.len(), payloads.len(), "one stored per payload");
        for (sent, stored) in payloads.iter().zip(&stored) {
            let rule = check(sent, stored, (before, after))?;
            let mut counts = counts.borrow_mut();
            *counts.entry(sent.kind).or_default() += 1;
            *counts.entry(rule).or_default() += 1;
        }
        Ok(())
    });
    if let Err(error) = result {
        panic!("{error}");
    }
    let counts = counts.into_inner();
    // Every kind of payload, and every rule, was tried often enough to mean something.
    for kind in [
        "object",
        "object with created_at",
        "empty object",
        "object with data",
        "other JSON",
        "bytes",
        "not JSON, from {",
        "not a JSON object: stored as it came",
        "not a JSON object, shaped like one: stamped",
        "a JSON object with created_at: stored as it came",
        "a JSON object with an escaped created_at key: stamped",
        "a JSON object without created_at: stamped",
    ] {
        assert!(
            counts.get(kind).copied().unwrap_or(0) >= 10,
            "too few {kind:?}: {counts:?}"
        );
    }
}

#[test]
fn push_stamps_created_at_into_json_objects_without_one_and_stores_the_rest_unchanged() {
    stores_only_what_it_may(|connection, payloads| {
        // As docs/PROTOCOL.md documents it: KEYS, then DELAY_MS DUE_AT_MS CHANNEL, then ID UNIQUE ENVELOPE per task.
        let mut eval = redis::cmd("EVAL");
        eval.arg(PUSH).arg(6);
        for key in [
            "ready:normal",
            "delayed:normal",
            "delayed-tasks",
            "wake",
            "unique",
            "stats",
        ] {
            eval.arg(format!("kmq:{{q}}:{key}"));
        }
        eval.arg(0).arg(0).arg("kmq:{q}:delay-wake");
        for payload in payloads {
            eval.arg("").arg(0).arg(&payload.bytes);
        }
        let accepted: Vec<i64> = eval.query(connection).unwrap();
        assert_eq!(accepted, vec![1; payloads.len()]);
    });
}

#[test]
fn fire_stamps_created_at_into_json_objects_without_one_and_stores_the_rest_unchanged() {
    stores_only_what_it_may(|connection, payloads| {
        // One slot (0, long past) of a new schedule per payload, in one pipeline.
        let mut pipe = redis::pipe();
        for (i, payload) in payloads.iter().enumerate() {
            pipe.cmd("EVAL")
                .arg(FIRE)
                .arg(4)
                .arg("kmq:{q}:schedules")
                .arg("kmq:{q}:ready:normal")
                .arg("kmq:{q}:wake")
                .arg("kmq:{q}:stats")
                .arg(format!("s{i}"))
                .arg(0)
                .arg(&payload.bytes);
        }
        let fired: Vec<(i64, i64)> = pipe.query(connection).unwrap();
        assert!(fired.iter().all(|(result, _)| *result == 1), "{fired:?}");
        let _: () = redis::cmd("DEL")
            .arg("kmq:{q}:schedules")
            .query(connection)
            .unwrap();
    });
}

#[test]
fn push_stamps_the_documented_examples() {
    let redis = RedisServer::start();
    let mut connection = redis.connection();
    // (sent, stored with N for the stamp)
    let cases: &[(&str, &str)] = &[
        (
            r#"{"id":"a","type":"t"}"#,
            r#"{"created_at":N,"id":"a","type":"t"}"#,
        ),
        (
            " \n {\"id\" : \"a\" }\t",
            " \n {\"created_at\":N,\"id\" : \"a\" }\t",
        ),
        ("{}", r#"{"created_at":N}"#),
        ("{ }", r#"{"created_at":N }"#),
        (
            r#"{"type":"t","data":{"created_at":1}}"#,
            r#"{"created_at":N,"type":"t","data":{"created_at":1}}"#,
        ),
        (
            r#"{"type":"t","data":"created_at","xcreated_at":1}"#,
            r#"{"created_at":N,"type":"t","data":"created_at","xcreated_at":1}"#,
        ),
        (
            r#"{"type":"t","created_at":1700000000000}"#,
            r#"{"type":"t","created_at":1700000000000}"#,
        ),
        (
            r#"  {"type":"t","created_at":null}"#,
            r#"  {"type":"t","created_at":null}"#,
        ),
        ("[1,2]", "[1,2]"),
        (r#""text""#, r#""text""#),
        ("42", "42"),
        ("", ""),
        ("not json", "not json"),
        ("{not json}", "{not json}"),
        (r#"{"id":"cut"#, r#"{"id":"cut"#),
        (r#"{"type":"t"} trailing"#, r#"{"type":"t"} trailing"#),
        (r#"{"created_at":1,}"#, r#"{"created_at":1,}"#),
    ];
    let mut eval = redis::cmd("EVAL");
    eval.arg(PUSH).arg(6);
    for key in [
        "ready:normal",
        "delayed:normal",
        "delayed-tasks",
        "wake",
        "unique",
        "stats",
    ] {
        eval.arg(format!("kmq:{{q}}:{key}"));
    }
    eval.arg(0).arg(0).arg("kmq:{q}:delay-wake");
    for (sent, _) in cases {
        eval.arg("").arg(0).arg(*sent);
    }
    let before = redis_ms(&mut connection);
    let _: Vec<i64> = eval.query(&mut connection).unwrap();
    let after = redis_ms(&mut connection);
    let stored: Vec<String> = redis.cmd(&["LRANGE", "kmq:{q}:ready:normal", "0", "-1"]);
    assert_eq!(stored.len(), cases.len());
    for ((sent, expected), stored) in cases.iter().zip(&stored) {
        let stamp = stored
            .split_once("\"created_at\":")
            .map(|(_, rest)| {
                rest.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
            })
            .filter(|digits| !digits.is_empty() && expected.contains(":N"));
        let expected = match &stamp {
            Some(ms) => {
                let ms: i64 = ms.parse().unwrap();
                assert!((before..=after).contains(&ms), "{sent:?}: stamp {ms}");
                expected.replace(":N", &format!(":{ms}"))
            }
            None => expected.to_string(),
        };
        assert_eq!(stored, &expected, "sent {sent:?}");
    }
}
