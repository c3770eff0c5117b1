//! The device manager's persistent state.
//!
//! - [`CheckpointData`] is the kubelet's `kubelet_internal_checkpoint`, byte for byte
//!   ([`CheckpointData::encode`] / [`CheckpointData::decode`]), including its checksum: FNV-1a 32
//!   over a go-spew `%#v` rendering with Go type names ([`CheckpointData::checksum`],
//!   [`CheckpointData::spew`]). A kubelet reads what Pluglet writes and the other way round.
//! - [`write`] / [`write_with`] store it atomically (temporary file, fsync, rename, fsync of the
//!   directory; [`Durability::NoFsync`] for benchmarks), [`load`] reads and verifies it, and
//!   [`load_or_set_aside`] renames a corrupt file to `<name>.corrupt-<unix-ts>` so the daemon
//!   can report it and start empty.
//! - [`save_side`] / [`load_side`] / [`load_side_or_set_aside`] do the same for Pluglet's own
//!   side file (any serde type, sha256-checked), for what the kubelet's format cannot hold.
//!
//! Start at [`format`] for the data and its Go rules (nil vs empty), [`checksum`] for the
//! go-spew rendering, [`store`] for the files.
//!
//! ```
//! use std::collections::BTreeMap;
//! use pluglet_checkpoint::{CheckpointData, LoadOutcome, PodDevicesEntry};
//!
//! let dir = tempfile::tempdir()?;
//! let path = pluglet_checkpoint::checkpoint_path(dir.path());
//! let data = CheckpointData {
//!     pod_device_entries: Some(vec![PodDevicesEntry {
//!         pod_uid: "pod-1".into(),
//!         container_name: "ctr".into(),
//!         resource_name: "vendor.com/gpu".into(),
//!         device_ids: Some(BTreeMap::from([(-1, Some(vec!["gpu0".to_owned()]))])),
//!         alloc_resp: Some(Vec::new()),
//!     }]),
//!     registered_devices: BTreeMap::from([("vendor.com/gpu".into(), Some(vec!["gpu0".into()]))]),
//! };
//! pluglet_checkpoint::write(&path, &data)?;
//! match pluglet_checkpoint::load_or_set_aside(&path)? {
//!     LoadOutcome::Loaded(loaded) => assert_eq!(loaded, data),
//!     LoadOutcome::Missing => unreachable!("just written"),
//!     LoadOutcome::SetAside { reason, moved_to } => {
//!         panic!("{reason}; kept as {}", moved_to.display())
//!     }
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod checksum;
pub mod error;
pub mod format;
pub mod journal;
pub mod side;
pub mod store;

pub use checksum::fnv1a_32;
pub use error::{CheckpointError, FormatError};
pub use format::{CheckpointData, DevicesPerNuma, EntryParts, PodDevicesEntry};
pub use journal::{Journal, JournalRecord};
pub use side::{
    decode_side, encode_side, load_side, load_side_or_set_aside, save_side, save_side_with,
};
pub use store::{
    CHECKPOINT_FILE_NAME, Durability, LoadOutcome, SET_ASIDE_MARKER, checkpoint_path, keep_copy,
    load, load_or_set_aside, replace_file, set_aside, sync_parent, write, write_atomic,
    write_atomic_in_pieces, write_with,
};
