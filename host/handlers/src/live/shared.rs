//! The live set's shared state: the set in force, the writer's lock and what it owns, the
//! change log, the state directory and the event sinks; and what the transaction and the
//! rollbacks both use (recording, persisting, making a served version).

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use arc_swap::ArcSwap;
use pluglet_core::events::{EventKind, EventLog};
use pluglet_handler_runtime::{CallGate, Handler, Runtime};
use tokio::sync::broadcast;

use super::builtins::Builtins;
use super::status::{ChangeRecord, ChangeState, HandlersEvent};
use crate::file::{self, FileError, HANDLERS_FILE, HandlersFile};
use crate::integrity::Trust;
use crate::served::{Origin, ProbationFailed, Served};
use crate::set::HandlerSet;
use crate::slot::SlotKey;
use crate::state::{Applied, Decision, StateStore, Version};

/// What the writer owns besides the set: the decisions, and the versions last recorded as
/// applied.
pub(super) struct Writer {
    pub(super) decisions: Vec<Decision>,
    pub(super) applied: Option<Vec<Applied>>,
}

/// Changes of the slots and the file, for `ctl handlers`.
#[derive(Default)]
pub(super) struct ChangeLog {
    pub(super) file: Option<ChangeRecord>,
    pub(super) slots: BTreeMap<SlotKey, ChangeRecord>,
}

/// The live set's shared state (see the module doc).
pub(crate) struct Shared {
    pub(super) runtime: Runtime,
    pub(super) dir: PathBuf,
    pub(super) builtins: Builtins,
    pub(super) trust: Trust,
    pub(super) set: ArcSwap<HandlerSet>,
    pub(super) writer: Mutex<Writer>,
    pub(super) changes: Mutex<ChangeLog>,
    pub(super) store: Option<StateStore>,
    pub(super) events: broadcast::Sender<HandlersEvent>,
    /// The daemon's event log, once given.
    pub(super) log: std::sync::OnceLock<EventLog>,
    /// Events recorded before the log was given (a refusal at start), handed to it then.
    pub(super) early_events: Mutex<Vec<(EventKind, String, String)>>,
    /// Whether `handlers.toml` had any text when it was last read.
    pub(super) had_text: std::sync::atomic::AtomicBool,
    /// Where a served version reports a failed probation (rolls it back, see
    /// [`Shared::served`]).
    pub(super) probation_failed: ProbationFailed,
    /// Per slot: the calls running, whichever version of the slot runs them.
    pub(super) gates: Mutex<BTreeMap<SlotKey, Arc<CallGate>>>,
    /// Where `oci://` modules are pulled from and kept.
    pub(super) sources: crate::source::Sources,
    /// Whether the last change was refused because a module could not be pulled (the watcher
    /// then retries it with backoff).
    pub(super) pull_failed: std::sync::atomic::AtomicBool,
    /// The entries fleet rollouts put in force, by slot: they win over `handlers.toml`.
    pub(super) rollouts: Mutex<BTreeMap<SlotKey, crate::file::SlotEntry>>,
    /// Held by a reload for its whole length: a reload that read `handlers.toml` and the
    /// entries of rollouts never swaps its set in after a later one (the watcher and a rollout
    /// reload from different threads).
    pub(super) reloading: Mutex<()>,
}

impl Shared {
    /// A version of `slot` served by this set: a configured one counts its calls at the slot's
    /// gate, and reports a failed probation here (see [`Served::new`]).
    pub(super) fn served(
        &self,
        slot: SlotKey,
        handler: Arc<Handler>,
        origin: Origin,
        builtin: Option<&Arc<Handler>>,
        on_probation: bool,
    ) -> Served {
        let gate = matches!(origin, Origin::Configured { .. }).then(|| self.gate(&slot));
        Served::new(
            slot,
            handler,
            origin,
            builtin,
            on_probation,
            gate,
            self.probation_failed.clone(),
        )
    }

    /// The gate counting the calls of `slot` (one per slot, shared by its versions).
    fn gate(&self, slot: &SlotKey) -> Arc<CallGate> {
        let mut gates = self.gates.lock().unwrap_or_else(|e| e.into_inner());
        gates.entry(slot.clone()).or_default().clone()
    }

    pub(super) fn record(
        &self,
        kind: EventKind,
        subject: impl FnOnce() -> String,
        message: impl FnOnce() -> String,
    ) {
        match self.log.get() {
            Some(log) => log.record(kind, subject(), message()),
            None => self
                .early_events
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((kind, subject(), message())),
        }
    }

    /// Reads `handlers.toml` at start, noting whether it has text.
    pub(super) fn read_file(&self) -> Result<HandlersFile, FileError> {
        let path = self.dir.join(HANDLERS_FILE);
        let text = file::read_text(&path)?;
        self.had_text.store(
            text.as_deref().is_some_and(|t| !t.trim().is_empty()),
            std::sync::atomic::Ordering::Relaxed,
        );
        let mut file = match text {
            Some(text) => file::parse(&self.dir, &path, &text)?,
            None => HandlersFile::default(),
        };
        self.with_rollouts(&mut file);
        Ok(file)
    }

    /// `file` with the entries of fleet rollouts over its own.
    pub(super) fn with_rollouts(&self, file: &mut HandlersFile) {
        for (slot, entry) in self.lock_rollouts().iter() {
            file.entries.insert(slot.clone(), entry.clone());
        }
    }

    /// `handlers.toml` as a whole was refused (it cannot be read or parsed): recorded for
    /// `ctl handlers`, the log and the events; returns the reason.
    pub(super) fn file_refused(&self, err: &FileError) -> String {
        let path = self.dir.join(HANDLERS_FILE);
        let reason = pluglet_core::error_chain(err);
        tracing::warn!(file = %path.display(), error = %reason, "handlers change refused; the handlers in force keep serving");
        self.lock_changes().file = Some(ChangeRecord {
            state: ChangeState::Refused,
            at: SystemTime::now(),
            reason: reason.clone(),
            module: None,
            sha256: None,
        });
        self.record(
            EventKind::HandlerRefused,
            || HANDLERS_FILE.to_owned(),
            || reason.clone(),
        );
        let _ = self.events.send(HandlersEvent::Refused {
            reason: reason.clone(),
        });
        reason
    }

    pub(super) fn lock_changes(&self) -> std::sync::MutexGuard<'_, ChangeLog> {
        self.changes.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn lock_rollouts(
        &self,
    ) -> std::sync::MutexGuard<'_, BTreeMap<SlotKey, crate::file::SlotEntry>> {
        self.rollouts.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn lock_reloading(&self) -> std::sync::MutexGuard<'_, ()> {
        self.reloading.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn lock_writer(&self) -> std::sync::MutexGuard<'_, Writer> {
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Saves the decisions (when they changed) and the versions `set` puts the slots on (when
    /// they changed), and drops kept modules nothing refers to any more.
    pub(super) fn persist(&self, writer: &mut Writer, decisions_changed: bool, set: &HandlerSet) {
        let Some(store) = &self.store else { return };
        if decisions_changed && let Err(e) = store.save_decisions(&writer.decisions) {
            tracing::warn!(error = %e, "cannot save handler rollback decisions; a rollback will not survive a restart");
        }
        let applied: Vec<Applied> = set
            .slots()
            .filter_map(|(slot, state)| match state.current.origin() {
                Origin::Configured { entry, sha256 } => Some(Applied {
                    slot,
                    version: Version {
                        sha256: sha256.clone(),
                        entry: entry.clone(),
                    },
                    signature: state.current.signature().cloned(),
                }),
                Origin::Builtin => None,
            })
            .collect();
        if writer.applied.as_ref() != Some(&applied) {
            match store.save_applied(&applied) {
                Ok(()) => writer.applied = Some(applied),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot save the handler versions applied; a restart may start from older ones");
                }
            }
        }
        let mut keep: HashSet<String> = HashSet::new();
        for (_, state) in set.slots() {
            for served in std::iter::once(&state.current).chain(state.previous.iter()) {
                if let Origin::Configured { sha256, .. } = served.origin() {
                    keep.insert(sha256.clone());
                }
            }
        }
        for d in &writer.decisions {
            if let Some(r) = &d.restored {
                keep.insert(r.sha256.clone());
            }
        }
        store.retain_modules(&keep);
    }
}
