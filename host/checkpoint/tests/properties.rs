//! Property tests of the readers: the kubelet checkpoint and the journal take any bytes without
//! a panic and never make up data. The fuzz targets in `fuzz/` (`scripts/fuzz.sh`) run the same
//! readers on coverage-guided input.

use std::collections::BTreeMap;

use pluglet_checkpoint::format::{CheckpointData, PodDevicesEntry};
use pluglet_checkpoint::journal::Journal;
use pluglet_checkpoint::store::Durability;
use proptest::prelude::*;

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9./-]{0,12}",
        any::<String>(),
        Just("\"\\\u{0}\u{2028}<>&".to_string()),
    ]
}

fn ids() -> impl Strategy<Value = Option<Vec<String>>> {
    proptest::option::of(proptest::collection::vec(text(), 0..4))
}

fn entry() -> impl Strategy<Value = PodDevicesEntry> {
    (
        text(),
        text(),
        text(),
        proptest::option::of(proptest::collection::btree_map(any::<i64>(), ids(), 0..3)),
        proptest::option::of(proptest::collection::vec(any::<u8>(), 0..24)),
    )
        .prop_map(
            |(pod_uid, container_name, resource_name, device_ids, alloc_resp)| PodDevicesEntry {
                pod_uid,
                container_name,
                resource_name,
                device_ids,
                alloc_resp,
            },
        )
}

fn data() -> impl Strategy<Value = CheckpointData> {
    (
        proptest::option::of(proptest::collection::vec(entry(), 0..4)),
        proptest::collection::btree_map(text(), ids(), 0..3),
    )
        .prop_map(|(pod_device_entries, registered_devices)| CheckpointData {
            pod_device_entries,
            registered_devices: registered_devices.into_iter().collect::<BTreeMap<_, _>>(),
        })
}

proptest! {
    #[test]
    fn any_bytes_decode_or_fail(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(data) = CheckpointData::decode(&bytes) {
            prop_assert_eq!(CheckpointData::decode(&data.encode()).unwrap(), data);
        }
    }

    #[test]
    fn data_round_trips(data in data()) {
        prop_assert_eq!(CheckpointData::decode(&data.encode()).unwrap(), data);
    }

    #[test]
    fn a_checkpoint_cut_short_anywhere_is_refused(data in data(), at in any::<prop::sample::Index>()) {
        let bytes = data.encode();
        let cut = at.index(bytes.len());
        prop_assert!(CheckpointData::decode(&bytes[..cut]).is_err(), "{} of {} bytes accepted", cut, bytes.len());
    }

    #[test]
    fn a_changed_byte_never_yields_other_data(data in data(), at in any::<prop::sample::Index>(), xor in 1u8..) {
        let mut bytes = data.encode();
        let i = at.index(bytes.len());
        bytes[i] ^= xor;
        if let Ok(read) = CheckpointData::decode(&bytes) {
            prop_assert_eq!(read, data, "byte {} changed", i);
        }
    }

    #[test]
    fn a_journal_file_of_any_bytes_opens(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        std::fs::write(&path, &bytes).unwrap();
        let opened = Journal::open(&path, Durability::NoFsync).unwrap();
        if let Some(aside) = &opened.set_aside {
            prop_assert_eq!(std::fs::read(aside).unwrap(), bytes, "the copy set aside is kept as it was");
        }
    }

    #[test]
    fn a_journal_cut_short_gives_a_record_that_was_written(
        payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 1..5),
        at in any::<prop::sample::Index>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let mut journal = Journal::open(&path, Durability::NoFsync).unwrap().journal;
        for payload in &payloads {
            journal.append(payload).unwrap();
        }
        drop(journal);
        let bytes = std::fs::read(&path).unwrap();
        let cut = at.index(bytes.len());
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let opened = Journal::open(&path, Durability::NoFsync).unwrap();
        if let Some(record) = opened.record {
            let seq = usize::try_from(record.seq).unwrap();
            prop_assert!(seq >= 1 && seq <= payloads.len());
            prop_assert_eq!(&record.payload, &payloads[seq - 1]);
        }
    }
}
