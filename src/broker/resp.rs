//! kmqd's own reader of Redis's replies (RESP2), for the connections it opens itself ([`super::node`]).
//!
//! Why: redis-rs parses replies with `combine`, which costs about 1,780 instructions per element of an array
//! (measured on a reply of 1,000 bulk strings of 100 bytes, in memory), the largest single cost of the daemon's
//! fetcher: every claimed task is one element of a claim's `LRANGE`, every popped one of `LMPOP`'s reply
//! (docs/PERFORMANCE.md, "A reply reader of our own"). This reader builds the same [`Value`]s in a loop over a
//! buffer, about a tenth of that.
//!
//! It reads what a RESP2 connection receives: arrays, bulk strings, integers, nil, simple strings and errors.
//! An error line is handed, byte for byte, to redis-rs's own parser, so that every [`redis::ServerError`] (its
//! kind, code and detail, which the cluster client and kmqd's callers act on) is exactly redis-rs's; any other
//! type byte (RESP3's, which a connection that never sent `HELLO 3` does not receive) is a protocol error. The
//! conversions follow redis-rs's parser (`redis::parse_redis_value`): a negative length is nil, a simple string
//! `OK` is [`Value::Okay`], integers are `str::trim` then `i64::from_str` of their line, lines must be UTF-8,
//! arrays nest at most 100 deep. A property test holds the two to the same values on generated replies, fed in
//! pieces of every size.
//!
//! Lengths come from the peer, so none is allocated before its bytes arrive: an array makes room for at most
//! [`MAX_PREALLOCATED`] elements, a bulk string longer than [`MAX_BULK`] (512 MiB) is a protocol error, and a
//! large one takes memory as it is read (review L10: a declared 10^17 bytes aborted the daemon).
//!
//! An I/O error or a malformed reply leaves the stream in the middle of a reply: its caller must close the
//! connection ([`super::node::PlainConnection`] does).

use std::io::{self, Read};

use redis::{ErrorKind, RedisError, RedisResult, Value};

use super::payloads::Payloads;

/// How much one `read` asks for: a claim of 1,000 tasks of 100 bytes is about 120 KB.
const READ_SIZE: usize = 64 * 1024;

/// A bulk string longer than this is read into its own buffer rather than through the reader's, which would
/// otherwise grow to the largest payload ever received and stay that size.
const LARGE_BULK: usize = READ_SIZE;

/// The longest bulk string read: 512 MiB, Redis's default `proto-max-bulk-len`, the most a Redis string holds
/// unless that is raised, and the most `max_task_bytes` allows. A longer length (up to 18 digits) can only come
/// from a corrupt or hostile peer, and is a protocol error before anything is allocated for it.
pub(crate) const MAX_BULK: usize = 512 * 1024 * 1024;

/// The most room made for the payloads of one array before they are read: a claim of 1,000 tasks of 16 KiB.
/// Beyond it the buffer grows as payloads arrive, so that a corrupt array length and first bulk length cannot
/// reserve more.
const MAX_RESERVED: usize = 16 * 1024 * 1024;

/// redis-rs's limit on nested arrays.
const MAX_DEPTH: usize = 100;

/// Most elements an array's length makes room for before they are read: a corrupt length must not allocate.
const MAX_PREALLOCATED: usize = 4096;

/// The bytes received and not yet parsed: `buf[start..end]`.
#[derive(Debug)]
pub(crate) struct Reader {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// While set, the bulk strings at this depth of each reply (the reply itself is depth 1) go into `collected`.
    collect_at: Option<usize>,
    collected: Payloads,
    /// The payloads left in the array being read: room is made for them at once, each the size of the next.
    expected: usize,
}

impl Default for Reader {
    fn default() -> Reader {
        Reader {
            buf: vec![0; READ_SIZE],
            start: 0,
            end: 0,
            collect_at: None,
            collected: Payloads::default(),
            expected: 0,
        }
    }
}

/// A line's place in the reader's buffer: its type byte at `at`, its text at `text..text_end` (without the
/// type byte and the CRLF).
struct Line {
    at: usize,
    text: usize,
    text_end: usize,
}

fn parse_error(detail: impl Into<String>) -> RedisError {
    RedisError::from((ErrorKind::Parse, "parse error", detail.into()))
}

/// An integer line as redis-rs reads it: plain digits with an optional minus at once, anything else through
/// `str::trim` and `i64::from_str` as redis-rs does.
fn integer(text: &[u8]) -> RedisResult<i64> {
    let (negative, digits) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    if (1..=18).contains(&digits.len()) {
        let mut magnitude = 0i64;
        let mut plain = true;
        for &byte in digits {
            let digit = byte.wrapping_sub(b'0');
            plain &= digit <= 9;
            magnitude = magnitude.wrapping_mul(10).wrapping_add(i64::from(digit));
        }
        if plain {
            return Ok(if negative { -magnitude } else { magnitude });
        }
    }
    std::str::from_utf8(text)
        .ok()
        .and_then(|line| line.trim().parse::<i64>().ok())
        .ok_or_else(|| parse_error("Expected integer, got garbage"))
}

fn utf8(text: &[u8]) -> RedisResult<&str> {
    std::str::from_utf8(text).map_err(|error| parse_error(error.to_string()))
}

impl Reader {
    /// From now until [`Reader::collected`], the bulk strings at `depth` of the replies read (the reply itself is
    /// depth 1) are payloads: their bytes go end to end into one buffer, and each stands in its reply as
    /// `Value::Int` of its index there. A claim's tasks are read so, one allocation for all of them
    /// ([`super::payloads`]).
    pub(crate) fn collect_payloads(&mut self, depth: usize) {
        self.collect_at = Some(depth);
    }

    /// The payloads collected since [`Reader::collect_payloads`], which ends.
    pub(crate) fn collected(&mut self) -> Payloads {
        self.collect_at = None;
        std::mem::take(&mut self.collected)
    }

    /// Reads one whole reply from `stream`.
    pub(crate) fn value(&mut self, stream: &mut impl Read) -> RedisResult<Value> {
        self.element(stream, 1)
    }

    /// Whether bytes not read as a reply yet were received.
    #[cfg(test)]
    fn has_unread(&self) -> bool {
        self.start < self.end
    }

    fn element(&mut self, stream: &mut impl Read, depth: usize) -> RedisResult<Value> {
        if depth > MAX_DEPTH {
            return Err(parse_error("Maximum recursion depth exceeded"));
        }
        let line = self.line(stream)?;
        let text = &self.buf[line.text..line.text_end];
        match self.buf[line.at] {
            b'$' => {
                let length = integer(text)?;
                if length < 0 {
                    return Ok(Value::Nil);
                }
                let length = usize::try_from(length)
                    .ok()
                    .filter(|length| *length <= MAX_BULK)
                    .ok_or_else(|| {
                        parse_error(format!(
                            "a bulk string of {length} bytes, longer than the {} MiB a Redis string holds",
                            MAX_BULK >> 20
                        ))
                    })?;
                if self.collect_at == Some(depth) {
                    return self.collect(stream, length);
                }
                self.bulk(stream, length).map(Value::BulkString)
            }
            b'*' => {
                let length = integer(text)?;
                if length < 0 {
                    return Ok(Value::Nil);
                }
                let length = length as usize;
                if self.collect_at == Some(depth + 1) {
                    // Its elements are payloads: the first makes room for all (see `collect`).
                    self.expected = length;
                }
                let mut elements = Vec::with_capacity(length.min(MAX_PREALLOCATED));
                for _ in 0..length {
                    elements.push(self.element(stream, depth + 1)?);
                }
                Ok(Value::Array(elements))
            }
            b':' => integer(text).map(Value::Int),
            b'+' if text == b"OK" => Ok(Value::Okay),
            b'+' => Ok(Value::SimpleString(utf8(text)?.to_string())),
            // The error line, type byte and CRLF included, read by redis-rs: its ServerError, exactly.
            b'-' => redis::parse_redis_value(&self.buf[line.at..line.text_end + 2]),
            other => Err(parse_error(format!(
                "unexpected reply type {:?} on a RESP2 connection",
                char::from(other)
            ))),
        }
    }

    /// The next line, its CRLF consumed; receives more until it is whole.
    fn line(&mut self, stream: &mut impl Read) -> RedisResult<Line> {
        let mut searched = self.start;
        loop {
            // The next CR; a line ends at the first one followed by an LF (redis-rs's `take_until_bytes`).
            let window = &self.buf[searched..self.end];
            if let Some(found) = window.iter().position(|&byte| byte == b'\r') {
                let text_end = searched + found;
                if text_end + 1 < self.end {
                    if self.buf[text_end + 1] != b'\n' {
                        searched = text_end + 1;
                        continue;
                    }
                    let at = self.start;
                    if text_end == at {
                        return Err(parse_error("an empty line where a reply was expected"));
                    }
                    self.start = text_end + 2;
                    return Ok(Line {
                        at,
                        text: at + 1,
                        text_end,
                    });
                }
                // A CR that ends what was received: the next read says whether an LF follows.
                searched = text_end;
            } else {
                searched = self.end;
            }
            let before = self.start;
            self.receive(stream)?;
            // Receiving may have moved the unread bytes to the front of the buffer.
            searched = searched - before + self.start;
        }
    }

    /// A bulk string's `length` bytes and its CRLF.
    fn bulk(&mut self, stream: &mut impl Read, length: usize) -> RedisResult<Vec<u8>> {
        if length > LARGE_BULK {
            let buffered = (self.end - self.start).min(length);
            let mut bytes = self.buf[self.start..self.start + buffered].to_vec();
            self.start += buffered;
            read_growing(stream, &mut bytes, length - buffered)?;
            self.crlf(stream)?;
            return Ok(bytes);
        }
        while self.end - self.start < length + 2 {
            self.receive(stream)?;
        }
        let bytes = self.buf[self.start..self.start + length].to_vec();
        self.start += length;
        self.crlf(stream)?;
        Ok(bytes)
    }

    /// A bulk string's `length` bytes and its CRLF, as the next collected payload.
    fn collect(&mut self, stream: &mut impl Read, length: usize) -> RedisResult<Value> {
        // One allocation for a claim of payloads of one size, rather than one per doubling; a bound on what a
        // corrupt length may reserve.
        self.collected.reserve(
            self.expected.min(MAX_PREALLOCATED),
            length.min(LARGE_BULK),
            MAX_RESERVED,
        );
        self.expected = self.expected.saturating_sub(1);
        let index = if length > LARGE_BULK {
            let buffered = (self.end - self.start).min(length);
            let (buf, start) = (&self.buf, self.start);
            let index = self.collected.push_with(|bytes| {
                bytes.extend_from_slice(&buf[start..start + buffered]);
                read_growing(stream, bytes, length - buffered)
            })?;
            self.start += buffered;
            index
        } else {
            while self.end - self.start < length + 2 {
                self.receive(stream)?;
            }
            let index = self
                .collected
                .push(&self.buf[self.start..self.start + length]);
            self.start += length;
            index
        };
        self.crlf(stream)?;
        Ok(Value::Int(index as i64))
    }

    fn crlf(&mut self, stream: &mut impl Read) -> RedisResult<()> {
        while self.end - self.start < 2 {
            self.receive(stream)?;
        }
        if &self.buf[self.start..self.start + 2] != b"\r\n" {
            return Err(parse_error("a bulk string not followed by CRLF"));
        }
        self.start += 2;
        Ok(())
    }

    /// Receives more bytes: at least one, or an error (the end of the stream is one).
    fn receive(&mut self, stream: &mut impl Read) -> RedisResult<()> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.buf.len() - self.end < READ_SIZE / 2 {
            // Make room: move the unread bytes to the front, and grow when they fill half the buffer (a line or
            // a bulk string of up to LARGE_BULK bytes must fit whole).
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if self.buf.len() - self.end < READ_SIZE / 2 {
                self.buf.resize(self.buf.len() + READ_SIZE, 0);
            }
        }
        let received = loop {
            match stream.read(&mut self.buf[self.end..]) {
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                result => break result?,
            }
        };
        if received == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
        self.end += received;
        Ok(())
    }
}

/// Appends the next `more` bytes of `stream` to `bytes`, making room as they arrive: twice what came so far (at
/// least [`READ_SIZE`]), never more than what is left. So the memory a bulk string takes follows the bytes
/// received, not the length its header declares (a peer that declares 512 MiB and sends 10 bytes costs 64 KiB),
/// and a string received whole ends in a buffer of exactly its size. On an error `bytes` may hold part of it.
fn read_growing(stream: &mut impl Read, bytes: &mut Vec<u8>, more: usize) -> io::Result<()> {
    let (start, end) = (bytes.len(), bytes.len() + more);
    while bytes.len() < end {
        let chunk = (bytes.len() - start).max(READ_SIZE).min(end - bytes.len());
        bytes.reserve_exact(chunk);
        // `read_to_end` reads into the room without zeroing it first, and stops at the chunk's end.
        let received = stream.by_ref().take(chunk as u64).read_to_end(bytes)?;
        if received < chunk {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A stream that hands out at most `piece` bytes per read.
    struct Pieces<'a> {
        bytes: &'a [u8],
        piece: usize,
    }

    impl Read for Pieces<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(self.piece).min(self.bytes.len());
            buf[..n].copy_from_slice(&self.bytes[..n]);
            self.bytes = &self.bytes[n..];
            Ok(n)
        }
    }

    /// Every reply in `bytes`, read by this reader in pieces of `piece` bytes.
    fn read_all(bytes: &[u8], piece: usize) -> Vec<RedisResult<Value>> {
        let mut stream = Pieces { bytes, piece };
        let mut reader = Reader::default();
        let mut values = Vec::new();
        while !stream.bytes.is_empty() || reader.has_unread() {
            let value = reader.value(&mut stream);
            let failed = value.is_err();
            values.push(value);
            if failed {
                break;
            }
        }
        values
    }

    /// redis-rs's reading of one reply.
    fn reference(bytes: &[u8]) -> RedisResult<Value> {
        redis::parse_redis_value(bytes)
    }

    fn same(ours: &RedisResult<Value>, theirs: &RedisResult<Value>) -> bool {
        match (ours, theirs) {
            (Ok(a), Ok(b)) => a == b,
            (Err(a), Err(b)) => a.kind() == b.kind(),
            _ => false,
        }
    }

    #[test]
    fn reads_the_replies_of_a_claim_as_redis_rs_does() {
        let replies: Vec<&[u8]> = vec![
            b"+OK\r\n",
            b"+QUEUED\r\n",
            b"*2\r\n*5\r\n:1733333333333\r\n:0\r\n:0\r\n:2\r\n:41\r\n*2\r\n$3\r\nabc\r\n$0\r\n\r\n",
            b"$-1\r\n",
            b"*-1\r\n",
            b"*0\r\n",
            b":-42\r\n",
            b": 7 \r\n",
            b"-ERR unknown command\r\n",
            b"-NOSCRIPT No matching script. Please use EVAL.\r\n",
            b"-LEASELOST owner x has no live lease\r\n",
            b"-MOVED 3999 127.0.0.1:6381\r\n",
            b"-EXECABORT Transaction discarded because of previous errors.\r\n",
            b"$5\r\nhe\r\nl\r\n",
            b"+\xce\xbb\r\n",
            b"+a\rb\r\n",
            b"-ERR half\rline\r\n",
            b"*1\r\n+\r\r\n",
        ];
        for reply in replies {
            for piece in [1, 2, 3, 7, 4096] {
                let ours = read_all(reply, piece);
                assert_eq!(ours.len(), 1, "{reply:?}");
                let theirs = reference(reply);
                assert!(
                    same(&ours[0], &theirs),
                    "{reply:?} in pieces of {piece}: ours {:?}, redis-rs {theirs:?}",
                    ours[0]
                );
            }
        }
    }

    #[test]
    fn server_errors_keep_redis_rs_kind_code_and_detail() {
        let Ok(Value::ServerError(error)) =
            &read_all(b"-FENCED claim 7 below the floor 9\r\n", 3)[0]
        else {
            panic!("not a server error");
        };
        assert_eq!(error.code(), "FENCED");
        assert_eq!(error.details(), Some("claim 7 below the floor 9"));
        let Ok(Value::ServerError(error)) = &read_all(b"-NOSCRIPT gone\r\n", 1)[0] else {
            panic!("not a server error");
        };
        assert_eq!(error.kind(), Some(redis::ServerErrorKind::NoScript));
    }

    #[test]
    fn malformed_replies_are_errors_not_values() {
        for reply in [
            &b"$3\r\nabcd\r\n"[..],
            b":12x\r\n",
            b"!5\r\nhello\r\n",
            b"\r\n",
            b"+\xff\r\n",
        ] {
            let ours = read_all(reply, 2);
            assert!(
                ours.last().is_some_and(Result::is_err),
                "{reply:?}: {ours:?}"
            );
        }
        let deep = "*1\r\n".repeat(MAX_DEPTH + 1) + ":1\r\n";
        assert!(read_all(deep.as_bytes(), 64)[0].is_err());
        assert!(reference(deep.as_bytes()).is_err());
    }

    #[test]
    fn a_stream_that_ends_inside_a_reply_is_an_unexpected_end() {
        let error = read_all(b"*2\r\n$3\r\nabc\r\n$3\r\nab", 5)
            .pop()
            .expect("a result")
            .expect_err("incomplete");
        assert!(error.is_connection_dropped(), "{error:?}");
        assert!(error.is_io_error());
    }

    #[test]
    fn a_bulk_larger_than_the_buffer_is_read_whole() {
        let payload: Vec<u8> = (0..3 * READ_SIZE + 17).map(|i| (i % 251) as u8).collect();
        let mut reply = format!("*2\r\n${}\r\n", payload.len()).into_bytes();
        reply.extend_from_slice(&payload);
        reply.extend_from_slice(b"\r\n$2\r\nok\r\n");
        for piece in [1000, READ_SIZE + 3, usize::MAX] {
            let ours = read_all(&reply, piece);
            assert_eq!(
                ours[0].as_ref().ok(),
                Some(&Value::Array(vec![
                    Value::BulkString(payload.clone()),
                    Value::BulkString(b"ok".to_vec())
                ]))
            );
        }
    }

    /// A stream of `bytes` that remembers the largest buffer a read was given, then ends.
    struct Watched<'a> {
        bytes: &'a [u8],
        largest: usize,
    }

    impl Read for Watched<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.largest = self.largest.max(buf.len());
            let n = buf.len().min(self.bytes.len()).min(READ_SIZE);
            buf[..n].copy_from_slice(&self.bytes[..n]);
            self.bytes = &self.bytes[n..];
            Ok(n)
        }
    }

    /// Reads `reply` with payloads collected at `collect` (or none), from a stream that watches its reads.
    fn read_watched(reply: &[u8], collect: Option<usize>) -> (RedisResult<Value>, usize) {
        let mut stream = Watched {
            bytes: reply,
            largest: 0,
        };
        let mut reader = Reader::default();
        if let Some(depth) = collect {
            reader.collect_payloads(depth);
        }
        let value = reader.value(&mut stream);
        (value, stream.largest)
    }

    #[test]
    fn a_bulk_longer_than_512_mib_is_a_protocol_error_before_anything_is_read() {
        // A corrupt or hostile peer (plain TCP, a man in the middle): its length allocated up front aborted the
        // daemon, or took 512 MiB and more for a reply of a few bytes (review L10).
        for length in [MAX_BULK + 1, 1 << 40, 999_999_999_999_999_999] {
            for (reply, collect) in [
                (format!("${length}\r\nabc"), None),
                (format!("*2\r\n$1\r\na\r\n${length}\r\nabc"), Some(2)),
            ] {
                let (value, largest) = read_watched(reply.as_bytes(), collect);
                let error = value.expect_err("refused");
                assert_eq!(error.kind(), ErrorKind::Parse, "{error}");
                assert!(
                    error
                        .to_string()
                        .contains(&format!("a bulk string of {length} bytes"))
                        && error.to_string().contains("512 MiB"),
                    "{error}"
                );
                assert!(largest <= READ_SIZE, "read {largest} bytes at once");
            }
        }
        // 512 MiB itself is a length Redis may send: it is read (here, until the stream ends).
        let (value, _) = read_watched(format!("${MAX_BULK}\r\nabc").as_bytes(), None);
        assert!(value.expect_err("cut short").is_connection_dropped());
    }

    #[test]
    fn a_large_bulk_takes_memory_as_its_bytes_arrive_not_as_its_length_declares() {
        // 400 MiB declared, 1 MiB sent: the reads (and the buffer behind them) stay near what was received.
        let sent: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
        let declared = 400 << 20;
        for collect in [None, Some(2)] {
            let mut reply = match collect {
                None => format!("${declared}\r\n").into_bytes(),
                Some(_) => format!("*1\r\n${declared}\r\n").into_bytes(),
            };
            reply.extend_from_slice(&sent);
            let (value, largest) = read_watched(&reply, collect);
            assert!(value.expect_err("cut short").is_connection_dropped());
            assert!(
                largest <= 2 * sent.len() + READ_SIZE,
                "a read was given {largest} bytes for {} received",
                sent.len()
            );
        }
        // Received whole, a large bulk is all there, in either path, in a buffer of its size.
        let payload: Vec<u8> = (0..5 * READ_SIZE + 3).map(|i| (i % 253) as u8).collect();
        let mut reply = format!("${}\r\n", payload.len()).into_bytes();
        reply.extend_from_slice(&payload);
        reply.extend_from_slice(b"\r\n");
        let (value, _) = read_watched(&reply, None);
        let Ok(Value::BulkString(bytes)) = value else {
            panic!("{value:?}");
        };
        assert_eq!(
            (bytes.len(), bytes.capacity()),
            (payload.len(), payload.len())
        );
        assert!(bytes == payload);
    }

    #[test]
    fn payloads_at_the_collected_depth_are_read_into_one_buffer_whatever_the_pieces() {
        // A claim's EXEC: the script's reply (integers), then its lists; the payloads are the lists' elements
        // (depth 3). Every bulk string at that depth is collected: a caller names a depth that holds nothing else.
        let large: Vec<u8> = (0..LARGE_BULK + 10).map(|i| (i % 256) as u8).collect();
        let mut reply = b"*3\r\n*2\r\n:17\r\n:-1\r\n*2\r\n$3\r\na\r\n\r\n$0\r\n\r\n".to_vec();
        reply.extend_from_slice(format!("*1\r\n${}\r\n", large.len()).as_bytes());
        reply.extend_from_slice(&large);
        reply.extend_from_slice(b"\r\n");
        for piece in [1, 5, 4096, usize::MAX] {
            let mut stream = Pieces {
                bytes: &reply,
                piece,
            };
            let mut reader = Reader::default();
            reader.collect_payloads(3);
            let value = reader.value(&mut stream).unwrap();
            let payloads = reader.collected();
            assert_eq!(
                value,
                Value::Array(vec![
                    Value::Array(vec![Value::Int(17), Value::Int(-1)]),
                    Value::Array(vec![Value::Int(0), Value::Int(1)]),
                    Value::Array(vec![Value::Int(2)]),
                ]),
                "in pieces of {piece}"
            );
            assert_eq!(payloads.len(), 3);
            assert_eq!(payloads.get(0), b"a\r\n");
            assert_eq!(payloads.get(1), b"");
            assert_eq!(payloads.get(2), &large[..]);
            // Collecting ended: the next reply's strings are values again.
            let mut next = Pieces {
                bytes: b"*1\r\n*1\r\n$1\r\nz\r\n",
                piece,
            };
            assert_eq!(
                reader.value(&mut next).unwrap(),
                Value::Array(vec![Value::Array(vec![Value::BulkString(b"z".to_vec())])])
            );
        }
    }

    /// Replies as Redis writes them: nested arrays of bulk strings (any bytes, CRLF too), integers, nils,
    /// simple strings and errors.
    fn reply() -> impl Strategy<Value = Vec<u8>> {
        let leaf = prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..300).prop_map(|bytes| {
                let mut out = format!("${}\r\n", bytes.len()).into_bytes();
                out.extend_from_slice(&bytes);
                out.extend_from_slice(b"\r\n");
                out
            }),
            any::<i64>().prop_map(|n| format!(":{n}\r\n").into_bytes()),
            Just(b"$-1\r\n".to_vec()),
            Just(b"*-1\r\n".to_vec()),
            "[A-Za-z ]{0,20}".prop_map(|text| format!("+{text}\r\n").into_bytes()),
            "[A-Z]{1,10}( [a-z0-9 ]{0,30})?".prop_map(|text| format!("-{text}\r\n").into_bytes()),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            proptest::collection::vec(inner, 0..8).prop_map(|elements| {
                let mut out = format!("*{}\r\n", elements.len()).into_bytes();
                for element in elements {
                    out.extend_from_slice(&element);
                }
                out
            })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn every_reply_reads_as_redis_rs_reads_it(
            replies in proptest::collection::vec(reply(), 1..4),
            piece in 1usize..200,
        ) {
            let stream: Vec<u8> = replies.concat();
            let ours = read_all(&stream, piece);
            prop_assert_eq!(ours.len(), replies.len());
            for (reply, ours) in replies.iter().zip(&ours) {
                let theirs = reference(reply);
                prop_assert!(same(ours, &theirs), "ours {:?}, redis-rs {:?}", ours, theirs);
            }
        }
    }
}
