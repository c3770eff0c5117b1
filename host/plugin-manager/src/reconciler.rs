//! The reconciler: a pure [`plan`] (deregistrations first) and a loop that runs it whenever
//! something changed (the kubelet's `reconciler.go`, without its 1 s poll).
//!
//! The loop owns the [`ActualState`] and the [`Executor`] and `select!`s on: desired state
//! changed, an operation finished, a backoff elapsed, an admin query, cancelled. It also keeps, per
//! socket, what an operator needs to see why a plugin is missing ([`SocketStatus`]).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::actual_state::{ActualState, RegistrationState};
use super::desired_state::{ChangedPaths, DesiredMap, DesiredStateReader};
use super::executor::{self, BackoffPolicy, Executor, Finished, TryStart};
use super::operation::{self, Operation, OperationContext, RegisterOutcome};
use super::plugin::{Generation, SocketPath, SocketPlugin};

/// The generations recorded per socket; what [`plan`] needs to know of the actual state.
pub trait Generations {
    /// Every (socket, generation) pair.
    fn pairs(&self) -> impl Iterator<Item = (&SocketPath, Generation)>;
    /// The generation recorded for `socket`.
    fn generation_of(&self, socket: &SocketPath) -> Option<Generation>;
}

impl Generations for ActualState {
    fn pairs(&self) -> impl Iterator<Item = (&SocketPath, Generation)> {
        self.entries().iter().map(|(p, e)| (p, e.record.generation))
    }
    fn generation_of(&self, socket: &SocketPath) -> Option<Generation> {
        self.generation(socket)
    }
}

impl Generations for BTreeMap<SocketPath, Generation> {
    fn pairs(&self) -> impl Iterator<Item = (&SocketPath, Generation)> {
        self.iter().map(|(p, g)| (p, *g))
    }
    fn generation_of(&self, socket: &SocketPath) -> Option<Generation> {
        self.get(socket).copied()
    }
}

/// What should happen to bring the actual state to the desired state: first a deregistration for
/// every actual entry whose socket is gone or was re-created, then a registration for every desired
/// socket whose generation is not in the actual state.
pub fn plan(desired: &DesiredMap, actual: &impl Generations) -> Vec<Operation> {
    let mut ops = Vec::new();
    for (socket, generation) in actual.pairs() {
        if desired.get(socket).map(|d| d.generation) != Some(generation) {
            ops.push(Operation::Deregister {
                socket: socket.clone(),
                generation,
            });
        }
    }
    for (socket, entry) in desired {
        if actual.generation_of(socket) != Some(entry.generation) {
            ops.push(Operation::Register {
                socket: socket.clone(),
                generation: entry.generation,
            });
        }
    }
    ops
}

/// [`plan`] for one socket: `desired` and `actual` are its generations in either state.
pub fn plan_socket(
    socket: &SocketPath,
    desired: Option<Generation>,
    actual: Option<Generation>,
) -> Vec<Operation> {
    let mut ops = Vec::new();
    if let Some(generation) = actual
        && desired != Some(generation)
    {
        ops.push(Operation::Deregister {
            socket: socket.clone(),
            generation,
        });
    }
    if let Some(generation) = desired
        && actual != Some(generation)
    {
        ops.push(Operation::Register {
            socket: socket.clone(),
            generation,
        });
    }
    ops
}

/// Where a socket's registration stands, as `pluglet ctl sockets` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketState {
    /// Registered.
    Registered,
    /// Refused by the register step; stays so until the socket is re-created.
    Refused,
    /// Failed (dial, GetInfo, no handler, validate); retried after a backoff.
    Retrying,
    /// An operation is running.
    InProgress,
    /// Seen, nothing started yet.
    Pending,
    /// Named like a socket (`*.sock`) but not one (a regular file, a symlink that does not
    /// resolve): never dialed; `last_error` says why.
    Ignored,
}

impl SocketState {
    /// The wire string (`registered`, `refused`, `retrying`, `in_progress`, `pending`,
    /// `ignored`).
    pub fn as_str(self) -> &'static str {
        match self {
            SocketState::Registered => "registered",
            SocketState::Refused => "refused",
            SocketState::Retrying => "retrying",
            SocketState::InProgress => "in_progress",
            SocketState::Pending => "pending",
            SocketState::Ignored => "ignored",
        }
    }
}

/// One socket known to the watcher and where its registration stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketStatus {
    /// Socket path.
    pub path: SocketPath,
    /// Registration state.
    pub state: SocketState,
    /// Register attempts for this incarnation of the socket.
    pub attempts: u32,
    /// Last failure or refusal.
    pub last_error: Option<String>,
    /// Plugin type from GetInfo, once known.
    pub plugin_type: Option<String>,
    /// Plugin name from GetInfo, once known.
    pub plugin_name: Option<String>,
    /// Time until the next attempt when retrying.
    pub next_retry: Option<Duration>,
}

/// A question to the reconciler, answered from its state.
#[derive(Debug)]
pub enum Query {
    /// Registered plugins.
    Plugins(oneshot::Sender<Vec<SocketPlugin>>),
    /// Every desired socket with its state.
    Sockets(oneshot::Sender<Vec<SocketStatus>>),
}

/// Per-socket bookkeeping for [`SocketStatus`].
#[derive(Debug, Default)]
struct Track {
    generation: Option<Generation>,
    attempts: u32,
    last_error: Option<String>,
    plugin_type: Option<String>,
    plugin_name: Option<String>,
}

/// What an operation task returns.
#[derive(Debug)]
enum Done {
    Registered(Box<RegisterOutcome>),
    Deregistered,
}

/// A failed operation (starts backoff).
#[derive(Debug)]
struct Failure {
    reason: String,
    info: Option<pluglet_handler_runtime::PluginInfo>,
}

impl From<executor::OperationPanicked> for Failure {
    fn from(panicked: executor::OperationPanicked) -> Failure {
        Failure {
            reason: panicked.to_string(),
            info: None,
        }
    }
}

/// The reconciler task's state.
pub struct Reconciler {
    desired: DesiredStateReader,
    changes: ChangedPaths,
    actual: ActualState,
    executor: Executor<Done, Failure>,
    cx: OperationContext,
    tracks: HashMap<SocketPath, Track>,
    queries: mpsc::Receiver<Query>,
    cancel: CancellationToken,
}

impl Reconciler {
    /// A reconciler over `desired` and `actual`, running operations with `cx`.
    pub fn new(
        desired: DesiredStateReader,
        changes: ChangedPaths,
        actual: ActualState,
        cx: OperationContext,
        queries: mpsc::Receiver<Query>,
        cancel: CancellationToken,
    ) -> Reconciler {
        let policy = BackoffPolicy {
            initial: cx.timings.backoff_initial,
            max: cx.timings.backoff_max,
        };
        Reconciler {
            desired,
            changes,
            actual,
            executor: Executor::new(policy),
            cx,
            tracks: HashMap::new(),
            queries,
            cancel,
        }
    }

    /// Runs until cancelled; running operations are aborted then.
    ///
    /// At start and when a backoff elapsed it plans everything; otherwise it plans only the
    /// sockets that changed (reported by the watcher) or whose operation finished, so a burst of N
    /// new sockets costs O(N log N) planning, not O(N²).
    pub async fn run(mut self) {
        let mut full = true;
        let mut dirty: Vec<SocketPath> = Vec::new();
        // When the last full plan ran: every backoff expiring after it still needs one, even if
        // other wake-ups (admin queries, events) let its expiry pass before the timer branch ran.
        let mut planned_at = Instant::now();
        loop {
            if full {
                planned_at = Instant::now();
                self.reconcile(planned_at);
            } else {
                self.reconcile_sockets(&mut dirty);
            }
            full = false;
            dirty.clear();
            let wake = self.executor.next_wake(planned_at);
            tokio::select! {
                _ = self.cancel.cancelled() => break,
                finished = self.executor.next_finished() => {
                    dirty.push(finished.operation.socket().clone());
                    self.apply(finished);
                }
                changed = self.changes.next() => match changed {
                    Some(socket) => dirty.push(socket),
                    None => {
                        debug!("desired state writer gone, reconciler stops");
                        break;
                    }
                },
                Some(query) = self.queries.recv() => self.answer(query),
                _ = sleep_until(wake), if wake.is_some() => full = true,
            }
            while let Some(socket) = self.changes.try_next() {
                dirty.push(socket);
            }
            while let Some(finished) = self.executor.try_next_finished() {
                dirty.push(finished.operation.socket().clone());
                self.apply(finished);
            }
        }
        self.executor.shutdown().await;
    }

    fn reconcile(&mut self, now: Instant) {
        let ops = {
            let desired = self.desired.borrow();
            plan(&desired, &self.actual)
        };
        for op in ops {
            self.start(op, now);
        }
    }

    /// Plans the `dirty` sockets only; deregistrations first, as in [`plan`].
    fn reconcile_sockets(&mut self, dirty: &mut Vec<SocketPath>) {
        dirty.sort();
        dirty.dedup();
        let mut ops: Vec<Operation> = dirty
            .iter()
            .flat_map(|socket| {
                let desired = self.desired.peek_generation(socket);
                plan_socket(socket, desired, self.actual.generation(socket))
            })
            .collect();
        ops.sort_by_key(|op| matches!(op, Operation::Register { .. }));
        let now = Instant::now();
        for op in ops {
            self.start(op, now);
        }
    }

    fn start(&mut self, op: Operation, now: Instant) {
        let cx = &self.cx;
        match op.clone() {
            Operation::Register { socket, generation } => {
                let key = socket.clone();
                let started = self.executor.try_start(op, now, || {
                    let cx = cx.clone();
                    async move {
                        match operation::register(cx, socket, generation).await {
                            RegisterOutcome::Failed { info, reason } => {
                                Err(Failure { reason, info })
                            }
                            outcome => Ok(Done::Registered(Box::new(outcome))),
                        }
                    }
                });
                if started == TryStart::Started {
                    let track = self.tracks.entry(key).or_default();
                    if track.generation != Some(generation) {
                        *track = Track {
                            generation: Some(generation),
                            ..Track::default()
                        };
                    }
                    track.attempts += 1;
                }
            }
            Operation::Deregister { socket, generation } => {
                let actual = &mut self.actual;
                self.executor.try_start(op, now, || {
                    let entry = actual.remove(&socket, generation);
                    let cx = cx.clone();
                    async move {
                        if let Some(entry) = entry {
                            operation::deregister(cx, entry.record).await;
                        }
                        Ok(Done::Deregistered)
                    }
                });
            }
        }
    }

    fn apply(&mut self, finished: Finished<Done, Failure>) {
        let Finished { operation, result } = finished;
        let socket = operation.socket().clone();
        let generation = operation.generation();
        let outcome = match (result, &operation) {
            (Ok(Done::Deregistered), _) => None,
            (Err(Failure { reason, .. }), Operation::Deregister { .. }) => {
                warn!(%socket, %reason, "deregistration failed");
                None
            }
            (Ok(Done::Registered(outcome)), _) => Some(*outcome),
            (Err(Failure { info, reason }), Operation::Register { .. }) => {
                Some(RegisterOutcome::Failed { info, reason })
            }
        };
        if let Some(outcome) = outcome {
            let track = self.tracks.entry(socket.clone()).or_default();
            let is_current = track.generation == Some(generation);
            match outcome {
                RegisterOutcome::Registered {
                    record,
                    notify_error,
                } => {
                    if let Some(seen) = self.desired.seen(&socket, generation) {
                        self.cx
                            .latency
                            .observe(&record.info.plugin_type, seen.elapsed());
                    }
                    if is_current {
                        track.last_error = notify_error;
                        track.plugin_type = Some(record.info.plugin_type.clone());
                        track.plugin_name = Some(record.info.name.clone());
                    }
                    self.actual.add_registered(record);
                }
                RegisterOutcome::Refused { record, reason } => {
                    if is_current {
                        track.last_error = Some(reason.clone());
                        track.plugin_type = Some(record.info.plugin_type.clone());
                        track.plugin_name = Some(record.info.name.clone());
                    }
                    self.actual.add_refused(record, reason);
                }
                RegisterOutcome::Failed { info, reason } => {
                    if is_current {
                        if let Some(info) = info {
                            track.plugin_type = Some(info.plugin_type);
                            track.plugin_name = Some(info.name);
                        }
                        track.last_error = Some(reason);
                    }
                }
            }
        }
        if !self.desired.snapshot_contains(&socket) && self.actual.get(&socket).is_none() {
            self.tracks.remove(&socket);
            self.executor.forget(&socket);
        }
    }

    fn answer(&mut self, query: Query) {
        match query {
            Query::Plugins(reply) => {
                let plugins = self
                    .actual
                    .entries()
                    .values()
                    .filter(|e| e.state == RegistrationState::Registered)
                    .map(|e| e.record.clone())
                    .collect();
                let _ = reply.send(plugins);
            }
            Query::Sockets(reply) => {
                let _ = reply.send(self.socket_statuses());
            }
        }
    }

    fn socket_statuses(&mut self) -> Vec<SocketStatus> {
        let now = Instant::now();
        let desired = self.desired.snapshot();
        let ignored = self.desired.ignored();
        let mut statuses: Vec<SocketStatus> = desired
            .iter()
            .map(|(path, entry)| {
                let track = self
                    .tracks
                    .get(path)
                    .filter(|t| t.generation == Some(entry.generation));
                let actual = self
                    .actual
                    .get(path)
                    .filter(|a| a.record.generation == entry.generation);
                let backoff = self
                    .executor
                    .backoff(path)
                    .filter(|b| b.generation == entry.generation);
                let (state, next_retry) = match (actual, self.executor.is_running(path), backoff) {
                    (Some(a), _, _) => match a.state {
                        RegistrationState::Registered => (SocketState::Registered, None),
                        RegistrationState::Refused { .. } => (SocketState::Refused, None),
                    },
                    (None, true, _) => (SocketState::InProgress, None),
                    (None, false, Some(b)) => (
                        SocketState::Retrying,
                        Some(b.until.saturating_duration_since(now)),
                    ),
                    (None, false, None) => (SocketState::Pending, None),
                };
                let last_error = match actual.map(|a| &a.state) {
                    Some(RegistrationState::Refused { reason }) => Some(reason.clone()),
                    _ => track.and_then(|t| t.last_error.clone()),
                };
                SocketStatus {
                    path: path.clone(),
                    state,
                    attempts: track.map_or(0, |t| t.attempts),
                    last_error,
                    plugin_type: actual
                        .map(|a| a.record.info.plugin_type.clone())
                        .or_else(|| track.and_then(|t| t.plugin_type.clone())),
                    plugin_name: actual
                        .map(|a| a.record.info.name.clone())
                        .or_else(|| track.and_then(|t| t.plugin_name.clone())),
                    next_retry,
                }
            })
            .collect();
        statuses.extend(ignored.into_iter().map(|(path, reason)| SocketStatus {
            path,
            state: SocketState::Ignored,
            attempts: 0,
            last_error: Some(reason),
            plugin_type: None,
            plugin_name: None,
            next_retry: None,
        }));
        statuses.sort_by(|a, b| a.path.cmp(&b.path));
        statuses
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::super::desired_state::{DesiredEntry, FileId};
    use super::*;

    fn desired(entries: &[(&str, u64)]) -> DesiredMap {
        entries
            .iter()
            .map(|(p, g)| {
                (
                    SocketPath::new(*p),
                    DesiredEntry {
                        generation: Generation(*g),
                        file_id: FileId { dev: 0, ino: *g },
                        seen: std::time::Instant::now(),
                    },
                )
            })
            .collect()
    }

    fn actual(entries: &[(&str, u64)]) -> BTreeMap<SocketPath, Generation> {
        entries
            .iter()
            .map(|(p, g)| (SocketPath::new(*p), Generation(*g)))
            .collect()
    }

    fn reg(p: &str, g: u64) -> Operation {
        Operation::Register {
            socket: SocketPath::new(p),
            generation: Generation(g),
        }
    }

    fn dereg(p: &str, g: u64) -> Operation {
        Operation::Deregister {
            socket: SocketPath::new(p),
            generation: Generation(g),
        }
    }

    #[test]
    fn plan_table() {
        struct Case {
            name: &'static str,
            desired: &'static [(&'static str, u64)],
            actual: &'static [(&'static str, u64)],
            want: Vec<Operation>,
        }
        let cases = [
            Case {
                name: "nothing to do",
                desired: &[("/a", 1)],
                actual: &[("/a", 1)],
                want: vec![],
            },
            Case {
                name: "new socket registers",
                desired: &[("/a", 1)],
                actual: &[],
                want: vec![reg("/a", 1)],
            },
            Case {
                name: "removed socket deregisters",
                desired: &[],
                actual: &[("/a", 1)],
                want: vec![dereg("/a", 1)],
            },
            Case {
                name: "re-created socket deregisters first, then registers",
                desired: &[("/b", 2), ("/a", 3)],
                actual: &[("/a", 1)],
                want: vec![dereg("/a", 1), reg("/a", 3), reg("/b", 2)],
            },
        ];
        for c in cases {
            assert_eq!(
                plan(&desired(c.desired), &actual(c.actual)),
                c.want,
                "{}",
                c.name
            );
        }
    }

    #[test]
    fn plan_socket_agrees_with_plan() {
        // Every combination of one socket's generations in the two states, planned both ways.
        let generations = [None, Some(1), Some(2)];
        for d in generations {
            for a in generations {
                let desired_pairs: Vec<(&str, u64)> = d.map(|g| ("/a", g)).into_iter().collect();
                let actual_pairs: Vec<(&str, u64)> = a.map(|g| ("/a", g)).into_iter().collect();
                let whole = plan(&desired(&desired_pairs), &actual(&actual_pairs));
                let one = plan_socket(&SocketPath::new("/a"), d.map(Generation), a.map(Generation));
                assert_eq!(one, whole, "desired {d:?}, actual {a:?}");
            }
        }
    }

    #[test]
    fn socket_states_use_wire_strings() {
        let all = [
            SocketState::Registered,
            SocketState::Refused,
            SocketState::Retrying,
            SocketState::InProgress,
            SocketState::Pending,
            SocketState::Ignored,
        ];
        let strings: Vec<_> = all.iter().map(|s| s.as_str()).collect();
        assert_eq!(
            strings,
            [
                "registered",
                "refused",
                "retrying",
                "in_progress",
                "pending",
                "ignored"
            ]
        );
    }
}
