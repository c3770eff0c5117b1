//! The live handler set: the [`HandlerSet`] in force behind an `ArcSwap`, and the one writer that
//! changes it.
//!
//! Readers (every hook call) load the set without a lock and keep the [`Served`] they got for
//! the whole of their work. Writers are a change of the handlers directory ([`Handlers::reload`],
//! a transaction), a rollback by hand ([`Handlers::roll_back`]) and a rollback of a failing new
//! module (from the call that reached `rollback_after`); they take the writer lock only to build
//! and swap the next set, never while compiling.
//!
//! A reload is one transaction: `handlers.toml` is parsed, every module it names is read and
//! hashed, every entry whose module or entry changed is compiled and admitted (imports, contract,
//! the slot's family), and only when every entry passes is the new set swapped in. Otherwise
//! nothing changes and the refusal is kept for `ctl handlers` until the next successful change.
//! A module applied with a vectors file beside it must pass every case first (see
//! [`crate::Vectors`]); the vectors are checked when the module is applied, so a change of the
//! vectors file alone does not re-check a module already in force.
//!
//! By concept: [`Handlers`] here (start, reload, status), the shared state and what every
//! writer uses (`shared`), the transaction (`transaction`, with the pin and signature check),
//! rollbacks (`rollback`), what the set reports about itself (`status`) and the built-ins
//! (`builtins`). A failing new module reaches `rollback` through the callback this set gives
//! each [`Served`] it makes, not through a pointer of its own.

mod builtins;
mod rollback;
mod shared;
mod status;
mod transaction;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use arc_swap::ArcSwap;
use pluglet_core::events::EventLog;
use pluglet_handler_runtime::{Handler, LoadError, ModuleSource, Runtime};
use tokio::sync::broadcast;

pub use builtins::Builtins;
pub use rollback::RollbackError;
use shared::{ChangeLog, Shared, Writer};
pub use status::{
    ChangeRecord, ChangeState, EntryRefusal, HandlersEvent, ReloadOutcome, SlotStatus, Status,
};
use transaction::TransactionError;

use crate::file::{self, FileError, HANDLERS_FILE, HandlersFile, SlotEntry};
use crate::integrity::Trust;
use crate::served::{Origin, ProbationFailed, Served};
use crate::set::{HandlerSet, SlotState};
use crate::slot::SlotKey;
use crate::state::{Applied, StateStore};

/// Why the handler set could not be loaded at start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// `handlers.toml` as a whole.
    #[error(transparent)]
    File(#[from] FileError),
    /// Entries that cannot be applied.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Entries(Vec<EntryRefusal>),
    /// A built-in module could not be loaded (a build problem, not a configuration one).
    #[error("built-in handler failed to load")]
    Builtin(#[source] LoadError),
    /// The state directory could not be opened.
    #[error("cannot open the handler state in {path}")]
    State {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The live handler set: cheap to clone; every clone is the same set.
#[derive(Clone)]
pub struct Handlers {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Handlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handlers")
            .field("dir", &self.shared.dir)
            .field("generation", &self.shared.set.load().generation)
            .finish_non_exhaustive()
    }
}

impl Handlers {
    /// The built-in handlers alone, with no `handlers.toml` and no state directory: what
    /// tests, benchmarks and tools that need no vendor module run with.
    pub fn builtins_only(runtime: Runtime) -> Result<Handlers, StartError> {
        let builtins = Builtins::embedded(&runtime).map_err(StartError::Builtin)?;
        Handlers::load(
            runtime,
            Path::new("/nonexistent-handlers-dir"),
            None,
            builtins,
            Trust::default(),
        )
    }

    /// Loads the set from `dir` at start: the built-ins, then the versions last applied (kept in
    /// `state_dir`), then `handlers.toml` if present, applied to them as a live change is. A
    /// change that is refused leaves every slot on the version last applied to it and is
    /// reported as a live refusal is; only an entry refused for a slot that never had a version
    /// applied fails the start (naming the file, entry and reason), as does a `handlers.toml`
    /// that cannot be read when none was ever applied. `state_dir` keeps rollback decisions and
    /// the versions applied across restarts (`None`: not kept). `trust`: the keys that sign
    /// modules and whether a signature is required.
    pub fn load(
        runtime: Runtime,
        dir: &Path,
        state_dir: Option<&Path>,
        builtins: Builtins,
        trust: Trust,
    ) -> Result<Handlers, StartError> {
        Handlers::load_with_registry(
            runtime,
            dir,
            state_dir,
            builtins,
            trust,
            pluglet_oci::RegistryOptions::default(),
        )
    }

    /// [`Handlers::load`], with `registry`: how the registries of `oci://` modules are reached.
    /// A module named by an OCI reference is pulled when its entry is first applied and kept by
    /// digest in `<state_dir>/handlers/oci/`; a restart serves the digest in force without
    /// asking the registry.
    pub fn load_with_registry(
        runtime: Runtime,
        dir: &Path,
        state_dir: Option<&Path>,
        builtins: Builtins,
        trust: Trust,
        registry: pluglet_oci::RegistryOptions,
    ) -> Result<Handlers, StartError> {
        let store = state_dir
            .map(|state| {
                StateStore::open(state).map_err(|source| StartError::State {
                    path: state.to_path_buf(),
                    source,
                })
            })
            .transpose()?;
        let decisions = store
            .as_ref()
            .map(StateStore::decisions)
            .unwrap_or_default();
        let applied = store.as_ref().and_then(StateStore::applied);
        let rollouts = store.as_ref().map(StateStore::rollouts).unwrap_or_default();
        let shared = Arc::new_cyclic(|me: &Weak<Shared>| {
            // Where every version this set serves reports a failed probation: a rollback, as
            // long as the set exists.
            let owner = me.clone();
            let probation_failed = ProbationFailed::new(move |served, reason| {
                if let Some(shared) = owner.upgrade() {
                    shared.roll_back_failing(served, reason);
                }
            });
            let builtin = |slot: SlotKey, handler: &Arc<Handler>| SlotState {
                current: Arc::new(Served::new(
                    slot,
                    handler.clone(),
                    Origin::Builtin,
                    None,
                    false,
                    None,
                    probation_failed.clone(),
                )),
                previous: None,
            };
            let set = HandlerSet {
                generation: 0,
                plugin_types: builtins
                    .plugin_types
                    .iter()
                    .map(|(t, h)| (t.clone(), builtin(SlotKey::PluginType(t.clone()), h)))
                    .collect(),
                resources: BTreeMap::new(),
                default_policy: builtin(SlotKey::DefaultPolicy, &builtins.policy),
            };
            Shared {
                runtime,
                dir: dir.to_path_buf(),
                builtins,
                trust,
                set: ArcSwap::from_pointee(set),
                writer: Mutex::new(Writer {
                    decisions,
                    applied: applied.clone(),
                }),
                changes: Mutex::new(ChangeLog::default()),
                store,
                events: broadcast::channel(256).0,
                log: std::sync::OnceLock::new(),
                early_events: Mutex::new(Vec::new()),
                had_text: std::sync::atomic::AtomicBool::new(false),
                probation_failed,
                gates: Mutex::new(BTreeMap::new()),
                sources: crate::source::Sources::new(registry, state_dir),
                pull_failed: std::sync::atomic::AtomicBool::new(false),
                rollouts: Mutex::new(rollouts),
                reloading: Mutex::new(()),
            }
        });
        let handlers = Handlers { shared };
        if let Some(applied) = &applied {
            handlers.shared.restore_applied(applied);
        }
        let mut file = match handlers.shared.read_file() {
            Ok(file) => file,
            // Applied before: the file is refused as a live change of it would be.
            Err(err) if applied.is_some() => {
                handlers.shared.file_refused(&err);
                return Ok(handlers);
            }
            Err(err) => return Err(err.into()),
        };
        let resolved = handlers
            .shared
            .resolve_sources(&mut file, &|_| false)
            .map_err(TransactionError::Entries);
        match resolved.and_then(|()| handlers.shared.transaction(file, true)) {
            Ok(_) => {
                handlers.shared.rollbacks_in_force();
                Ok(handlers)
            }
            Err(TransactionError::Entries(refusals)) => {
                // Refused as a live change: every slot stays on the version last applied to
                // it. A slot that never had one has nothing to serve the entry's intent.
                let base = handlers.current();
                let never_applied: Vec<EntryRefusal> = refusals
                    .into_iter()
                    .filter(|r| {
                        base.slot(&r.slot)
                            .is_none_or(|s| s.current.entry().is_none())
                    })
                    .collect();
                if never_applied.is_empty() {
                    Ok(handlers)
                } else {
                    Err(StartError::Entries(never_applied))
                }
            }
        }
    }

    /// The set in force (a snapshot: later changes do not show in it).
    pub fn current(&self) -> Arc<HandlerSet> {
        self.shared.set.load_full()
    }

    /// The registration handler in force for a plugin type (`None`: an unknown type).
    pub fn for_plugin_type(&self, plugin_type: &str) -> Option<Arc<Served>> {
        self.shared.set.load().for_plugin_type(plugin_type)
    }

    /// The allocation policy in force for a resource.
    pub fn for_resource(&self, resource: &str) -> Arc<Served> {
        self.shared.set.load().for_resource(resource)
    }

    /// The handlers directory.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Events from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<HandlersEvent> {
        self.shared.events.subscribe()
    }

    /// Records every change applied, refused or rolled back in `log` from now on (the first log
    /// given is kept).
    pub fn with_events(self, log: EventLog) -> Handlers {
        let early = std::mem::take(
            &mut *self
                .shared
                .early_events
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        for (kind, subject, message) in early {
            log.record(kind, subject, message);
        }
        if self.shared.log.set(log).is_err() {
            tracing::warn!("the handler set records in the event log it was given first");
        }
        self
    }

    /// Reads the handlers directory again and applies what changed, as one transaction (see
    /// the module doc). An empty `handlers.toml` that had text when it was last read is taken
    /// as caught between its truncation and its write: nothing is decided
    /// ([`ReloadOutcome::Waiting`]). Compiles: call it off the async reactor.
    pub fn reload(&self) -> ReloadOutcome {
        self.reload_file(false, &|_| false)
    }

    /// Like [`Handlers::reload`], resolving the tag of every `oci://` entry whose slot `which`
    /// selects again (a digest in force is otherwise kept): a moved tag is pulled and applied
    /// through the same transaction; an unmoved one changes nothing and downloads nothing.
    pub fn refresh(&self, which: &dyn Fn(&SlotKey) -> bool) -> ReloadOutcome {
        self.reload_file(true, which)
    }

    /// Whether the last change was refused because a module named by an OCI reference could
    /// not be pulled: the watcher retries it with backoff until it applies or the entry
    /// changes.
    pub fn awaiting_pull(&self) -> bool {
        self.shared
            .pull_failed
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Pulls of `oci://` modules by outcome, and their durations, since start.
    pub fn pull_stats(&self) -> crate::source::PullStats {
        self.shared.sources.stats()
    }

    /// Like [`Handlers::reload`], the caller knowing that `handlers.toml` is written whole (its
    /// writer is done): an empty file is a file without entries.
    pub fn reload_written(&self) -> ReloadOutcome {
        self.reload_file(true, &|_| false)
    }

    fn reload_file(&self, written: bool, refresh: &dyn Fn(&SlotKey) -> bool) -> ReloadOutcome {
        let _reloading = self.shared.lock_reloading();
        self.reload_locked(written, refresh)
    }

    /// A reload, the caller holding the reload lock.
    fn reload_locked(&self, written: bool, refresh: &dyn Fn(&SlotKey) -> bool) -> ReloadOutcome {
        use std::sync::atomic::Ordering;
        let path = self.shared.dir.join(HANDLERS_FILE);
        let text = match file::read_text(&path) {
            Ok(text) => text,
            Err(err) => return ReloadOutcome::Refused(self.shared.file_refused(&err)),
        };
        let blank = text.as_deref().is_some_and(|t| t.trim().is_empty());
        if blank && !written && self.shared.had_text.load(Ordering::Relaxed) {
            let why = format!(
                "{} is empty but had entries a moment ago: taken as half-written, nothing                  applied; waiting for its writer to finish",
                path.display()
            );
            tracing::info!(file = %path.display(), "{why}");
            return ReloadOutcome::Waiting(why);
        }
        self.shared.had_text.store(
            text.as_deref().is_some_and(|t| !t.trim().is_empty()),
            Ordering::Relaxed,
        );
        let mut file = match text.map_or(Ok(HandlersFile::default()), |t| {
            file::parse(&self.shared.dir, &path, &t)
        }) {
            Ok(file) => file,
            Err(err) => return ReloadOutcome::Refused(self.shared.file_refused(&err)),
        };
        self.shared.with_rollouts(&mut file);
        let resolved = self
            .shared
            .resolve_sources(&mut file, refresh)
            .map_err(TransactionError::Entries);
        match resolved.and_then(|()| self.shared.transaction(file, false)) {
            Ok(slots) if slots.is_empty() => ReloadOutcome::Unchanged,
            Ok(slots) => ReloadOutcome::Applied(slots),
            Err(TransactionError::Entries(refusals)) => ReloadOutcome::Refused(
                refusals
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
        }
    }

    /// The entries fleet rollouts put in force, by slot (they win over `handlers.toml`).
    pub fn rollout_entries(&self) -> BTreeMap<SlotKey, SlotEntry> {
        self.shared.lock_rollouts().clone()
    }

    /// Replaces the entries of fleet rollouts with `entries` and applies `handlers.toml` under
    /// them as one transaction: a slot a rollout no longer names returns to its `handlers.toml`
    /// entry or its built-in. Once applied (or unchanged) the entries are kept in the state
    /// directory, so they survive a restart; a refused change leaves the entries in force before
    /// it (a module that cannot be pulled or admitted never blocks later changes of
    /// `handlers.toml`). Compiles and may pull: call it off the async reactor.
    pub fn set_rollout_entries(&self, entries: BTreeMap<SlotKey, SlotEntry>) -> ReloadOutcome {
        let _reloading = self.shared.lock_reloading();
        let before = std::mem::replace(&mut *self.shared.lock_rollouts(), entries.clone());
        let outcome = self.reload_locked(true, &|_| false);
        if matches!(outcome, ReloadOutcome::Refused(_)) {
            *self.shared.lock_rollouts() = before;
            return outcome;
        }
        if before != entries
            && let Some(store) = &self.shared.store
            && let Err(e) = store.save_rollouts(&entries)
        {
            tracing::warn!(error = %e, "cannot keep the entries of fleet rollouts in the state directory; they will not survive a restart");
        }
        outcome
    }

    /// The rollback decisions in force: versions rolled back and not applied again until
    /// their entry changes.
    pub fn rollbacks(&self) -> Vec<crate::state::Decision> {
        self.shared.lock_writer().decisions.clone()
    }

    /// Puts the previous version of `slot` back (or the built-in, if none is kept), by hand.
    pub fn roll_back(&self, slot: &SlotKey) -> Result<Arc<Served>, RollbackError> {
        self.shared.roll_back(
            slot,
            None,
            "rolled back by hand (pluglet ctl handlers rollback)",
        )
    }

    /// The set in force and the last changes.
    pub fn status(&self) -> Status {
        // The change log's lock first: a change swaps the set and records itself under it.
        let changes = self.shared.lock_changes();
        let set = self.current();
        Status {
            generation: set.generation,
            slots: set
                .slots()
                .map(|(slot, state)| SlotStatus {
                    last_change: changes.slots.get(&slot).cloned(),
                    slot,
                    current: state.current.clone(),
                    previous: state.previous.clone(),
                })
                .collect(),
            last_change: changes.file.clone(),
        }
    }

    /// Directories that hold the modules in force outside the handlers directory (to watch
    /// them too).
    pub fn module_dirs(&self) -> Vec<PathBuf> {
        let set = self.current();
        let mut dirs: Vec<PathBuf> = set
            .slots()
            .filter_map(|(_, s)| s.current.entry().map(|e| e.module.clone()))
            .filter_map(|m| m.parent().map(Path::to_path_buf))
            .filter(|d| d != &self.shared.dir)
            .collect();
        dirs.sort();
        dirs.dedup();
        dirs
    }
}

impl Shared {
    /// Gives every `oci://` entry of `file` its digest and pulled module (see
    /// [`crate::source`]); the entries that cannot be pulled are refused as a transaction
    /// refuses them.
    fn resolve_sources(
        &self,
        file: &mut HandlersFile,
        refresh: &dyn Fn(&SlotKey) -> bool,
    ) -> Result<(), Vec<EntryRefusal>> {
        use std::sync::atomic::Ordering;
        if file.entries.values().all(|e| e.source.is_none()) {
            self.pull_failed.store(false, Ordering::Relaxed);
            return Ok(());
        }
        let base = self.set.load_full();
        let in_force = |slot: &SlotKey, source: &str| {
            base.slot(slot)
                .and_then(|s| s.current.entry().cloned())
                .filter(|e| e.source.as_deref() == Some(source))
                .and_then(|e| e.digest)
        };
        let unresolved = file.clone();
        let resolved = self.sources.resolve(file, in_force, refresh);
        self.pull_failed.store(resolved.is_err(), Ordering::Relaxed);
        resolved.map_err(|unpulled| self.refuse_unpulled(&unresolved, unpulled))
    }

    /// At start, before `handlers.toml` is read: puts each slot back on the configured version
    /// last applied to it, from the bytes kept by digest. A version that cannot be loaded, or
    /// whose signature the daemon no longer trusts, is left out (the slot starts on its
    /// built-in, and `handlers.toml` decides it as on a first start).
    fn restore_applied(&self, applied: &[Applied]) {
        let Some(store) = &self.store else { return };
        let mut set = (*self.set.load_full()).clone();
        for kept in applied {
            let slot = &kept.slot;
            let module = kept.version.entry.module.display().to_string();
            let skip = |why: String| {
                tracing::warn!(%slot, module, sha256 = %kept.version.sha256, reason = why, "the version last applied cannot be restored; the slot starts from its built-in");
            };
            if self.trust.require
                && !kept
                    .signature
                    .as_ref()
                    .is_some_and(|s| self.trust.keys.iter().any(|k| k.id() == s.key_id))
            {
                skip("its signature is not by a key trusted now (--require-signatures)".into());
                continue;
            }
            let bytes = match store.module(&kept.version.sha256) {
                Ok(bytes) => bytes,
                Err(e) => {
                    skip(format!("kept module: {e}"));
                    continue;
                }
            };
            let limits = kept
                .version
                .entry
                .limits(self.runtime.config().default_limits);
            let handler = match self.runtime.load(
                ModuleSource::Bytes {
                    id: module.clone(),
                    bytes: bytes.into(),
                },
                kept.version.entry.settings.clone(),
                Some(limits),
            ) {
                Ok(handler) => handler,
                Err(e) => {
                    skip(pluglet_core::error_chain(&e));
                    continue;
                }
            };
            if !handler.implements(slot.family()) {
                skip(format!("it does not export the {} family", slot.family()));
                continue;
            }
            let served = self
                .served(
                    slot.clone(),
                    handler,
                    Origin::Configured {
                        entry: kept.version.entry.clone(),
                        sha256: kept.version.sha256.clone(),
                    },
                    self.builtins.for_slot(slot),
                    false,
                )
                .with_signature(kept.signature.clone());
            set = set.with_slot(
                slot,
                Some(SlotState {
                    current: Arc::new(served),
                    previous: None,
                }),
            );
        }
        set.generation = 0;
        self.set.store(Arc::new(set));
    }
}
