//! Group commit: the journal writer, one task that makes every change queued by
//! [`Persistence::change`] durable, as many at a time as are queued when it looks.
//!
//! A change is queued already made, on a copy of the state that holds every change queued
//! before it ([`Queue::pending`]), so the queue's order is the order of the journal and of the
//! state. The writer writes the records of every change queued (without waiting for the disk),
//! makes them durable with one `fdatasync`, then applies them to the state in order
//! ([`PodDevices::adopt_copy`]: the entries each change touched, taken from its copy once when
//! it was queued; the copy's whole map when the state has not changed since the copy was made),
//! publishes the acknowledged state and answers each change. Under concurrency a sync covers
//! every change that became ready while the previous one ran; alone, a change is written and
//! synced at once. The `fdatasync` runs on the writer's tokio worker, so after answering a group
//! the writer yields once before it looks for the next: the callers it answered were woken on
//! that worker (the last in the slot no other worker steals from) and would otherwise wait out
//! the next sync, and the tasks that were ready meanwhile queue their changes in time for it.
//! Under 16 clients this halved the syncs per allocation (docs/performance.md).
//!
//! A failed write or sync fails its whole group, and every change queued behind it (each was
//! made on a state that held the failed ones): none was applied to the state, so nothing is
//! held or shown that the disk may not have, and each caller undoes what it reserved.
//!
//! The writer holds the disk lock from the first write of a group to its last answer: the
//! checkpoint writer's snapshot (of the state) then never falls between a record reaching the
//! journal and its change reaching the state. Callers never take that lock: they queue behind
//! a short mutex and wait for their answer, so the next group gathers while a sync runs.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use pluglet_checkpoint::{CheckpointError, Durability};
use pluglet_core::error_chain;
use tokio::sync::{mpsc, oneshot};

use super::disk::Disk;
use super::{Inner, files, lock};
use crate::metrics::Metrics;
use crate::pod_devices::{Change, PodDevices};

/// What a change's caller hears: `Ok` once its record is durable and the change is made.
pub(super) type Answer = Result<(), Arc<CheckpointError>>;

/// A change made on the pending state, waiting for the writer.
struct Queued {
    /// The state the change was made on.
    pods: Arc<Mutex<PodDevices>>,
    /// The pending state after the change (a copy without index).
    state: PodDevices,
    /// The version of `pods` the copy was made from when no change was queued before it (the
    /// copy is then `pods` with this change alone; see [`PodDevices::adopt_copy`]).
    base: Option<u64>,
    /// What it did to each key it touched (empty: it changed nothing, and is answered with its
    /// group).
    changes: Vec<Change>,
}

/// The changes made and not yet answered, oldest first, each with where its answer goes.
#[derive(Default)]
pub(super) struct Queue {
    changes: VecDeque<(Arc<Queued>, oneshot::Sender<Answer>)>,
}

impl Queue {
    /// A copy (without index) of `pods` with every queued change made: what the next change
    /// is made on. The caller holds the queue's lock, so the writer cannot apply a change to
    /// `pods` and drop it from the queue in between.
    pub(super) fn pending(&self, pods: &Mutex<PodDevices>) -> PodDevices {
        let mut next = self.adopted(&lock(pods));
        next.forget_changes();
        next
    }

    /// [`Queue::pending`], made from `state` (locked by the caller), with what the queued
    /// changes did, by key, sorted, each key once.
    pub(super) fn pending_from(&self, state: &PodDevices) -> (PodDevices, Vec<Change>) {
        let mut next = self.adopted(state);
        let waiting = next.take_changes();
        (next, waiting)
    }

    /// A copy (without index) of `state` with every queued change made on it.
    fn adopted(&self, state: &PodDevices) -> PodDevices {
        let mut next = state.without_index();
        for (queued, _) in &self.changes {
            next.adopt(&queued.changes);
        }
        next
    }

    /// Queues a change made on [`Queue::pending`] (made when `pods` was at version `version`);
    /// returns where its answer will come.
    pub(super) fn push(
        &mut self,
        pods: &Arc<Mutex<PodDevices>>,
        version: u64,
        mut state: PodDevices,
    ) -> oneshot::Receiver<Answer> {
        let changes = state.take_changes();
        let (answer, answered) = oneshot::channel();
        let queued = Queued {
            pods: pods.clone(),
            state,
            base: self.changes.is_empty().then_some(version),
            changes,
        };
        self.changes.push_back((Arc::new(queued), answer));
        answered
    }

    /// How many changes wait.
    #[cfg(test)]
    pub(super) fn changes_len(&self) -> usize {
        self.changes.len()
    }

    /// Whether no change waits.
    pub(super) fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }
}

/// Wakes the writer (a wake already pending is enough: the writer takes every queued change).
pub(super) fn wake(wake: &mpsc::Sender<()>) {
    let _ = wake.try_send(());
}

/// The journal writer: runs while the persistence it belongs to exists (its wake sender drops
/// with it).
pub(super) async fn run(inner: Weak<Inner>, mut wake: mpsc::Receiver<()>) {
    while wake.recv().await.is_some() {
        let Some(inner) = inner.upgrade() else {
            return;
        };
        while commit_group(&inner).await {
            // The callers just answered, and the tasks ready meanwhile, run before the next
            // group's sync blocks this worker (see the module doc).
            tokio::task::yield_now().await;
        }
    }
}

/// Makes every queued change durable with one sync and answers them; false when none was
/// queued.
async fn commit_group(inner: &Inner) -> bool {
    let mut disk = inner.disk.lock().await;
    let group: Vec<Arc<Queued>> = lock(&inner.queue)
        .changes
        .iter()
        .map(|(queued, _)| queued.clone())
        .collect();
    let Some(last) = group.last() else {
        return false;
    };
    let started = Instant::now();
    let mut records = 0;
    let mut written = Ok(());
    for queued in group.iter().filter(|q| !q.changes.is_empty()) {
        written = write_record(
            &mut disk,
            &inner.paths.journal,
            inner.durability,
            &queued.state,
            &queued.changes,
        );
        records += 1;
        if written.is_err() {
            break;
        }
    }
    let result = written.and_then(|()| if records > 0 { disk.sync() } else { Ok(()) });
    let elapsed = started.elapsed();
    if records > 0 {
        inner
            .metrics
            .journal_group(result.is_ok(), records, elapsed);
    }
    if result.is_ok() && records > 0 && inner.durability == Durability::Fsync {
        inner.metrics.journal_sync();
    }
    let answers: Vec<(oneshot::Sender<Answer>, Answer)> = {
        let mut queue = lock(&inner.queue);
        match result {
            Ok(()) => {
                let done: Vec<_> = queue.changes.drain(..group.len()).collect();
                for (queued, _) in &done {
                    lock(&queued.pods).adopt_copy(&queued.state, queued.base, &queued.changes);
                }
                // The copy the last record was made from is the state now acknowledged (the one
                // it replaces is dropped after the swap, off the mutex).
                let acknowledged = Arc::new(last.state.clone());
                let _replaced = std::mem::replace(&mut *lock(&inner.acknowledged), acknowledged);
                done.into_iter().map(|(_, to)| (to, Ok(()))).collect()
            }
            Err(err) => {
                // A failed write may have left the file as it was or not (a torn slot is
                // harmless: the other slot holds the previous record); the next record is a
                // whole one.
                let failed = queue.changes.len();
                tracing::error!(
                    error = %error_chain(&err),
                    changes = failed,
                    "cannot write the allocation journal: every change waiting for it is refused"
                );
                let err = Arc::new(err);
                queue
                    .changes
                    .drain(..)
                    .map(|(_, to)| (to, Err(err.clone())))
                    .collect()
            }
        }
    };
    let changed = answers.iter().any(|(_, a)| a.is_ok());
    drop(disk);
    if changed {
        inner.requests.allocations_changed();
    }
    for (to, answer) in answers {
        // A caller that stopped waiting (its request was dropped) is not told.
        let _ = to.send(answer);
    }
    true
}

/// Writes the record of a change that did `changes` and left `state` (as what it changed,
/// or as the whole state when the newest whole record's slot has no room or the journal's
/// newest record is not known to hold the state it was made on), naming the checkpoint files
/// `disk` names. Not durable before [`Disk::sync`].
fn write_record(
    disk: &mut Disk,
    journal: &Path,
    durability: Durability,
    state: &PodDevices,
    changes: &[Change],
) -> Result<(), CheckpointError> {
    let change = files::encode_change(&disk.on_disk, changes);
    let done = disk.write_change(journal, durability, &change)?;
    if done {
        return Ok(());
    }
    let whole = files::encode_journal(&disk.on_disk, state);
    disk.write(journal, durability, &whole)
}

/// Makes durable a record that changes nothing: `state` (the state the journal holds, or is
/// to hold: a whole record when it does not), naming the checkpoint files `disk` names now.
/// For a start whose restored state the journal does not hold (`open.rs`), and for a
/// checkpoint whose snapshot was taken before the newest records (`writer.rs`).
pub(super) fn record_state(
    disk: &mut Disk,
    journal: &Path,
    durability: Durability,
    metrics: &Metrics,
    state: &PodDevices,
) -> Result<(), CheckpointError> {
    let started = Instant::now();
    let result = write_record(disk, journal, durability, state, &[]).and_then(|()| disk.sync());
    metrics.journal_group(result.is_ok(), 1, started.elapsed());
    if result.is_ok() && durability == Durability::Fsync {
        metrics.journal_sync();
    }
    result
}
