//! The payloads of one claim or pop, end to end in one buffer: one allocation for a batch of tasks instead of one
//! per task, filled by kmqd's reply reader as it reads them ([`super::resp::Reader::collect_payloads`]) or copied
//! from redis-rs's values where another connection read the reply (docs/PERFORMANCE.md, "The daemon's hot path,
//! cut down").

use redis::Value;

use super::{Result, reply_error};

#[derive(Debug, Default)]
pub struct Payloads {
    bytes: Vec<u8>,
    /// Where each payload ends in `bytes`.
    ends: Vec<usize>,
}

impl Payloads {
    /// Appends a payload; returns its index.
    pub fn push(&mut self, payload: &[u8]) -> usize {
        self.bytes.extend_from_slice(payload);
        self.ends.push(self.bytes.len());
        self.ends.len() - 1
    }

    /// Appends a payload that `fill` appends to the buffer (a bulk string read straight from a socket, the buffer
    /// growing as its bytes arrive); returns its index, or `fill`'s error (the payload is then not added).
    pub(crate) fn push_with<E>(
        &mut self,
        fill: impl FnOnce(&mut Vec<u8>) -> std::result::Result<(), E>,
    ) -> std::result::Result<usize, E> {
        let start = self.bytes.len();
        if let Err(error) = fill(&mut self.bytes) {
            self.bytes.truncate(start);
            return Err(error);
        }
        self.ends.push(self.bytes.len());
        Ok(self.ends.len() - 1)
    }

    /// Makes room for `more` payloads of `size` bytes, at most `most` bytes of it (nothing when there is room
    /// already): the sizes come from a reply's headers, before its payloads are read.
    pub(crate) fn reserve(&mut self, more: usize, size: usize, most: usize) {
        self.ends.reserve(more);
        self.bytes.reserve(more.saturating_mul(size).min(most));
    }

    pub fn get(&self, index: usize) -> &[u8] {
        let start = index.checked_sub(1).map_or(0, |before| self.ends[before]);
        &self.bytes[start..self.ends[index]]
    }

    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }
}

/// Gathers the payloads of one reply, in order, into [`Payloads`]: each element is one the reader collected
/// (`Value::Int` of its index, the next one due) or a string to copy (a reply another connection read).
#[derive(Debug)]
pub(crate) struct Gather {
    payloads: Payloads,
    next: usize,
}

impl Gather {
    /// Starts from what the reader collected while it read the reply (empty for another connection).
    pub(crate) fn new(collected: Payloads) -> Gather {
        Gather {
            payloads: collected,
            next: 0,
        }
    }

    /// Takes the next payload: a payload exactly as stored (producers may push bytes that are not UTF-8, and
    /// such a task is dead-lettered with its bytes intact).
    pub(crate) fn take(&mut self, value: Value, what: &'static str) -> Result<()> {
        match value {
            Value::Int(index) if index == self.next as i64 && self.next < self.payloads.len() => {}
            Value::BulkString(bytes) if self.next == self.payloads.len() => {
                self.payloads.push(&bytes);
            }
            Value::SimpleString(text) if self.next == self.payloads.len() => {
                self.payloads.push(text.as_bytes());
            }
            other => {
                return Err(reply_error(
                    what,
                    format!("expected a string, got {other:?}"),
                ));
            }
        }
        self.next += 1;
        Ok(())
    }

    /// The payloads gathered; an error if the reader collected one that the reply did not stand for.
    pub(crate) fn finish(self, what: &'static str) -> Result<Payloads> {
        if self.next != self.payloads.len() {
            return Err(reply_error(
                what,
                format!(
                    "{} payloads read, {} in the reply",
                    self.payloads.len(),
                    self.next
                ),
            ));
        }
        Ok(self.payloads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_keep_their_exact_bytes_in_order() {
        let mut payloads = Payloads::default();
        assert_eq!(payloads.push(b"{\"a\":1}"), 0);
        assert_eq!(payloads.push(b""), 1);
        assert_eq!(
            payloads.push_with(|bytes| {
                bytes.extend_from_slice(&[0xff, b'\r', b'\n']);
                Ok::<(), ()>(())
            }),
            Ok(2)
        );
        assert_eq!(
            payloads.push_with(|bytes| {
                bytes.extend_from_slice(b"par");
                Err("cut")
            }),
            Err("cut")
        );
        assert_eq!(payloads.len(), 3);
        assert_eq!(payloads.get(0), b"{\"a\":1}");
        assert_eq!(payloads.get(1), b"");
        assert_eq!(payloads.get(2), [0xff, b'\r', b'\n']);
    }

    #[test]
    fn a_reply_gathers_what_the_reader_collected_or_copies_its_strings() {
        let mut collected = Payloads::default();
        collected.push(b"x");
        collected.push(b"y");
        let mut gather = Gather::new(collected);
        gather.take(Value::Int(0), "t").unwrap();
        gather.take(Value::Int(1), "t").unwrap();
        let payloads = gather.finish("t").unwrap();
        assert_eq!((payloads.get(0), payloads.get(1)), (&b"x"[..], &b"y"[..]));

        let mut gather = Gather::new(Payloads::default());
        gather.take(Value::BulkString(b"x".to_vec()), "t").unwrap();
        assert_eq!(gather.finish("t").unwrap().get(0), b"x");

        // Out of order, a number where a copy is due, or a collected payload the reply never named: errors.
        let mut collected = Payloads::default();
        collected.push(b"x");
        collected.push(b"y");
        let mut gather = Gather::new(collected);
        assert!(gather.take(Value::Int(1), "t").is_err());
        gather.take(Value::Int(0), "t").unwrap();
        assert!(gather.finish("t").is_err());
        assert!(
            Gather::new(Payloads::default())
                .take(Value::Int(0), "t")
                .is_err()
        );
    }
}
