//! One version of a handler as it serves one slot: the hook calls go through it, so that each
//! is counted, a failure of a new module counts against its probation, and (with
//! `on_failure = "builtin"`) a failed call is decided by the built-in instead.
//!
//! A [`Served`] never changes which module it runs: a swap or a rollback puts a new `Served`
//! in the set, and a caller holding the old one (a registration between its validate and
//! register hooks, an allocation in flight) finishes on the version it started with.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime};

use pluglet_handler_runtime::{
    Accepted, AllocationRequest, Call, CallContext, CallGate, Family, Handler, HandlerError,
    HandlerFault, Hook, PluginInfo, Refusal, RegisteredPlugin, RegistrationFacts,
};

use crate::file::{OnFailure, SlotEntry, default_max_concurrent_calls};
use crate::integrity::SignatureInfo;
use crate::slot::SlotKey;
use crate::stats::{CallStats, FailureKind};

/// Clean calls in a row that end a new module's probation.
pub const PROBATION_CLEAN_CALLS: u32 = 100;

/// The least time a call waits for its slot to run fewer calls than its limit (a call waits
/// its deadline, at least this long), so that a call merely queued behind other good calls on
/// a loaded machine is not refused.
pub const MIN_SLOT_WAIT: Duration = Duration::from_secs(1);

/// Where a served version came from.
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(
    clippy::large_enum_variant,
    reason = "one per served version, which lives behind an Arc"
)]
pub enum Origin {
    /// A built-in module.
    Builtin,
    /// An entry of `handlers.toml`, with the digest of the bytes compiled.
    Configured {
        /// The entry.
        entry: SlotEntry,
        /// sha256 of the module, hex.
        sha256: String,
    },
}

/// Where a served version reports that its probation failed (`rollback_after` failures): given
/// by the owner of the set it serves in, which rolls the version back if it is still in force.
/// Called on the thread of the call that failed, so the next call already runs on what the
/// owner put back.
#[derive(Clone)]
pub(crate) struct ProbationFailed(Arc<ReportFn>);

/// The owner's report of a failed probation: the version and the reason.
type ReportFn = dyn Fn(&Served, String) + Send + Sync;

impl ProbationFailed {
    /// Reports to `report`, called with the version and the reason.
    pub(crate) fn new(report: impl Fn(&Served, String) + Send + Sync + 'static) -> ProbationFailed {
        ProbationFailed(Arc::new(report))
    }
}

impl std::fmt::Debug for ProbationFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProbationFailed")
    }
}

/// A new module's probation: failures count until `rollback_after`, or until enough clean
/// calls in a row end it.
#[derive(Debug)]
struct Probation {
    rollback_after: u32,
    failures: AtomicU32,
    clean_streak: AtomicU32,
    over: AtomicBool,
    triggered: AtomicBool,
}

/// A handler serving one slot (see the module doc).
#[derive(Debug)]
pub struct Served {
    slot: SlotKey,
    handler: Arc<Handler>,
    origin: Origin,
    signature: Option<SignatureInfo>,
    applied_at: SystemTime,
    fallback: Option<Arc<Handler>>,
    probation: Option<Probation>,
    stats: CallStats,
    probation_failed: ProbationFailed,
    /// A configured module's slot gate and the calls it may run at once (built-ins, trusted,
    /// are not limited).
    gate: Option<(Arc<CallGate>, u32)>,
}

impl Served {
    /// Calls of the slot running now and `max_concurrent_calls`; `None` for a built-in, whose
    /// calls are neither limited nor counted.
    pub fn concurrency(&self) -> Option<(u32, u32)> {
        self.gate
            .as_ref()
            .map(|(gate, limit)| (gate.running(), *limit))
    }

    /// A version for `slot`. `builtin`: the built-in that decides failed calls, when the entry
    /// asks for it. `on_probation`: a newly applied module with something to roll back to.
    /// `gate`: the slot's call gate, shared by its versions (a configured module without one
    /// gets a gate of its own). `probation_failed`: where a failed probation is reported.
    pub(crate) fn new(
        slot: SlotKey,
        handler: Arc<Handler>,
        origin: Origin,
        builtin: Option<&Arc<Handler>>,
        on_probation: bool,
        gate: Option<Arc<CallGate>>,
        probation_failed: ProbationFailed,
    ) -> Served {
        let (fallback, probation) = match &origin {
            Origin::Builtin => (None, None),
            Origin::Configured { entry, .. } => (
                (entry.on_failure == OnFailure::Builtin)
                    .then(|| builtin.cloned())
                    .flatten(),
                (on_probation && entry.rollback_after > 0).then(|| Probation {
                    rollback_after: entry.rollback_after,
                    failures: AtomicU32::new(0),
                    clean_streak: AtomicU32::new(0),
                    over: AtomicBool::new(false),
                    triggered: AtomicBool::new(false),
                }),
            ),
        };
        let gate = match &origin {
            Origin::Builtin => None,
            Origin::Configured { entry, .. } => {
                let gate = gate.unwrap_or_else(|| Arc::new(CallGate::new()));
                let limit = entry
                    .max_concurrent_calls
                    .unwrap_or_else(default_max_concurrent_calls);
                Some((gate, limit))
            }
        };
        Served {
            slot,
            handler,
            origin,
            signature: None,
            applied_at: SystemTime::now(),
            fallback,
            probation,
            stats: CallStats::default(),
            probation_failed,
            gate,
        }
    }

    /// The same version, vouched for by `signature`.
    pub(crate) fn with_signature(mut self, signature: Option<SignatureInfo>) -> Served {
        self.signature = signature;
        self
    }

    /// The signature that vouched for the module when it was applied, if one was checked.
    pub fn signature(&self) -> Option<&SignatureInfo> {
        self.signature.as_ref()
    }

    /// The slot it serves.
    pub fn slot(&self) -> &SlotKey {
        &self.slot
    }

    /// The loaded module.
    pub fn handler(&self) -> &Arc<Handler> {
        &self.handler
    }

    /// Module id: `builtin:<name>` or the file path.
    pub fn module(&self) -> &str {
        self.handler.module()
    }

    /// sha256 of the module, hex.
    pub fn sha256(&self) -> &str {
        self.handler.sha256()
    }

    /// Where it came from.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// The entry it was configured by, if not a built-in.
    pub fn entry(&self) -> Option<&SlotEntry> {
        match &self.origin {
            Origin::Configured { entry, .. } => Some(entry),
            Origin::Builtin => None,
        }
    }

    /// When it was put in force.
    pub fn applied_at(&self) -> SystemTime {
        self.applied_at
    }

    /// Whether it exports `family`.
    pub fn implements(&self, family: Family) -> bool {
        self.handler.implements(family)
    }

    /// Whether it is still on probation.
    pub fn on_probation(&self) -> bool {
        self.probation
            .as_ref()
            .is_some_and(|p| !p.over.load(Ordering::Relaxed))
    }

    /// Its counters.
    pub fn stats(&self) -> &CallStats {
        &self.stats
    }

    /// How many calls of its slot run now; `None` for a built-in (not counted).
    pub fn running_calls(&self) -> Option<u32> {
        self.gate.as_ref().map(|(gate, _)| gate.running())
    }

    /// How many calls of its slot may run at once; `None` for a built-in (not limited).
    pub fn max_concurrent_calls(&self) -> Option<u32> {
        self.gate.as_ref().map(|(_, limit)| *limit)
    }

    /// `registration.validate` (see [`Handler::validate`]).
    pub fn validate(
        &self,
        cx: &CallContext,
        plugin: &PluginInfo,
        existing: Option<&RegisteredPlugin>,
    ) -> Result<Call<Result<Accepted, Refusal>>, HandlerError> {
        self.observe(
            Hook::Validate,
            |h| h.validate(cx, plugin, existing),
            |v| v.is_err(),
        )
    }

    /// `registration.register` (see [`Handler::register`]).
    pub fn register(
        &self,
        cx: &CallContext,
        plugin: &PluginInfo,
        facts: &RegistrationFacts,
    ) -> Result<Call<Result<(), Refusal>>, HandlerError> {
        self.observe(
            Hook::Register,
            |h| h.register(cx, plugin, facts),
            |v| v.is_err(),
        )
    }

    /// `registration.deregister` (see [`Handler::deregister`]).
    pub fn deregister(
        &self,
        cx: &CallContext,
        plugin: &PluginInfo,
    ) -> Result<Call<()>, HandlerError> {
        self.observe(Hook::Deregister, |h| h.deregister(cx, plugin), |_| false)
    }

    /// `allocation-policy.allocate` (see [`Handler::allocate`]).
    pub fn allocate(
        &self,
        cx: &CallContext,
        request: &AllocationRequest,
    ) -> Result<Call<Result<Vec<String>, Refusal>>, HandlerError> {
        self.observe(Hook::Allocate, |h| h.allocate(cx, request), |v| v.is_err())
    }

    /// Runs `call` on the module once its slot lets it in: counts it, and on failure counts the
    /// failure against the probation and hands the call to the fallback, if any.
    fn observe<T>(
        &self,
        hook: Hook,
        call: impl Fn(&Handler) -> Result<Call<T>, HandlerError>,
        refused: impl Fn(&T) -> bool,
    ) -> Result<Call<T>, HandlerError> {
        let started = Instant::now();
        let result = self.enter(hook).and_then(|_permit| call(&self.handler));
        let elapsed = started.elapsed();
        let err = match result {
            Ok(answer) => {
                self.stats.answered(elapsed, refused(&answer.value));
                self.clean_call();
                return Ok(answer);
            }
            Err(err) => err,
        };
        // A call stopping to run again off the async worker is no outcome yet; nor is a failure
        // whose fallback would run in place: both are decided, and counted once, on the rerun.
        if matches!(err.fault(), HandlerFault::HandedOff)
            || (self.fallback.is_some() && pluglet_handler_runtime::hand_off())
        {
            return Err(HandlerError {
                fault: HandlerFault::HandedOff,
                ..err
            });
        }
        let kind = FailureKind::of(err.fault());
        let message = pluglet_core::error_chain(&err);
        self.stats.failed(elapsed, kind, message.clone());
        if kind.is_the_modules() {
            self.failed_call(&message);
        }
        match &self.fallback {
            Some(builtin) => {
                tracing::warn!(
                    slot = %self.slot,
                    module = self.module(),
                    sha256 = self.sha256(),
                    error = %message,
                    builtin = builtin.module(),
                    "handler call failed; decided by the built-in (on_failure = \"builtin\")"
                );
                call(builtin)
            }
            None => Err(err),
        }
    }

    /// Waits until the slot runs fewer calls than its limit; gives up, with the module's error
    /// naming the limit, after the call's deadline (at least [`MIN_SLOT_WAIT`]).
    fn enter(
        &self,
        hook: Hook,
    ) -> Result<Option<pluglet_handler_runtime::GatePermit<'_>>, HandlerError> {
        let Some((gate, limit)) = &self.gate else {
            return Ok(None);
        };
        if let Some(permit) = gate.try_enter(*limit) {
            return Ok(Some(permit));
        }
        // Waiting would block an async worker: the call runs again off it, and waits there.
        if pluglet_handler_runtime::hand_off() {
            return Err(HandlerError {
                module: self.module().to_owned(),
                hook,
                fault: HandlerFault::HandedOff,
            });
        }
        let wait = self.handler.limits().deadline.max(MIN_SLOT_WAIT);
        gate.enter(*limit, Some(wait))
            .map(Some)
            .map_err(|waited| HandlerError {
                module: self.module().to_owned(),
                hook,
                fault: HandlerFault::Busy {
                    limit: *limit,
                    waited,
                },
            })
    }

    fn clean_call(&self) {
        let Some(p) = &self.probation else { return };
        if p.over.load(Ordering::Relaxed) {
            return;
        }
        if p.clean_streak.fetch_add(1, Ordering::Relaxed) + 1 >= PROBATION_CLEAN_CALLS {
            p.over.store(true, Ordering::Relaxed);
            tracing::info!(
                slot = %self.slot,
                module = self.module(),
                sha256 = self.sha256(),
                "handler passed its probation ({PROBATION_CLEAN_CALLS} clean calls in a row)"
            );
        }
    }

    /// Counts a failure against the probation; at `rollback_after`, reports it to the owner,
    /// here and now, so that the next call already runs on the version the owner puts back.
    fn failed_call(&self, message: &str) {
        let Some(p) = &self.probation else { return };
        if p.over.load(Ordering::Relaxed) {
            return;
        }
        p.clean_streak.store(0, Ordering::Relaxed);
        let failures = p.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures < p.rollback_after || p.triggered.swap(true, Ordering::SeqCst) {
            return;
        }
        let reason = format!(
            "{failures} failed calls during probation (rollback_after = {}); last: {message}",
            p.rollback_after
        );
        (self.probation_failed.0)(self, reason);
    }
}
