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
//!   in-place write and an `fdatasync`).
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

pub mod files;
pub mod restore;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use pluglet_checkpoint::{
    CheckpointData, CheckpointError, Durability, Journal, LoadOutcome, PodDevicesEntry,
};
use pluglet_core::error_chain;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::pod_devices::PodDevices;
use files::SideState;
use restore::{Files, Found, Restored, SetAside};

/// File name of the side file in the state directory.
pub const SIDE_FILE_NAME: &str = "device-manager.json";

/// File name of the allocation journal in the state directory.
pub const JOURNAL_FILE_NAME: &str = "device-manager.journal";

/// The checkpoint writer fsyncs the directory (making its renames survive a power cut) after
/// this many renames.
const DIR_SYNC_AFTER: usize = 4;

/// How many checkpoint files a journal record names at most (more only while writes keep
/// failing).
const MAX_ON_DISK: usize = 16;

/// How long allocations and releases must have been quiet before the checkpoint writer is woken
/// for them. They are durable in the journal already; waiting makes a burst of them one write,
/// keeps the write's fsyncs from queueing on the disk ahead of the next allocation's journal
/// record, and keeps the writer thread's wake-up off the allocation's path. A device change, a
/// caller waiting for the write, or shutdown wakes it sooner.
const ALLOCATION_WRITE_DELAY: Duration = Duration::from_millis(20);

/// The longest a steady stream of allocations and releases (never quiet for
/// [`ALLOCATION_WRITE_DELAY`]) keeps the checkpoint writer waiting after the first change it has
/// not written: the kubelet-format checkpoint never lags the journal by more.
const ALLOCATION_WRITE_MAX: Duration = Duration::from_secs(1);

/// The first retry of a failed checkpoint write comes after this long; each next one after
/// twice as long, up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(500);

/// The longest wait between retries of a failed checkpoint write.
const RETRY_MAX: Duration = Duration::from_secs(10);

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

/// The durable side of the state, behind one async mutex so that a journal record and the
/// checkpoint writer's snapshots are ordered: a record taken after a snapshot names that
/// snapshot's file, and a snapshot never sees a change whose record is not on disk yet.
#[derive(Debug)]
pub(crate) struct Disk {
    /// The allocation journal; `None` while it cannot be opened for writing (a read-only state
    /// directory, say): every change tries again, and is refused until it can be.
    pub journal: Option<Journal>,
    /// Kubelet checksums of the checkpoint files that may be in place if the process dies now:
    /// the one found at start or last written, and any being written (or that failed to be)
    /// since. [`NO_CHECKPOINT`] stands for "no file".
    pub on_disk: Vec<u64>,
    /// Renames since the last directory fsync.
    pub unsynced: usize,
}

/// What a journal record names for "no checkpoint file in place" (a kubelet checksum is a
/// 32-bit FNV value, so it never equals this).
pub const NO_CHECKPOINT: u64 = u64::MAX;

impl Disk {
    /// A snapshot with this checksum is about to be written.
    pub fn writing(&mut self, checksum: u64) {
        self.on_disk.push(checksum);
        if self.on_disk.len() > MAX_ON_DISK {
            self.on_disk.remove(0);
        }
    }

    /// The file with this checksum is in place: earlier ones are gone.
    pub fn written(&mut self, checksum: u64) {
        self.on_disk.clear();
        self.on_disk.push(checksum);
        self.unsynced += 1;
    }

    /// Whether the writer should fsync the directory now.
    pub fn needs_dir_sync(&self) -> bool {
        self.unsynced >= DIR_SYNC_AFTER
    }

    /// Writes `payload` as the journal's newest record, opening the journal first if it is not
    /// open (it could not be at start, or a previous attempt failed).
    fn append(
        &mut self,
        path: &Path,
        durability: Durability,
        payload: &[u8],
    ) -> Result<(), CheckpointError> {
        if self.journal.is_none() {
            let opened = Journal::open(path, durability)?;
            if let Some(moved_to) = &opened.set_aside {
                tracing::warn!(
                    path = %path.display(),
                    moved_to = %moved_to.display(),
                    "the allocation journal was not a journal any more; kept aside, starting a new one"
                );
            }
            tracing::info!(path = %path.display(), "allocation journal open for writing again");
            self.journal = Some(opened.journal);
        }
        match &mut self.journal {
            Some(journal) => journal.append(payload),
            None => unreachable!("opened above"),
        }
    }
}

/// The outcome of the latest write.
#[derive(Clone, Debug, Default)]
struct Written {
    /// Every change requested up to this number is on disk (or failed with `error`).
    seq: u64,
    /// The write's error, if it failed.
    error: Option<Arc<CheckpointError>>,
}

/// Coalesces write requests for the writer.
#[derive(Debug)]
struct Requests {
    requested: AtomicU64,
    /// Devices changed since the side file was last written (allocations alone leave it as is).
    devices_changed: AtomicBool,
    /// A delayed wake of the writer is pending.
    wake_armed: AtomicBool,
    /// When allocations last changed (the delayed wake waits until they have been quiet).
    last_allocation_change: Mutex<tokio::time::Instant>,
    wake: Notify,
    written: watch::Sender<Written>,
}

/// A pending delayed wake of the writer: wakes it when dropped, also when its timer task is
/// dropped unfinished (a runtime shutting down), so a wake is never lost.
struct DelayedWake(Arc<Requests>);

impl Drop for DelayedWake {
    fn drop(&mut self) {
        self.0.wake_armed.store(false, Ordering::SeqCst);
        self.0.wake.notify_one();
    }
}

/// The narrow handle the parts that change the state hold: they ask for a checkpoint write
/// after a change (with their own lock released), nothing more.
#[derive(Clone, Debug)]
pub(crate) struct WriteRequests(Arc<Requests>);

impl WriteRequests {
    /// Requests with no write done yet.
    pub(crate) fn new() -> WriteRequests {
        WriteRequests(Arc::new(Requests {
            requested: AtomicU64::new(0),
            devices_changed: AtomicBool::new(false),
            wake_armed: AtomicBool::new(false),
            last_allocation_change: Mutex::new(tokio::time::Instant::now()),
            wake: Notify::new(),
            written: watch::Sender::new(Written::default()),
        }))
    }

    /// Asks for a write of the checkpoint (allocations changed), made once allocations have been
    /// quiet for `ALLOCATION_WRITE_DELAY`, at the latest `ALLOCATION_WRITE_MAX` after the first
    /// change not yet written; returns its number.
    pub fn allocations_changed(&self) -> u64 {
        let seq = self.0.requested.fetch_add(1, Ordering::SeqCst) + 1;
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let now = tokio::time::Instant::now();
                *lock(&self.0.last_allocation_change) = now;
                if !self.0.wake_armed.swap(true, Ordering::SeqCst) {
                    let wake = DelayedWake(self.0.clone());
                    let latest = now + ALLOCATION_WRITE_MAX;
                    runtime.spawn(async move {
                        loop {
                            let quiet =
                                *lock(&wake.0.last_allocation_change) + ALLOCATION_WRITE_DELAY;
                            let due = quiet.min(latest);
                            if tokio::time::Instant::now() >= due {
                                break;
                            }
                            tokio::time::sleep_until(due).await;
                        }
                        drop(wake);
                    });
                }
            }
            Err(_) => self.0.wake.notify_one(),
        }
        seq
    }

    /// Asks for a write of both files (devices or resources changed) at once; returns its
    /// number.
    pub fn devices_changed(&self) -> u64 {
        self.0.devices_changed.store(true, Ordering::SeqCst);
        let seq = self.0.requested.fetch_add(1, Ordering::SeqCst) + 1;
        self.0.wake.notify_one();
        seq
    }

    /// The number of the latest request.
    pub fn requested(&self) -> u64 {
        self.0.requested.load(Ordering::SeqCst)
    }

    /// Waits until the write covering request `seq` is done (waking the writer at once).
    pub async fn flush(&self, seq: u64) -> Result<(), Arc<CheckpointError>> {
        let mut rx = self.0.written.subscribe();
        if rx.borrow().seq < seq {
            self.0.wake.notify_one();
        }
        let written = rx
            .wait_for(|w| w.seq >= seq)
            .await
            .map(|w| w.clone())
            .unwrap_or_default();
        match written.error {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Writer side: waits for a request newer than the last write; returns its number.
    async fn next_request(&self) -> u64 {
        loop {
            let target = self.0.requested.load(Ordering::SeqCst);
            if target > self.0.written.borrow().seq {
                return target;
            }
            self.0.wake.notified().await;
        }
    }

    /// Writer side: whether requests are waiting.
    fn pending(&self) -> bool {
        self.0.requested.load(Ordering::SeqCst) > self.0.written.borrow().seq
    }

    /// Writer side: whether the side file must be written too; clears the flag.
    fn take_devices_changed(&self) -> bool {
        self.0.devices_changed.swap(false, Ordering::SeqCst)
    }

    /// Writer side: records the outcome of the write covering `seq`.
    fn done(&self, seq: u64, error: Option<CheckpointError>) {
        self.0.written.send_replace(Written {
            seq,
            error: error.map(Arc::new),
        });
    }
}

/// What the writer writes: the kubelet checkpoint, and the side file when asked for. The side
/// file comes as a function that builds it from what the snapshot took (shared device sets), so
/// that it is built after the disk lock is released.
pub(crate) type Snapshot = (CheckpointData, Option<SideSource>);

/// Builds the side file's content of a snapshot.
pub(crate) type SideSource = Box<dyn FnOnce() -> SideState + Send>;

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
        let persistence = Persistence {
            inner: Arc::new(Inner {
                acknowledged: ArcSwap::from_pointee(restored.pods.without_index()),
                paths,
                durability,
                metrics,
                disk: tokio::sync::Mutex::new(Disk {
                    journal,
                    on_disk,
                    unsynced: 0,
                }),
                requests: WriteRequests::new(),
            }),
        };
        Ok((persistence, restored))
    }

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
        let (payload, next) = {
            let mut current = lock(pods);
            let mut next = current.without_index();
            let version = next.version();
            change(&mut next);
            if next.version() == version {
                // Nothing changes: nothing to record.
                return Ok(change(&mut current));
            }
            (files::encode_journal(&disk.on_disk, &next), next)
        };
        // On the caller's thread: one small in-place write and an `fdatasync` (~0.2 ms)
        // cost less than handing the runtime worker to another thread around them.
        let started = Instant::now();
        let result = disk.append(&self.inner.paths.journal, self.inner.durability, &payload);
        self.inner
            .metrics
            .journal_write(result.is_ok(), started.elapsed());
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

    /// Writes the current state at once and makes it survive a power cut (the first write of
    /// a start); the writer must be running.
    pub async fn write_now(&self) -> Result<(), Arc<CheckpointError>> {
        let seq = self.inner.requests.devices_changed();
        self.inner.requests.flush(seq).await?;
        self.sync_dirs().await.map_err(Arc::new)
    }

    /// The writer: one write per batch of requests, and a last one when `cancel` fires.
    /// `snapshot(with_side)` takes the state to write. Its file writes block the thread it
    /// runs on: the device manager runs it on a thread of its own ([`Persistence::spawn_writer`]),
    /// so that the fsyncs of a checkpoint write never hold a runtime worker while the answer to
    /// the change that asked for it is on its way.
    pub async fn run_writer(
        self,
        snapshot: impl Fn(bool) -> Snapshot + Send,
        cancel: CancellationToken,
    ) {
        let requests = &self.inner.requests;
        // After a failed write (a full disk, say), the next attempt comes without waiting for a
        // change, sooner at first: the checkpoint catches up once the cause is gone.
        let mut retry: Option<Duration> = None;
        loop {
            tokio::select! {
                _ = requests.next_request() => {}
                _ = tokio::time::sleep(retry.unwrap_or_default()), if retry.is_some() => {
                    requests.devices_changed();
                }
                _ = cancel.cancelled() => {
                    if !requests.pending() {
                        break;
                    }
                }
            };
            // Every request so far is covered by the snapshot taken below.
            let target = requests.requested();
            let with_side = requests.take_devices_changed();
            let (bytes, checksum, side) = {
                // Under the disk lock, so a journal record made after this snapshot names it.
                let mut disk = self.inner.disk.lock().await;
                let (data, side) = snapshot(with_side);
                let (bytes, checksum) = data.encode_with_checksum();
                disk.writing(checksum);
                (bytes, checksum, side)
            };
            let paths = &self.inner.paths;
            let started = Instant::now();
            let result = files::write_files(
                &paths.checkpoint,
                &paths.side,
                &bytes,
                side,
                self.inner.durability,
            );
            self.inner
                .metrics
                .checkpoint_write(result.is_ok(), started.elapsed());
            let result = match result {
                Ok(()) => {
                    let sync = {
                        let mut disk = self.inner.disk.lock().await;
                        disk.written(checksum);
                        disk.needs_dir_sync()
                    };
                    if sync { self.sync_dirs().await } else { Ok(()) }
                }
                Err(err) => Err(err),
            };
            retry = match &result {
                Ok(()) => None,
                Err(err) => {
                    let next = retry.map_or(RETRY_FIRST, |r| (r * 2).min(RETRY_MAX));
                    tracing::error!(
                        error = %error_chain(err),
                        retry_in = ?next,
                        "cannot write the device manager checkpoint"
                    );
                    Some(next)
                }
            };
            requests.done(target, result.err());
        }
        if self.inner.disk.lock().await.unsynced > 0
            && let Err(err) = self.sync_dirs().await
        {
            tracing::error!(error = %error_chain(&err), "cannot sync the device manager checkpoint");
        }
    }

    /// Runs [`Persistence::run_writer`] on a thread of its own (driving it with the current
    /// runtime's handle); returns a future that ends when the writer does (`Err` if its thread
    /// panicked), for the caller to keep, so waiting for it waits for the last write.
    pub fn spawn_writer(
        &self,
        snapshot: impl Fn(bool) -> Snapshot + Send + 'static,
        cancel: CancellationToken,
    ) -> std::io::Result<impl std::future::Future<Output = Result<(), String>> + Send + 'static>
    {
        let runtime = tokio::runtime::Handle::current();
        let writer = self.clone().run_writer(snapshot, cancel);
        let (done, ended) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("checkpoint-writer".into())
            .spawn(move || {
                runtime.block_on(writer);
                let _ = done.send(());
            })?;
        Ok(async move {
            ended
                .await
                .map_err(|_| "the checkpoint writer's thread panicked".to_owned())
        })
    }

    /// Fsyncs the directories of the checkpoint and the side file, so that the renames so far
    /// survive a power cut.
    async fn sync_dirs(&self) -> Result<(), CheckpointError> {
        let paths = &self.inner.paths;
        if self.inner.durability == Durability::Fsync {
            pluglet_handler_runtime::run_in_place(|| {
                pluglet_checkpoint::sync_parent(&paths.checkpoint)?;
                pluglet_checkpoint::sync_parent(&paths.side)
            })?;
        }
        self.inner.disk.lock().await.unsynced = 0;
        Ok(())
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

/// Locks a mutex whose holder cannot leave it half-changed (so a poisoned one is taken as is).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
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

    use pluglet_core::ResourceName;
    use pluglet_proto::v1beta1::ContainerAllocateResponse;

    use super::*;
    use crate::pod_devices::{Entry, EntryState, HolderKey, group_by_numa};

    fn paths(dir: &Path) -> Paths {
        Paths {
            checkpoint: dir.join("kubelet_internal_checkpoint"),
            side: dir.join("state").join(SIDE_FILE_NAME),
            journal: dir.join(JOURNAL_FILE_NAME),
        }
    }

    fn allocate(pods: &mut PodDevices, pod: &str, device: &str) {
        pods.insert(
            HolderKey::new(pod, "ctr", "vendor.com/gpu"),
            Entry {
                devices: vec![device.into()],
                numa: group_by_numa([(device, &[0][..])]),
                state: EntryState::Allocated {
                    response: ContainerAllocateResponse::default(),
                },
                pod: None,
            },
        );
    }

    /// The writer's snapshots of `pods` alone (no resources).
    fn source(pods: &Arc<Mutex<PodDevices>>) -> impl Fn(bool) -> Snapshot + Send + 'static {
        let pods = pods.clone();
        move |with_side| {
            let pods = pods.lock().unwrap().clone();
            let resources: BTreeMap<ResourceName, crate::devices::DeviceSet> = BTreeMap::new();
            let side = with_side.then(|| Box::new(SideState::default) as SideSource);
            (files::kubelet_data(resources.iter(), &pods), side)
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_writer_thread_writes_the_last_change_before_its_tasks_end() {
        let dir = tempfile::tempdir().unwrap();
        let pods = Arc::new(Mutex::new(PodDevices::default()));
        let (persistence, _) =
            Persistence::open(paths(dir.path()), Durability::NoFsync, Metrics::default()).unwrap();
        let cancel = CancellationToken::new();
        let tasks = tokio_util::task::TaskTracker::new();
        tasks.spawn(
            persistence
                .spawn_writer(source(&pods), cancel.clone())
                .unwrap(),
        );
        persistence.write_now().await.unwrap();
        persistence
            .change(&pods, |p| allocate(p, "pod-1", "d0"))
            .await
            .unwrap();
        cancel.cancel();
        tasks.close();
        tasks.wait().await;
        let written = pluglet_checkpoint::load(&paths(dir.path()).checkpoint)
            .unwrap()
            .expect("a checkpoint");
        let held: Vec<String> = written
            .pod_device_entries
            .unwrap_or_default()
            .into_iter()
            .map(|e| e.pod_uid)
            .collect();
        assert_eq!(held, ["pod-1"]);
    }

    #[test]
    fn a_record_names_the_file_in_place_and_the_one_being_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut disk = Disk {
            journal: Some(
                Journal::open(&dir.path().join("j"), Durability::NoFsync)
                    .unwrap()
                    .journal,
            ),
            on_disk: Vec::new(),
            unsynced: 0,
        };
        disk.writing(1);
        disk.written(1);
        disk.writing(2);
        assert_eq!(disk.on_disk, [1, 2], "a crash now leaves either in place");
        disk.written(2);
        assert_eq!(
            disk.on_disk,
            [2],
            "file 1 is gone for good once 2 is in place"
        );
        disk.writing(3);
        disk.writing(4);
        assert_eq!(disk.on_disk, [2, 3, 4], "a failed write stays named");
        assert!(!disk.needs_dir_sync());
        disk.written(4);
        disk.written(4);
        disk.written(4);
        assert!(disk.needs_dir_sync(), "every fourth rename");
    }

    #[test]
    fn a_delayed_wake_dropped_with_its_runtime_still_wakes_the_writer() {
        let requests = WriteRequests::new();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        runtime.block_on(async {
            requests.allocations_changed();
        });
        assert!(
            requests.0.wake_armed.load(Ordering::SeqCst),
            "a wake is pending"
        );
        drop(runtime);
        assert!(!requests.0.wake_armed.load(Ordering::SeqCst), "disarmed");
        let woken = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(async {
                tokio::select! {
                    biased;
                    _ = requests.0.wake.notified() => true,
                    _ = std::future::ready(()) => false,
                }
            });
        assert!(woken, "the writer's wake was not lost");
    }

    /// Whether the writer has been woken since the last look (takes the wake).
    async fn woken(requests: &WriteRequests) -> bool {
        tokio::select! {
            biased;
            _ = requests.0.wake.notified() => true,
            _ = std::future::ready(()) => false,
        }
    }

    /// Elapsed paused time since `start`, in whole milliseconds.
    fn ms_since(start: tokio::time::Instant) -> u128 {
        start.elapsed().as_millis()
    }

    #[tokio::test(start_paused = true)]
    async fn the_writer_is_woken_once_allocations_are_quiet() {
        let requests = WriteRequests::new();
        let start = tokio::time::Instant::now();
        requests.allocations_changed();
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            assert!(
                !woken(&requests).await,
                "woken at {} ms while allocations kept changing every 10 ms",
                ms_since(start)
            );
            requests.allocations_changed();
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
        assert!(!woken(&requests).await, "woken before 20 quiet ms");
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(woken(&requests).await, "not woken after 25 quiet ms");
        assert!(!requests.0.wake_armed.load(Ordering::SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn a_steady_stream_of_allocations_wakes_the_writer_once_a_second() {
        let requests = WriteRequests::new();
        let start = tokio::time::Instant::now();
        requests.allocations_changed();
        let mut wakes = Vec::new();
        for _ in 0..250 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            if woken(&requests).await {
                wakes.push(ms_since(start));
            }
            requests.allocations_changed();
        }
        assert_eq!(wakes.len(), 2, "wakes at {wakes:?} ms");
        assert!(
            (1000..=1010).contains(&wakes[0]),
            "first wake {} ms after the first change, not at the latest 1 s",
            wakes[0]
        );
        assert!(
            (2000..=2020).contains(&wakes[1]),
            "second wake {} ms after the start, not 1 s after the first change it did not cover",
            wakes[1]
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
        assert!(woken(&requests).await, "the stream's end wakes the writer");
    }

    #[tokio::test]
    async fn flush_waits_for_the_covering_write() {
        let requests = WriteRequests::new();
        let seq = requests.allocations_changed();
        let writer = {
            let requests = requests.clone();
            tokio::spawn(async move {
                let target = requests.next_request().await;
                requests.done(target, None);
            })
        };
        requests.flush(seq).await.unwrap();
        writer.await.unwrap();
        assert!(!requests.pending());
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
                let data = files::kubelet_data(resources.iter(), &pods.lock().unwrap());
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
            "the journal untouched"
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
