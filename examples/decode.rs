//! The worker's decode of one envelope, N times, for callgrind: `valgrind --tool=callgrind
//! target/release/examples/decode SHAPE N` twice (say N = 0 and 20,000); the difference of the totals over N is
//! the instructions per decode (docs/PERFORMANCE.md, "The envelope's fast path").

use std::hint::black_box;

use kmqd::task::{self, Envelope};

/// Envelopes as they reach a worker: the library's (`Client::push_batch`: id, type, data, attempt) after
/// push.lua stamped `created_at` in front, with kmqd-bench's data `1` or `{}`; json.dumps's spacing (the
/// protocol's Python example); a retried task.
const SHAPES: &[(&str, &str)] = &[
    (
        "bench",
        r#"{"created_at":1764700000000,"id":"0b7e3c1e-6d2f-4a57-9f3e-8f1d2c3b4a5e","type":"test","data":1,"attempt":0}"#,
    ),
    (
        "empty",
        r#"{"created_at":1764700000000,"id":"0b7e3c1e-6d2f-4a57-9f3e-8f1d2c3b4a5e","type":"test","data":{},"attempt":0}"#,
    ),
    (
        "object",
        r#"{"created_at":1764700000000,"id":"0b7e3c1e-6d2f-4a57-9f3e-8f1d2c3b4a5e","type":"email.send","data":{"to":"a@example.com","n":3},"attempt":0}"#,
    ),
    (
        "python",
        r#"{"created_at":1764700000000,"id": "0b7e3c1e-6d2f-4a57-9f3e-8f1d2c3b4a5e", "type": "email.send", "data": {"to": "a@example.com", "n": 3}}"#,
    ),
    (
        "retried",
        r#"{"id":"0b7e3c1e-6d2f-4a57-9f3e-8f1d2c3b4a5e","type":"test","data":{},"created_at":1764700000000,"attempt":2,"last_error":"handler failed: boom"}"#,
    ),
];

fn main() {
    let mut args = std::env::args().skip(1);
    let shape = args.next().unwrap_or_else(|| "bench".to_string());
    let n: usize = args.next().map_or(100_000, |n| n.parse().expect("N"));
    let payload = SHAPES
        .iter()
        .find(|(name, _)| *name == shape)
        .unwrap_or_else(|| {
            panic!(
                "shapes: {:?}",
                SHAPES.iter().map(|s| s.0).collect::<Vec<_>>()
            )
        })
        .1
        .as_bytes();
    let mut attempts = 0;
    for _ in 0..n {
        // As `QueueContext::decode` does for a queue without foreign payloads.
        let text = task::utf8(black_box(payload)).expect("UTF-8");
        let envelope = Envelope::decode(text).expect("an envelope");
        attempts += black_box(&envelope).attempt;
    }
    black_box(attempts);
}
