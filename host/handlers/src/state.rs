//! What the handler set keeps in the state directory so that a rollback survives a restart:
//! `handlers/rollbacks.json` (the decisions), `handlers/applied.json` (the configured version
//! each slot was last put on, with its entry and signature, so that a restart starts from the
//! set in force as a live change would) and `handlers/modules/<sha256>.wasm` (the bytes of
//! every configured module applied, so that the version a rollback restores, or the version
//! last applied, can be loaded again whatever has happened to its file since), and
//! `handlers/rollouts.json` (the entries fleet rollouts put in force, which win over
//! `handlers.toml`, so that what a node took from a rollout survives its restart).
//!
//! Files are written whole (temporary file, `fsync`, rename, directory `fsync`). A decisions file
//! that cannot be parsed is renamed to `rollbacks.json.corrupt-<time>` and reported, never
//! deleted.

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::file::SlotEntry;
use crate::integrity::SignatureInfo;
use crate::slot::SlotKey;

/// One configured version: the module's digest and the entry it ran under.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Version {
    /// sha256 of the module, hex.
    pub sha256: String,
    /// The entry.
    pub entry: SlotEntry,
}

/// A rollback decision: `rejected` is not applied again to `slot` until its file or entry
/// changes; `restored` (or the built-in, when `None`) serves instead.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// The slot.
    pub slot: SlotKey,
    /// The version rolled back.
    pub rejected: Version,
    /// The version put back; `None`: the built-in.
    pub restored: Option<Version>,
    /// Why.
    pub reason: String,
    /// When (RFC 3339).
    pub at: String,
}

impl Decision {
    /// What was rolled back to what, when and why, as a change's reason says it.
    pub fn describe(&self) -> String {
        format!(
            "module sha256 {} was rolled back at {} to {}: {}",
            self.rejected.sha256,
            self.at,
            self.restored.as_ref().map_or_else(
                || "the built-in".to_owned(),
                |r| format!("sha256 {}", r.sha256)
            ),
            self.reason
        )
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct DecisionsFile {
    rollbacks: Vec<Decision>,
}

/// The configured version a slot was last put on (applied, or restored by a rollback).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    /// The slot.
    pub slot: SlotKey,
    /// The version.
    pub version: Version,
    /// The signature that vouched for it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<SignatureInfo>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct AppliedFile {
    slots: Vec<Applied>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct RolloutsFile {
    slots: Vec<(SlotKey, SlotEntry)>,
}

/// `<state>/handlers`.
#[derive(Debug)]
pub struct StateStore {
    dir: PathBuf,
}

impl StateStore {
    /// Opens (creates) `<state_dir>/handlers` and its `modules` folder.
    pub fn open(state_dir: &Path) -> std::io::Result<StateStore> {
        let dir = state_dir.join("handlers");
        std::fs::create_dir_all(dir.join("modules"))?;
        Ok(StateStore { dir })
    }

    fn decisions_path(&self) -> PathBuf {
        self.dir.join("rollbacks.json")
    }

    fn applied_path(&self) -> PathBuf {
        self.dir.join("applied.json")
    }

    fn rollouts_path(&self) -> PathBuf {
        self.dir.join("rollouts.json")
    }

    /// The entries fleet rollouts put in force, by slot; none when there is no file (a corrupt
    /// file is set aside).
    pub fn rollouts(&self) -> BTreeMap<SlotKey, SlotEntry> {
        read_or_set_aside::<RolloutsFile>(
            &self.rollouts_path(),
            "the entries of fleet rollouts",
            "starting without them",
        )
        .map(|file| file.slots.into_iter().collect())
        .unwrap_or_default()
    }

    /// Writes the entries of fleet rollouts whole.
    pub fn save_rollouts(&self, entries: &BTreeMap<SlotKey, SlotEntry>) -> std::io::Result<()> {
        let file = RolloutsFile {
            slots: entries.clone().into_iter().collect(),
        };
        let bytes = serde_json::to_vec_pretty(&file).map_err(std::io::Error::other)?;
        write_whole(&self.rollouts_path(), &bytes)
    }

    fn module_path(&self, sha256: &str) -> PathBuf {
        self.dir.join("modules").join(format!("{sha256}.wasm"))
    }

    /// The decisions on disk; none when there is no file; a corrupt file is set aside.
    pub fn decisions(&self) -> Vec<Decision> {
        read_or_set_aside::<DecisionsFile>(
            &self.decisions_path(),
            "handler rollback decisions",
            "starting without them",
        )
        .map(|file| file.rollbacks)
        .unwrap_or_default()
    }

    /// Writes the decisions whole.
    pub fn save_decisions(&self, decisions: &[Decision]) -> std::io::Result<()> {
        let file = DecisionsFile {
            rollbacks: decisions.to_vec(),
        };
        let bytes = serde_json::to_vec_pretty(&file).map_err(std::io::Error::other)?;
        write_whole(&self.decisions_path(), &bytes)
    }

    /// The versions last applied; `None` when none was ever recorded (a first start). A file
    /// that cannot be read or parsed is reported and set aside, as if none was recorded.
    pub fn applied(&self) -> Option<Vec<Applied>> {
        read_or_set_aside::<AppliedFile>(
            &self.applied_path(),
            "the handler versions last applied",
            "starting from the built-ins",
        )
        .map(|file| file.slots)
    }

    /// Writes the versions last applied whole.
    pub fn save_applied(&self, applied: &[Applied]) -> std::io::Result<()> {
        let file = AppliedFile {
            slots: applied.to_vec(),
        };
        let bytes = serde_json::to_vec_pretty(&file).map_err(std::io::Error::other)?;
        write_whole(&self.applied_path(), &bytes)
    }

    /// Keeps a module's bytes under its digest (once).
    pub fn keep_module(&self, sha256: &str, bytes: &[u8]) -> std::io::Result<()> {
        let path = self.module_path(sha256);
        if path.exists() {
            return Ok(());
        }
        write_whole(&path, bytes)
    }

    /// A kept module's bytes.
    pub fn module(&self, sha256: &str) -> std::io::Result<Vec<u8>> {
        std::fs::read(self.module_path(sha256))
    }

    /// Removes kept modules whose digest is not in `keep`.
    pub fn retain_modules(&self, keep: &HashSet<String>) {
        let Ok(entries) = std::fs::read_dir(self.dir.join("modules")) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(sha) = name.to_str().and_then(|n| n.strip_suffix(".wasm")) else {
                continue;
            };
            if !keep.contains(sha) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(parent) = path.parent() {
        std::fs::File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// The JSON file at `path`: `None` when there is none, or when it cannot be read (reported) or
/// parsed (reported, and renamed to `<name>.corrupt-<time>` so the next write starts afresh).
/// `what` names the file's content in the report, `then` what the daemon does instead.
fn read_or_set_aside<T: serde::de::DeserializeOwned>(
    path: &Path,
    what: &str,
    then: &str,
) -> Option<T> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "cannot read {what}; {then}");
            return None;
        }
    };
    match serde_json::from_str::<T>(&text) {
        Ok(value) => Some(value),
        Err(e) => {
            let aside = path.with_extension(format!(
                "json.corrupt-{}",
                chrono::Utc::now().format("%Y%m%dT%H%M%SZ")
            ));
            let _ = std::fs::rename(path, &aside);
            tracing::warn!(
                file = %path.display(),
                set_aside = %aside.display(),
                error = %e,
                "{what} are corrupt; set aside, {then}"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::file::OnFailure;

    fn version(sha: &str) -> Version {
        Version {
            sha256: sha.into(),
            entry: SlotEntry {
                module: "/h/p.wasm".into(),
                sha256: None,
                deadline_ms: None,
                memory_mib: None,
                max_concurrent_calls: None,
                reuse_instances: None,
                fuel: None,
                settings: Default::default(),
                rollback_after: 3,
                on_failure: OnFailure::Fail,
                source: None,
                digest: None,
                rollout: None,
            },
        }
    }

    #[test]
    fn decisions_and_modules_round_trip_and_a_corrupt_file_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        assert!(store.decisions().is_empty());
        let decision = Decision {
            slot: SlotKey::Resource("vendor.com/gpu".into()),
            rejected: version("bb"),
            restored: Some(version("aa")),
            reason: "3 failed calls".into(),
            at: "2026-12-01T00:00:00Z".into(),
        };
        store
            .save_decisions(std::slice::from_ref(&decision))
            .unwrap();
        assert_eq!(store.decisions(), vec![decision]);

        store.keep_module("aa", b"one").unwrap();
        store.keep_module("bb", b"two").unwrap();
        store.retain_modules(&HashSet::from(["aa".to_owned()]));
        assert_eq!(store.module("aa").unwrap(), b"one");
        assert!(store.module("bb").is_err());

        assert_eq!(store.applied(), None);
        let applied = Applied {
            slot: SlotKey::Resource("vendor.com/gpu".into()),
            version: version("aa"),
            signature: Some(SignatureInfo {
                key_id: "AB12".into(),
                trusted_comment: "spread-policy 1.0".into(),
            }),
        };
        store.save_applied(std::slice::from_ref(&applied)).unwrap();
        assert_eq!(store.applied(), Some(vec![applied]));
        store.save_applied(&[]).unwrap();
        assert_eq!(store.applied(), Some(Vec::new()));

        std::fs::write(dir.path().join("handlers/rollbacks.json"), "{").unwrap();
        assert!(store.decisions().is_empty());
        let aside = std::fs::read_dir(dir.path().join("handlers"))
            .unwrap()
            .flatten()
            .any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("rollbacks.json.corrupt-")
            });
        assert!(aside);
    }

    #[test]
    fn rollout_entries_round_trip_and_a_corrupt_file_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        assert!(store.rollouts().is_empty());
        let mut entry = version("aa").entry;
        entry.rollout = Some("gpu-v2".into());
        let entries = BTreeMap::from([
            (SlotKey::Resource("vendor.com/gpu".into()), entry.clone()),
            (SlotKey::PluginType("CSIPlugin".into()), version("bb").entry),
        ]);
        store.save_rollouts(&entries).unwrap();
        assert_eq!(store.rollouts(), entries);
        store.save_rollouts(&BTreeMap::new()).unwrap();
        assert!(store.rollouts().is_empty());

        std::fs::write(dir.path().join("handlers/rollouts.json"), "[").unwrap();
        assert!(store.rollouts().is_empty());
        assert!(
            std::fs::read_dir(dir.path().join("handlers"))
                .unwrap()
                .flatten()
                .any(|e| e
                    .file_name()
                    .to_string_lossy()
                    .starts_with("rollouts.json.corrupt-"))
        );
    }
}
