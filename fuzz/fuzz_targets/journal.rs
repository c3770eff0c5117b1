//! The journal: a file of any content opens (its newest valid record, or set aside), and a
//! record's payload of any content decodes to allocations or to nothing, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pluglet_checkpoint::journal::Journal;
use pluglet_checkpoint::store::Durability;
use pluglet_device_manager::persistence::files::decode_journal;

fuzz_target!(|bytes: &[u8]| {
    let _ = decode_journal(bytes);
    let dir = std::env::temp_dir().join(format!("pluglet-fuzz-journal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let path = dir.join("journal");
    std::fs::write(&path, bytes).expect("write the journal file");
    let opened = Journal::open(&path, Durability::NoFsync).expect("a journal always opens");
    if let Some(record) = opened.record {
        let _ = decode_journal(&record.payload);
    }
    if let Some(aside) = opened.set_aside {
        std::fs::remove_file(aside).expect("remove the set-aside copy");
    }
});
