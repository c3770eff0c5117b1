//! The checkpoint writer: the kubelet checkpoint and the side file written by one task on a
//! thread of its own, one write per batch of requests ([`super::WriteRequests`]), retried after
//! a failure, with a last write when the device manager stops.
//!
//! One write: the snapshot, under the disk lock (a copy of the state's map and device sets);
//! its kubelet checksum, off the lock (it renders the whole state: about 3 ms with 10,000
//! allocations, during which allocations commit); the journal made to name that checksum,
//! under the lock again ([`Persistence::name`]: one more record, only if some were written
//! since the snapshot); then the file's bytes and the writes, off the lock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pluglet_checkpoint::{CheckpointError, Durability};
use pluglet_core::error_chain;
use tokio_util::sync::CancellationToken;

use super::Persistence;
use super::files::{self, KubeletCheckpoint, SideState};
use crate::error::WriterError;

/// The first retry of a failed checkpoint write comes after this long; each next one after
/// twice as long, up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(500);

/// The longest wait between retries of a failed checkpoint write.
const RETRY_MAX: Duration = Duration::from_secs(10);

/// What the writer writes: the kubelet checkpoint, and the side file when asked for. The side
/// file comes as a function that builds it from what the snapshot took (shared device sets), so
/// that it is built after the disk lock is released; so are the checkpoint's bytes (only its
/// checksum is needed under the lock).
pub(crate) type Snapshot = (KubeletCheckpoint, Option<SideSource>);

/// Builds the side file's content of a snapshot.
pub(crate) type SideSource = Box<dyn FnOnce() -> SideState + Send>;

impl Persistence {
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
            let (data, side, records) = {
                // Under the disk lock, so that it holds every change whose record is on disk
                // and none whose record is not; with the records written before it.
                let disk = self.inner.disk.lock().await;
                let (data, side) = snapshot(with_side);
                (data, side, disk.records)
            };
            let checksum = data.checksum();
            let result = self
                .name(checksum, records)
                .await
                .and_then(|()| self.write_snapshot(data, checksum, side));
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
            // Done until the next request: a large checkpoint's snapshot and bytes were freed here.
            pluglet_core::idle::going_idle();
        }
        if self.inner.disk.lock().await.unsynced > 0
            && let Err(err) = self.sync_dirs().await
        {
            tracing::error!(error = %error_chain(&err), "cannot sync the device manager checkpoint");
        }
    }

    /// Makes the journal name the checkpoint with `checksum`, before it is written, for a
    /// snapshot taken after `records` journal records: every record from now on
    /// names it, and if records were written since the snapshot (changes it lacks), one more
    /// record that changes nothing names it too and is made durable. Without that, a process
    /// that died with this checkpoint in place would leave a newest record not naming it, and
    /// the checkpoint, lacking those changes, would win at the next start (`restore.rs`).
    ///
    /// The checksum renders the whole state (milliseconds on a full node) and is taken between
    /// the two, off the disk lock, so allocations keep committing meanwhile; the extra record
    /// is written only when one did.
    pub(crate) async fn name(&self, checksum: u64, records: u64) -> Result<(), CheckpointError> {
        let mut disk = self.inner.disk.lock().await;
        disk.writing(checksum);
        if disk.records == records {
            return Ok(());
        }
        let inner = &self.inner;
        // Taken apart from the record's write: the mutex is not held across it.
        let acknowledged = Arc::clone(&super::lock(&inner.acknowledged));
        super::group::record_state(
            &mut disk,
            &inner.paths.journal,
            inner.durability,
            &inner.metrics,
            &acknowledged,
        )
    }

    /// Writes the checkpoint of `data` (whose checksum is `checksum`) and, when given, the side
    /// file.
    fn write_snapshot(
        &self,
        data: KubeletCheckpoint,
        checksum: u64,
        side: Option<SideSource>,
    ) -> Result<(), CheckpointError> {
        let bytes = data.encode(checksum);
        // The snapshot's copy of the state goes before the writes start.
        drop(data);
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
        result
    }

    /// Runs [`Persistence::run_writer`] on a thread of its own (driving it with the current
    /// runtime's handle); returns a future that ends when the writer does (`Err` if its thread
    /// panicked), for the caller to keep, so waiting for it waits for the last write.
    pub fn spawn_writer(
        &self,
        snapshot: impl Fn(bool) -> Snapshot + Send + 'static,
        cancel: CancellationToken,
    ) -> std::io::Result<impl std::future::Future<Output = Result<(), WriterError>> + Send + 'static>
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
        Ok(async move { ended.await.map_err(|_| WriterError::Panicked) })
    }

    /// Fsyncs the directories of the checkpoint and the side file, so that the renames so far
    /// survive a power cut.
    async fn sync_dirs(&self) -> Result<(), CheckpointError> {
        let paths = &self.inner.paths;
        if self.inner.durability == Durability::Fsync {
            blocking(|| {
                pluglet_checkpoint::sync_parent(&paths.checkpoint)?;
                pluglet_checkpoint::sync_parent(&paths.side)
            })?;
        }
        self.inner.disk.lock().await.unsynced = 0;
        Ok(())
    }
}

/// Runs blocking file work from async code: on a worker of tokio's multi-thread runtime after
/// handing its queue to another thread (`block_in_place`), elsewhere as it is.
fn blocking<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::metrics::Metrics;
    use crate::persistence::tests::{allocate, paths, source};
    use crate::pod_devices::PodDevices;

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
}
