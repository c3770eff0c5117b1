//! The HTTP/2 `:authority` rewriting layer for servers (docs/kubelet-compatibility.md, "HTTP/2
//! authority from Go plugins" and "HPACK details").
//!
//! grpc-go clients that dial a unix socket by path send the path (`/var/lib/kubelet/...`) as
//! `:authority`; grpc-python sends it percent-encoded. The `h2` crate under hyper refuses both
//! with `RST_STREAM(PROTOCOL_ERROR)` and has no switch to relax that. [`AuthorityRewrite`] sits
//! between the accepted socket and the server and rewrites such values to `localhost` on the
//! way in.
//!
//! What it does to the client→server byte stream (server→client bytes are never touched):
//! 1. checks the 24-byte HTTP/2 client preface; anything else is passed through untouched and
//!    left for `h2` to refuse;
//! 2. forwards every frame except HEADERS/CONTINUATION as it arrives, DATA included (never
//!    re-framed: its padding counts for flow control);
//! 3. reassembles each header block (HEADERS + CONTINUATION*), strips padding, keeps the
//!    priority bytes, and decodes it with an HPACK decoder that mirrors the client's dynamic
//!    table (capped at 4096 bytes, the default: the server never advertises another size);
//! 4. if no rewrite has been needed yet on the connection, forwards the original frames byte for
//!    byte; otherwise, and from then on for every later block of the connection, re-encodes the
//!    block as literals without indexing (names and decoded values without Huffman coding, a
//!    value the decoder left Huffman-coded as the client coded it), with every `:authority`
//!    that [`http::uri::Authority`] rejects replaced by `localhost`, re-chunked into HEADERS +
//!    CONTINUATION frames of at most 16 KiB. Re-encoding every later block keeps `h2`'s dynamic
//!    table frozen, so it never sees references to entries it did not get (grpc-python reuses a
//!    connection with blocks made of table references).
//!
//! Framing violations (a frame interleaved into an open header block, padding longer than the
//! frame) are passed through untouched from that point on, so `h2` answers them with the proper
//! GOAWAY. A header block larger than [`MAX_HEADER_BLOCK`] (CONTINUATION floods), a decoded header
//! list larger than [`MAX_HEADER_LIST`] (HPACK bombs), or an HPACK error after rewriting started
//! closes the connection with an error that is logged.
//!
//! Cost: one HPACK decode per header block (the crate's own decoder, table-driven Huffman), about
//! 3 µs for a gRPC client's first request; see `benches/connection.rs`. A Huffman-coded value
//! that goes into no table and is not an `:authority` is not decoded at all: `:path`, which
//! gRPC clients on `h2` send that way on every request.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use crate::hpack::{Decoder, HpackError, Value};
use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// Largest header block (sum of HEADERS + CONTINUATION payloads, padding included) accepted on
/// one stream; a larger one closes the connection. gRPC requests carry well under 1 KiB.
pub const MAX_HEADER_BLOCK: usize = 64 * 1024;

/// Largest decoded header list accepted in one block, counted as in RFC 7541 §4.1 (name, value
/// and 32 bytes per field; a value the layer leaves Huffman-coded counts with its coded length);
/// a larger one closes the connection. Bounds the memory an HPACK bomb (a small block of
/// references to large table entries) can make the layer allocate.
pub const MAX_HEADER_LIST: usize = 256 * 1024;

/// The value that replaces a rejected `:authority`; what the upstream kubelet itself sends.
const LOCALHOST: &[u8] = b"localhost";
/// The HTTP/2 client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_LEN: usize = 9;
/// Re-encoded header blocks are cut into frames of at most this payload: the minimum
/// SETTINGS_MAX_FRAME_SIZE, so every peer accepts it.
const MAX_CHUNK: usize = 16 * 1024;
/// SETTINGS_HEADER_TABLE_SIZE default (RFC 9113 §6.5.2); `h2` servers never advertise another.
const HEADER_TABLE_SIZE: usize = 4096;
/// Bytes read from the socket at a time.
const READ_CHUNK: usize = 8 * 1024;

const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
const PRIORITY_LEN: usize = 5;

/// An accepted connection whose incoming HTTP/2 header blocks get a valid `:authority`.
///
/// Wraps a server-side stream (a [`tokio::net::UnixStream`] from
/// [`incoming_any_authority`](crate::incoming_any_authority)); reads go through the rewriting
/// state machine described in the [module docs](self), writes go straight to the inner stream.
/// Implements tonic's [`Connected`] with the inner stream's connection info, so handlers served
/// by tonic's own server still see the peer credentials ([`crate::serve`] passes none on).
pub struct AuthorityRewrite<S> {
    inner: S,
    /// Boxed: `h2` moves the whole connection, this stream included, several times as it
    /// starts, and the state machine is a few hundred bytes.
    rewriter: Box<Rewriter>,
    /// Rewritten bytes not yet handed to the reader.
    out: BytesMut,
    /// Scratch buffer for reads from `inner`; never zeroed (the reader only sees what was read).
    input: Box<[std::mem::MaybeUninit<u8>]>,
    /// `inner` reported end of file.
    eof: bool,
    /// The connection is being closed for this reason once `out` is drained.
    failed: Option<RewriteError>,
    /// The failure has been reported; further reads see end of file.
    closed: bool,
}

impl<S> AuthorityRewrite<S> {
    /// Wraps a freshly accepted server-side connection (nothing read from it yet).
    pub fn new(inner: S) -> Self {
        AuthorityRewrite {
            inner,
            rewriter: Box::new(Rewriter::new()),
            out: BytesMut::new(),
            input: Box::new_uninit_slice(READ_CHUNK),
            eof: false,
            failed: None,
            closed: false,
        }
    }

    /// The wrapped connection.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Whether at least one header block on this connection had its `:authority` rewritten.
    pub fn rewrote(&self) -> bool {
        self.rewriter.rewriting
    }
}

impl<S> std::fmt::Debug for AuthorityRewrite<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthorityRewrite")
            .field("rewriting", &self.rewriter.rewriting)
            .field("pending", &self.out.len())
            .field("eof", &self.eof)
            .finish_non_exhaustive()
    }
}

impl<S: Connected> Connected for AuthorityRewrite<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityRewrite<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if !this.out.is_empty() {
                let n = buf.remaining().min(this.out.len());
                buf.put_slice(&this.out[..n]);
                this.out.advance(n);
                return Poll::Ready(Ok(()));
            }
            if let Some(error) = this.failed.take() {
                this.closed = true;
                tracing::warn!(%error, "closing HTTP/2 connection");
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, error)));
            }
            if this.eof || this.closed {
                return Poll::Ready(Ok(()));
            }
            if this.rewriter.is_passthrough() {
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            let mut scratch = ReadBuf::uninit(&mut this.input);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut scratch))?;
            let read = scratch.filled();
            if read.is_empty() {
                this.eof = true;
                this.rewriter.finish(&mut this.out);
            } else if let Err(error) = this.rewriter.feed(read, &mut this.out) {
                this.failed = Some(error);
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityRewrite<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Why the layer closed a connection.
#[derive(Debug, thiserror::Error)]
enum RewriteError {
    /// CONTINUATION flood or an absurd HEADERS frame.
    #[error(
        "header block on stream {stream_id} exceeds {MAX_HEADER_BLOCK} bytes (at least {len}); the client sent too many CONTINUATION frames"
    )]
    BlockTooLarge { stream_id: u32, len: usize },
    /// HPACK bomb.
    #[error("decoded header list on stream {stream_id} exceeds {MAX_HEADER_LIST} bytes")]
    HeaderListTooLarge { stream_id: u32 },
    /// The client's HPACK could not be decoded after rewriting started (before, the block is
    /// passed through and `h2` reports it).
    #[error("HPACK error in header block on stream {stream_id}")]
    Hpack {
        stream_id: u32,
        #[source]
        source: HpackError,
    },
}

/// Where the byte stream parser is.
enum State {
    /// Matching the client preface; `matched` bytes of it seen so far.
    Preface { matched: usize },
    /// Reading a 9-byte frame header.
    FrameHeader {
        buf: [u8; FRAME_HEADER_LEN],
        filled: usize,
    },
    /// Copying the payload of a frame that is not part of a header block.
    Forward { remaining: usize },
    /// Reading the payload of a HEADERS or CONTINUATION frame.
    HeaderPayload {
        header: FrameHeader,
        payload: Vec<u8>,
    },
    /// Not HTTP/2 as the layer understands it: everything goes through untouched, for `h2` to
    /// judge.
    Passthrough,
}

#[derive(Clone, Copy)]
struct FrameHeader {
    len: usize,
    kind: u8,
    flags: u8,
    stream_id: u32,
    raw: [u8; FRAME_HEADER_LEN],
}

impl FrameHeader {
    fn parse(raw: [u8; FRAME_HEADER_LEN]) -> FrameHeader {
        FrameHeader {
            len: usize::from(raw[0]) << 16 | usize::from(raw[1]) << 8 | usize::from(raw[2]),
            kind: raw[3],
            flags: raw[4],
            stream_id: u32::from_be_bytes([raw[5], raw[6], raw[7], raw[8]]) & 0x7fff_ffff,
            raw,
        }
    }
}

/// A header block being reassembled.
struct Block {
    stream_id: u32,
    /// END_STREAM from the HEADERS frame.
    end_stream: bool,
    /// Priority bytes from the HEADERS frame, if it had the PRIORITY flag.
    priority: Option<[u8; PRIORITY_LEN]>,
    /// The original frames, byte for byte.
    raw: Vec<u8>,
    /// The header block fragments, padding removed.
    fragment: Vec<u8>,
}

/// The header fields of one block, in one buffer kept from block to block (a gRPC client sends a
/// block per request: no allocation per field or per block). A value is kept as the block coded
/// it when the decoder left it Huffman-coded.
#[derive(Default)]
struct Fields {
    bytes: Vec<u8>,
    /// Where each field's name and value end in `bytes`, in order, and whether the value is
    /// Huffman-coded.
    ends: Vec<(usize, usize, bool)>,
}

impl Fields {
    /// Buffers with room for a gRPC request's fields, so that a connection's first block does
    /// not grow them field by field.
    fn with_room() -> Fields {
        Fields {
            bytes: Vec::with_capacity(FIELDS_ROOM),
            ends: Vec::with_capacity(FIELDS_ROOM / 32),
        }
    }

    /// Empties the buffers; ones a large block grew past [`KEPT_BUFFER`] are freed.
    fn clear(&mut self) {
        if self.bytes.capacity() > KEPT_BUFFER
            || self.ends.capacity() * std::mem::size_of::<(usize, usize, bool)>() > KEPT_BUFFER
        {
            *self = Fields::default();
        } else {
            self.bytes.clear();
            self.ends.clear();
        }
    }

    fn push(&mut self, name: &[u8], value: Value<'_>) {
        let (value, huffman) = value.coded();
        self.bytes.extend_from_slice(name);
        let name_end = self.bytes.len();
        self.bytes.extend_from_slice(value);
        self.ends.push((name_end, self.bytes.len(), huffman));
    }

    /// Each field's name, value, and whether the value is Huffman-coded.
    fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8], bool)> {
        let mut start = 0;
        self.ends
            .iter()
            .map(move |&(name_end, value_end, huffman)| {
                let field = (
                    &self.bytes[start..name_end],
                    &self.bytes[name_end..value_end],
                    huffman,
                );
                start = value_end;
                field
            })
    }
}

/// Bytes of names and values [`Fields`] has room for from the start; a gRPC request's header
/// list is a few hundred bytes.
const FIELDS_ROOM: usize = 512;

/// Largest buffer a connection keeps for its next header block; a larger one (a rare, large
/// block) is freed once used.
const KEPT_BUFFER: usize = 16 * 1024;

/// `buf`, emptied, if it is small enough to keep for the next block.
fn keep(buf: Vec<u8>) -> Vec<u8> {
    let mut buf = if buf.capacity() <= KEPT_BUFFER {
        buf
    } else {
        Vec::new()
    };
    buf.clear();
    buf
}

/// A finished block's buffers (see [`Block`]), kept for the next block.
#[derive(Default)]
struct SpareBuffers {
    /// A HEADERS or CONTINUATION frame's payload.
    payload: Vec<u8>,
    /// The original frames.
    raw: Vec<u8>,
    /// The header block fragments.
    fragment: Vec<u8>,
}

/// The client→server half of the layer, without I/O: bytes in, bytes out.
struct Rewriter {
    state: State,
    block: Option<Block>,
    decoder: Decoder,
    /// A block has been rewritten on this connection: every later block is re-encoded.
    rewriting: bool,
    /// The fields of the block being finished (empty in between).
    fields: Fields,
    /// The buffers of a finished block, emptied, for the next one.
    spare: SpareBuffers,
}

impl Rewriter {
    fn new() -> Rewriter {
        Rewriter {
            state: State::Preface { matched: 0 },
            block: None,
            decoder: Decoder::new(HEADER_TABLE_SIZE),
            rewriting: false,
            fields: Fields::with_room(),
            spare: Default::default(),
        }
    }

    fn is_passthrough(&self) -> bool {
        matches!(self.state, State::Passthrough)
    }

    /// Consumes `input`, appending what should reach the server to `out`.
    fn feed(&mut self, mut input: &[u8], out: &mut BytesMut) -> Result<(), RewriteError> {
        while !input.is_empty() {
            match &mut self.state {
                State::Passthrough => {
                    out.extend_from_slice(input);
                    return Ok(());
                }
                State::Preface { matched } => {
                    let want = &PREFACE[*matched..];
                    let n = want.len().min(input.len());
                    if input[..n] != want[..n] {
                        tracing::debug!(
                            "not an HTTP/2 client preface; passing the connection through"
                        );
                        out.extend_from_slice(&PREFACE[..*matched]);
                        self.state = State::Passthrough;
                        continue;
                    }
                    *matched += n;
                    input = &input[n..];
                    if *matched == PREFACE.len() {
                        out.extend_from_slice(PREFACE);
                        self.state = State::FrameHeader {
                            buf: [0; FRAME_HEADER_LEN],
                            filled: 0,
                        };
                    }
                }
                State::FrameHeader { buf, filled } => {
                    let n = (FRAME_HEADER_LEN - *filled).min(input.len());
                    buf[*filled..*filled + n].copy_from_slice(&input[..n]);
                    *filled += n;
                    input = &input[n..];
                    if *filled == FRAME_HEADER_LEN {
                        let header = FrameHeader::parse(*buf);
                        self.start_frame(header, out)?;
                    }
                }
                State::Forward { remaining } => {
                    let n = (*remaining).min(input.len());
                    out.extend_from_slice(&input[..n]);
                    *remaining -= n;
                    input = &input[n..];
                    if *remaining == 0 {
                        self.state = next_frame();
                    }
                }
                State::HeaderPayload { header, payload } => {
                    let n = (header.len - payload.len()).min(input.len());
                    payload.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    if payload.len() == header.len {
                        let header = *header;
                        let payload = std::mem::take(payload);
                        self.state = next_frame();
                        self.header_frame(header, payload, out)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The peer closed its side: whatever is held back goes out as it came in.
    fn finish(&mut self, out: &mut BytesMut) {
        if let Some(block) = self.block.take() {
            out.extend_from_slice(&block.raw);
        }
        match std::mem::replace(&mut self.state, State::Passthrough) {
            State::Preface { matched } => out.extend_from_slice(&PREFACE[..matched]),
            State::FrameHeader { buf, filled } => out.extend_from_slice(&buf[..filled]),
            State::HeaderPayload { header, payload } => {
                out.extend_from_slice(&header.raw);
                out.extend_from_slice(&payload);
            }
            State::Forward { .. } | State::Passthrough => {}
        }
    }

    /// A complete frame header has been read.
    fn start_frame(&mut self, header: FrameHeader, out: &mut BytesMut) -> Result<(), RewriteError> {
        let in_block = self.block.is_some();
        let is_header_frame = header.kind == TYPE_HEADERS || header.kind == TYPE_CONTINUATION;
        if in_block && header.kind != TYPE_CONTINUATION {
            // RFC 9113 §6.2: nothing may interleave a header block. Let h2 say so.
            self.give_up(out, &header.raw, "frame interleaved into a header block");
            return Ok(());
        }
        if !in_block && header.kind == TYPE_CONTINUATION {
            self.give_up(
                out,
                &header.raw,
                "CONTINUATION without an open header block",
            );
            return Ok(());
        }
        if !is_header_frame {
            out.extend_from_slice(&header.raw);
            self.state = if header.len == 0 {
                next_frame()
            } else {
                State::Forward {
                    remaining: header.len,
                }
            };
            return Ok(());
        }
        let so_far = self.block.as_ref().map_or(0, |b| b.raw.len());
        if so_far + header.len > MAX_HEADER_BLOCK {
            return Err(RewriteError::BlockTooLarge {
                stream_id: header.stream_id,
                len: so_far + header.len,
            });
        }
        let mut payload = std::mem::take(&mut self.spare.payload);
        if header.len == 0 {
            // An empty payload completes at once; `feed` would not come back for it.
            self.state = next_frame();
            return self.header_frame(header, payload, out);
        }
        payload.reserve(header.len);
        self.state = State::HeaderPayload { header, payload };
        Ok(())
    }

    /// A complete HEADERS or CONTINUATION frame has been read.
    fn header_frame(
        &mut self,
        header: FrameHeader,
        payload: Vec<u8>,
        out: &mut BytesMut,
    ) -> Result<(), RewriteError> {
        if header.kind == TYPE_HEADERS {
            let mut start = 0;
            let mut pad = 0;
            if header.flags & FLAG_PADDED != 0 {
                match payload.first() {
                    Some(&len) => pad = usize::from(len),
                    None => {
                        let raw = [&header.raw[..], &payload].concat();
                        self.give_up(out, &raw, "PADDED HEADERS frame without a pad length");
                        return Ok(());
                    }
                }
                start = 1;
            }
            let mut priority = None;
            if header.flags & FLAG_PRIORITY != 0 {
                match payload.get(start..start + PRIORITY_LEN) {
                    Some(bytes) => {
                        let mut p = [0; PRIORITY_LEN];
                        p.copy_from_slice(bytes);
                        priority = Some(p);
                    }
                    None => {
                        let raw = [&header.raw[..], &payload].concat();
                        self.give_up(out, &raw, "HEADERS frame too short for its priority");
                        return Ok(());
                    }
                }
                start += PRIORITY_LEN;
            }
            if start + pad > payload.len() {
                let raw = [&header.raw[..], &payload].concat();
                self.give_up(out, &raw, "HEADERS padding longer than the frame");
                return Ok(());
            }
            let mut raw = std::mem::take(&mut self.spare.raw);
            raw.extend_from_slice(&header.raw);
            raw.extend_from_slice(&payload);
            let mut fragment = std::mem::take(&mut self.spare.fragment);
            fragment.extend_from_slice(&payload[start..payload.len() - pad]);
            self.block = Some(Block {
                stream_id: header.stream_id,
                end_stream: header.flags & FLAG_END_STREAM != 0,
                priority,
                raw,
                fragment,
            });
        } else {
            let Some(block) = self.block.as_mut() else {
                // `start_frame` only lets CONTINUATION through with an open block.
                let raw = [&header.raw[..], &payload].concat();
                self.give_up(out, &raw, "CONTINUATION without an open header block");
                return Ok(());
            };
            if block.stream_id != header.stream_id {
                let raw = [&header.raw[..], &payload].concat();
                self.give_up(out, &raw, "CONTINUATION on another stream");
                return Ok(());
            }
            block.raw.extend_from_slice(&header.raw);
            block.raw.extend_from_slice(&payload);
            block.fragment.extend_from_slice(&payload);
        }
        self.spare.payload = keep(payload);
        if header.flags & FLAG_END_HEADERS != 0 {
            let block = self.block.take().expect("a header block is open");
            let finished = self.finish_block(&block, out);
            self.fields.clear();
            self.spare.raw = keep(block.raw);
            self.spare.fragment = keep(block.fragment);
            finished?;
        }
        Ok(())
    }

    /// Decodes a complete header block and forwards it, rewritten if needed.
    fn finish_block(&mut self, block: &Block, out: &mut BytesMut) -> Result<(), RewriteError> {
        let fields = &mut self.fields;
        fields.clear();
        let mut list_size = 0usize;
        let mut too_large = false;
        let mut replaced = false;
        let decoded = self.decoder.decode(&block.fragment, |name, value| {
            // A value left Huffman-coded counts with its coded length: the layer holds only that.
            let (bytes, _) = value.coded();
            list_size = list_size.saturating_add(name.len() + bytes.len() + 32);
            if list_size > MAX_HEADER_LIST {
                too_large = true;
                return;
            }
            // The decoder hands out every `:authority` decoded.
            if let Value::Plain(value) = value
                && name == b":authority"
                && http::uri::Authority::try_from(value).is_err()
            {
                tracing::debug!(
                    authority = %String::from_utf8_lossy(value),
                    stream_id = block.stream_id,
                    "replacing an :authority that is not a URI authority with localhost"
                );
                replaced = true;
            }
            fields.push(name, value);
        });
        if too_large {
            return Err(RewriteError::HeaderListTooLarge {
                stream_id: block.stream_id,
            });
        }
        if let Err(source) = decoded {
            if self.rewriting {
                return Err(RewriteError::Hpack {
                    stream_id: block.stream_id,
                    source,
                });
            }
            // h2's table is still in step with the client's: it will report the error itself.
            tracing::debug!(%source, "undecodable header block; passing the connection through");
            self.give_up(out, &block.raw, "undecodable header block");
            return Ok(());
        }
        self.rewriting |= replaced;
        if !self.rewriting {
            out.extend_from_slice(&block.raw);
            return Ok(());
        }
        write_block(block, &encode_literals(&self.fields), out);
        Ok(())
    }

    /// Stops interpreting the connection: `held` (bytes not yet forwarded, in order) and
    /// everything after goes through untouched, so `h2` sees and reports the violation.
    fn give_up(&mut self, out: &mut BytesMut, held: &[u8], why: &str) {
        tracing::debug!(
            why,
            "HTTP/2 framing violation; passing the connection through"
        );
        if let Some(block) = self.block.take() {
            out.extend_from_slice(&block.raw);
        }
        out.extend_from_slice(held);
        self.state = State::Passthrough;
    }
}

fn next_frame() -> State {
    State::FrameHeader {
        buf: [0; FRAME_HEADER_LEN],
        filled: 0,
    }
}

/// Encodes header fields as "literal header field without indexing — new name" (RFC 7541
/// §6.2.2): needs no encoder state and adds nothing to the server's dynamic table. Names and
/// decoded values are written without Huffman coding; a value the decoder left Huffman-coded is
/// written as the client coded it. Every `:authority` that is not a URI authority becomes
/// `localhost`.
fn encode_literals(fields: &Fields) -> Vec<u8> {
    let size = fields.bytes.len() + 11 * fields.ends.len();
    let mut block = Vec::with_capacity(size);
    for (name, value, huffman) in fields.iter() {
        let value = if !huffman
            && name == b":authority"
            && http::uri::Authority::try_from(value).is_err()
        {
            LOCALHOST
        } else {
            value
        };
        block.push(0x00);
        encode_string(name, false, &mut block);
        encode_string(value, huffman, &mut block);
    }
    block
}

/// A string literal: the Huffman flag and a 7-bit prefix length, then the bytes as given.
fn encode_string(bytes: &[u8], huffman: bool, out: &mut Vec<u8>) {
    let flag = if huffman { 0x80 } else { 0x00 };
    encode_integer(bytes.len(), 7, flag, out);
    out.extend_from_slice(bytes);
}

/// An HPACK integer (RFC 7541 §5.1) with an `prefix_bits`-bit prefix; `first` holds the bits of
/// the first byte above the prefix.
fn encode_integer(mut value: usize, prefix_bits: u32, first: u8, out: &mut Vec<u8>) {
    let max_prefix = (1usize << prefix_bits) - 1;
    if value < max_prefix {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max_prefix as u8);
    value -= max_prefix;
    while value >= 0x80 {
        out.push((value & 0x7f) as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Frames an encoded header block as HEADERS + CONTINUATION* of at most [`MAX_CHUNK`] bytes each,
/// keeping END_STREAM and the priority of the original HEADERS frame; padding is dropped.
fn write_block(block: &Block, encoded: &[u8], out: &mut BytesMut) {
    let priority_len = if block.priority.is_some() {
        PRIORITY_LEN
    } else {
        0
    };
    let first_len = encoded.len().min(MAX_CHUNK - priority_len);
    let (first, mut rest) = encoded.split_at(first_len);

    let mut flags = 0;
    if block.end_stream {
        flags |= FLAG_END_STREAM;
    }
    if block.priority.is_some() {
        flags |= FLAG_PRIORITY;
    }
    if rest.is_empty() {
        flags |= FLAG_END_HEADERS;
    }
    put_frame_header(
        out,
        priority_len + first.len(),
        TYPE_HEADERS,
        flags,
        block.stream_id,
    );
    if let Some(priority) = block.priority {
        out.extend_from_slice(&priority);
    }
    out.extend_from_slice(first);

    while !rest.is_empty() {
        let n = rest.len().min(MAX_CHUNK);
        let (chunk, tail) = rest.split_at(n);
        let flags = if tail.is_empty() { FLAG_END_HEADERS } else { 0 };
        put_frame_header(out, n, TYPE_CONTINUATION, flags, block.stream_id);
        out.extend_from_slice(chunk);
        rest = tail;
    }
}

fn put_frame_header(out: &mut BytesMut, len: usize, kind: u8, flags: u8, stream_id: u32) {
    let len = u32::try_from(len).expect("frame payload fits in 24 bits");
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream_id.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        put_frame_header(&mut out, payload.len(), kind, flags, stream_id);
        out.extend_from_slice(payload);
        out.to_vec()
    }

    fn literal(name: &str, value: &str, first: u8) -> Vec<u8> {
        let mut out = vec![first];
        encode_string(name.as_bytes(), false, &mut out);
        encode_string(value.as_bytes(), false, &mut out);
        out
    }

    fn run(input: &[u8], step: usize) -> (Vec<u8>, Result<(), RewriteError>, bool) {
        let mut rewriter = Rewriter::new();
        let mut out = BytesMut::new();
        for chunk in input.chunks(step) {
            if let Err(error) = rewriter.feed(chunk, &mut out) {
                return (out.to_vec(), Err(error), rewriter.rewriting);
            }
        }
        rewriter.finish(&mut out);
        (out.to_vec(), Ok(()), rewriter.rewriting)
    }

    fn decode_blocks(output: &[u8]) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
        assert!(output.starts_with(PREFACE));
        let mut rest = &output[PREFACE.len()..];
        let mut decoder = loona_hpack::Decoder::new();
        let mut blocks = Vec::new();
        let mut block = Vec::new();
        while !rest.is_empty() {
            let mut raw = [0; FRAME_HEADER_LEN];
            raw.copy_from_slice(&rest[..FRAME_HEADER_LEN]);
            let header = FrameHeader::parse(raw);
            let payload = &rest[FRAME_HEADER_LEN..FRAME_HEADER_LEN + header.len];
            rest = &rest[FRAME_HEADER_LEN + header.len..];
            if header.kind == TYPE_HEADERS || header.kind == TYPE_CONTINUATION {
                let skip = if header.flags & FLAG_PRIORITY != 0 {
                    5
                } else {
                    0
                };
                assert_eq!(header.flags & FLAG_PADDED, 0);
                block.extend_from_slice(&payload[skip..]);
                if header.flags & FLAG_END_HEADERS != 0 {
                    blocks.push(decoder.decode(&block).unwrap());
                    block.clear();
                }
            }
        }
        blocks
    }

    #[test]
    fn integers_encode_as_in_rfc_7541_appendix_c1() {
        let mut out = Vec::new();
        encode_integer(10, 5, 0, &mut out);
        assert_eq!(out, [0x0a]);
        out.clear();
        encode_integer(1337, 5, 0, &mut out);
        assert_eq!(out, [0x1f, 0x9a, 0x0a]);
        out.clear();
        encode_integer(42, 8, 0, &mut out);
        assert_eq!(out, [0x2a]);
    }

    #[test]
    fn valid_authority_passes_through_byte_for_byte() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[]));
        let block = [
            literal(":method", "POST", 0x40),
            literal(":authority", "localhost", 0x40),
        ]
        .concat();
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &block));
        input.extend(frame(
            0x0,
            FLAG_END_STREAM | FLAG_PADDED,
            1,
            &[2, b'x', 0, 0],
        ));
        for step in [1, 2, 7, 9, 4096] {
            let (out, result, rewriting) = run(&input, step);
            result.unwrap();
            assert!(!rewriting);
            assert_eq!(out, input, "step {step}");
        }
    }

    #[test]
    fn path_authority_is_rewritten_whatever_the_read_sizes() {
        let mut input = PREFACE.to_vec();
        let block = [
            literal(":method", "POST", 0x00),
            literal(":authority", "/run/plugin.sock", 0x00),
            literal("te", "trailers", 0x00),
        ]
        .concat();
        let mut headers = vec![2, 0, 0, 0, 3, 200];
        headers.extend_from_slice(&block[..5]);
        headers.extend_from_slice(&[0, 0]);
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_PADDED | FLAG_PRIORITY | FLAG_END_STREAM,
            5,
            &headers,
        ));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 5, &block[5..]));
        let mut expected = None;
        for step in [1, 3, 9, 10, 4096] {
            let (out, result, rewriting) = run(&input, step);
            result.unwrap();
            assert!(rewriting);
            let blocks = decode_blocks(&out);
            assert_eq!(
                blocks,
                [vec![
                    (b":method".to_vec(), b"POST".to_vec()),
                    (b":authority".to_vec(), b"localhost".to_vec()),
                    (b"te".to_vec(), b"trailers".to_vec()),
                ]]
            );
            // HEADERS keeps END_STREAM and the priority bytes, loses the padding.
            let first = FrameHeader::parse(out[24..33].try_into().unwrap());
            assert_eq!(
                first.flags,
                FLAG_END_STREAM | FLAG_PRIORITY | FLAG_END_HEADERS
            );
            assert_eq!(&out[33..38], &[0, 0, 0, 3, 200]);
            assert_eq!(first.stream_id, 5);
            match &expected {
                None => expected = Some(out),
                Some(expected) => assert_eq!(&out, expected, "step {step}"),
            }
        }
    }

    #[test]
    fn large_rewritten_blocks_are_cut_into_continuations() {
        let mut input = PREFACE.to_vec();
        let big = "v".repeat(100);
        let mut block = literal(":authority", "/x.sock", 0x00);
        for i in 0..400 {
            block.extend(literal(&format!("x-h{i}"), &big, 0x00));
        }
        assert!(block.len() > 2 * MAX_CHUNK && block.len() < MAX_HEADER_BLOCK);
        for chunk in block.chunks(MAX_CHUNK) {
            let first = input.len() == PREFACE.len();
            let last = chunk.as_ptr_range().end == block.as_ptr_range().end;
            let kind = if first {
                TYPE_HEADERS
            } else {
                TYPE_CONTINUATION
            };
            let flags = if last { FLAG_END_HEADERS } else { 0 };
            input.extend(frame(kind, flags, 1, chunk));
        }
        let (out, result, _) = run(&input, 8192);
        result.unwrap();
        let blocks = decode_blocks(&out);
        assert_eq!(blocks.len(), 1);
        assert_eq!(blocks[0].len(), 401);
        assert_eq!(blocks[0][0].1, b"localhost");
        let mut rest = &out[PREFACE.len()..];
        while !rest.is_empty() {
            let header = FrameHeader::parse(rest[..9].try_into().unwrap());
            assert!(header.len <= MAX_CHUNK);
            rest = &rest[9 + header.len..];
        }
    }

    #[test]
    fn oversized_header_block_is_refused() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, 0, 1, &[0x82]));
        for _ in 0..4 {
            input.extend(frame(TYPE_CONTINUATION, 0, 1, &[0; MAX_CHUNK]));
        }
        let (_, result, _) = run(&input, 4096);
        let error = result.unwrap_err();
        assert!(
            matches!(error, RewriteError::BlockTooLarge { stream_id: 1, .. }),
            "{error}"
        );
        assert!(error.to_string().contains("exceeds 65536 bytes"), "{error}");
    }

    #[test]
    fn hpack_bomb_is_refused() {
        let mut input = PREFACE.to_vec();
        let value = "b".repeat(4000);
        let first = literal("x-bomb", &value, 0x40);
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_END_STREAM,
            1,
            &first,
        ));
        // 100 references of ~4 KiB each decode to ~400 KiB.
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 3, &[0x80 | 62; 100]));
        let (_, result, _) = run(&input, 4096);
        let error = result.unwrap_err();
        assert!(
            matches!(error, RewriteError::HeaderListTooLarge { stream_id: 3 }),
            "{error}"
        );
    }

    #[test]
    fn hpack_errors_before_rewriting_are_left_to_h2() {
        let mut input = PREFACE.to_vec();
        // Index 70 does not exist in an empty dynamic table.
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &[0x80 | 70]));
        input.extend(frame(0x6, 0, 0, &[0; 8]));
        let (out, result, _) = run(&input, 4096);
        result.unwrap();
        assert_eq!(out, input);
    }

    #[test]
    fn hpack_errors_after_rewriting_close_the_connection() {
        let mut input = PREFACE.to_vec();
        let block = literal(":authority", "/x.sock", 0x00);
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &block));
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 3, &[0x80 | 70]));
        let (_, result, _) = run(&input, 4096);
        let error = result.unwrap_err();
        assert!(
            matches!(error, RewriteError::Hpack { stream_id: 3, .. }),
            "{error}"
        );
    }

    #[test]
    fn not_a_preface_passes_through() {
        let input = b"PRI * HTTP/1.1\r\n\r\nhello".to_vec();
        for step in [1, 5, 100] {
            let (out, result, _) = run(&input, step);
            result.unwrap();
            assert_eq!(out, input);
        }
    }

    #[test]
    fn truncated_input_is_forwarded_as_it_came() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, 0, 1, &literal(":method", "GET", 0)));
        input.extend(&frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &[0x82, 0x84])[..11]);
        let (out, result, _) = run(&input, 7);
        result.unwrap();
        assert_eq!(out, input);
    }

    #[test]
    fn a_huffman_path_before_a_rewritten_authority_is_forwarded_as_coded() {
        let mut input = PREFACE.to_vec();
        let path = crate::hpack::huffman_encode(b"/pluglet.admin.v1.Admin/Allocate");
        // `:path` (static name 4) without indexing, its value Huffman-coded, as h2 sends it.
        let mut block = vec![0x04];
        encode_string(&path, true, &mut block);
        block.extend(literal(":authority", "/run/plugin.sock", 0x00));
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &block));
        let (out, result, rewriting) = run(&input, 4096);
        result.unwrap();
        assert!(rewriting);
        assert_eq!(
            decode_blocks(&out),
            [vec![
                (
                    b":path".to_vec(),
                    b"/pluglet.admin.v1.Admin/Allocate".to_vec()
                ),
                (b":authority".to_vec(), b"localhost".to_vec()),
            ]]
        );
        // The path's coded bytes went through as they came.
        assert!(out.windows(path.len()).any(|w| w == path.as_slice()));
    }

    #[test]
    fn the_wrapped_stream_stays_small_to_move() {
        let size = std::mem::size_of::<AuthorityRewrite<tokio::net::UnixStream>>();
        println!("AuthorityRewrite<UnixStream>: {size} bytes");
        assert!(size <= 160, "{size} bytes");
    }
}
