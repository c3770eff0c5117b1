//! The HTTP/2 `:authority` rewriting layer: any byte stream, cut into reads of any size, is
//! passed on or ends the connection with an error, never a panic; the result does not depend
//! on where the reads were cut.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pluglet_uds::fuzzing::rewrite_in_chunks;

/// The HTTP/2 client connection preface: streams without it are passed through untouched.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fuzz_target!(|input: (u8, &[u8])| {
    let (cut, bytes) = input;
    let mut stream = Vec::with_capacity(PREFACE.len() + bytes.len());
    if cut & 0x80 != 0 {
        stream.extend_from_slice(PREFACE);
    }
    stream.extend_from_slice(bytes);
    let whole = rewrite_in_chunks(&stream, stream.len());
    let pieces = rewrite_in_chunks(&stream, usize::from(cut & 0x7f) + 1);
    assert_eq!(whole, pieces);
});
