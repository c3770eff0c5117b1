//! [`Persistence::open`]: the three files read at start. A corrupt file is kept aside (the
//! checkpoint as a copy, left in place until the first write replaces it; the side file and
//! the journal renamed); what the files then say is [`super::restore`]'s to decide.

use std::path::Path;
use std::sync::{Arc, Mutex};

use pluglet_checkpoint::{
    CheckpointData, CheckpointError, Durability, Journal, LoadOutcome, PodDevicesEntry,
};
use pluglet_core::error_chain;

use super::files::SideState;
use super::restore::{self, Files, Found, Restored, SetAside};
use super::{Disk, Inner, NO_CHECKPOINT, Paths, Persistence, WriteRequests};
use crate::metrics::Metrics;

impl Persistence {
    /// Reads the three files and returns what they describe. A corrupt checkpoint is kept
    /// aside as a copy and left in place until the first write replaces it; a corrupt side
    /// file or journal is renamed aside. A journal that cannot be opened for writing is read
    /// all the same: the state is restored, and changes are refused until it can be written.
    pub fn open(
        paths: Paths,
        durability: Durability,
        metrics: Metrics,
    ) -> Result<(Persistence, Restored), CheckpointError> {
        let (journal, journal_found) = match Journal::open(&paths.journal, durability) {
            Ok(opened) => {
                let found = match opened.set_aside {
                    Some(moved_to) if opened.salvaged => Found::Salvaged(
                        opened.record,
                        SetAside {
                            path: paths.journal.clone(),
                            moved_to,
                            reason: "not a whole Pluglet journal (cut short, or a slot header \
                                     damaged), but it still held an intact record"
                                .into(),
                        },
                    ),
                    Some(moved_to) => Found::SetAside(SetAside {
                        path: paths.journal.clone(),
                        moved_to,
                        reason: "not a Pluglet journal, or both of its slots are damaged".into(),
                    }),
                    None => Found::Loaded(opened.record),
                };
                (Some(opened.journal), found)
            }
            Err(err) => {
                tracing::error!(
                    error = %error_chain(&err),
                    "cannot open the allocation journal for writing: allocations and releases are refused until it can be"
                );
                (None, Found::Loaded(Journal::read(&paths.journal)?))
            }
        };
        let (checkpoint, checkpoint_readable, on_disk) = read_checkpoint(&paths.checkpoint)?;
        let side = found(
            &paths.side,
            pluglet_checkpoint::load_side_or_set_aside::<SideState>(&paths.side)?,
        );
        let restored = restore::restore(Files {
            checkpoint,
            checkpoint_readable,
            side,
            journal: journal_found,
        });
        let mut disk = Disk {
            journal,
            on_disk,
            unsynced: 0,
            based: false,
            records: 0,
        };
        if restored.journal_current {
            disk.based = disk.journal.is_some();
        } else {
            rebase(&mut disk, &paths.journal, durability, &metrics, &restored);
        }
        let (wake, woken) = tokio::sync::mpsc::channel(1);
        let persistence = Persistence {
            inner: Arc::new(Inner {
                acknowledged: Mutex::new(Arc::new(restored.pods.without_index())),
                paths,
                durability,
                metrics,
                disk: tokio::sync::Mutex::new(disk),
                requests: WriteRequests::new(),
                queue: Default::default(),
                wake,
                writer: std::sync::Mutex::new(Some(woken)),
            }),
        };
        Ok((persistence, restored))
    }
}

/// Writes the restored state as the journal's newest record, durable, when the journal does
/// not hold it (a checkpoint it does not name won, or there was no journal), so that changes
/// can be written as what they changed from the first one on: a change is never written after
/// a record it was not made on. Done here rather than by the first change after the start,
/// which on a node holding 10,000 allocations then waited for the whole state (a 1.8 MB
/// record) to be written and synced. A journal that cannot be written now is left to the first
/// change, which tries again (and is refused if it still cannot).
fn rebase(
    disk: &mut Disk,
    path: &Path,
    durability: Durability,
    metrics: &Metrics,
    restored: &Restored,
) {
    if disk.journal.is_none() {
        return;
    }
    if let Err(err) = super::group::record_state(disk, path, durability, metrics, &restored.pods) {
        tracing::warn!(
            error = %error_chain(&err),
            "cannot write the restored state to the allocation journal; the first allocation or release tries again"
        );
    }
}

/// What [`read_checkpoint`] found: the file's content, the entries still readable in it when
/// it is corrupt, and the checksums a journal record names for the file in place.
type CheckpointFound = (Found<CheckpointData>, Vec<PodDevicesEntry>, Vec<u64>);

/// Reads the checkpoint (a corrupt one is kept aside as a copy): see [`CheckpointFound`].
fn read_checkpoint(path: &Path) -> Result<CheckpointFound, CheckpointError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok((Found::Missing, Vec::new(), vec![NO_CHECKPOINT]));
        }
        Err(source) => {
            return Err(CheckpointError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    match CheckpointData::decode(&bytes) {
        Ok(data) => {
            let checksum = data.checksum();
            Ok((Found::Loaded(data), Vec::new(), vec![checksum]))
        }
        Err(source) => {
            let reason = CheckpointError::Corrupt {
                path: path.to_path_buf(),
                source,
            };
            let moved_to = pluglet_checkpoint::keep_copy(path)?;
            let aside = SetAside {
                path: path.to_path_buf(),
                moved_to,
                reason: error_chain(&reason),
            };
            Ok((
                Found::SetAside(aside),
                CheckpointData::readable_entries(&bytes),
                Vec::new(),
            ))
        }
    }
}

fn found<T>(path: &Path, outcome: LoadOutcome<T>) -> Found<T> {
    match outcome {
        LoadOutcome::Loaded(value) => Found::Loaded(value),
        LoadOutcome::Missing => Found::Missing,
        LoadOutcome::SetAside { reason, moved_to } => Found::SetAside(SetAside {
            path: path.to_path_buf(),
            moved_to,
            reason: error_chain(&reason),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    use std::time::Instant;

    use pluglet_core::ResourceName;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::persistence::SideSource;
    use crate::persistence::files;
    use crate::persistence::tests::{allocate, paths};
    use crate::pod_devices::PodDevices;

    /// The files a node leaves behind: three allocations written to the kubelet checkpoint by
    /// the writer (with the side file), then pod-1 released, which only the journal holds.
    async fn real_files(dir: &Path) -> (Vec<u8>, Vec<u8>) {
        use crate::persistence::files::SideResource;
        use crate::persistence::files::tests::gpu_set;
        let pods = Arc::new(Mutex::new(PodDevices::default()));
        let (persistence, _) =
            Persistence::open(paths(dir), Durability::NoFsync, Metrics::default()).unwrap();
        let source = {
            let pods = pods.clone();
            move |with_side: bool| {
                let resources = BTreeMap::from([(ResourceName::from("vendor.com/gpu"), gpu_set())]);
                let data = files::KubeletCheckpoint::of(
                    resources.iter(),
                    pods.lock().unwrap().without_index(),
                );
                let side = with_side.then(|| {
                    Box::new(move || SideState {
                        resources: BTreeMap::from([(
                            ResourceName::from("vendor.com/gpu"),
                            SideResource::of(&gpu_set(), "builtin:device-plugin", "ab"),
                        )]),
                    }) as SideSource
                });
                (data, side)
            }
        };
        let cancel = CancellationToken::new();
        let writer = tokio::spawn(persistence.clone().run_writer(source, cancel.clone()));
        for (pod, device) in [("pod-1", "d0"), ("pod-2", "d1"), ("pod-3", "d2")] {
            persistence
                .change(&pods, |p| allocate(p, pod, device))
                .await
                .unwrap();
        }
        persistence.write_now().await.unwrap();
        cancel.cancel();
        writer.await.unwrap();
        persistence
            .change(&pods, |p| p.release("pod-1", None))
            .await
            .unwrap();
        let checkpoint = std::fs::read(paths(dir).checkpoint).unwrap();
        let entries = CheckpointData::decode(&checkpoint)
            .unwrap()
            .pod_device_entries
            .unwrap();
        assert_eq!(entries.len(), 3, "the checkpoint holds pod-1 still");
        (checkpoint, std::fs::read(paths(dir).journal).unwrap())
    }

    fn pods_of(restored: &Restored) -> Vec<String> {
        restored
            .pods
            .iter()
            .map(|(k, e)| format!("{}:{}", k.pod_uid, e.devices.join(",")))
            .collect()
    }

    /// Every strict prefix of a real checkpoint is corrupt: it is kept aside byte for byte and
    /// left in place (the first write replaces it), the journal gives back exactly what Pluglet
    /// acknowledged last (never the released pod-1), the side file the devices, and the report
    /// names what the copy still shows that is not restored.
    #[tokio::test]
    async fn a_checkpoint_cut_at_every_byte_offset_loses_nothing_the_journal_proves() {
        let dir = tempfile::tempdir().unwrap();
        let (full, journal) = real_files(dir.path()).await;
        let paths = paths(dir.path());
        // Where pod-1's entry ends: from there on the copy shows it.
        let pod1_end = {
            let text = String::from_utf8(full.clone()).unwrap();
            let start = text.find(r#"{"PodUID":"pod-1""#).unwrap();
            let alloc = start + text[start..].find(r#""AllocResp""#).unwrap();
            alloc + text[alloc..].find('}').unwrap() + 1
        };
        let started = Instant::now();
        for cut in 0..full.len() {
            let prefix = &full[..cut];
            std::fs::write(&paths.checkpoint, prefix).unwrap();
            let (_, restored) =
                Persistence::open(paths.clone(), Durability::NoFsync, Metrics::default()).unwrap();
            let report = &restored.report;
            assert_eq!(pods_of(&restored), ["pod-2:d1", "pod-3:d2"], "cut at {cut}");
            assert!(report.from_journal, "cut at {cut}");
            assert_eq!(report.set_aside.len(), 1, "cut at {cut}");
            let aside = &report.set_aside[0];
            assert_eq!(aside.path, paths.checkpoint);
            assert!(
                aside.reason.contains("is corrupt"),
                "cut at {cut}: {}",
                aside.reason
            );
            assert_eq!(
                std::fs::read(&aside.moved_to).unwrap(),
                prefix,
                "cut at {cut}"
            );
            assert_eq!(
                std::fs::read(&paths.checkpoint).unwrap(),
                prefix,
                "still in place"
            );
            let recovery = report.recovery.as_ref().expect("a recovery report");
            assert_eq!(recovery.from_journal, Some(2), "cut at {cut}");
            let lost: &[&str] = if cut >= pod1_end {
                &["pod-1/ctr vendor.com/gpu [d0]"]
            } else {
                &[]
            };
            assert_eq!(recovery.not_restored, lost, "cut at {cut}");
            let summary = recovery.summary();
            assert!(
                summary.starts_with("recovered 2 allocations from the journal"),
                "{summary}"
            );
            assert!(summary.contains("other entries"), "{summary}");
            let gpu = &restored.resources["vendor.com/gpu"];
            assert_eq!(
                gpu.capacity(),
                3,
                "devices from the side file, cut at {cut}"
            );
            std::fs::remove_file(&aside.moved_to).unwrap();
        }
        // The whole file is the checkpoint as written: it stands, nothing is set aside.
        std::fs::write(&paths.checkpoint, &full).unwrap();
        let (_, restored) =
            Persistence::open(paths.clone(), Durability::NoFsync, Metrics::default()).unwrap();
        assert!(restored.report.set_aside.is_empty());
        assert_eq!(
            std::fs::read(&paths.journal).unwrap(),
            journal,
            "the journal untouched: it holds the state restored"
        );
        eprintln!(
            "{} cut checkpoints opened in {:?}",
            full.len(),
            started.elapsed()
        );
    }

    /// A checkpoint edited by hand fails its checksum: kept aside, the journal's allocations
    /// stand, and the entries the copy shows that are not restored are named.
    #[tokio::test]
    async fn a_checkpoint_edited_by_hand_is_kept_aside_and_the_journal_stands() {
        let dir = tempfile::tempdir().unwrap();
        let (full, _) = real_files(dir.path()).await;
        let paths = paths(dir.path());
        let edited = String::from_utf8(full)
            .unwrap()
            .replace(r#"["d2"]"#, r#"["d1"]"#);
        std::fs::write(&paths.checkpoint, &edited).unwrap();
        let (_, restored) =
            Persistence::open(paths.clone(), Durability::NoFsync, Metrics::default()).unwrap();
        assert_eq!(pods_of(&restored), ["pod-2:d1", "pod-3:d2"]);
        let aside = &restored.report.set_aside[0];
        assert!(
            aside.reason.contains("checksum mismatch"),
            "{}",
            aside.reason
        );
        assert_eq!(std::fs::read_to_string(&aside.moved_to).unwrap(), edited);
        let recovery = restored.report.recovery.as_ref().unwrap();
        assert_eq!(
            recovery.not_restored,
            [
                "pod-1/ctr vendor.com/gpu [d0]",
                "pod-3/ctr vendor.com/gpu [d1]"
            ]
        );

        // Without the journal nothing is proven: no allocation, devices from the side file.
        std::fs::remove_file(&aside.moved_to).unwrap();
        std::fs::remove_file(&paths.journal).unwrap();
        let (_, restored) =
            Persistence::open(paths.clone(), Durability::NoFsync, Metrics::default()).unwrap();
        assert!(restored.pods.is_empty());
        assert_eq!(restored.resources["vendor.com/gpu"].capacity(), 3);
        let summary = restored.report.recovery.as_ref().unwrap().summary();
        assert!(summary.starts_with("no journal record"), "{summary}");
        assert!(
            summary.contains("3 still readable in the copy are not restored"),
            "{summary}"
        );
    }

    #[tokio::test]
    async fn a_journal_cut_short_still_gives_its_newest_record() {
        let dir = tempfile::tempdir().unwrap();
        real_files(dir.path()).await;
        let paths = paths(dir.path());
        let whole = std::fs::read(&paths.journal).unwrap();
        std::fs::write(&paths.journal, &whole[..whole.len() - 1]).unwrap();
        let (_, restored) =
            Persistence::open(paths.clone(), Durability::NoFsync, Metrics::default()).unwrap();
        // pod-1's release was in the journal only: the cut file still proves it.
        assert_eq!(pods_of(&restored), ["pod-2:d1", "pod-3:d2"]);
        assert!(restored.report.journal_salvaged);
        let aside = &restored.report.set_aside[0];
        assert_eq!(aside.path, paths.journal);
        assert!(
            aside.reason.contains("still held an intact record"),
            "{}",
            aside.reason
        );
        assert_eq!(
            std::fs::read(&aside.moved_to).unwrap(),
            &whole[..whole.len() - 1]
        );
        // The new journal is whole: the next start finds nothing to set aside.
        let (_, again) = Persistence::open(paths, Durability::NoFsync, Metrics::default()).unwrap();
        assert!(again.report.set_aside.is_empty());
        assert_eq!(pods_of(&again), ["pod-2:d1", "pod-3:d2"]);
    }
}
