//! [`Persistence`]: the device manager's state on disk, behind one type with one promise:
//! [`Persistence::change`] makes a change to the allocations only once it is durable, and
//! refuses it (changing nothing) when it cannot be made durable.
//!
//! The files:
//! - `kubelet_internal_checkpoint` in the device plugins directory, in the kubelet's exact
//!   format (see `docs/kubelet-compatibility.md`, "Checkpoint format"), so a kubelet
//!   and Pluglet each read the other's;
//! - a side file in the state directory for what that format cannot hold (every device with
//!   its health and NUMA nodes, the policy in force): [`files::SideState`];
//! - an allocation journal in the state directory ([`pluglet_checkpoint::Journal`]: one
//!   in-place write and an `fdatasync`). A change is written as what it changed (the entries
//!   it put and the keys it removed: [`files::encode_change`]) after the newest whole record,
//!   so its cost does not grow with the allocations held; a whole record of the state
//!   ([`files::encode_journal`]) is written only when the journal's slot has no room left for
//!   changes, about once per slot-size of changes.
//!
//! Two ways to disk:
//! - the checkpoint and the side file are written by one writer on a thread of its own
//!   ([`Persistence::run_writer`], [`Persistence::spawn_writer`]), coalesced: a change asks for
//!   a write ([`WriteRequests`]); the writer takes one snapshot per write, so a burst of changes
//!   costs one write. A device change wakes the writer at once; after allocations and releases
//!   alone it is woken once they have been quiet for `ALLOCATION_WRITE_DELAY`, at the latest
//!   `ALLOCATION_WRITE_MAX` after the first change it has not written;
//! - allocations and releases must be durable before they are answered. Rather than wait for
//!   the checkpoint (temporary file, fsync, rename, directory fsync), [`Persistence::change`]
//!   writes a journal record first, on the caller's thread, and the checkpoint follows. The
//!   checkpoint writer's snapshots are taken under the same lock, so the checkpoint never holds
//!   a change the journal does not.
//!
//! Which is newer after a crash: each journal record names the checkpoint files that were in
//! place or being written when it was made (by their kubelet checksums, see [`Disk`]); the
//! rules that follow from that are in [`restore`], a pure function of the files' contents.
//! Only the newest files are named, so an older state that a kubelet happens to write again
//! (an empty node, say) is not mistaken for Pluglet's. After a power cut the checkpoint's last
//! renames may be undone, as with the kubelet (it never fsyncs the directory; Pluglet does
//! every fourth write): the older checkpoint then wins and the allocations made since are lost,
//! with the containers that used them.
//!
//! One file per part: `open.rs` reads the files at start ([`Persistence::open`]; what they
//! mean is decided by [`restore`]); this file makes a change durable ([`Persistence::change`])
//! and publishes the acknowledged state; `disk.rs` keeps what a journal record names;
//! `requests.rs` coalesces write requests; `writer.rs` is the checkpoint writer; [`files`] is
//! what goes into each file.

mod disk;
pub mod files;
mod open;
mod requests;
pub mod restore;
mod writer;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::ArcSwap;
use pluglet_checkpoint::{CheckpointError, Durability};
use pluglet_core::error_chain;

use crate::metrics::Metrics;
use crate::pod_devices::PodDevices;
use disk::Disk;
pub use disk::NO_CHECKPOINT;
pub(crate) use requests::WriteRequests;
pub(crate) use writer::{SideSource, Snapshot};

/// File name of the side file in the state directory.
pub const SIDE_FILE_NAME: &str = "device-manager.json";

/// File name of the allocation journal in the state directory.
pub const JOURNAL_FILE_NAME: &str = "device-manager.journal";

/// Where the three files live.
#[derive(Clone, Debug)]
pub struct Paths {
    /// `kubelet_internal_checkpoint`.
    pub checkpoint: PathBuf,
    /// The side file.
    pub side: PathBuf,
    /// The journal.
    pub journal: PathBuf,
}

struct Inner {
    paths: Paths,
    durability: Durability,
    disk: tokio::sync::Mutex<Disk>,
    requests: WriteRequests,
    metrics: Metrics,
    /// The allocations as of the newest durable change (the state its journal record holds),
    /// for readers that must not take the allocator's lock ([`Persistence::acknowledged`]).
    acknowledged: ArcSwap<PodDevices>,
}

/// The files, the journal and the writer's bookkeeping (see the module doc). Cheap to clone.
#[derive(Clone)]
pub(crate) struct Persistence {
    inner: Arc<Inner>,
}

impl Persistence {
    /// The allocations as of the newest change made durable (reserved entries included, as
    /// they stood then): a shared, immutable copy, read without the allocator's lock.
    pub fn acknowledged(&self) -> Arc<PodDevices> {
        self.inner.acknowledged.load_full()
    }

    /// The handle for asking for checkpoint writes.
    pub fn requests(&self) -> WriteRequests {
        self.inner.requests.clone()
    }

    /// Makes a change to the allocations durable, then makes it: `change` is applied to a copy
    /// of `pods`'s entries ([`PodDevices::without_index`]) to write the journal record of the
    /// state after it, and once that record is on disk, to `pods` itself. On error `pods` is
    /// left as it was, so nothing that is not durable is ever acknowledged, held or shown to the
    /// checkpoint writer. `change` must do the same to both, so it must not depend on what the
    /// index says is held: it runs under the disk lock, which every change of allocated entries
    /// takes.
    /// Returns what `change` returned on `pods`; asks for a checkpoint write to follow.
    pub async fn change<T>(
        &self,
        pods: &Mutex<PodDevices>,
        mut change: impl FnMut(&mut PodDevices) -> T,
    ) -> Result<T, Arc<CheckpointError>> {
        let mut disk = self.inner.disk.lock().await;
        let (change_payload, next) = {
            let mut current = lock(pods);
            let mut next = current.without_index();
            let version = next.version();
            change(&mut next);
            if next.version() == version {
                // Nothing changes: nothing to record.
                return Ok(change(&mut current));
            }
            let touched = next.take_touched();
            (files::encode_change(&disk.on_disk, &next, &touched), next)
        };
        // On the caller's thread: one small in-place write and an `fdatasync` (~0.2 ms)
        // cost less than handing the runtime worker to another thread around them.
        let started = Instant::now();
        let result = disk
            .append_change(
                &self.inner.paths.journal,
                self.inner.durability,
                &change_payload,
            )
            .and_then(|written| {
                if written {
                    return Ok(());
                }
                // No room left after the newest whole record: a whole record of the state.
                let whole = files::encode_journal(&disk.on_disk, &next);
                disk.append(&self.inner.paths.journal, self.inner.durability, &whole)
            });
        self.inner
            .metrics
            .journal_write(result.is_ok(), started.elapsed());
        if result.is_ok() && self.inner.durability == Durability::Fsync {
            self.inner.metrics.journal_sync();
        }
        match result {
            Ok(()) => {
                let out = change(&mut lock(pods));
                // The copy the record was made from is the state now acknowledged; publishing
                // it costs nothing more (the one it replaces was dropped here before).
                self.inner.acknowledged.store(Arc::new(next));
                drop(disk);
                self.inner.requests.allocations_changed();
                Ok(out)
            }
            Err(err) => {
                // A failed append may have left the file as it was or not (a torn slot is
                // harmless: the other slot holds the previous record); open it again next time.
                tracing::error!(error = %error_chain(&err), "cannot write the allocation journal");
                Err(Arc::new(err))
            }
        }
    }
}

/// Locks a mutex whose holder cannot leave it half-changed (so a poisoned one is taken as is).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use pluglet_core::ResourceName;
    use pluglet_proto::v1beta1::ContainerAllocateResponse;
    use tokio_util::sync::CancellationToken;

    use super::files::SideState;
    use super::*;
    use crate::pod_devices::{HolderKey, Holding, HoldingState, group_by_numa};

    pub(crate) fn paths(dir: &Path) -> Paths {
        Paths {
            checkpoint: dir.join("kubelet_internal_checkpoint"),
            side: dir.join("state").join(SIDE_FILE_NAME),
            journal: dir.join(JOURNAL_FILE_NAME),
        }
    }

    pub(crate) fn allocate(pods: &mut PodDevices, pod: &str, device: &str) {
        pods.insert(
            HolderKey::new(pod, "ctr", "vendor.com/gpu"),
            Holding {
                devices: vec![device.into()],
                numa: group_by_numa([(device, &[0][..])]),
                state: HoldingState::Allocated {
                    response: ContainerAllocateResponse::default(),
                },
                pod: None,
            },
        );
    }

    /// The writer's snapshots of `pods` alone (no resources).
    pub(crate) fn source(
        pods: &Arc<Mutex<PodDevices>>,
    ) -> impl Fn(bool) -> Snapshot + Send + 'static {
        let pods = pods.clone();
        move |with_side| {
            let pods = pods.lock().unwrap().clone();
            let resources: BTreeMap<ResourceName, crate::devices::DeviceSet> = BTreeMap::new();
            let side = with_side.then(|| Box::new(SideState::default) as SideSource);
            (files::kubelet_data(resources.iter(), &pods), side)
        }
    }

    /// Commits, a checkpoint, another commit, and a crash: each open sees what was durable.
    #[tokio::test]
    async fn what_commit_returned_for_survives_a_crash_before_the_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let pods = Arc::new(Mutex::new(PodDevices::default()));
        let (persistence, restored) =
            Persistence::open(paths(dir.path()), Durability::NoFsync, Metrics::default()).unwrap();
        assert_eq!(restored.report.allocations, 0);
        let cancel = CancellationToken::new();
        let writer = tokio::spawn(
            persistence
                .clone()
                .run_writer(source(&pods), cancel.clone()),
        );
        persistence.write_now().await.unwrap();
        persistence
            .change(&pods, |p| allocate(p, "pod-1", "d0"))
            .await
            .unwrap();
        // The writer may or may not have caught up; stop it before the second commit, as a
        // crash would, so that only the journal holds pod-2.
        cancel.cancel();
        writer.await.unwrap();
        persistence
            .change(&pods, |p| allocate(p, "pod-2", "d1"))
            .await
            .unwrap();
        drop(persistence);

        let (_, restored) =
            Persistence::open(paths(dir.path()), Durability::NoFsync, Metrics::default()).unwrap();
        assert!(restored.report.from_journal);
        let held: Vec<String> = restored
            .pods
            .iter()
            .map(|(k, _)| k.pod_uid.to_string())
            .collect();
        assert_eq!(held, ["pod-1", "pod-2"]);
    }

    fn held(pods: &PodDevices) -> Vec<String> {
        pods.iter().map(|(k, _)| k.pod_uid.to_string()).collect()
    }

    /// Changes are written as what they changed, after a whole record; a start from a
    /// checkpoint newer than the journal writes a whole record first, so the journal never
    /// applies a change to a state that is not the one it was made on.
    #[tokio::test]
    async fn changes_after_a_whole_record_restore_the_state_they_were_made_on() {
        let dir = tempfile::tempdir().unwrap();
        let open = || {
            Persistence::open(paths(dir.path()), Durability::NoFsync, Metrics::default()).unwrap()
        };
        let journal = || pluglet_checkpoint::Journal::read(&paths(dir.path()).journal).unwrap();
        let (persistence, _) = open();
        let pods = Mutex::new(PodDevices::default());
        for (pod, device) in [("pod-1", "d0"), ("pod-2", "d1"), ("pod-3", "d2")] {
            persistence
                .change(&pods, |p| allocate(p, pod, device))
                .await
                .unwrap();
        }
        persistence
            .change(&pods, |p| p.release("pod-1", None))
            .await
            .unwrap();
        let record = journal().unwrap();
        assert_eq!(
            (record.seq, record.changes.len()),
            (4, 3),
            "a whole record, then three changes"
        );
        drop(persistence);
        let (_, restored) = open();
        assert!(restored.report.from_journal);
        assert_eq!(held(&restored.pods), ["pod-2", "pod-3"]);

        // A checkpoint the journal does not name (a kubelet's, say) wins at the next start.
        let foreign = {
            let mut p = PodDevices::default();
            allocate(&mut p, "pod-9", "d9");
            files::kubelet_data(std::iter::empty(), &p).encode()
        };
        std::fs::write(paths(dir.path()).checkpoint, foreign).unwrap();
        let (persistence, restored) = open();
        assert!(!restored.report.from_journal);
        assert_eq!(held(&restored.pods), ["pod-9"]);
        let pods = Mutex::new(restored.pods);
        persistence
            .change(&pods, |p| allocate(p, "pod-4", "d3"))
            .await
            .unwrap();
        let record = journal().unwrap();
        assert!(
            record.changes.is_empty(),
            "the first change of a start is a whole record"
        );
        persistence
            .change(&pods, |p| p.release("pod-9", None))
            .await
            .unwrap();
        assert_eq!(journal().unwrap().changes.len(), 1);
        drop(persistence);
        // The journal names that checkpoint and holds what was answered since.
        let (_, restored) = open();
        assert!(restored.report.from_journal);
        assert_eq!(held(&restored.pods), ["pod-4"]);
    }
}
