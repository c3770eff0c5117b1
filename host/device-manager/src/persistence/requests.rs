//! [`WriteRequests`]: how a change asks for a checkpoint write. Requests are coalesced: the
//! writer takes one snapshot per write, so a burst of changes costs one write. A device change
//! wakes the writer at once; allocations and releases wake it once they have been quiet.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pluglet_checkpoint::CheckpointError;
use tokio::sync::{Notify, watch};

use super::lock;

/// How long allocations and releases must have been quiet before the checkpoint writer is woken
/// for them. They are durable in the journal already; waiting makes a burst of them one write,
/// keeps the write's fsyncs from queueing on the disk ahead of the next allocation's journal
/// record, and keeps the writer thread's wake-up off the allocation's path. A device change, a
/// caller waiting for the write, or shutdown wakes it sooner.
pub const ALLOCATION_WRITE_DELAY: Duration = Duration::from_millis(20);

/// The longest a steady stream of allocations and releases (never quiet for
/// [`ALLOCATION_WRITE_DELAY`]) keeps the checkpoint writer waiting after the first change it has
/// not written: the kubelet-format checkpoint never lags the journal by more.
const ALLOCATION_WRITE_MAX: Duration = Duration::from_secs(1);

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
    pub(super) async fn next_request(&self) -> u64 {
        loop {
            let target = self.0.requested.load(Ordering::SeqCst);
            if target > self.0.written.borrow().seq {
                return target;
            }
            self.0.wake.notified().await;
        }
    }

    /// Writer side: whether requests are waiting.
    pub(super) fn pending(&self) -> bool {
        self.0.requested.load(Ordering::SeqCst) > self.0.written.borrow().seq
    }

    /// Writer side: whether the side file must be written too; clears the flag.
    pub(super) fn take_devices_changed(&self) -> bool {
        self.0.devices_changed.swap(false, Ordering::SeqCst)
    }

    /// Writer side: records the outcome of the write covering `seq`.
    pub(super) fn done(&self, seq: u64, error: Option<CheckpointError>) {
        self.0.written.send_replace(Written {
            seq,
            error: error.map(Arc::new),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
