//! The HPACK decoder: any header block is fields or an error, never a panic; a decoder that
//! failed is not used again, as on a real connection.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pluglet_uds::fuzzing::Decoder;

fuzz_target!(|blocks: Vec<&[u8]>| {
    let mut decoder = Decoder::new(4096);
    for block in blocks {
        if decoder.decode(block, |_, _| {}).is_err() {
            break;
        }
    }
});
