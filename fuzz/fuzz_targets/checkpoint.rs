//! The kubelet checkpoint reader: any bytes give data or an error, never a panic; what it
//! accepts encodes back to a file it reads as the same data.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pluglet_checkpoint::format::CheckpointData;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(data) = CheckpointData::decode(bytes) {
        let again = CheckpointData::decode(&data.encode()).expect("re-encoded data reads back");
        assert_eq!(again, data);
    }
});
