//! The task envelope: the only module that knows the wire format of a task (docs/PROTOCOL.md, "The envelope").
//!
//! An envelope is a JSON object. kmqd reads the fields it knows and keeps every other field byte for byte, so a
//! task that is retried or dead-lettered comes back with whatever its producer put in it. `data` is never
//! decoded by the daemon: it goes to the plugin as the JSON text the producer wrote.
//!
//! Decoding borrows from the payload (an [`Envelope<'a>`] points into the text it was read from), so running a
//! task allocates nothing for its id, type or data; [`Envelope::into_owned`] detaches one that must outlive it.

mod scan;

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer, ser::SerializeMap};
use serde_json::value::RawValue;

/// The envelope version this build speaks. An envelope without `v` is version 1.
pub(crate) const ENVELOPE_VERSION: u32 = 1;

/// A decoded task envelope, borrowing from the payload it was read from where it can.
#[derive(Clone, Debug)]
pub struct Envelope<'a> {
    /// Absent only in envelopes written by hand; the daemon then assigns one (see [`Envelope::ensure_id`]).
    pub id: Option<Cow<'a, str>>,
    /// Selects the handler.
    pub kind: Cow<'a, str>,
    /// The task's payload as JSON text (`null` when absent).
    pub data: Cow<'a, RawValue>,
    /// Enqueue time in ms on Redis's clock, stamped by the enqueue script when the producer gave none.
    pub created_at: Option<i64>,
    /// 0 on the first run.
    pub attempt: u32,
    /// The level the producer asked for; informational once the task is in a list.
    pub priority: Option<Cow<'a, str>>,
    /// Set when the task was pushed as unique: its id is held until the task is done or dead.
    pub unique: bool,
    /// Why the previous attempt failed.
    pub last_error: Option<Cow<'a, str>>,
    /// How many times the task came back, uncharged, from a daemon whose lease expired while it held the task
    /// (it may not even have started it). Written by kmqd; a task recovered more than once runs in isolation.
    pub recovered: u32,
    /// How many times the task crashed (or hung) its daemon while it ran alone, each charged as a failed attempt.
    /// Written by kmqd.
    pub crashes: u32,
    /// The envelope version, 1 when absent.
    pub version: u32,
    /// Every field kmqd does not know, kept as the producer wrote it.
    pub extra: Vec<(Cow<'a, str>, Cow<'a, RawValue>)>,
}

impl PartialEq for Envelope<'_> {
    fn eq(&self, other: &Envelope<'_>) -> bool {
        // RawValue has no PartialEq: raw JSON is compared as text, which is what kmqd preserves.
        let raw_eq = |a: &RawValue, b: &RawValue| a.get() == b.get();
        self.id == other.id
            && self.kind == other.kind
            && raw_eq(&self.data, &other.data)
            && self.created_at == other.created_at
            && self.attempt == other.attempt
            && self.priority == other.priority
            && self.unique == other.unique
            && self.last_error == other.last_error
            && self.recovered == other.recovered
            && self.crashes == other.crashes
            && self.version == other.version
            && self.extra.len() == other.extra.len()
            && self
                .extra
                .iter()
                .zip(&other.extra)
                .all(|((ka, va), (kb, vb))| ka == kb && raw_eq(va, vb))
    }
}

/// Why a payload is not a usable envelope. The text ends up in the dead-letter record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed task: {0}")]
pub struct EnvelopeError(pub String);

/// Why an envelope of `version`, newer than this build speaks, is refused.
#[cold]
fn unspoken(version: u32) -> EnvelopeError {
    EnvelopeError(format!(
        "envelope version {version} is newer than this kmqd speaks ({ENVELOPE_VERSION}); upgrade kmqd"
    ))
}

/// The JSON `null`, for a task without `data`.
fn null() -> &'static RawValue {
    static NULL: std::sync::LazyLock<&'static RawValue> =
        // "null" is valid JSON.
        std::sync::LazyLock::new(|| serde_json::from_str("null").expect("null is JSON"));
    &NULL
}

impl<'a> Envelope<'a> {
    /// A new envelope as a producer makes it: attempt 0, no `created_at` (the enqueue script stamps it).
    pub fn new(id: String, kind: String, data: Box<RawValue>) -> Envelope<'static> {
        Envelope {
            id: Some(Cow::Owned(id)),
            kind: Cow::Owned(kind),
            data: Cow::Owned(data),
            ..Envelope::blank()
        }
    }

    /// Every field at the value an absent one reads as (the type empty, which a decoder refuses).
    fn blank() -> Envelope<'a> {
        Envelope {
            id: None,
            kind: Cow::Borrowed(""),
            data: Cow::Borrowed(null()),
            created_at: None,
            attempt: 0,
            priority: None,
            unique: false,
            last_error: None,
            recovered: 0,
            crashes: 0,
            version: ENVELOPE_VERSION,
            extra: Vec::new(),
        }
    }

    /// Decodes a payload taken from Redis, borrowing from it: by the fast scan of what producers write
    /// ([`scan`]), or by serde_json, which defines the result, when the scan gives up.
    pub fn decode(payload: &'a str) -> Result<Envelope<'a>, EnvelopeError> {
        let mut slot = Slot::new();
        Envelope::decode_in(payload, &mut slot)?;
        Ok(slot.0.envelope)
    }

    /// [`Envelope::decode`] into `slot`, where the envelope stays: the worker's, which decodes one per task (an
    /// envelope is some 200 bytes, and each move of one out of a `Result` was a call of `memcpy`, callgrind).
    pub(crate) fn decode_in(payload: &'a str, slot: &mut Slot<'a>) -> Result<(), EnvelopeError> {
        let fields = &mut slot.0;
        // An absent type is empty: both are for serde_json to refuse.
        if scan::envelope(payload, fields).is_some() && !fields.envelope.kind.is_empty() {
            if fields.envelope.version > ENVELOPE_VERSION {
                return Err(unspoken(fields.envelope.version));
            }
            return Ok(());
        }
        fields.envelope = Envelope::decode_with_serde_json(payload)?;
        Ok(())
    }

    /// [`Envelope::decode`] without its fast scan: the definition the scan is held to (its tests, the `envelope`
    /// fuzzer). Not for the daemon's use.
    #[doc(hidden)]
    pub fn decode_with_serde_json(payload: &'a str) -> Result<Envelope<'a>, EnvelopeError> {
        serde_json::from_str::<Envelope<'a>>(payload)
            .map_err(|error| EnvelopeError(error.to_string()))?
            .spoken()
    }

    /// The envelope, unless its version is newer than this build speaks.
    fn spoken(self) -> Result<Envelope<'a>, EnvelopeError> {
        if self.version > ENVELOPE_VERSION {
            return Err(unspoken(self.version));
        }
        Ok(self)
    }

    /// Decodes a payload of a queue that also accepts *foreign* payloads: plain JSON objects that are not
    /// envelopes (no `type`), whose task type is the string in `type_field`. Such a payload becomes the `data` of
    /// a new envelope, whole; its `id` field, when a string, becomes the task id. Envelopes decode as usual.
    pub fn decode_foreign(
        payload: &'a str,
        type_field: &str,
    ) -> Result<Envelope<'a>, EnvelopeError> {
        let strict = Envelope::decode(payload);
        let Err(error) = &strict else { return strict };
        let Ok(fields) =
            serde_json::from_str::<std::collections::HashMap<Cow<'_, str>, &RawValue>>(payload)
        else {
            return strict;
        };
        if fields.contains_key("type") {
            return strict;
        }
        let Some(kind) = fields.get(type_field) else {
            return Err(EnvelopeError(format!(
                "{}; and no {type_field:?} field for a foreign payload",
                error.0
            )));
        };
        let kind: String = serde_json::from_str(kind.get())
            .ok()
            .filter(|kind: &String| !kind.is_empty())
            .ok_or_else(|| {
                EnvelopeError(format!(
                    "foreign payload: {type_field:?} must be a non-empty string"
                ))
            })?;
        let id = fields
            .get("id")
            .and_then(|id| serde_json::from_str::<String>(id.get()).ok())
            .unwrap_or_else(new_id);
        let data: &RawValue =
            serde_json::from_str(payload).map_err(|error| EnvelopeError(error.to_string()))?;
        let mut envelope = Envelope::new(id, kind, Box::default());
        envelope.data = Cow::Borrowed(data);
        Ok(envelope)
    }

    /// Encodes the envelope: known fields first, in a fixed order, then the producer's extra fields.
    pub fn encode(&self) -> String {
        // Serializing strings, integers and raw JSON into a String cannot fail.
        serde_json::to_string(self).expect("envelope serialization is infallible")
    }

    /// The id, or `fallback` for a hand-written envelope without one. Retries and dead records write the id
    /// back, so a task keeps the id it was first given.
    pub(crate) fn ensure_id(&mut self, fallback: impl FnOnce() -> String) -> &str {
        self.id.get_or_insert_with(|| Cow::Owned(fallback()))
    }

    /// When the task expires (ms since the epoch on Redis's clock; docs/PROTOCOL.md, "Expiry"): the producer's
    /// `expires_at`, kept among the fields kmqd does not decode, so that an envelope without unknown fields costs
    /// its worker one test of an empty list; `None` when absent or null. A value that is not an integer makes the
    /// task malformed: it is dead-lettered unrun with this reason, rather than run without the expiry its producer
    /// asked for.
    #[inline]
    pub fn expires_at(&self) -> Result<Option<i64>, EnvelopeError> {
        // Inlined into the worker, this test is all an envelope without undecoded fields pays for expiry.
        if self.extra.is_empty() {
            return Ok(None);
        }
        self.expires_at_among_extra()
    }

    /// [`Envelope::expires_at`] once the envelope has fields kmqd does not decode: out of line, so that the
    /// worker inlines only the test above.
    #[inline(never)]
    fn expires_at_among_extra(&self) -> Result<Option<i64>, EnvelopeError> {
        let Some((_, raw)) = self.extra.iter().find(|(key, _)| key == "expires_at") else {
            return Ok(None);
        };
        serde_json::from_str::<Option<i64>>(raw.get()).map_err(|_| {
            EnvelopeError(format!(
                "expires_at {} is not a time: write an integer, ms since the epoch, or leave it out",
                raw.get().chars().take(100).collect::<String>()
            ))
        })
    }

    /// The task's group (`[queues.groups]`: the producer's `group` field, kept among the fields kmqd does not
    /// decode for every queue); `None` when absent or null. A group that is not a string of 1 to
    /// [`crate::config::MAX_GROUP_BYTES`] bytes makes the task malformed on a grouped queue (groups.lua puts it in
    /// the group with the empty name, and the daemon dead-letters it with this reason).
    pub fn group(&self) -> Result<Option<String>, EnvelopeError> {
        let Some((_, raw)) = self.extra.iter().find(|(key, _)| key == "group") else {
            return Ok(None);
        };
        let bound = crate::config::MAX_GROUP_BYTES;
        let refused = || {
            EnvelopeError(format!(
                "group {} is not a group name: write a string of 1 to {bound} bytes, or leave it out",
                raw.get().chars().take(100).collect::<String>()
            ))
        };
        match serde_json::from_str::<Option<String>>(raw.get()) {
            Ok(None) => Ok(None),
            Ok(Some(group)) if !group.is_empty() && group.len() <= bound => Ok(Some(group)),
            _ => Err(refused()),
        }
    }

    /// The id for logs and records: the empty string when the envelope has none.
    pub(crate) fn id_str(&self) -> &str {
        self.id.as_deref().unwrap_or("")
    }

    /// The same envelope, owning its text.
    pub fn into_owned(self) -> Envelope<'static> {
        let owned = |text: Cow<'_, str>| Cow::Owned(text.into_owned());
        let raw = |value: Cow<'_, RawValue>| Cow::Owned(value.into_owned());
        Envelope {
            id: self.id.map(owned),
            kind: owned(self.kind),
            data: raw(self.data),
            created_at: self.created_at,
            attempt: self.attempt,
            priority: self.priority.map(owned),
            unique: self.unique,
            last_error: self.last_error.map(owned),
            recovered: self.recovered,
            crashes: self.crashes,
            version: self.version,
            extra: self
                .extra
                .into_iter()
                .map(|(key, value)| (owned(key), raw(value)))
                .collect(),
        }
    }
}

impl Serialize for Envelope<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        if let Some(id) = &self.id {
            map.serialize_entry("id", id)?;
        }
        map.serialize_entry("type", &self.kind)?;
        map.serialize_entry("data", &self.data)?;
        if let Some(created_at) = self.created_at {
            map.serialize_entry("created_at", &created_at)?;
        }
        map.serialize_entry("attempt", &self.attempt)?;
        if let Some(priority) = &self.priority {
            map.serialize_entry("priority", priority)?;
        }
        if self.unique {
            map.serialize_entry("unique", &true)?;
        }
        if let Some(last_error) = &self.last_error {
            map.serialize_entry("last_error", last_error)?;
        }
        if self.recovered > 0 {
            map.serialize_entry("recovered", &self.recovered)?;
        }
        if self.crashes > 0 {
            map.serialize_entry("crashes", &self.crashes)?;
        }
        if self.version != ENVELOPE_VERSION {
            map.serialize_entry("v", &self.version)?;
        }
        for (key, value) in &self.extra {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

/// A string that borrows from the input when it holds no escapes.
struct Text<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Text<'de>, D::Error> {
        struct TextVisitor;
        impl<'de> Visitor<'de> for TextVisitor {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(text)))
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(text.to_string())))
            }
            fn visit_string<E: de::Error>(self, text: String) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(text)))
            }
        }
        deserializer.deserialize_str(TextVisitor)
    }
}

/// An optional string: `null` reads as absent.
struct OptionalText<'a>(Option<Cow<'a, str>>);

impl<'de> Deserialize<'de> for OptionalText<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<OptionalText<'de>, D::Error> {
        Ok(OptionalText(
            Option::<Text<'de>>::deserialize(deserializer)?.map(|text| text.0),
        ))
    }
}

/// The envelope's known keys, as serde_json's visitor reads them (the scan has its own, `scan::Key`); anything else
/// is kept in `extra`.
enum Field<'a> {
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
    Other(Cow<'a, str>),
}

impl<'de> Deserialize<'de> for Field<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Field<'de>, D::Error> {
        let key = Text::deserialize(deserializer)?.0;
        Ok(match &*key {
            "id" => Field::Id,
            "type" => Field::Type,
            "data" => Field::Data,
            "created_at" => Field::CreatedAt,
            "attempt" => Field::Attempt,
            "priority" => Field::Priority,
            "unique" => Field::Unique,
            "last_error" => Field::LastError,
            "recovered" => Field::Recovered,
            "crashes" => Field::Crashes,
            "v" => Field::Version,
            _ => Field::Other(key),
        })
    }
}

/// Where an envelope is decoded in place ([`Envelope::decode_in`]).
pub(crate) struct Slot<'a>(Fields<'a>);

impl<'a> Slot<'a> {
    pub(crate) fn new() -> Slot<'a> {
        Slot(Fields::new())
    }

    /// The envelope decoded (at its defaults before a decode succeeded).
    pub(crate) fn envelope(&self) -> &Envelope<'a> {
        &self.0.envelope
    }

    pub(crate) fn envelope_mut(&mut self) -> &mut Envelope<'a> {
        &mut self.0.envelope
    }

    /// Fills the slot with `envelope`, decoded elsewhere.
    pub(crate) fn set(&mut self, envelope: Envelope<'a>) {
        self.0.envelope = envelope;
    }

    pub(crate) fn into_envelope(self) -> Envelope<'a> {
        self.0.envelope
    }
}

impl Default for Slot<'_> {
    fn default() -> Self {
        Slot::new()
    }
}

/// An envelope as a decoder fills it: each field at its default until read, and which known fields were read
/// (`seen`, a bit each), so that a repeated one is refused. What serde_json's visitor and the fast scan both fill,
/// so that the defaults live here once; built once, in place, and returned without an `Option` around it (an
/// envelope is some 200 bytes, and each move of one was a call of `memcpy`, callgrind).
struct Fields<'a> {
    envelope: Envelope<'a>,
    seen: u16,
}

impl<'a> Fields<'a> {
    const ID: u16 = 1;
    const TYPE: u16 = 1 << 1;
    const DATA: u16 = 1 << 2;
    const CREATED_AT: u16 = 1 << 3;
    const ATTEMPT: u16 = 1 << 4;
    const PRIORITY: u16 = 1 << 5;
    const UNIQUE: u16 = 1 << 6;
    const LAST_ERROR: u16 = 1 << 7;
    const RECOVERED: u16 = 1 << 8;
    const CRASHES: u16 = 1 << 9;
    const VERSION: u16 = 1 << 10;

    /// No field read: every field at the value an absent one reads as (the type empty, which is refused).
    fn new() -> Fields<'a> {
        Fields {
            envelope: Envelope::blank(),
            seen: 0,
        }
    }

    /// The envelope, to set the known field `bit` in; `None` when it was read already.
    fn once(&mut self, bit: u16) -> Option<&mut Envelope<'a>> {
        if self.seen & bit != 0 {
            return None;
        }
        self.seen |= bit;
        Some(&mut self.envelope)
    }

    /// [`Fields::once`], with serde_json's error for a repeated field.
    fn first<E: de::Error>(
        &mut self,
        bit: u16,
        name: &'static str,
    ) -> Result<&mut Envelope<'a>, E> {
        self.once(bit).ok_or_else(|| E::duplicate_field(name))
    }
}

impl<'de> Deserialize<'de> for Envelope<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Envelope<'de>, D::Error> {
        struct EnvelopeVisitor;

        impl<'de> Visitor<'de> for EnvelopeVisitor {
            type Value = Envelope<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a task envelope: a JSON object with at least \"type\"")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Envelope<'de>, A::Error> {
                let mut fields = Fields::new();
                // Each value is read before its key is checked for a repeat: a repeated key with a value of the
                // wrong type is refused for its type.
                while let Some(field) = map.next_key::<Field<'de>>()? {
                    match field {
                        Field::Id => {
                            let id = map.next_value::<Text<'de>>()?.0;
                            fields.first(Fields::ID, "id")?.id = Some(id);
                        }
                        Field::Type => {
                            let kind = map.next_value::<Text<'de>>()?.0;
                            fields.first(Fields::TYPE, "type")?.kind = kind;
                        }
                        Field::Data => {
                            let data = map.next_value::<&'de RawValue>()?;
                            fields.first(Fields::DATA, "data")?.data = Cow::Borrowed(data);
                        }
                        Field::CreatedAt => {
                            let created_at = map.next_value::<Option<i64>>()?;
                            fields.first(Fields::CREATED_AT, "created_at")?.created_at = created_at;
                        }
                        Field::Attempt => {
                            let attempt = map.next_value::<u32>()?;
                            fields.first(Fields::ATTEMPT, "attempt")?.attempt = attempt;
                        }
                        Field::Priority => {
                            let priority = map.next_value::<OptionalText<'de>>()?.0;
                            fields.first(Fields::PRIORITY, "priority")?.priority = priority;
                        }
                        Field::Unique => {
                            let unique = map.next_value::<bool>()?;
                            fields.first(Fields::UNIQUE, "unique")?.unique = unique;
                        }
                        Field::LastError => {
                            let last_error = map.next_value::<OptionalText<'de>>()?.0;
                            fields.first(Fields::LAST_ERROR, "last_error")?.last_error = last_error;
                        }
                        Field::Recovered => {
                            let recovered = map.next_value::<u32>()?;
                            fields.first(Fields::RECOVERED, "recovered")?.recovered = recovered;
                        }
                        Field::Crashes => {
                            let crashes = map.next_value::<u32>()?;
                            fields.first(Fields::CRASHES, "crashes")?.crashes = crashes;
                        }
                        Field::Version => {
                            let version = map.next_value::<u32>()?;
                            fields.first(Fields::VERSION, "v")?.version = version;
                        }
                        Field::Other(key) => {
                            let value = map.next_value::<&'de RawValue>()?;
                            fields.envelope.extra.push((key, Cow::Borrowed(value)));
                        }
                    }
                }
                if fields.seen & Fields::TYPE == 0 {
                    return Err(de::Error::missing_field("type"));
                }
                if fields.envelope.kind.is_empty() {
                    return Err(de::Error::invalid_value(
                        de::Unexpected::Str(""),
                        &"a non-empty task type",
                    ));
                }
                Ok(fields.envelope)
            }
        }

        deserializer.deserialize_map(EnvelopeVisitor)
    }
}

/// A payload as text: envelopes are UTF-8 JSON. The error names the first invalid byte, so a dead-letter reason
/// tells a producer what to fix (its bytes are kept in the record, see `settlement`).
pub fn utf8(payload: &[u8]) -> Result<&str, EnvelopeError> {
    std::str::from_utf8(payload).map_err(|error| {
        EnvelopeError(format!(
            "not UTF-8 text (invalid byte 0x{:02x} at offset {}); an envelope is a UTF-8 JSON object",
            payload[error.valid_up_to()],
            error.valid_up_to()
        ))
    })
}

/// The string `id` of a payload that is a JSON object but not a valid envelope (a missing `type`, a field of the
/// wrong type), so that its dead-letter record can still be found by id. `None` for anything else.
pub fn salvage_id(payload: &[u8]) -> Option<String> {
    // Read leniently: a payload that is malformed because of a bad byte elsewhere still has a good id.
    let text = String::from_utf8_lossy(payload);
    let object: std::collections::HashMap<String, Box<RawValue>> =
        serde_json::from_str(&text).ok()?;
    let id: String = serde_json::from_str(object.get("id")?.get()).ok()?;
    (!id.contains('\u{fffd}')).then_some(id)
}

/// Parses `text` as JSON for a task's `data`, with an error that says what was wrong.
pub fn data_from_str(text: &str) -> Result<Box<RawValue>, String> {
    RawValue::from_string(text.to_string())
        .map_err(|error| format!("data is not valid JSON: {error}"))
}

/// How much of a payload a log line shows.
pub(crate) const LOGGED_PAYLOAD_BYTES: usize = 256;

/// `text` for a log field: its control characters escaped (`\n`, `\u{1b}`), so that a task type, an id or a
/// handler's message cannot forge a log line or drive a terminal (tracing-subscriber escapes only the message;
/// journald splits entries at newlines: the review's L3), and cut to at most `max` bytes (at a character
/// boundary), saying how long it was when cut, so that one huge task or message cannot flood the log. Borrowed
/// when short and plain, as nearly every id and type is.
pub fn capped(text: &str, max: usize) -> Cow<'_, str> {
    let plain = !text.chars().any(char::is_control);
    if plain && text.len() <= max {
        return Cow::Borrowed(text);
    }
    let escaped: Cow<'_, str> = if plain {
        Cow::Borrowed(text)
    } else {
        Cow::Owned(
            text.chars()
                .map(|c| {
                    if c.is_control() {
                        c.escape_default().to_string()
                    } else {
                        c.to_string()
                    }
                })
                .collect(),
        )
    };
    if escaped.len() <= max {
        return Cow::Owned(escaped.into_owned());
    }
    let mut end = max;
    while !escaped.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!(
        "{}… ({} bytes in all)",
        &escaped[..end],
        text.len()
    ))
}

/// A new random task id.
pub(crate) fn new_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_unknown_fields_and_data_byte_for_byte() {
        let payload = r#"{"id":"a1","type":"mail.send","data":{"to": "x@y", "n": 12345678901234567890},"created_at":1700000000000,"attempt":2,"trace":{"span": 7},"priority":"high"}"#;
        let envelope = Envelope::decode(payload).unwrap();
        assert_eq!(envelope.id.as_deref(), Some("a1"));
        assert_eq!(envelope.kind, "mail.send");
        assert_eq!(
            envelope.data.get(),
            r#"{"to": "x@y", "n": 12345678901234567890}"#
        );
        assert_eq!(envelope.attempt, 2);
        assert_eq!(envelope.created_at, Some(1_700_000_000_000));
        let encoded = envelope.encode();
        assert_eq!(
            encoded,
            r#"{"id":"a1","type":"mail.send","data":{"to": "x@y", "n": 12345678901234567890},"created_at":1700000000000,"attempt":2,"priority":"high","trace":{"span": 7}}"#
        );
        assert_eq!(Envelope::decode(&encoded).unwrap(), envelope);
    }

    #[test]
    fn minimal_envelope_gets_defaults() {
        let envelope = Envelope::decode(r#"{"type":"t"}"#).unwrap();
        assert_eq!(envelope.id, None);
        assert_eq!(envelope.data.get(), "null");
        assert_eq!(envelope.attempt, 0);
        assert!(!envelope.unique);
        assert_eq!(envelope.encode(), r#"{"type":"t","data":null,"attempt":0}"#);
    }

    #[test]
    fn foreign_payloads_take_their_type_from_the_configured_field() {
        let payload = r#"{"callback": "send_mail", "args": [1, 2], "id": "f1"}"#;
        let envelope = Envelope::decode_foreign(payload, "callback").unwrap();
        assert_eq!(
            (envelope.id.as_deref(), &*envelope.kind),
            (Some("f1"), "send_mail")
        );
        assert_eq!(
            envelope.data.get(),
            payload,
            "the whole payload is the data"
        );
        let encoded = envelope.encode();
        let retried = Envelope::decode_foreign(&encoded, "callback").unwrap();
        assert_eq!(retried, envelope, "once wrapped, it is an envelope");
        let plain = Envelope::decode_foreign(r#"{"type":"t","data":1}"#, "callback").unwrap();
        assert_eq!(plain.kind, "t", "envelopes still decode as envelopes");
        let cases = [
            (r#"{"args": []}"#, "no \"callback\" field"),
            (r#"{"callback": 7}"#, "must be a non-empty string"),
            ("[1]", "a task envelope"),
        ];
        for (payload, expected) in cases {
            let error = Envelope::decode_foreign(payload, "callback")
                .unwrap_err()
                .to_string();
            assert!(error.contains(expected), "{payload}: {error}");
        }
    }

    #[test]
    fn a_payload_that_is_not_utf8_names_the_bad_byte() {
        let error = utf8(b"{\"type\":\"t\",\"data\":\"\xff\"}")
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            "malformed task: not UTF-8 text (invalid byte 0xff at offset 20); an envelope is a UTF-8 JSON object"
        );
        assert_eq!(utf8(b"{}").unwrap(), "{}");
    }

    #[test]
    fn long_log_fields_are_capped_at_a_character_boundary() {
        assert_eq!(capped("short", 10), "short");
        assert_eq!(capped("ééé", 3), "é… (6 bytes in all)");
    }

    #[test]
    fn control_characters_in_log_fields_are_escaped() {
        assert!(matches!(capped("mail.send", 256), Cow::Borrowed(_)));
        assert_eq!(
            capped("x\nkmqd[1]: fake line\u{1b}[2J\t", 256),
            "x\\nkmqd[1]: fake line\\u{1b}[2J\\t"
        );
        assert_eq!(capped("a\nb\nc", 4), "a\\nb… (5 bytes in all)");
    }

    #[test]
    fn the_id_of_a_malformed_object_is_salvaged() {
        assert_eq!(
            salvage_id(br#"{"id":"x1","data":1}"#).as_deref(),
            Some("x1")
        );
        assert_eq!(salvage_id(br#"{"id":7,"type":"t"}"#), None);
        assert_eq!(salvage_id(b"not json"), None);
        assert_eq!(salvage_id(br#"["id"]"#), None);
        assert_eq!(
            salvage_id(b"{\"id\":\"ok\",\"type\":\"\xff\"}").as_deref(),
            Some("ok"),
            "a bad byte elsewhere"
        );
        assert_eq!(
            salvage_id(b"{\"id\":\"\xff\"}"),
            None,
            "a bad byte in the id"
        );
    }

    #[test]
    fn malformed_payloads_say_what_is_wrong() {
        let cases = [
            ("not json", "expected ident"),
            ("[1,2]", "a task envelope"),
            (r#"{"id":"x"}"#, "missing field `type`"),
            (r#"{"type":""}"#, "non-empty task type"),
            (r#"{"type":"t","attempt":-1}"#, "invalid value"),
            (r#"{"type":"t","type":"u"}"#, "duplicate field `type`"),
            (r#"{"type":"t","v":2}"#, "newer than this kmqd speaks"),
        ];
        for (payload, expected) in cases {
            let error = Envelope::decode(payload).unwrap_err().to_string();
            assert!(error.starts_with("malformed task: "), "{payload}: {error}");
            assert!(
                error.contains(expected),
                "{payload}: {error} (wanted {expected:?})"
            );
        }
    }
}
