//! Pluglet's side file: what Pluglet keeps beyond the kubelet's format (unhealthy devices, NUMA
//! nodes, the policy digest, …), for any `T: Serialize + DeserializeOwned`.
//!
//! Layout, one line of JSON with no whitespace:
//!
//! ```text
//! {"format":"pluglet-side-file/1","sha256":"<64 lower-case hex>","data":<T as JSON>}
//! ```
//!
//! The sha256 covers the exact bytes of `<T as JSON>` as written, so verifying it needs no
//! canonical re-encoding. The file is written and set aside exactly like the checkpoint
//! ([`crate::write_atomic`], [`LoadOutcome`]). A file whose data no longer fits `T` (say, after
//! an incompatible upgrade) counts as corrupt: it is set aside and the daemon starts empty.

use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest as _, Sha256};

use crate::error::{CheckpointError, FormatError};
use crate::store::{self, Durability, LoadOutcome};

/// The start of every side file, up to the checksum.
const PREFIX: &[u8] = br#"{"format":"pluglet-side-file/1","sha256":""#;
/// Between the checksum and the data.
const MIDDLE: &[u8] = br#"","data":"#;
/// Length of a sha256 in hex.
const HEX_LEN: usize = 64;

/// Encodes `value` as a whole side file (envelope, checksum and data).
pub fn encode_side<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let data = serde_json::to_vec(value)?;
    let digest = hex::encode(Sha256::digest(&data));
    let mut out = Vec::with_capacity(PREFIX.len() + HEX_LEN + MIDDLE.len() + data.len() + 1);
    out.extend_from_slice(PREFIX);
    out.extend_from_slice(digest.as_bytes());
    out.extend_from_slice(MIDDLE);
    out.extend_from_slice(&data);
    out.push(b'}');
    Ok(out)
}

/// Decodes a whole side file, verifying its checksum before parsing the data.
pub fn decode_side<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, FormatError> {
    let rest = bytes.strip_prefix(PREFIX).ok_or(FormatError::Layout(
        "does not start with the side-file header",
    ))?;
    if rest.len() < HEX_LEN + MIDDLE.len() + 1 {
        return Err(FormatError::Layout("truncated"));
    }
    let (stored, rest) = rest.split_at(HEX_LEN);
    let data = rest
        .strip_prefix(MIDDLE)
        // Tolerate a newline an editor may have added after the closing brace.
        .map(<[u8]>::trim_ascii_end)
        .and_then(|rest| rest.strip_suffix(b"}"))
        .ok_or(FormatError::Layout("the data is not framed as written"))?;
    let stored =
        std::str::from_utf8(stored).map_err(|_| FormatError::Layout("the checksum is not hex"))?;
    let computed = hex::encode(Sha256::digest(data));
    if stored != computed {
        return Err(FormatError::ChecksumMismatch {
            stored: stored.to_owned(),
            computed,
        });
    }
    serde_json::from_slice(data).map_err(FormatError::Json)
}

/// Writes `value` to the side file at `path`, atomically and with fsync.
pub fn save_side<T: Serialize + ?Sized>(path: &Path, value: &T) -> Result<(), CheckpointError> {
    save_side_with(path, value, Durability::Fsync)
}

/// Writes `value` to the side file at `path`, atomically, fsyncing as `durability` says.
pub fn save_side_with<T: Serialize + ?Sized>(
    path: &Path,
    value: &T,
    durability: Durability,
) -> Result<(), CheckpointError> {
    let bytes = encode_side(value).map_err(|source| CheckpointError::Encode {
        path: path.to_path_buf(),
        source,
    })?;
    store::write_atomic(path, &bytes, durability)
}

/// Reads the side file at `path`: `Ok(None)` when there is none, [`CheckpointError::Corrupt`]
/// when it fails its checksum or does not fit `T`.
pub fn load_side<T: DeserializeOwned>(path: &Path) -> Result<Option<T>, CheckpointError> {
    store::load_with(path, decode_side)
}

/// Reads the side file at `path`; a corrupt one is renamed to `<name>.corrupt-<unix-ts>`.
pub fn load_side_or_set_aside<T: DeserializeOwned>(
    path: &Path,
) -> Result<LoadOutcome<T>, CheckpointError> {
    store::load_or_set_aside_with(path, decode_side)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::fs;

    use serde::Deserialize;

    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct State {
        unhealthy: BTreeMap<String, Vec<String>>,
        numa: BTreeMap<String, Vec<i64>>,
        policy_digest: Option<String>,
    }

    fn state() -> State {
        State {
            unhealthy: BTreeMap::from([("vendor.com/gpu".into(), vec!["d3".into()])]),
            numa: BTreeMap::from([("d0".into(), vec![0]), ("d3".into(), vec![1])]),
            policy_digest: Some("ab".repeat(32)),
        }
    }

    #[test]
    fn encode_layout_and_round_trip() {
        let bytes = encode_side(&state()).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.starts_with(r#"{"format":"pluglet-side-file/1","sha256":""#));
        assert!(
            text.contains(r#"","data":{"unhealthy":{"vendor.com/gpu":["d3"]}"#),
            "{text}"
        );
        // The whole file is JSON a person (or jq) can read.
        let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(value["data"]["policy_digest"], "ab".repeat(32));
        assert_eq!(decode_side::<State>(&bytes).unwrap(), state());
    }

    #[test]
    fn save_and_load_both_durabilities() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").join("devices.json");
        for durability in [Durability::Fsync, Durability::NoFsync] {
            save_side_with(&path, &state(), durability).unwrap();
            assert_eq!(load_side::<State>(&path).unwrap(), Some(state()));
        }
        save_side(&path, &state()).unwrap();
        match load_side_or_set_aside::<State>(&path).unwrap() {
            LoadOutcome::Loaded(loaded) => assert_eq!(loaded, state()),
            other => panic!("expected Loaded, got {other:?}"),
        }
    }

    #[test]
    fn missing_side_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("devices.json");
        assert_eq!(load_side::<State>(&path).unwrap(), None);
        assert!(matches!(
            load_side_or_set_aside::<State>(&path).unwrap(),
            LoadOutcome::Missing
        ));
    }

    #[test]
    fn tampered_data_fails_the_checksum_and_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("devices.json");
        save_side(&path, &state()).unwrap();
        let tampered = fs::read_to_string(&path).unwrap().replace("d3", "d4");
        fs::write(&path, &tampered).unwrap();
        assert!(matches!(
            load_side::<State>(&path),
            Err(CheckpointError::Corrupt {
                source: FormatError::ChecksumMismatch { .. },
                ..
            })
        ));
        match load_side_or_set_aside::<State>(&path).unwrap() {
            LoadOutcome::SetAside { reason, moved_to } => {
                assert!(reason.is_corrupt());
                assert!(!path.exists());
                assert_eq!(fs::read_to_string(moved_to).unwrap(), tampered);
            }
            other => panic!("expected SetAside, got {other:?}"),
        }
    }

    #[test]
    fn malformed_envelopes_are_layout_errors() {
        let good = encode_side(&state()).unwrap();
        let cases: Vec<Vec<u8>> = vec![
            Vec::new(),
            b"{}".to_vec(),
            PREFIX.to_vec(),
            [&good[..], b"x"].concat(),
        ];
        for case in cases {
            assert!(
                matches!(decode_side::<State>(&case), Err(FormatError::Layout(_))),
                "{:?}",
                String::from_utf8_lossy(&case)
            );
        }
        // Cut short: the data no longer hashes to the stored checksum.
        assert!(matches!(
            decode_side::<State>(&good[..good.len() - 1]),
            Err(FormatError::ChecksumMismatch { .. })
        ));
    }

    #[test]
    fn trailing_newline_is_tolerated() {
        let good = encode_side(&state()).unwrap();
        let with_newline = [&good[..], b"\n"].concat();
        assert_eq!(decode_side::<State>(&with_newline).unwrap(), state());
    }

    #[test]
    fn data_that_no_longer_fits_the_type_is_corrupt() {
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct Other {
            something_else: u32,
        }
        let bytes = encode_side(&state()).unwrap();
        assert!(matches!(
            decode_side::<Other>(&bytes),
            Err(FormatError::Json(_))
        ));
    }

    #[test]
    fn unencodable_value_is_an_encode_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.json");
        // JSON object keys must be strings; a map keyed by a tuple is refused by serde_json.
        let bad: BTreeMap<(u8, u8), u8> = BTreeMap::from([((1, 2), 3)]);
        let err = save_side(&path, &bad).unwrap_err();
        assert!(matches!(err, CheckpointError::Encode { .. }), "{err:?}");
        assert!(!path.exists());
    }
}
