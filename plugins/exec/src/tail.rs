//! The end of a stream, kept for a reason: where a program's error message usually is.

/// How many bytes of standard error (or output) a reason quotes: the end, where the error usually is. Shorter than
/// kmqd's 1024-byte message buffer, so the head of the reason and the tail both fit.
pub const TAIL_BYTES: usize = 768;

/// The end of a stream: its last [`TAIL_BYTES`] bytes.
#[derive(Default)]
pub struct Tail {
    bytes: Vec<u8>,
    cut: bool,
}

impl Tail {
    pub fn push(&mut self, chunk: &[u8]) {
        self.bytes.extend_from_slice(chunk);
        if self.bytes.len() > TAIL_BYTES {
            let excess = self.bytes.len() - TAIL_BYTES;
            self.bytes.drain(..excess);
            self.cut = true;
        }
    }

    pub fn text(&self) -> String {
        // A cut may fall inside a UTF-8 character: skip its continuation bytes.
        let start = if self.cut {
            self.bytes
                .iter()
                .position(|byte| byte & 0b1100_0000 != 0b1000_0000)
                .unwrap_or(self.bytes.len())
        } else {
            0
        };
        let text = String::from_utf8_lossy(&self.bytes[start..]);
        let text = text.trim();
        if self.cut && !text.is_empty() {
            format!("...{text}")
        } else {
            text.to_string()
        }
    }
}
