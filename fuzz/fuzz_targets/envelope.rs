//! `Envelope::decode` and `Envelope::decode_foreign` on arbitrary payloads (docs/PROTOCOL.md, "The envelope").
//!
//! Properties: `task::utf8` and `task::salvage_id` never panic on any bytes; and for every UTF-8 input:
//! - neither decoder panics;
//! - when a decoder succeeds, `encode()` is JSON (JSON that serde_json's own `Value` parser accepts whenever it
//!   accepts the input), and decodes again to an equal envelope;
//! - `data` and every unknown field keep their text byte for byte (they are slices of the input, and come back
//!   unchanged from the re-encoded envelope);
//! - a second encode of the decoded envelope is identical to the first (encoding is a fixed point);
//! - `Envelope::decode`, whose fast scan takes most envelopes, says exactly what serde_json's decoding says
//!   (`Envelope::decode_with_serde_json`, the definition): the same envelope, or the same error.

#![no_main]

use kmqd::task::{Envelope, EnvelopeError};
use libfuzzer_sys::fuzz_target;
use serde::de::IgnoredAny;

/// The payload the decoders take. When `Envelope::decode` takes `&[u8]`, this line becomes
/// `fn payload(bytes: &[u8]) -> Option<&[u8]> { Some(bytes) }` and the rest of the target stays as it is.
#[rustfmt::skip]
fn payload(bytes: &[u8]) -> Option<&str> { std::str::from_utf8(bytes).ok() }

/// The field a foreign payload takes its type from, as in the README's example.
const FOREIGN_TYPE_FIELD: &str = "callback";

fuzz_target!(|bytes: &[u8]| {
    // What the daemon does with any payload it takes before decoding it (and with one that does not decode):
    // neither may panic, whatever the bytes.
    let _ = kmqd::task::utf8(bytes);
    let _ = kmqd::task::salvage_id(bytes);
    let Some(input) = payload(bytes) else { return };
    let strict = Envelope::decode(input);
    assert_eq!(
        strict,
        Envelope::decode_with_serde_json(input),
        "the fast scan and serde_json differ"
    );
    if let Ok(envelope) = &strict {
        check_round_trip(bytes, envelope, false);
    }
    let foreign = Envelope::decode_foreign(input, FOREIGN_TYPE_FIELD);
    if let Ok(envelope) = &foreign {
        check_round_trip(bytes, envelope, true);
    }
    // An envelope is an envelope in both decoders: the foreign path only adds payloads without `type`.
    if let (Ok(strict), Ok(foreign)) = (&strict, &foreign) {
        assert_eq!(
            strict, foreign,
            "decode_foreign changed an envelope that decode accepts"
        );
    }
    if strict.is_ok() {
        assert!(
            foreign.is_ok(),
            "decode accepts what decode_foreign refuses"
        );
    }
});

/// Decodes kmqd's own encoding again, with the decoder that read the input. (`as_ref` gives the decoders the
/// `&str` they take today, and the `&[u8]` they may take tomorrow.)
#[allow(clippy::useless_asref)]
fn decode_again(encoded: &str, foreign: bool) -> Result<Envelope<'_>, EnvelopeError> {
    if foreign {
        Envelope::decode_foreign(encoded.as_ref(), FOREIGN_TYPE_FIELD)
    } else {
        Envelope::decode(encoded.as_ref())
    }
}

fn check_round_trip(input: &[u8], envelope: &Envelope<'_>, foreign: bool) {
    // What kmqd keeps byte for byte is a slice of the input (a borrowed `RawValue`): the whole input without
    // the whitespace around it, for a foreign payload's data. A task without `data` has `null`.
    let kept = |raw: &str| contains(input, raw.as_bytes());
    let data = envelope.data.get();
    assert!(
        data == "null" || kept(data),
        "data is not the producer's text: {data:?}"
    );
    for (key, value) in &envelope.extra {
        assert!(
            kept(value.get()),
            "unknown field {key:?} is not the producer's text: {:?}",
            value.get()
        );
    }

    let encoded = envelope.encode();
    assert!(
        serde_json::from_str::<IgnoredAny>(&encoded).is_ok(),
        "encode() is not JSON: {encoded}"
    );
    if serde_json::from_slice::<serde_json::Value>(input).is_ok()
        && let Err(error) = serde_json::from_str::<serde_json::Value>(&encoded)
    {
        panic!("encode() is not JSON ({error}): {encoded}");
    }
    let again = match decode_again(&encoded, foreign) {
        Ok(again) => again,
        Err(error) => panic!("encode() does not decode again ({error}): {encoded}"),
    };
    assert_eq!(
        &again, envelope,
        "the round trip changed the envelope: {encoded}"
    );
    assert_eq!(
        again.data.get(),
        envelope.data.get(),
        "data changed: {encoded}"
    );
    for ((key, before), (_, after)) in envelope.extra.iter().zip(&again.extra) {
        assert_eq!(
            before.get(),
            after.get(),
            "unknown field {key:?} changed: {encoded}"
        );
    }
    assert_eq!(again.encode(), encoded, "encoding is not a fixed point");
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty()
        || haystack
            .windows(needle.len())
            .any(|window| window == needle)
}
