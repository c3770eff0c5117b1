//! Entry points for the fuzz targets (`fuzz/`, run by `scripts/fuzz.sh`) and the property tests:
//! the HPACK decoder, and a synchronous driver of the `:authority` layer. Built only with the
//! `fuzzing` feature; nothing in Pluglet calls it.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, ReadBuf};

use crate::AuthorityRewrite;
pub use crate::hpack::{Decoder, HpackError};

/// What the layer made of a client's byte stream.
#[derive(Debug, PartialEq, Eq)]
pub struct Rewritten {
    /// The bytes passed on to the HTTP/2 server, up to the end or the error.
    pub bytes: Vec<u8>,
    /// The error that closed the connection, if one did.
    pub error: Option<String>,
}

/// Runs `input` through an [`AuthorityRewrite`] whose socket hands out at most `chunk` bytes
/// per read, and collects what a server would read from it.
pub fn rewrite_in_chunks(input: &[u8], chunk: usize) -> Rewritten {
    let mut layer = AuthorityRewrite::new(Chunked {
        rest: input,
        chunk: chunk.max(1),
    });
    let mut context = Context::from_waker(Waker::noop());
    let mut bytes = Vec::with_capacity(input.len());
    let mut buf = vec![0u8; 4096];
    loop {
        let mut read = ReadBuf::new(&mut buf);
        match Pin::new(&mut layer).poll_read(&mut context, &mut read) {
            Poll::Ready(Ok(())) if read.filled().is_empty() => {
                return Rewritten { bytes, error: None };
            }
            Poll::Ready(Ok(())) => bytes.extend_from_slice(read.filled()),
            Poll::Ready(Err(e)) => {
                return Rewritten {
                    bytes,
                    error: Some(e.to_string()),
                };
            }
            Poll::Pending => unreachable!("an in-memory socket is always ready"),
        }
    }
}

/// An in-memory socket that returns at most `chunk` bytes per read.
struct Chunked<'a> {
    rest: &'a [u8],
    chunk: usize,
}

impl AsyncRead for Chunked<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let n = self.chunk.min(buf.remaining()).min(self.rest.len());
        let (now, later) = self.rest.split_at(n);
        buf.put_slice(now);
        self.rest = later;
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const HEADERS: u8 = 0x1;
    const END_HEADERS: u8 = 0x4;

    fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(payload.len()).expect("small frame");
        let mut out = len.to_be_bytes()[1..].to_vec();
        out.extend_from_slice(&[kind, flags]);
        out.extend_from_slice(&stream_id.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// A literal header field with a new name, without indexing and without Huffman coding
    /// (names and values here are shorter than 127 bytes).
    fn literal(name: &[u8], value: &[u8]) -> Vec<u8> {
        let mut out = vec![0x00, name.len() as u8];
        out.extend_from_slice(name);
        out.push(value.len() as u8);
        out.extend_from_slice(value);
        out
    }

    fn authority() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            Just(b"localhost".to_vec()),
            Just(b"/var/lib/kubelet/device-plugins/kubelet.sock".to_vec()),
            Just(b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fx.sock".to_vec()),
            proptest::collection::vec(any::<u8>(), 0..40),
        ]
    }

    /// A client byte stream: the preface, then HEADERS frames with an `:authority`, and frames
    /// of any type and content (framing violations among them) when `anything` is set, DATA
    /// frames otherwise.
    fn stream(anything: bool) -> impl Strategy<Value = Vec<u8>> {
        let headers = (authority(), 0u32..4)
            .prop_map(|(auth, id)| {
                let block = [literal(b":method", b"POST"), literal(b":authority", &auth)].concat();
                frame(HEADERS, END_HEADERS, id * 2 + 1, &block)
            })
            .boxed();
        let any_frame = (
            any::<u8>(),
            any::<u8>(),
            0u32..4,
            proptest::collection::vec(any::<u8>(), 0..48),
        )
            .prop_map(move |(kind, flags, id, payload)| match anything {
                true => frame(kind % 10, flags, id, &payload),
                false => frame(0x0, 0, id * 2 + 1, &payload),
            })
            .boxed();
        proptest::collection::vec(prop_oneof![3 => headers, 1 => any_frame], 0..8).prop_map(
            |frames| {
                let mut out = PREFACE.to_vec();
                out.extend(frame(0x4, 0, 0, &[]));
                frames.into_iter().for_each(|f| out.extend(f));
                out
            },
        )
    }

    proptest! {
        #[test]
        fn rewriting_does_not_depend_on_how_reads_are_cut(input in stream(true), cut in 1usize..40) {
            let whole = rewrite_in_chunks(&input, input.len());
            prop_assert_eq!(rewrite_in_chunks(&input, cut), whole);
        }

        #[test]
        fn any_bytes_are_passed_on_or_refused(input in proptest::collection::vec(any::<u8>(), 0..512), cut in 1usize..64) {
            let mut with_preface = PREFACE.to_vec();
            with_preface.extend_from_slice(&input);
            for bytes in [&input, &with_preface] {
                prop_assert_eq!(rewrite_in_chunks(bytes, cut), rewrite_in_chunks(bytes, bytes.len()));
            }
        }

        #[test]
        fn every_authority_passed_on_is_valid(input in stream(false)) {
            let out = rewrite_in_chunks(&input, input.len());
            prop_assume!(out.error.is_none());
            let mut rest = &out.bytes[PREFACE.len()..];
            let mut decoder = loona_hpack::Decoder::new();
            let mut block = Vec::new();
            while rest.len() >= 9 {
                let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
                let (kind, flags) = (rest[3], rest[4]);
                prop_assume!(rest.len() >= 9 + len);
                let payload = &rest[9..9 + len];
                rest = &rest[9 + len..];
                if kind == HEADERS || kind == 0x9 {
                    block.extend_from_slice(payload);
                    if flags & END_HEADERS != 0 {
                        let Ok(fields) = decoder.decode(&block) else { break };
                        for (name, value) in fields {
                            if name == b":authority" {
                                let text = std::str::from_utf8(&value).expect("a valid authority is text");
                                prop_assert!(text.parse::<http::uri::Authority>().is_ok(), "{:?} passed on", text);
                            }
                        }
                        block.clear();
                    }
                }
            }
        }

        #[test]
        fn hpack_blocks_of_any_bytes_decode_or_fail(blocks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..128), 1..6)) {
            let mut decoder = Decoder::new(4096);
            for block in &blocks {
                if decoder.decode(block, |_, _| {}).is_err() {
                    break;
                }
                prop_assert!(decoder.table_size() <= 4096);
            }
        }
    }
}
