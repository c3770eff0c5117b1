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
//!   changes (about once per slot-size of changes), at a start whose restored state the
//!   journal does not hold, and after a failed write.
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
//!   a change the journal does not; the checksum that the journal names the checkpoint by is
//!   taken off that lock (see `writer.rs`).
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
mod group;
mod open;
mod requests;
pub mod restore;
mod writer;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pluglet_checkpoint::{CheckpointError, Durability};

use crate::metrics::Metrics;
use crate::pod_devices::{Change, PodDevices};
use disk::Disk;
pub use disk::NO_CHECKPOINT;
pub use requests::ALLOCATION_WRITE_DELAY;
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
    /// Stored by every group the journal writer commits, read now and then (the checkpoint
    /// writer, the pod-resources and admin listings): behind a mutex held only to swap or
    /// clone the `Arc`. An `ArcSwap`, whose store walks every thread's list of borrowed
    /// pointers, cost an allocation about 900 instructions more.
    acknowledged: Mutex<Arc<PodDevices>>,
    /// The changes waiting for the journal writer.
    queue: Mutex<group::Queue>,
    /// Wakes the journal writer.
    wake: tokio::sync::mpsc::Sender<()>,
    /// The journal writer's end of `wake`, until the first change starts it.
    writer: Mutex<Option<tokio::sync::mpsc::Receiver<()>>>,
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
        Arc::clone(&lock(&self.inner.acknowledged))
    }

    /// The handle for asking for checkpoint writes.
    pub fn requests(&self) -> WriteRequests {
        self.inner.requests.clone()
    }

    /// Makes a change to the allocations durable, then makes it: `change` is applied to a copy
    /// of `pods`'s entries ([`PodDevices::without_index`]) with every change still waiting for
    /// the disk already made on it, and the change is queued for the journal writer
    /// ([`group`]). Once its record is on disk (with those of the changes queued beside it:
    /// one `fdatasync` for all), the entries it touched are made so in `pods`, in the order the
    /// changes were queued. On error `pods` is left as it was, so nothing that is not durable
    /// is ever acknowledged, held or shown to the checkpoint writer; the caller undoes what it
    /// reserved. `change` must not depend on what the index says is held: the copy has none.
    /// Returns what `change` returned; asks for a checkpoint write to follow.
    pub async fn change<T>(
        &self,
        pods: &Arc<Mutex<PodDevices>>,
        change: impl FnOnce(&mut PodDevices) -> T,
    ) -> Result<T, Arc<CheckpointError>> {
        let made = {
            let mut queue = lock(&self.inner.queue);
            let mut next = queue.pending(pods);
            let version = next.version();
            let out = change(&mut next);
            Made::queue(&mut queue, pods, version, next, out)
        };
        self.answered(made).await
    }

    /// [`Persistence::change`], with `change` also shown the state itself (locked while it
    /// runs, with its index) and what the changes still waiting for the disk did, by key,
    /// sorted: the copy's entries are the state's but for those keys. For a change that finds
    /// what it changes faster by the state's index than by the copy's entries (a sync of pods
    /// walks the held pods).
    pub async fn change_beside<T>(
        &self,
        pods: &Arc<Mutex<PodDevices>>,
        change: impl FnOnce(&PodDevices, &[Change], &mut PodDevices) -> T,
    ) -> Result<T, Arc<CheckpointError>> {
        let made = {
            let mut queue = lock(&self.inner.queue);
            let state = lock(pods);
            let (mut next, waiting) = queue.pending_from(&state);
            let version = next.version();
            let out = change(&state, &waiting, &mut next);
            drop(state);
            Made::queue(&mut queue, pods, version, next, out)
        };
        self.answered(made).await
    }

    /// Waits for a change's answer, once the writer runs.
    async fn answered<T>(&self, made: Made<T>) -> Result<T, Arc<CheckpointError>> {
        let (out, answered) = match made {
            Made::Nothing(out) => return Ok(out),
            Made::Queued(out, answered) => (out, answered),
        };
        self.start_writer();
        group::wake(&self.inner.wake);
        match answered.await {
            Ok(Ok(())) => Ok(out),
            Ok(Err(err)) => Err(err),
            Err(_) => Err(Arc::new(CheckpointError::Write {
                path: self.inner.paths.journal.clone(),
                step: "hand the record to the journal writer",
                source: std::io::Error::other(
                    "the journal writer stopped (the daemon is stopping)",
                ),
            })),
        }
    }

    /// Starts the journal writer on the current runtime, once.
    fn start_writer(&self) {
        let woken = lock(&self.inner.writer).take();
        if let Some(woken) = woken {
            tokio::spawn(group::run(Arc::downgrade(&self.inner), woken));
        }
    }
}

/// A change made on the pending copy: nothing to wait for, or queued for the writer.
enum Made<T> {
    /// It changed nothing, and nothing it saw is waiting for the disk.
    Nothing(T),
    /// Queued: its answer comes once its record is durable.
    Queued(T, tokio::sync::oneshot::Receiver<group::Answer>),
}

impl<T> Made<T> {
    /// Queues `next` (the copy `out`'s change was made on, at `version` before it) unless it
    /// changed nothing and nothing waits.
    fn queue(
        queue: &mut group::Queue,
        pods: &Arc<Mutex<PodDevices>>,
        version: u64,
        next: PodDevices,
        out: T,
    ) -> Made<T> {
        if next.version() == version && queue.is_empty() {
            return Made::Nothing(out);
        }
        Made::Queued(out, queue.push(pods, version, next))
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
    use crate::answer::PluginAnswer;
    use crate::keep_list::KeepList;
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
                devices: vec![device.into()].into(),
                numa: group_by_numa([(device, &[0][..])]).into(),
                state: HoldingState::Allocated {
                    answer: PluginAnswer::of(&ContainerAllocateResponse::default()),
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
            (files::KubeletCheckpoint::of(resources.iter(), pods), side)
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

    /// The checkpoint's checksum is taken off the disk lock, so changes commit while it
    /// runs: a checkpoint whose snapshot lacks them is named by a record after them before it
    /// is written, and a process that dies with that checkpoint in place loses none of them.
    #[tokio::test]
    async fn a_checkpoint_taken_before_a_change_never_wins_over_it() {
        let dir = tempfile::tempdir().unwrap();
        let open = || {
            Persistence::open(paths(dir.path()), Durability::NoFsync, Metrics::default()).unwrap()
        };
        let changes = || {
            pluglet_checkpoint::Journal::read(&paths(dir.path()).journal)
                .unwrap()
                .unwrap()
                .changes
                .len()
        };
        let (persistence, _) = open();
        let pods = Arc::new(Mutex::new(PodDevices::default()));
        persistence
            .change(&pods, |p| allocate(p, "pod-1", "d0"))
            .await
            .unwrap();

        // The writer's steps: a snapshot, its checksum (with `meanwhile` committed before it
        // is taken), the journal made to name it; returns the snapshot, its checksum and how
        // many records naming it were added.
        let take_and_name = |meanwhile: Option<(&'static str, &'static str)>| {
            let (persistence, pods, changes) = (&persistence, &pods, &changes);
            async move {
                let records = persistence.inner.disk.lock().await.records;
                let (data, _) = source(pods)(false);
                if let Some((pod, device)) = meanwhile {
                    persistence
                        .change(pods, |p| allocate(p, pod, device))
                        .await
                        .unwrap();
                }
                let checksum = data.checksum();
                let before = changes();
                persistence.name(checksum, records).await.unwrap();
                (data, checksum, changes() - before)
            }
        };
        let (_, _, added) = take_and_name(None).await;
        assert_eq!(
            added, 0,
            "nothing committed since the snapshot: no record added"
        );
        persistence
            .change(&pods, |p| allocate(p, "pod-2", "d1"))
            .await
            .unwrap();
        let (data, checksum, added) = take_and_name(Some(("pod-3", "d2"))).await;
        assert_eq!(
            added, 1,
            "pod-3 committed since the snapshot: a record naming it"
        );
        // The checkpoint lands, and the process dies before another record is written.
        std::fs::write(paths(dir.path()).checkpoint, data.encode(checksum)).unwrap();
        drop(persistence);

        let (_, restored) = open();
        assert!(restored.report.from_journal);
        assert_eq!(held(&restored.pods), ["pod-1", "pod-2", "pod-3"]);
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
        let pods = Arc::new(Mutex::new(PodDevices::default()));
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
            (5, 4),
            "the whole record the start wrote, then four changes"
        );
        drop(persistence);
        let (_, restored) = open();
        assert!(restored.report.from_journal);
        assert_eq!(held(&restored.pods), ["pod-2", "pod-3"]);

        // A checkpoint the journal does not name (a kubelet's, say) wins at the next start.
        let foreign = {
            let mut p = PodDevices::default();
            allocate(&mut p, "pod-9", "d9");
            files::tests::kubelet_data(std::iter::empty(), &p).encode()
        };
        std::fs::write(paths(dir.path()).checkpoint, foreign).unwrap();
        let (persistence, restored) = open();
        assert!(!restored.report.from_journal);
        assert_eq!(held(&restored.pods), ["pod-9"]);
        let pods = Arc::new(Mutex::new(restored.pods));
        let record = journal().unwrap();
        assert!(
            record.changes.is_empty(),
            "a start writes the state it restored as a whole record"
        );
        persistence
            .change(&pods, |p| allocate(p, "pod-4", "d3"))
            .await
            .unwrap();
        assert_eq!(journal().unwrap().changes.len(), 1, "changes follow it");
        persistence
            .change(&pods, |p| p.release("pod-9", None))
            .await
            .unwrap();
        assert_eq!(journal().unwrap().changes.len(), 2);
        drop(persistence);
        // The journal names that checkpoint and holds what was answered since.
        let (_, restored) = open();
        assert!(restored.report.from_journal);
        assert_eq!(held(&restored.pods), ["pod-4"]);
    }

    /// Changes ready while the writer is busy are made durable together, by one `fdatasync`,
    /// in the order they were made; each caller hears only once that sync has returned, and
    /// every change is in the state and in the journal afterwards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn changes_ready_together_share_one_sync() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Metrics::default();
        let mut registry = prometheus_client::registry::Registry::default();
        metrics.register(&mut registry);
        let syncs = || {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
            text.lines()
                .find_map(|l| l.strip_prefix("pluglet_journal_syncs_total "))
                .map(|v| v.trim().parse::<u64>().unwrap())
                .unwrap()
        };
        let (persistence, _) =
            Persistence::open(paths(dir.path()), Durability::Fsync, metrics.clone()).unwrap();
        assert_eq!(syncs(), 1, "the start's whole record");
        let pods = Arc::new(Mutex::new(PodDevices::default()));
        persistence
            .change(&pods, |p| allocate(p, "pod-0", "d0"))
            .await
            .unwrap();
        assert_eq!(syncs(), 2);

        // The writer is kept busy (the disk lock held, as during a sync) while 16 changes
        // are made; none is answered or in the state before their sync.
        let busy = persistence.inner.disk.lock().await;
        let changes: Vec<_> = (1..=16)
            .map(|i| {
                let (persistence, pods) = (persistence.clone(), pods.clone());
                tokio::spawn(async move {
                    persistence
                        .change(&pods, |p| {
                            allocate(p, &format!("pod-{i}"), &format!("d{i}"))
                        })
                        .await
                })
            })
            .collect();
        while lock(&persistence.inner.queue).changes_len() < 16 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            held(&lock(&pods)),
            ["pod-0"],
            "nothing is held before it is durable"
        );
        assert!(changes.iter().all(|c| !c.is_finished()));
        drop(busy);
        for change in changes {
            change.await.unwrap().unwrap();
        }
        assert_eq!(syncs(), 3, "one sync for the 16 changes");
        assert_eq!(lock(&pods).iter().count(), 17);
        assert_eq!(persistence.acknowledged().iter().count(), 17);
        drop(persistence);
        let (_, restored) =
            Persistence::open(paths(dir.path()), Durability::Fsync, Metrics::default()).unwrap();
        assert!(restored.report.from_journal);
        assert_eq!(restored.pods.iter().count(), 17);
    }

    /// A change made beside the state sees, with the state, the keys of the changes still
    /// waiting for the disk: a sync of pods that finds the held pods by the state's index
    /// frees a pod whose allocation is queued and not yet in the state.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_change_beside_the_state_sees_the_changes_waiting_for_the_disk() {
        let dir = tempfile::tempdir().unwrap();
        let (persistence, _) =
            Persistence::open(paths(dir.path()), Durability::NoFsync, Metrics::default()).unwrap();
        let pods = Arc::new(Mutex::new(PodDevices::default()));
        persistence
            .change(&pods, |p| allocate(p, "pod-0", "d0"))
            .await
            .unwrap();

        let busy = persistence.inner.disk.lock().await;
        let queued = {
            let (persistence, pods) = (persistence.clone(), pods.clone());
            tokio::spawn(async move {
                persistence
                    .change(&pods, |p| allocate(p, "pod-1", "d1"))
                    .await
            })
        };
        while lock(&persistence.inner.queue).changes_len() < 1 {
            tokio::task::yield_now().await;
        }
        let sync = {
            let (persistence, pods) = (persistence.clone(), pods.clone());
            tokio::spawn(async move {
                let keep = KeepList::from_iter(["pod-0"]);
                persistence
                    .change_beside(&pods, |state, waiting, next| {
                        let held: Vec<String> =
                            state.iter().map(|(k, _)| k.pod_uid.to_string()).collect();
                        let keys = next.not_kept_beside(state, waiting, &keep);
                        let freed: Vec<String> = next
                            .release_keys(keys)
                            .into_iter()
                            .map(|(k, _)| k.pod_uid.to_string())
                            .collect();
                        let waiting: Vec<HolderKey> =
                            waiting.iter().map(|c| c.key().clone()).collect();
                        (held, waiting, freed)
                    })
                    .await
            })
        };
        while lock(&persistence.inner.queue).changes_len() < 2 {
            tokio::task::yield_now().await;
        }
        drop(busy);
        queued.await.unwrap().unwrap();
        let (held_then, waiting, freed) = sync.await.unwrap().unwrap();
        assert_eq!(held_then, ["pod-0"], "pod-1 was not in the state yet");
        assert_eq!(waiting, [HolderKey::new("pod-1", "ctr", "vendor.com/gpu")]);
        assert_eq!(freed, ["pod-1"]);
        assert_eq!(held(&lock(&pods)), ["pod-0"]);
    }
}
