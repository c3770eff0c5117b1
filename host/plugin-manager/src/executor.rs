//! Operation executor: at most one operation per socket path at a time, exponential backoff per
//! path after a failure (the kubelet's `goroutinemap` with `exponentialbackoff`).
//!
//! Owned by the reconciler task. Every operation runs as its own tokio task, so a slow or hanging
//! plugin only ever occupies its own path. [`Executor::try_start`] answers [`TryStart::Started`],
//! [`TryStart::AlreadyRunning`] or [`TryStart::BackingOff`], normal answers rather than errors.
//!
//! Backoff per path: the first failure waits `initial` (kubelet 500 ms), each further failure
//! doubles it up to `max` (kubelet 2 min 2 s); a success forgets it. Unlike the kubelet, a failure
//! of one generation of a socket does not hold back the next generation (a re-created socket is
//! tried at once).

use std::collections::HashMap;
use std::future::Future;

use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Instant;

use super::operation::Operation;
use super::plugin::{Generation, SocketPath};

/// Answer of [`Executor::try_start`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TryStart {
    /// The operation runs now.
    Started,
    /// Another operation on the same path is running; ask again when it finished.
    AlreadyRunning,
    /// The path failed recently; ask again after `until`.
    BackingOff {
        /// When the next attempt may start.
        until: Instant,
    },
}

/// An operation's task panicked; it counts as a failure of its path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("operation panicked: {message}")]
pub struct OperationPanicked {
    /// The panic's text.
    pub message: String,
}

pub use pluglet_core::BackoffPolicy;

/// Backoff state of one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Consecutive failures.
    pub failures: u32,
    /// No new operation before this instant.
    pub until: Instant,
    /// Generation whose operation failed.
    pub generation: Generation,
}

#[derive(Debug, Default)]
struct Slot {
    running: Option<(Operation, AbortHandle)>,
    backoff: Option<Backoff>,
}

/// A finished operation and what it returned.
#[derive(Debug)]
pub struct Finished<T, E> {
    /// The operation.
    pub operation: Operation,
    /// Its result; `Err` starts (or extends) the path's backoff.
    pub result: Result<T, E>,
}

/// Runs operations, one per path, with backoff.
#[derive(Debug)]
pub struct Executor<T, E> {
    policy: BackoffPolicy,
    slots: HashMap<SocketPath, Slot>,
    tasks: JoinSet<(Operation, Result<T, E>)>,
}

impl<T: Send + 'static, E: From<OperationPanicked> + Send + 'static> Executor<T, E> {
    /// An idle executor.
    pub fn new(policy: BackoffPolicy) -> Executor<T, E> {
        Executor {
            policy,
            slots: HashMap::new(),
            tasks: JoinSet::new(),
        }
    }

    /// Starts the future made by `future` for `op` unless its path is busy or backing off (then
    /// `future` is not called). The future resolves to `Err` on failure (backoff) and `Ok`
    /// otherwise; a panic counts as a failure.
    pub fn try_start<F>(
        &mut self,
        op: Operation,
        now: Instant,
        future: impl FnOnce() -> F,
    ) -> TryStart
    where
        F: Future<Output = Result<T, E>> + Send + 'static,
    {
        let slot = self.slots.entry(op.socket().clone()).or_default();
        if slot.running.is_some() {
            return TryStart::AlreadyRunning;
        }
        if let Some(b) = slot.backoff
            && b.until > now
            && b.generation == op.generation()
        {
            return TryStart::BackingOff { until: b.until };
        }
        let fut = future();
        let op2 = op.clone();
        let abort = self.tasks.spawn(async move { (op2, fut.await) });
        slot.running = Some((op, abort));
        TryStart::Started
    }

    /// Whether an operation runs on `socket`.
    pub fn is_running(&self, socket: &SocketPath) -> bool {
        self.slots.get(socket).is_some_and(|s| s.running.is_some())
    }

    /// Backoff state of `socket`, if it failed and has not succeeded since.
    pub fn backoff(&self, socket: &SocketPath) -> Option<Backoff> {
        self.slots.get(socket).and_then(|s| s.backoff)
    }

    /// Number of running operations.
    pub fn running(&self) -> usize {
        self.tasks.len()
    }

    /// The earliest backoff expiry after `since` (the last full plan) among idle paths, to wake
    /// the reconciler then. It may already be past: the reconciler then plans at once, so an
    /// expiry is never lost because something else woke the loop after it.
    pub fn next_wake(&self, since: Instant) -> Option<Instant> {
        self.slots
            .values()
            .filter(|s| s.running.is_none())
            .filter_map(|s| s.backoff.map(|b| b.until))
            .filter(|until| *until > since)
            .min()
    }

    /// Forgets the backoff of `socket` unless an operation runs on it (the socket is gone).
    pub fn forget(&mut self, socket: &SocketPath) {
        if self.slots.get(socket).is_some_and(|s| s.running.is_none()) {
            self.slots.remove(socket);
        }
    }

    /// Waits for the next operation to finish and records its outcome (backoff on failure).
    /// Pending forever when nothing runs.
    pub async fn next_finished(&mut self) -> Finished<T, E> {
        loop {
            let Some(joined) = self.tasks.join_next().await else {
                std::future::pending::<()>().await;
                continue;
            };
            match joined {
                Ok((operation, result)) => return self.finish(operation, result),
                Err(e) if e.is_cancelled() => continue,
                Err(e) => {
                    // A panicking operation is a failed operation (the kubelet recovers panics too).
                    let id = e.id();
                    let op = self.slots.values().find_map(|s| {
                        s.running
                            .as_ref()
                            .filter(|(_, h)| h.id() == id)
                            .map(|(op, _)| op.clone())
                    });
                    if let Some(operation) = op {
                        return self.finish(
                            operation,
                            Err(E::from(OperationPanicked {
                                message: e.to_string(),
                            })),
                        );
                    }
                }
            }
        }
    }

    /// Like [`Executor::next_finished`] but only returns what already finished.
    pub fn try_next_finished(&mut self) -> Option<Finished<T, E>> {
        loop {
            match self.tasks.try_join_next()? {
                Ok((operation, result)) => return Some(self.finish(operation, result)),
                Err(e) => {
                    let id = e.id();
                    let op = self.slots.values().find_map(|s| {
                        s.running
                            .as_ref()
                            .filter(|(_, h)| h.id() == id)
                            .map(|(op, _)| op.clone())
                    });
                    if let Some(operation) = op {
                        return Some(self.finish(
                            operation,
                            Err(E::from(OperationPanicked {
                                message: e.to_string(),
                            })),
                        ));
                    }
                }
            }
        }
    }

    /// Stops every running operation.
    pub async fn shutdown(&mut self) {
        self.tasks.shutdown().await;
        for slot in self.slots.values_mut() {
            slot.running = None;
        }
    }

    fn finish(&mut self, operation: Operation, result: Result<T, E>) -> Finished<T, E> {
        if result.is_ok() {
            // Success forgets the path: nothing running, no backoff.
            self.slots.remove(operation.socket());
            return Finished { operation, result };
        }
        let now = Instant::now();
        let policy = self.policy;
        let slot = self.slots.entry(operation.socket().clone()).or_default();
        slot.running = None;
        let failures = match slot.backoff {
            Some(b) if b.generation == operation.generation() => b.failures + 1,
            _ => 1,
        };
        slot.backoff = Some(Backoff {
            failures,
            until: now + policy.delay(failures),
            generation: operation.generation(),
        });
        Finished { operation, result }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn policy() -> BackoffPolicy {
        BackoffPolicy {
            initial: Duration::from_millis(500),
            max: Duration::from_secs(122),
        }
    }

    fn reg(path: &str, g: u64) -> Operation {
        Operation::Register {
            socket: SocketPath::new(path),
            generation: Generation(g),
        }
    }

    #[test]
    fn backoff_doubles_from_500ms_to_the_kubelet_cap() {
        let p = policy();
        assert_eq!(p.delay(1), Duration::from_millis(500));
        assert_eq!(p.delay(2), Duration::from_secs(1));
        assert_eq!(p.delay(3), Duration::from_secs(2));
        assert_eq!(p.delay(9), Duration::from_secs(122));
        assert_eq!(p.delay(100), Duration::from_secs(122));
    }

    #[tokio::test(start_paused = true)]
    async fn one_operation_per_path_and_backoff_after_failure() {
        let mut ex: Executor<(), OperationPanicked> = Executor::new(policy());
        let now = Instant::now();
        assert_eq!(
            ex.try_start(reg("/a", 1), now, || async {
                Err(OperationPanicked {
                    message: "boom".into(),
                })
            }),
            TryStart::Started
        );
        assert_eq!(
            ex.try_start(reg("/a", 1), now, || async { Ok(()) }),
            TryStart::AlreadyRunning
        );
        assert_eq!(
            ex.try_start(reg("/b", 1), now, || async { Ok(()) }),
            TryStart::Started,
            "another path is not held up"
        );
        let mut failed = None;
        for _ in 0..2 {
            let f = ex.next_finished().await;
            if f.result.is_err() {
                failed = Some(f);
            }
        }
        assert_eq!(failed.unwrap().operation, reg("/a", 1));
        let now = Instant::now();
        let TryStart::BackingOff { until } = ex.try_start(reg("/a", 1), now, || async { Ok(()) })
        else {
            panic!("expected backoff")
        };
        assert_eq!(until - now, Duration::from_millis(500));
        assert_eq!(ex.next_wake(now), Some(until));
        // An expiry that has passed still wakes the reconciler if no full plan ran since it
        // (other wake-ups, such as admin queries, may have come first); none once one has.
        assert_eq!(ex.next_wake(until - Duration::from_millis(1)), Some(until));
        assert_eq!(ex.next_wake(until), None);
        // A new generation of the socket is not held back.
        assert_eq!(
            ex.try_start(reg("/a", 2), now, || async { Ok(()) }),
            TryStart::Started
        );
        assert!(ex.next_finished().await.result.is_ok());
        assert_eq!(
            ex.backoff(&SocketPath::new("/a")),
            None,
            "success forgets the backoff"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn consecutive_failures_double_the_wait() {
        let mut ex: Executor<(), OperationPanicked> = Executor::new(policy());
        for expected_ms in [500u64, 1000, 2000] {
            tokio::time::sleep(Duration::from_secs(5)).await;
            let now = Instant::now();
            assert_eq!(
                ex.try_start(reg("/a", 1), now, || async {
                    Err(OperationPanicked {
                        message: "x".into(),
                    })
                }),
                TryStart::Started
            );
            ex.next_finished().await;
            let b = ex.backoff(&SocketPath::new("/a")).unwrap();
            assert_eq!(b.until - Instant::now(), Duration::from_millis(expected_ms));
        }
    }
}
