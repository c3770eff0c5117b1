//! A small HPACK decoder (RFC 7541) for the `:authority` layer: it mirrors the client's dynamic
//! table and hands out each header field of a block.
//!
//! A Huffman-coded value that does not go into the dynamic table and is not an `:authority` is
//! handed out as the block codes it ([`Value::Huffman`]): the layer only looks at `:authority`,
//! and can forward such a value without reading it. That is `:path` on every gRPC request (the
//! `h2` crate never indexes it), about a thousand instructions per request saved.
//!
//! Written here rather than taken from a crate because the candidates either rebuild their
//! Huffman tables for every string (~20 µs each, ~0.2 ms per new gRPC connection) or can panic
//! on malformed input. Huffman strings are decoded a nibble at a time with a state table built
//! once from the code in RFC 7541 Appendix B.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::OnceLock;

/// Per-entry overhead in the dynamic table size (RFC 7541 §4.1).
const ENTRY_OVERHEAD: usize = 32;
/// Largest integer accepted; bigger values cannot be meaningful in a block of at most 64 KiB.
const MAX_INTEGER: usize = 1 << 24;

/// Why a header block could not be decoded.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum HpackError {
    /// An index of 0 or past the end of the static + dynamic table.
    #[error("header table index {0} does not exist")]
    BadIndex(usize),
    /// An integer longer than any block could need.
    #[error("integer too large")]
    IntegerOverflow,
    /// The block ends in the middle of a representation.
    #[error("header block truncated")]
    Truncated,
    /// A Huffman string with EOS inside, or bad padding.
    #[error("invalid Huffman-coded string")]
    Huffman,
    /// A dynamic table size update above the size the server allows.
    #[error("dynamic table size update to {size} exceeds the allowed {allowed}")]
    TableSize {
        /// The size asked for.
        size: usize,
        /// The limit.
        allowed: usize,
    },
    /// A dynamic table size update after the first header field of a block (RFC 7541 §4.2).
    #[error("dynamic table size update after a header field")]
    LateSizeUpdate,
}

/// A header field's value as [`Decoder::decode`] hands it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Value<'a> {
    /// The value's bytes.
    Plain(&'a [u8]),
    /// A Huffman-coded value, not decoded: the value of a literal that is not added to the
    /// dynamic table, of a field other than `:authority`. It may be invalid Huffman code.
    Huffman(&'a [u8]),
}

impl<'a> Value<'a> {
    /// The bytes as the block carries them, and whether they are Huffman-coded.
    pub fn coded(&self) -> (&'a [u8], bool) {
        match *self {
            Value::Plain(bytes) => (bytes, false),
            Value::Huffman(bytes) => (bytes, true),
        }
    }

    /// The value's bytes, decoded (borrowed when they were not Huffman-coded).
    pub fn decode(&self) -> Result<Cow<'a, [u8]>, HpackError> {
        match *self {
            Value::Plain(bytes) => Ok(Cow::Borrowed(bytes)),
            Value::Huffman(bytes) => huffman_decode(bytes).map(Cow::Owned),
        }
    }
}

/// The decoding side of one HPACK context (one HTTP/2 connection, one direction).
pub struct Decoder {
    /// Newest entry first, as HPACK indexes it.
    table: VecDeque<(Vec<u8>, Vec<u8>)>,
    /// Sum of the entries' sizes.
    size: usize,
    /// Current maximum, set by the encoder's size updates.
    max_size: usize,
    /// The maximum the encoder may ask for (SETTINGS_HEADER_TABLE_SIZE).
    allowed: usize,
}

impl Decoder {
    /// A fresh context; `allowed` is the server's SETTINGS_HEADER_TABLE_SIZE.
    pub fn new(allowed: usize) -> Decoder {
        Decoder {
            table: VecDeque::new(),
            size: 0,
            max_size: allowed,
            allowed,
        }
    }

    /// Decodes one complete header block, calling `field(name, value)` for each header field in
    /// order; see [`Value`] for the values left Huffman-coded. On error the context is unusable
    /// (the connection has to go).
    pub fn decode(
        &mut self,
        mut buf: &[u8],
        mut field: impl FnMut(&[u8], Value<'_>),
    ) -> Result<(), HpackError> {
        let mut seen_field = false;
        while let Some(&first) = buf.first() {
            if first & 0x80 != 0 {
                // Indexed header field (§6.1).
                let index = decode_integer(&mut buf, 7)?;
                let (name, value) = self.entry(index)?;
                field(name, Value::Plain(value));
            } else if first & 0x40 != 0 {
                // Literal with incremental indexing (§6.2.1).
                let (name, value) = self.literal(&mut buf, 6)?;
                let name = name.into_owned();
                let value = value.decode()?.into_owned();
                field(&name, Value::Plain(&value));
                self.insert(name, value);
            } else if first & 0x20 != 0 {
                // Dynamic table size update (§6.3).
                if seen_field {
                    return Err(HpackError::LateSizeUpdate);
                }
                let size = decode_integer(&mut buf, 5)?;
                if size > self.allowed {
                    return Err(HpackError::TableSize {
                        size,
                        allowed: self.allowed,
                    });
                }
                self.max_size = size;
                self.evict(0);
                continue;
            } else {
                // Literal without indexing (§6.2.2) or never indexed (§6.2.3).
                let (name, value) = self.literal(&mut buf, 4)?;
                if matches!(value, Value::Huffman(_)) && *name != *b":authority" {
                    field(&name, value);
                } else {
                    field(&name, Value::Plain(&value.decode()?));
                }
            }
            seen_field = true;
        }
        Ok(())
    }

    /// Reads a literal representation whose name index has a `prefix`-bit prefix: its name,
    /// and its value as the block codes it.
    fn literal<'b>(
        &self,
        buf: &mut &'b [u8],
        prefix: u32,
    ) -> Result<(Cow<'_, [u8]>, Value<'b>), HpackError> {
        let index = decode_integer(buf, prefix)?;
        let name = if index == 0 {
            Cow::Owned(read_string(buf)?.decode()?.into_owned())
        } else {
            Cow::Borrowed(self.entry(index)?.0)
        };
        let value = read_string(buf)?;
        Ok((name, value))
    }

    /// Entry `index` of the static table followed by the dynamic table (1-based).
    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), HpackError> {
        if index == 0 {
            return Err(HpackError::BadIndex(index));
        }
        if let Some(&(name, value)) = STATIC_TABLE.get(index - 1) {
            return Ok((name.as_bytes(), value.as_bytes()));
        }
        self.table
            .get(index - 1 - STATIC_TABLE.len())
            .map(|(name, value)| (name.as_slice(), value.as_slice()))
            .ok_or(HpackError::BadIndex(index))
    }

    /// Adds an entry, evicting the oldest ones to make room (§4.4).
    fn insert(&mut self, name: Vec<u8>, value: Vec<u8>) {
        let size = name.len() + value.len() + ENTRY_OVERHEAD;
        if size > self.max_size {
            // An entry larger than the table empties it and is not added.
            self.table.clear();
            self.size = 0;
            return;
        }
        self.evict(size);
        self.size += size;
        self.table.push_front((name, value));
    }

    /// Evicts the oldest entries until `room` more bytes fit under the maximum.
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max_size {
            match self.table.pop_back() {
                Some((name, value)) => self.size -= name.len() + value.len() + ENTRY_OVERHEAD,
                None => break,
            }
        }
    }

    /// Current size of the dynamic table, in RFC 7541 §4.1 terms.
    #[cfg(test)]
    pub fn table_size(&self) -> usize {
        self.size
    }
}

/// Reads an integer with a `prefix`-bit prefix (§5.1), advancing `buf`.
fn decode_integer(buf: &mut &[u8], prefix: u32) -> Result<usize, HpackError> {
    let (&first, mut rest) = buf.split_first().ok_or(HpackError::Truncated)?;
    let mask = (1usize << prefix) - 1;
    let mut value = usize::from(first) & mask;
    if value == mask {
        let mut shift = 0;
        loop {
            let (&byte, tail) = rest.split_first().ok_or(HpackError::Truncated)?;
            rest = tail;
            value += usize::from(byte & 0x7f) << shift;
            if value > MAX_INTEGER {
                return Err(HpackError::IntegerOverflow);
            }
            if byte & 0x80 == 0 {
                break;
            }
            shift += 7;
            if shift > 28 {
                return Err(HpackError::IntegerOverflow);
            }
        }
    }
    *buf = rest;
    Ok(value)
}

/// Reads a string literal (§5.2), Huffman-coded or not, advancing `buf`.
fn read_string<'b>(buf: &mut &'b [u8]) -> Result<Value<'b>, HpackError> {
    let huffman = buf.first().ok_or(HpackError::Truncated)? & 0x80 != 0;
    let len = decode_integer(buf, 7)?;
    if len > buf.len() {
        return Err(HpackError::Truncated);
    }
    let (bytes, rest) = buf.split_at(len);
    *buf = rest;
    Ok(if huffman {
        Value::Huffman(bytes)
    } else {
        Value::Plain(bytes)
    })
}

/// One step of the Huffman state machine: from a state, on one 4-bit input.
#[derive(Clone, Copy, Default)]
struct Step {
    /// The state after the nibble.
    next: u8,
    /// A symbol completed inside the nibble (codes are at least 5 bits: at most one).
    symbol: Option<u8>,
    /// EOS appeared, or the code has no such path.
    fail: bool,
}

/// The Huffman code as a nibble-driven state machine over the code tree's 256 internal nodes.
struct HuffmanMachine {
    steps: Vec<[Step; 16]>,
    /// Whether a string may end in this state: at most 7 bits into a code, all of them 1 (a
    /// prefix of EOS, §5.2).
    may_end: Vec<bool>,
}

fn huffman_machine() -> &'static HuffmanMachine {
    static MACHINE: OnceLock<HuffmanMachine> = OnceLock::new();
    MACHINE.get_or_init(build_huffman_machine)
}

fn build_huffman_machine() -> HuffmanMachine {
    const NONE: usize = usize::MAX;
    // The code tree: children by bit, and the symbol of a leaf.
    let mut children: Vec<[usize; 2]> = vec![[NONE; 2]];
    let mut leaf: Vec<Option<u16>> = vec![None];
    for (symbol, &(code, len)) in (0u16..).zip(HUFFMAN_CODE.iter()) {
        let mut node = 0;
        for i in (0..len).rev() {
            let bit = ((code >> i) & 1) as usize;
            if children[node][bit] == NONE {
                children.push([NONE; 2]);
                leaf.push(None);
                children[node][bit] = children.len() - 1;
            }
            node = children[node][bit];
        }
        leaf[node] = Some(symbol);
    }

    // Number the internal nodes (the root first) and note their depth and all-ones path.
    let mut state_of = vec![0u8; children.len()];
    let mut internal = Vec::new();
    let mut may_end = Vec::new();
    let mut stack = vec![(0usize, 0u32, true)];
    while let Some((node, depth, ones)) = stack.pop() {
        if leaf[node].is_some() {
            continue;
        }
        state_of[node] =
            u8::try_from(internal.len()).expect("the Huffman code has 256 internal nodes");
        internal.push(node);
        may_end.push(depth <= 7 && ones);
        for bit in [1usize, 0] {
            if children[node][bit] != NONE {
                stack.push((children[node][bit], depth + 1, ones && bit == 1));
            }
        }
    }

    let steps = internal
        .iter()
        .map(|&start| {
            let mut row = [Step::default(); 16];
            for (nibble, step) in row.iter_mut().enumerate() {
                let mut node = start;
                for i in (0..4).rev() {
                    node = children[node][(nibble >> i) & 1];
                    if node == NONE {
                        step.fail = true;
                        break;
                    }
                    match leaf[node] {
                        Some(256) => {
                            step.fail = true;
                            break;
                        }
                        Some(symbol) => {
                            step.symbol = Some(symbol as u8);
                            node = 0;
                        }
                        None => {}
                    }
                }
                if !step.fail {
                    step.next = state_of[node];
                }
            }
            row
        })
        .collect();
    HuffmanMachine { steps, may_end }
}

/// Decodes a Huffman-coded string (§5.2, Appendix B).
fn huffman_decode(bytes: &[u8]) -> Result<Vec<u8>, HpackError> {
    let machine = huffman_machine();
    let mut out = Vec::with_capacity(bytes.len() * 8 / 5);
    let mut state = 0u8;
    for &byte in bytes {
        for nibble in [byte >> 4, byte & 0x0f] {
            let step = machine.steps[usize::from(state)][usize::from(nibble)];
            if step.fail {
                return Err(HpackError::Huffman);
            }
            if let Some(symbol) = step.symbol {
                out.push(symbol);
            }
            state = step.next;
        }
    }
    if !machine.may_end[usize::from(state)] {
        return Err(HpackError::Huffman);
    }
    Ok(out)
}

/// The static table (RFC 7541 Appendix A); index 1 is the first entry.
const STATIC_TABLE: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// The Huffman code (RFC 7541 Appendix B): (code, length in bits) for symbols 0..=255 and EOS.
const HUFFMAN_CODE: [(u32, u8); 257] = [
    (0x1ff8, 13),
    (0x7fffd8, 23),
    (0xfffffe2, 28),
    (0xfffffe3, 28),
    (0xfffffe4, 28),
    (0xfffffe5, 28),
    (0xfffffe6, 28),
    (0xfffffe7, 28),
    (0xfffffe8, 28),
    (0xffffea, 24),
    (0x3ffffffc, 30),
    (0xfffffe9, 28),
    (0xfffffea, 28),
    (0x3ffffffd, 30),
    (0xfffffeb, 28),
    (0xfffffec, 28),
    (0xfffffed, 28),
    (0xfffffee, 28),
    (0xfffffef, 28),
    (0xffffff0, 28),
    (0xffffff1, 28),
    (0xffffff2, 28),
    (0x3ffffffe, 30),
    (0xffffff3, 28),
    (0xffffff4, 28),
    (0xffffff5, 28),
    (0xffffff6, 28),
    (0xffffff7, 28),
    (0xffffff8, 28),
    (0xffffff9, 28),
    (0xffffffa, 28),
    (0xffffffb, 28),
    (0x14, 6),
    (0x3f8, 10),
    (0x3f9, 10),
    (0xffa, 12),
    (0x1ff9, 13),
    (0x15, 6),
    (0xf8, 8),
    (0x7fa, 11),
    (0x3fa, 10),
    (0x3fb, 10),
    (0xf9, 8),
    (0x7fb, 11),
    (0xfa, 8),
    (0x16, 6),
    (0x17, 6),
    (0x18, 6),
    (0x0, 5),
    (0x1, 5),
    (0x2, 5),
    (0x19, 6),
    (0x1a, 6),
    (0x1b, 6),
    (0x1c, 6),
    (0x1d, 6),
    (0x1e, 6),
    (0x1f, 6),
    (0x5c, 7),
    (0xfb, 8),
    (0x7ffc, 15),
    (0x20, 6),
    (0xffb, 12),
    (0x3fc, 10),
    (0x1ffa, 13),
    (0x21, 6),
    (0x5d, 7),
    (0x5e, 7),
    (0x5f, 7),
    (0x60, 7),
    (0x61, 7),
    (0x62, 7),
    (0x63, 7),
    (0x64, 7),
    (0x65, 7),
    (0x66, 7),
    (0x67, 7),
    (0x68, 7),
    (0x69, 7),
    (0x6a, 7),
    (0x6b, 7),
    (0x6c, 7),
    (0x6d, 7),
    (0x6e, 7),
    (0x6f, 7),
    (0x70, 7),
    (0x71, 7),
    (0x72, 7),
    (0xfc, 8),
    (0x73, 7),
    (0xfd, 8),
    (0x1ffb, 13),
    (0x7fff0, 19),
    (0x1ffc, 13),
    (0x3ffc, 14),
    (0x22, 6),
    (0x7ffd, 15),
    (0x3, 5),
    (0x23, 6),
    (0x4, 5),
    (0x24, 6),
    (0x5, 5),
    (0x25, 6),
    (0x26, 6),
    (0x27, 6),
    (0x6, 5),
    (0x74, 7),
    (0x75, 7),
    (0x28, 6),
    (0x29, 6),
    (0x2a, 6),
    (0x7, 5),
    (0x2b, 6),
    (0x76, 7),
    (0x2c, 6),
    (0x8, 5),
    (0x9, 5),
    (0x2d, 6),
    (0x77, 7),
    (0x78, 7),
    (0x79, 7),
    (0x7a, 7),
    (0x7b, 7),
    (0x7ffe, 15),
    (0x7fc, 11),
    (0x3ffd, 14),
    (0x1ffd, 13),
    (0xffffffc, 28),
    (0xfffe6, 20),
    (0x3fffd2, 22),
    (0xfffe7, 20),
    (0xfffe8, 20),
    (0x3fffd3, 22),
    (0x3fffd4, 22),
    (0x3fffd5, 22),
    (0x7fffd9, 23),
    (0x3fffd6, 22),
    (0x7fffda, 23),
    (0x7fffdb, 23),
    (0x7fffdc, 23),
    (0x7fffdd, 23),
    (0x7fffde, 23),
    (0xffffeb, 24),
    (0x7fffdf, 23),
    (0xffffec, 24),
    (0xffffed, 24),
    (0x3fffd7, 22),
    (0x7fffe0, 23),
    (0xffffee, 24),
    (0x7fffe1, 23),
    (0x7fffe2, 23),
    (0x7fffe3, 23),
    (0x7fffe4, 23),
    (0x1fffdc, 21),
    (0x3fffd8, 22),
    (0x7fffe5, 23),
    (0x3fffd9, 22),
    (0x7fffe6, 23),
    (0x7fffe7, 23),
    (0xffffef, 24),
    (0x3fffda, 22),
    (0x1fffdd, 21),
    (0xfffe9, 20),
    (0x3fffdb, 22),
    (0x3fffdc, 22),
    (0x7fffe8, 23),
    (0x7fffe9, 23),
    (0x1fffde, 21),
    (0x7fffea, 23),
    (0x3fffdd, 22),
    (0x3fffde, 22),
    (0xfffff0, 24),
    (0x1fffdf, 21),
    (0x3fffdf, 22),
    (0x7fffeb, 23),
    (0x7fffec, 23),
    (0x1fffe0, 21),
    (0x1fffe1, 21),
    (0x3fffe0, 22),
    (0x1fffe2, 21),
    (0x7fffed, 23),
    (0x3fffe1, 22),
    (0x7fffee, 23),
    (0x7fffef, 23),
    (0xfffea, 20),
    (0x3fffe2, 22),
    (0x3fffe3, 22),
    (0x3fffe4, 22),
    (0x7ffff0, 23),
    (0x3fffe5, 22),
    (0x3fffe6, 22),
    (0x7ffff1, 23),
    (0x3ffffe0, 26),
    (0x3ffffe1, 26),
    (0xfffeb, 20),
    (0x7fff1, 19),
    (0x3fffe7, 22),
    (0x7ffff2, 23),
    (0x3fffe8, 22),
    (0x1ffffec, 25),
    (0x3ffffe2, 26),
    (0x3ffffe3, 26),
    (0x3ffffe4, 26),
    (0x7ffffde, 27),
    (0x7ffffdf, 27),
    (0x3ffffe5, 26),
    (0xfffff1, 24),
    (0x1ffffed, 25),
    (0x7fff2, 19),
    (0x1fffe3, 21),
    (0x3ffffe6, 26),
    (0x7ffffe0, 27),
    (0x7ffffe1, 27),
    (0x3ffffe7, 26),
    (0x7ffffe2, 27),
    (0xfffff2, 24),
    (0x1fffe4, 21),
    (0x1fffe5, 21),
    (0x3ffffe8, 26),
    (0x3ffffe9, 26),
    (0xffffffd, 28),
    (0x7ffffe3, 27),
    (0x7ffffe4, 27),
    (0x7ffffe5, 27),
    (0xfffec, 20),
    (0xfffff3, 24),
    (0xfffed, 20),
    (0x1fffe6, 21),
    (0x3fffe9, 22),
    (0x1fffe7, 21),
    (0x1fffe8, 21),
    (0x7ffff3, 23),
    (0x3fffea, 22),
    (0x3fffeb, 22),
    (0x1ffffee, 25),
    (0x1ffffef, 25),
    (0xfffff4, 24),
    (0xfffff5, 24),
    (0x3ffffea, 26),
    (0x7ffff4, 23),
    (0x3ffffeb, 26),
    (0x7ffffe6, 27),
    (0x3ffffec, 26),
    (0x3ffffed, 26),
    (0x7ffffe7, 27),
    (0x7ffffe8, 27),
    (0x7ffffe9, 27),
    (0x7ffffea, 27),
    (0x7ffffeb, 27),
    (0xffffffe, 28),
    (0x7ffffec, 27),
    (0x7ffffed, 27),
    (0x7ffffee, 27),
    (0x7ffffef, 27),
    (0x7fffff0, 27),
    (0x3ffffee, 26),
    (0x3fffffff, 30),
];

#[cfg(test)]
/// Huffman-encodes `bytes` (padding with the most significant bits of EOS).
pub(crate) fn huffman_encode(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut acc: u64 = 0;
    let mut bits = 0;
    for &b in bytes {
        let (code, len) = HUFFMAN_CODE[usize::from(b)];
        acc = (acc << len) | u64::from(code);
        bits += u32::from(len);
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        out.push(((acc << (8 - bits)) as u8) | (0xff >> bits));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn decode(decoder: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, HpackError> {
        let mut fields = Vec::new();
        decoder.decode(block, |n, v| {
            fields.push((
                String::from_utf8(n.to_vec()).unwrap(),
                String::from_utf8(v.decode().unwrap().into_owned()).unwrap(),
            ))
        })?;
        Ok(fields)
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    /// The first request of RFC 7541 C.3 and C.4 (the same fields, coded differently).
    const FIRST_REQUEST: [(&str, &str); 4] = [
        (":method", "GET"),
        (":scheme", "http"),
        (":path", "/"),
        (":authority", "www.example.com"),
    ];

    #[test]
    fn rfc_7541_c3_requests_without_huffman() {
        let mut decoder = Decoder::new(4096);
        let first = hex("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d");
        assert_eq!(decode(&mut decoder, &first).unwrap(), pairs(&FIRST_REQUEST));
        assert_eq!(decoder.table_size(), 57);
        let second = hex("8286 84be 5808 6e6f 2d63 6163 6865");
        let mut second_request = FIRST_REQUEST.to_vec();
        second_request.push(("cache-control", "no-cache"));
        assert_eq!(
            decode(&mut decoder, &second).unwrap(),
            pairs(&second_request)
        );
        assert_eq!(decoder.table_size(), 110);
    }

    #[test]
    fn rfc_7541_c4_requests_with_huffman() {
        let mut decoder = Decoder::new(4096);
        let first = hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff");
        assert_eq!(decode(&mut decoder, &first).unwrap(), pairs(&FIRST_REQUEST));
        let second = hex("8286 84be 5886 a8eb 1064 9cbf");
        assert_eq!(
            decode(&mut decoder, &second).unwrap()[4],
            ("cache-control".to_string(), "no-cache".to_string())
        );
        let third = hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf");
        assert_eq!(
            decode(&mut decoder, &third).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value"),
            ])
        );
        assert_eq!(decoder.table_size(), 164);
    }

    #[test]
    fn huffman_round_trips_every_byte_value() {
        let all: Vec<u8> = (0..=255).collect();
        for len in [0, 1, 2, 3, 7, 64, 256] {
            let input: Vec<u8> = all
                .iter()
                .cycle()
                .skip(len * 7)
                .take(len)
                .copied()
                .collect();
            assert_eq!(huffman_decode(&huffman_encode(&input)).unwrap(), input);
        }
        let path = b"/var/lib/kubelet/device-plugins/kubelet.sock";
        assert_eq!(huffman_decode(&huffman_encode(path)).unwrap(), path);
    }

    #[test]
    fn huffman_rejects_eos_and_bad_padding() {
        // EOS (30 one bits) inside the string.
        assert_eq!(
            huffman_decode(&[0xff, 0xff, 0xff, 0xff]),
            Err(HpackError::Huffman)
        );
        // 'a' is 00011 (5 bits); padding of zeros instead of ones.
        assert_eq!(huffman_decode(&[0x18]), Err(HpackError::Huffman));
        // 'a' then a padding of 3 ones is fine; a whole extra byte of ones (11 bits) is not.
        assert_eq!(huffman_decode(&[0x1f]).unwrap(), b"a");
        assert_eq!(huffman_decode(&[0x1f, 0xff]), Err(HpackError::Huffman));
    }

    #[test]
    fn table_evicts_oldest_entries_and_obeys_size_updates() {
        let mut decoder = Decoder::new(100);
        // Each entry: 1 + 10 + 32 = 43 bytes; two fit in 100, the third evicts the first.
        for value in ["aaaaaaaaaa", "bbbbbbbbbb", "cccccccccc"] {
            let mut block = vec![0x40, 1, b'x', 10];
            block.extend_from_slice(value.as_bytes());
            decode(&mut decoder, &block).unwrap();
        }
        assert_eq!(decoder.table_size(), 86);
        assert_eq!(
            decode(&mut decoder, &[0x80 | 62]).unwrap()[0].1,
            "cccccccccc"
        );
        assert_eq!(
            decode(&mut decoder, &[0x80 | 63]).unwrap()[0].1,
            "bbbbbbbbbb"
        );
        assert_eq!(
            decode(&mut decoder, &[0x80 | 64]),
            Err(HpackError::BadIndex(64))
        );
        // A size update to 50 keeps only the newest; 0 empties the table.
        decode(&mut decoder, &[0x3f, 0x13, 0x82]).unwrap();
        assert_eq!(decoder.table_size(), 43);
        decode(&mut decoder, &[0x20, 0x82]).unwrap();
        assert_eq!(decoder.table_size(), 0);
        assert_eq!(
            decode(&mut decoder, &[0x3f, 0x46]),
            Err(HpackError::TableSize {
                size: 101,
                allowed: 100
            })
        );
    }

    #[test]
    fn malformed_blocks_are_errors() {
        let mut decoder = Decoder::new(4096);
        assert_eq!(decode(&mut decoder, &[0x80]), Err(HpackError::BadIndex(0)));
        assert_eq!(
            decode(&mut decoder, &[0x80 | 62]),
            Err(HpackError::BadIndex(62))
        );
        assert_eq!(
            decode(&mut decoder, &[0x00, 0x05, b'a']),
            Err(HpackError::Truncated)
        );
        assert_eq!(decode(&mut decoder, &[0x40]), Err(HpackError::Truncated));
        assert_eq!(
            decode(&mut decoder, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]),
            Err(HpackError::IntegerOverflow)
        );
        assert_eq!(
            decode(&mut decoder, &[0x82, 0x20]),
            Err(HpackError::LateSizeUpdate)
        );
    }

    #[test]
    fn agrees_with_loona_hpack_on_mixed_blocks() {
        let mut ours = Decoder::new(4096);
        let mut theirs = loona_hpack::Decoder::new();
        let mut blocks = Vec::new();
        for round in 0..40usize {
            let mut block = Vec::new();
            let value = format!("value-{round}-{}", "z".repeat(round * 13 % 90));
            let huffman = huffman_encode(value.as_bytes());
            // Literal with indexing, indexed name (content-type = 31), Huffman value.
            block.push(0x40 | 31);
            block.push(0x80 | u8::try_from(huffman.len()).unwrap());
            block.extend_from_slice(&huffman);
            // Reference to an older dynamic entry, if any.
            if round > 0 {
                block.push(0x80 | u8::try_from(62 + round.min(5)).unwrap());
            }
            // Never-indexed literal, new name, plain value.
            block.extend_from_slice(&[0x10, 3, b'k', b'e', b'y', 1, b'v']);
            blocks.push(block);
        }
        for block in &blocks {
            let expected: Vec<(String, String)> = theirs
                .decode(block)
                .unwrap()
                .into_iter()
                .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
                .collect();
            assert_eq!(decode(&mut ours, block).unwrap(), expected);
        }
    }

    #[test]
    fn unindexed_huffman_values_are_handed_out_coded_but_authority_is_decoded() {
        let mut decoder = Decoder::new(4096);
        let path = huffman_encode(b"/pluglet.admin.v1.Admin/Allocate");
        let authority = huffman_encode(b"/run/a.sock");
        let mut block = vec![0x04, 0x80 | u8::try_from(path.len()).unwrap()];
        block.extend_from_slice(&path);
        // Never indexed, `:authority` by name index 1.
        block.extend_from_slice(&[0x11, 0x80 | u8::try_from(authority.len()).unwrap()]);
        block.extend_from_slice(&authority);
        // With incremental indexing, content-type (31).
        let grpc = huffman_encode(b"application/grpc");
        block.extend_from_slice(&[0x40 | 31, 0x80 | u8::try_from(grpc.len()).unwrap()]);
        block.extend_from_slice(&grpc);
        let mut seen = Vec::new();
        decoder
            .decode(&block, |name, value| {
                let (bytes, huffman) = value.coded();
                seen.push((name.to_vec(), (bytes.to_vec(), huffman)));
            })
            .unwrap();
        assert_eq!(
            seen,
            [
                (b":path".to_vec(), (path, true)),
                (b":authority".to_vec(), (b"/run/a.sock".to_vec(), false)),
                (
                    b"content-type".to_vec(),
                    (b"application/grpc".to_vec(), false)
                ),
            ]
        );
        // The indexed one is in the table, decoded.
        assert_eq!(
            decode(&mut decoder, &[0x80 | 62]).unwrap(),
            pairs(&[("content-type", "application/grpc")])
        );
    }
}
