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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::SystemTime;

use arc_swap::ArcSwap;
use pluglet_core::events::{EventKind, EventLog};
use pluglet_handler_runtime::{CallGate, Handler, LoadError, ModuleSource, Runtime};
use sha2::{Digest, Sha256};
use tokio::sync::broadcast;

use crate::file::{self, Entry, FileError, HANDLERS_FILE, HandlersFile};
use crate::integrity::{self, SignatureInfo, Trust, Verdict};
use crate::served::{Origin, Served};
use crate::set::{HandlerSet, SlotState};
use crate::slot::SlotKey;
use crate::state::{Applied, Decision, StateStore, Version};

/// The built-in modules, loaded once.
#[derive(Clone, Debug)]
pub struct Builtins {
    plugin_types: BTreeMap<String, Arc<Handler>>,
    policy: Arc<Handler>,
}

impl Builtins {
    /// The modules embedded in the binary: `builtin:csi` for `CSIPlugin`,
    /// `builtin:device-plugin` for `DevicePlugin` and as the default allocation policy.
    pub fn embedded(runtime: &Runtime) -> Result<Builtins, LoadError> {
        let device_plugin = || ModuleSource::Builtin {
            name: "device-plugin".to_owned(),
            bytes: pluglet_wasm_guests::DEVICE_PLUGIN,
        };
        Builtins::load(
            runtime,
            vec![
                (
                    pluglet_core::names::CSI_PLUGIN.to_owned(),
                    ModuleSource::Builtin {
                        name: "csi".to_owned(),
                        bytes: pluglet_wasm_guests::CSI,
                    },
                ),
                (
                    pluglet_core::names::DEVICE_PLUGIN.to_owned(),
                    device_plugin(),
                ),
            ],
            device_plugin(),
        )
    }

    /// Loads each distinct module once, with the runtime's default limits and no settings.
    pub fn load(
        runtime: &Runtime,
        plugin_types: Vec<(String, ModuleSource)>,
        policy: ModuleSource,
    ) -> Result<Builtins, LoadError> {
        let mut loaded: BTreeMap<String, Arc<Handler>> = BTreeMap::new();
        let mut load = |source: ModuleSource| -> Result<Arc<Handler>, LoadError> {
            let id = source.id();
            if let Some(handler) = loaded.get(&id) {
                return Ok(handler.clone());
            }
            let handler = runtime.load(source, BTreeMap::new(), None)?;
            loaded.insert(id, handler.clone());
            Ok(handler)
        };
        let mut types = BTreeMap::new();
        for (plugin_type, source) in plugin_types {
            types.insert(plugin_type, load(source)?);
        }
        let policy = load(policy)?;
        Ok(Builtins {
            plugin_types: types,
            policy,
        })
    }

    /// The built-in that serves `slot` when nothing is configured, if there is one.
    pub fn for_slot(&self, slot: &SlotKey) -> Option<&Arc<Handler>> {
        match slot {
            SlotKey::PluginType(t) => self.plugin_types.get(t),
            SlotKey::Resource(_) | SlotKey::DefaultPolicy => Some(&self.policy),
        }
    }
}

/// What became of a change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeState {
    /// Put in force.
    Applied,
    /// Refused; the set in force kept serving.
    Refused,
    /// Rolled back to the previous version.
    RolledBack,
    /// Waiting, the version in force serving: a module file that changed while the pin still
    /// names the version in force, or a signature installed before the module it signs.
    Pending,
}

impl std::fmt::Display for ChangeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ChangeState::Applied => "applied",
            ChangeState::Refused => "refused",
            ChangeState::RolledBack => "rolled_back",
            ChangeState::Pending => "pending",
        })
    }
}

/// The last change of a slot, or of the file as a whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChangeRecord {
    /// What became of it.
    pub state: ChangeState,
    /// When.
    pub at: SystemTime,
    /// Why (what changed, what was wrong, why it was rolled back).
    pub reason: String,
    /// The module file concerned, if any.
    pub module: Option<String>,
    /// Its sha256, when it could be read.
    pub sha256: Option<String>,
}

/// One slot as `ctl handlers` shows it.
#[derive(Clone, Debug)]
pub struct SlotStatus {
    /// The slot.
    pub slot: SlotKey,
    /// The version in force.
    pub current: Arc<Served>,
    /// The previous version, kept warm.
    pub previous: Option<Arc<Served>>,
    /// The last change of the slot that was refused, rolled back or applied.
    pub last_change: Option<ChangeRecord>,
}

/// The set in force and the last changes.
#[derive(Clone, Debug)]
pub struct Status {
    /// Generation of the set in force.
    pub generation: u64,
    /// Every slot.
    pub slots: Vec<SlotStatus>,
    /// A refusal of the file as a whole (syntax, unknown key), until the next successful change.
    pub last_change: Option<ChangeRecord>,
}

/// What the set did, for tests and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HandlersEvent {
    /// A new set is in force.
    Applied {
        /// Its generation.
        generation: u64,
        /// The slots that changed.
        slots: Vec<SlotKey>,
    },
    /// A change was refused; nothing changed.
    Refused {
        /// Why, whole.
        reason: String,
    },
    /// A slot was rolled back.
    RolledBack {
        /// The slot.
        slot: SlotKey,
        /// Why.
        reason: String,
    },
}

/// What [`Handlers::reload`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// A new set is in force; these slots changed.
    Applied(Vec<SlotKey>),
    /// Nothing that serves calls changed.
    Unchanged,
    /// Refused (the reasons, one per line); the set in force keeps serving.
    Refused(String),
    /// `handlers.toml` looks half-written (empty, when it was not a moment ago): nothing was
    /// decided; read it again once its writer is done ([`Handlers::reload_written`]).
    Waiting(String),
}

/// One entry that cannot be applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryRefusal {
    /// `handlers.toml`.
    pub file: PathBuf,
    /// The slot.
    pub slot: SlotKey,
    /// The module file.
    pub module: PathBuf,
    /// Its sha256, when it could be read.
    pub sha256: Option<String>,
    /// What is wrong and what to do.
    pub reason: String,
}

impl std::fmt::Display for EntryRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: entry {}: module {}",
            self.file.display(),
            self.slot.entry_name(),
            self.module.display()
        )?;
        if let Some(sha) = &self.sha256 {
            write!(f, " (sha256 {sha})")?;
        }
        write!(f, ": {}", self.reason)
    }
}

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

/// Why a rollback could not be done.
#[derive(Debug, thiserror::Error)]
pub enum RollbackError {
    /// The set has no such slot.
    #[error("no handler serves {0}; `pluglet ctl handlers` lists the slots")]
    NoSuchSlot(SlotKey),
    /// Nothing to go back to.
    #[error("{0} has no previous version and no built-in to go back to")]
    NothingToRollBackTo(SlotKey),
    /// The slot is on its built-in already.
    #[error("{0} is already served by its built-in; there is nothing to roll back")]
    AlreadyBuiltin(SlotKey),
}

/// What the writer owns besides the set: the decisions, and the versions last recorded as
/// applied.
struct Writer {
    decisions: Vec<Decision>,
    applied: Option<Vec<Applied>>,
}

/// Changes of the slots and the file, for `ctl handlers`.
#[derive(Default)]
struct ChangeLog {
    file: Option<ChangeRecord>,
    slots: BTreeMap<SlotKey, ChangeRecord>,
}

/// The live set's shared state (see the module doc).
pub(crate) struct Shared {
    runtime: Runtime,
    dir: PathBuf,
    builtins: Builtins,
    trust: Trust,
    set: ArcSwap<HandlerSet>,
    writer: Mutex<Writer>,
    changes: Mutex<ChangeLog>,
    store: Option<StateStore>,
    events: broadcast::Sender<HandlersEvent>,
    /// The daemon's event log, once given.
    log: std::sync::OnceLock<EventLog>,
    /// Events recorded before the log was given (a refusal at start), handed to it then.
    early_events: Mutex<Vec<(EventKind, String, String)>>,
    /// Whether `handlers.toml` had any text when it was last read.
    had_text: std::sync::atomic::AtomicBool,
    me: Weak<Shared>,
    /// Per slot: the calls running, whichever version of the slot runs them.
    gates: Mutex<BTreeMap<SlotKey, Arc<CallGate>>>,
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

/// How one slot is to be served after a change.
enum Plan {
    /// As it is.
    Keep,
    /// As it is, with a change waiting (recorded as pending).
    Pending(ChangeRecord),
    /// By a newly loaded (or reused) handler.
    Apply {
        handler: Arc<Handler>,
        version: Version,
        bytes: Option<Arc<[u8]>>,
        signature: Option<SignatureInfo>,
    },
    /// By the version a rollback decision restored.
    Restore {
        handler: Arc<Handler>,
        origin: Origin,
        signature: Option<SignatureInfo>,
        reason: String,
    },
    /// By the built-in (the entry was removed).
    Builtin,
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
        let shared = Arc::new_cyclic(|me: &Weak<Shared>| {
            let builtin = |slot: SlotKey, handler: &Arc<Handler>| SlotState {
                current: Arc::new(Served::new(
                    slot,
                    handler.clone(),
                    Origin::Builtin,
                    None,
                    false,
                    me.clone(),
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
                me: me.clone(),
                gates: Mutex::new(BTreeMap::new()),
            }
        });
        let handlers = Handlers { shared };
        if let Some(applied) = &applied {
            handlers.shared.restore_applied(applied);
        }
        let file = match handlers.shared.read_file() {
            Ok(file) => file,
            // Applied before: the file is refused as a live change of it would be.
            Err(err) if applied.is_some() => {
                handlers.shared.file_refused(&err);
                return Ok(handlers);
            }
            Err(err) => return Err(err.into()),
        };
        match handlers.shared.transaction(file, true) {
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
        self.reload_file(false)
    }

    /// Like [`Handlers::reload`], the caller knowing that `handlers.toml` is written whole (its
    /// writer is done): an empty file is a file without entries.
    pub fn reload_written(&self) -> ReloadOutcome {
        self.reload_file(true)
    }

    fn reload_file(&self, written: bool) -> ReloadOutcome {
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
        let file = match text.map_or(Ok(HandlersFile::default()), |t| {
            file::parse(&self.shared.dir, &path, &t)
        }) {
            Ok(file) => file,
            Err(err) => return ReloadOutcome::Refused(self.shared.file_refused(&err)),
        };
        match self.shared.transaction(file, false) {
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
        let set = self.current();
        let changes = self.shared.lock_changes();
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

enum TransactionError {
    Entries(Vec<EntryRefusal>),
}

impl Shared {
    /// The gate counting the calls of `slot` (one per slot, shared by its versions).
    pub(crate) fn gate(&self, slot: &SlotKey) -> Arc<CallGate> {
        let mut gates = self.gates.lock().unwrap_or_else(|e| e.into_inner());
        gates.entry(slot.clone()).or_default().clone()
    }

    fn record(
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
    fn read_file(&self) -> Result<HandlersFile, FileError> {
        let path = self.dir.join(HANDLERS_FILE);
        let text = file::read_text(&path)?;
        self.had_text.store(
            text.as_deref().is_some_and(|t| !t.trim().is_empty()),
            std::sync::atomic::Ordering::Relaxed,
        );
        match text {
            Some(text) => file::parse(&self.dir, &path, &text),
            None => Ok(HandlersFile::default()),
        }
    }

    /// At start, once `handlers.toml` is applied: every slot a rollback decision still holds on
    /// the version it restored says so, as when the rollback happened (`ctl handlers`, the
    /// log, an event).
    fn rollbacks_in_force(&self) {
        let set = self.set.load_full();
        let decisions = self.lock_writer().decisions.clone();
        for decision in decisions.iter().filter(|d| next_names(&set, d)) {
            let Some(state) = set.slot(&decision.slot) else {
                continue;
            };
            // Restored by this start's own change: said already.
            if self.lock_changes().slots.contains_key(&decision.slot) {
                continue;
            }
            let reason = decision.describe();
            let record = ChangeRecord {
                state: ChangeState::RolledBack,
                at: SystemTime::now(),
                reason,
                module: Some(state.current.module().to_owned()),
                sha256: Some(state.current.sha256().to_owned()),
            };
            tracing::warn!(
                slot = %decision.slot,
                module = state.current.module(),
                reason = %record.reason,
                "serving the version a rollback restored"
            );
            self.record(
                EventKind::HandlerRolledBack,
                || decision.slot.id(),
                || change_message(&record),
            );
            self.lock_changes()
                .slots
                .entry(decision.slot.clone())
                .or_insert(record);
        }
    }

    /// `handlers.toml` as a whole was refused (it cannot be read or parsed): recorded for
    /// `ctl handlers`, the log and the events; returns the reason.
    fn file_refused(&self, err: &FileError) -> String {
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
            let served = Served::new(
                slot.clone(),
                handler,
                Origin::Configured {
                    entry: kept.version.entry.clone(),
                    sha256: kept.version.sha256.clone(),
                },
                self.builtins.for_slot(slot),
                false,
                self.me.clone(),
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

    fn lock_changes(&self) -> std::sync::MutexGuard<'_, ChangeLog> {
        self.changes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_writer(&self) -> std::sync::MutexGuard<'_, Writer> {
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Plans `file` against the set in force (compiling what changed, without the writer
    /// lock), then swaps the result in under the lock if the set has not changed meanwhile
    /// (else plans again; compiled modules are reused).
    fn transaction(
        &self,
        file: HandlersFile,
        at_start: bool,
    ) -> Result<Vec<SlotKey>, TransactionError> {
        let path = self.dir.join(HANDLERS_FILE);
        let mut compiled: HashMap<(String, Entry), Arc<Handler>> = HashMap::new();
        loop {
            let base = self.set.load_full();
            let decisions = self.lock_writer().decisions.clone();
            let mut plans: BTreeMap<SlotKey, Plan> = BTreeMap::new();
            let mut refusals = Vec::new();
            let mut pending = Vec::new();
            for (slot, entry) in &file.entries {
                match self.plan(&path, &base, &decisions, slot, entry, &mut compiled) {
                    Ok(Plan::Pending(record)) => {
                        pending.push((slot.clone(), record));
                        plans.insert(slot.clone(), Plan::Keep);
                    }
                    Ok(plan) => {
                        plans.insert(slot.clone(), plan);
                    }
                    Err(refusal) => refusals.push(*refusal),
                }
            }
            for (slot, state) in base.slots() {
                if !file.entries.contains_key(&slot)
                    && slot != SlotKey::DefaultPolicy
                    && state.current.entry().is_some()
                {
                    plans.insert(slot, Plan::Builtin);
                }
            }
            if !refusals.is_empty() {
                self.refused(&refusals);
                return Err(TransactionError::Entries(refusals));
            }

            let mut writer = self.lock_writer();
            if self.set.load().generation != base.generation {
                continue;
            }
            let (next, changed) = self.build(&base, plans);
            // Decisions whose slot no longer names the rejected version are void.
            let decided = writer.decisions.len();
            writer.decisions.retain(|d| {
                file.entries
                    .get(&d.slot)
                    .is_some_and(|e| *e == d.rejected.entry && next_names(&next, d))
            });
            let decisions_changed = writer.decisions.len() != decided;
            self.persist(&mut writer, decisions_changed, &next);
            self.set.store(Arc::new(next));
            let generation = self.set.load().generation;
            drop(writer);
            self.applied(&changed, generation, at_start);
            if !pending.is_empty() {
                let mut changes = self.lock_changes();
                for (slot, record) in pending {
                    let same = changes.slots.get(&slot).is_some_and(|r| {
                        r.state == ChangeState::Pending && r.sha256 == record.sha256
                    });
                    if !same {
                        changes.slots.insert(slot, record);
                    }
                }
            }
            return Ok(changed.into_iter().map(|(slot, _)| slot).collect());
        }
    }

    fn plan(
        &self,
        path: &Path,
        base: &HandlerSet,
        decisions: &[Decision],
        slot: &SlotKey,
        entry: &Entry,
        compiled: &mut HashMap<(String, Entry), Arc<Handler>>,
    ) -> Result<Plan, Box<EntryRefusal>> {
        let refuse = |sha256: Option<String>, reason: String| {
            Box::new(EntryRefusal {
                file: path.to_path_buf(),
                slot: slot.clone(),
                module: entry.module.clone(),
                sha256,
                reason,
            })
        };
        let bytes: Arc<[u8]> = match std::fs::read(&entry.module) {
            Ok(bytes) => bytes.into(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(refuse(
                    None,
                    "the module file is missing; put it back or change the entry".to_owned(),
                ));
            }
            Err(e) => {
                return Err(refuse(
                    None,
                    format!("cannot read the module file: {e}; check its permissions"),
                ));
            }
        };
        let sha256 = hex::encode(Sha256::digest(&bytes));
        let in_force = base.slot(slot).map(|s| &*s.current);
        let signature = match integrity::check(&self.trust, entry, &bytes, &sha256, in_force) {
            Ok(Verdict::Pass(signature)) => signature,
            Ok(Verdict::KeepInForce(reason)) => {
                return Ok(Plan::Pending(ChangeRecord {
                    state: ChangeState::Pending,
                    at: SystemTime::now(),
                    reason,
                    module: Some(entry.module.display().to_string()),
                    sha256: Some(sha256),
                }));
            }
            Err(reason) => return Err(refuse(Some(sha256), reason)),
        };
        let version = Version {
            sha256: sha256.clone(),
            entry: entry.clone(),
        };
        let state = base.slot(slot);
        let is = |served: &Served| matches!(served.origin(), Origin::Configured { entry: e, sha256: s } if *e == version.entry && *s == version.sha256);
        if let Some(decision) = decisions
            .iter()
            .find(|d| d.slot == *slot && d.rejected == version)
        {
            // Rolled back: not applied again until its file or entry changes.
            let restored_in_force =
                state.is_some_and(|s| match (&decision.restored, s.current.origin()) {
                    (None, Origin::Builtin) => true,
                    (Some(v), Origin::Configured { entry, sha256 }) => {
                        v.entry == *entry && v.sha256 == *sha256
                    }
                    _ => false,
                });
            if restored_in_force {
                return Ok(Plan::Keep);
            }
            return self.restore(path, slot, decision);
        }
        if state.is_some_and(|s| is(&s.current)) {
            return Ok(Plan::Keep);
        }
        let warm = state
            .and_then(|s| s.previous.as_ref())
            .filter(|p| is(p))
            .map(|p| p.handler().clone());
        let key = (sha256.clone(), entry.clone());
        let limits = entry.limits(self.runtime.config().default_limits);
        // The same bytes already compiled (in force, kept warm, or earlier in this transaction)
        // under another entry: bind the new settings and limits without compiling again.
        let same_bytes = || {
            state
                .into_iter()
                .flat_map(|s| std::iter::once(&s.current).chain(s.previous.iter()))
                .map(|served| served.handler().clone())
                .chain(compiled.values().cloned())
                .find(|h| h.sha256() == sha256)
        };
        let handler = match warm.or_else(|| compiled.get(&key).cloned()) {
            Some(handler) => handler,
            None if let Some(same) = same_bytes() => {
                let handler = same
                    .reconfigured(
                        entry.module.display().to_string(),
                        entry.settings.clone(),
                        Some(limits),
                    )
                    .map_err(|e| refuse(Some(sha256.clone()), pluglet_core::error_chain(&e)))?;
                compiled.insert(key, handler.clone());
                handler
            }
            None => {
                let handler = self
                    .runtime
                    .load(
                        ModuleSource::Bytes {
                            id: entry.module.display().to_string(),
                            bytes: bytes.clone(),
                        },
                        entry.settings.clone(),
                        Some(limits),
                    )
                    .map_err(|e| refuse(Some(sha256.clone()), pluglet_core::error_chain(&e)))?;
                compiled.insert(key, handler.clone());
                handler
            }
        };
        let family = slot.family();
        if !handler.implements(family) {
            return Err(refuse(
                Some(sha256),
                format!(
                    "the module does not export the {family} family this entry needs; point the \
                     entry at a handler that implements it"
                ),
            ));
        }
        crate::vectors::check_module(&handler, &entry.module)
            .map_err(|reason| refuse(Some(sha256.clone()), reason))?;
        Ok(Plan::Apply {
            handler,
            version,
            bytes: Some(bytes),
            signature,
        })
    }

    /// The version a decision restored, loaded from the kept bytes (or the built-in).
    fn restore(
        &self,
        path: &Path,
        slot: &SlotKey,
        decision: &Decision,
    ) -> Result<Plan, Box<EntryRefusal>> {
        let reason = decision.describe();
        let Some(restored) = &decision.restored else {
            return match self.builtins.for_slot(slot) {
                Some(builtin) => Ok(Plan::Restore {
                    handler: builtin.clone(),
                    origin: Origin::Builtin,
                    signature: None,
                    reason,
                }),
                None => Err(Box::new(EntryRefusal {
                    file: path.to_path_buf(),
                    slot: slot.clone(),
                    module: decision.rejected.entry.module.clone(),
                    sha256: Some(decision.rejected.sha256.clone()),
                    reason: format!("{reason}; there is no built-in for it"),
                })),
            };
        };
        let refuse = |why: String| {
            Box::new(EntryRefusal {
                file: path.to_path_buf(),
                slot: slot.clone(),
                module: decision.rejected.entry.module.clone(),
                sha256: Some(decision.rejected.sha256.clone()),
                reason: format!("{reason}; the version it restored cannot be loaded: {why}"),
            })
        };
        let bytes = self
            .store
            .as_ref()
            .ok_or_else(|| refuse("no state directory".into()))?
            .module(&restored.sha256)
            .map_err(|e| refuse(format!("kept module sha256 {}: {e}", restored.sha256)))?;
        let limits = restored.entry.limits(self.runtime.config().default_limits);
        let handler = self
            .runtime
            .load(
                ModuleSource::Bytes {
                    id: restored.entry.module.display().to_string(),
                    bytes: bytes.into(),
                },
                restored.entry.settings.clone(),
                Some(limits),
            )
            .map_err(|e| refuse(pluglet_core::error_chain(&e)))?;
        // Its signature, as recorded when it was last put in force.
        let signature = self
            .lock_writer()
            .applied
            .iter()
            .flatten()
            .find(|a| a.slot == *slot && a.version == *restored)
            .and_then(|a| a.signature.clone());
        Ok(Plan::Restore {
            handler,
            origin: Origin::Configured {
                entry: restored.entry.clone(),
                sha256: restored.sha256.clone(),
            },
            signature,
            reason,
        })
    }

    /// The next set from `base` and the plans; returns it and the slots that changed, each
    /// with the change to record.
    fn build(
        &self,
        base: &HandlerSet,
        plans: BTreeMap<SlotKey, Plan>,
    ) -> (HandlerSet, Vec<(SlotKey, ChangeRecord)>) {
        let mut next = base.clone();
        next.generation += 1;
        let mut changed = Vec::new();
        for (slot, plan) in plans {
            let old = base.slot(&slot).cloned();
            let builtin = self.builtins.for_slot(&slot);
            let (state, record) = match plan {
                Plan::Keep | Plan::Pending(_) => continue,
                Plan::Apply {
                    handler,
                    version,
                    bytes,
                    signature,
                } => {
                    if let (Some(store), Some(bytes)) = (&self.store, bytes)
                        && let Err(e) = store.keep_module(&version.sha256, &bytes)
                    {
                        tracing::warn!(module = %version.entry.module.display(), error = %e, "cannot keep a copy of the module in the state directory; a rollback of it will not survive a restart");
                    }
                    let previous = old.map(|o| o.current);
                    let has_target = previous.is_some() || builtin.is_some();
                    let mut reason = match &previous {
                        Some(p) => format!("replaces {} (sha256 {})", p.module(), p.sha256()),
                        None => "new entry".to_owned(),
                    };
                    if let Some(signature) = &signature {
                        reason.push_str(&format!("; signed \"{}\"", signature.trusted_comment));
                    }
                    if let Some(hash) = version.entry.settings_hash() {
                        reason.push_str(&format!("; settings {hash}"));
                    }
                    let record = ChangeRecord {
                        state: ChangeState::Applied,
                        at: SystemTime::now(),
                        reason,
                        module: Some(version.entry.module.display().to_string()),
                        sha256: Some(version.sha256.clone()),
                    };
                    let served = Served::new(
                        slot.clone(),
                        handler,
                        Origin::Configured {
                            entry: version.entry,
                            sha256: version.sha256,
                        },
                        builtin,
                        has_target,
                        self.me.clone(),
                    )
                    .with_signature(signature);
                    (
                        Some(SlotState {
                            current: Arc::new(served),
                            previous,
                        }),
                        record,
                    )
                }
                Plan::Restore {
                    handler,
                    origin,
                    signature,
                    reason,
                } => {
                    let served = Served::new(
                        slot.clone(),
                        handler,
                        origin,
                        builtin,
                        false,
                        self.me.clone(),
                    )
                    .with_signature(signature);
                    let record = ChangeRecord {
                        state: ChangeState::RolledBack,
                        at: SystemTime::now(),
                        reason,
                        module: Some(served.module().to_owned()),
                        sha256: Some(served.sha256().to_owned()),
                    };
                    (
                        Some(SlotState {
                            current: Arc::new(served),
                            previous: None,
                        }),
                        record,
                    )
                }
                Plan::Builtin => {
                    let previous = old.map(|o| o.current);
                    let state = builtin.map(|b| SlotState {
                        current: Arc::new(Served::new(
                            slot.clone(),
                            b.clone(),
                            Origin::Builtin,
                            None,
                            false,
                            self.me.clone(),
                        )),
                        previous: previous.clone(),
                    });
                    let record = ChangeRecord {
                        state: ChangeState::Applied,
                        at: SystemTime::now(),
                        reason: match &previous {
                            Some(p) => format!(
                                "entry removed; {} (sha256 {}) no longer serves",
                                p.module(),
                                p.sha256()
                            ),
                            None => "entry removed".to_owned(),
                        },
                        module: builtin.map(|b| b.module().to_owned()),
                        sha256: builtin.map(|b| b.sha256().to_owned()),
                    };
                    (state, record)
                }
            };
            next = next.with_slot(&slot, state);
            next.generation = base.generation + 1;
            changed.push((slot, record));
        }
        (next, changed)
    }

    /// Saves the decisions (when they changed) and the versions `set` puts the slots on (when
    /// they changed), and drops kept modules nothing refers to any more.
    fn persist(&self, writer: &mut Writer, decisions_changed: bool, set: &HandlerSet) {
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

    fn refused(&self, refusals: &[EntryRefusal]) {
        let mut changes = self.lock_changes();
        // The file itself parsed: a refusal of it as a whole is over.
        changes.file = None;
        for refusal in refusals {
            tracing::warn!(
                file = %refusal.module.display(),
                sha256 = refusal.sha256.as_deref().unwrap_or("-"),
                slot = %refusal.slot,
                reason = %refusal.reason,
                "handler change refused; the handler in force keeps serving"
            );
            self.record(
                EventKind::HandlerRefused,
                || refusal.slot.id(),
                || format!("{}: {}", refusal.module.display(), refusal.reason),
            );
            changes.slots.insert(
                refusal.slot.clone(),
                ChangeRecord {
                    state: ChangeState::Refused,
                    at: SystemTime::now(),
                    reason: refusal.reason.clone(),
                    module: Some(refusal.module.display().to_string()),
                    sha256: refusal.sha256.clone(),
                },
            );
        }
        drop(changes);
        let _ = self.events.send(HandlersEvent::Refused {
            reason: refusals
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n"),
        });
    }

    fn applied(&self, changed: &[(SlotKey, ChangeRecord)], generation: u64, at_start: bool) {
        let mut changes = self.lock_changes();
        // A successful change ends every refusal and wait before it.
        changes.file = None;
        changes.slots.retain(|_, record| {
            record.state != ChangeState::Refused && record.state != ChangeState::Pending
        });
        for (slot, record) in changed {
            match record.state {
                ChangeState::RolledBack => tracing::warn!(
                    %slot,
                    module = record.module.as_deref().unwrap_or("-"),
                    reason = %record.reason,
                    "serving the version a rollback restored"
                ),
                _ => tracing::info!(
                    %slot,
                    module = record.module.as_deref().unwrap_or("-"),
                    sha256 = record.sha256.as_deref().unwrap_or("-"),
                    change = %record.reason,
                    "handler applied"
                ),
            }
            if at_start && record.state == ChangeState::Applied {
                continue;
            }
            let kind = match record.state {
                ChangeState::RolledBack => EventKind::HandlerRolledBack,
                _ => EventKind::HandlerApplied,
            };
            self.record(kind, || slot.id(), || change_message(record));
            changes.slots.insert(slot.clone(), record.clone());
        }
        drop(changes);
        if !changed.is_empty() {
            let _ = self.events.send(HandlersEvent::Applied {
                generation,
                slots: changed.iter().map(|(s, _)| s.clone()).collect(),
            });
        }
    }

    /// A failing new module reached `rollback_after`: roll it back if it is still in force.
    pub(crate) fn roll_back_failing(&self, served: &Served, reason: String) {
        let in_force = self
            .set
            .load()
            .slot(served.slot())
            .is_some_and(|s| std::ptr::eq(Arc::as_ptr(&s.current), served));
        if !in_force {
            return;
        }
        if let Err(e) = self.roll_back(served.slot(), Some(served), &reason) {
            tracing::warn!(slot = %served.slot(), module = served.module(), error = %e, reason, "failing handler not rolled back");
        }
    }

    /// Puts back the previous version of `slot` (or its built-in). `expected`: only if that
    /// version is still in force.
    fn roll_back(
        &self,
        slot: &SlotKey,
        expected: Option<&Served>,
        reason: &str,
    ) -> Result<Arc<Served>, RollbackError> {
        let mut writer = self.lock_writer();
        let base = self.set.load_full();
        let state = base
            .slot(slot)
            .ok_or_else(|| RollbackError::NoSuchSlot(slot.clone()))?;
        if expected.is_some_and(|e| !std::ptr::eq(Arc::as_ptr(&state.current), e)) {
            return Ok(state.current.clone());
        }
        let builtin = self.builtins.for_slot(slot);
        let (handler, origin, signature) = match &state.previous {
            Some(previous) => (
                previous.handler().clone(),
                previous.origin().clone(),
                previous.signature().cloned(),
            ),
            None => match (builtin, state.current.origin()) {
                (Some(b), Origin::Configured { .. }) => (b.clone(), Origin::Builtin, None),
                (_, Origin::Builtin) => return Err(RollbackError::AlreadyBuiltin(slot.clone())),
                _ => return Err(RollbackError::NothingToRollBackTo(slot.clone())),
            },
        };
        let restored = Arc::new(
            Served::new(
                slot.clone(),
                handler,
                origin.clone(),
                builtin,
                false,
                self.me.clone(),
            )
            .with_signature(signature),
        );
        let next = base.with_slot(
            slot,
            Some(SlotState {
                current: restored.clone(),
                previous: None,
            }),
        );
        if let Origin::Configured { entry, sha256 } = state.current.origin() {
            writer.decisions.retain(|d| d.slot != *slot);
            writer.decisions.push(Decision {
                slot: slot.clone(),
                rejected: Version {
                    sha256: sha256.clone(),
                    entry: entry.clone(),
                },
                restored: match &origin {
                    Origin::Configured { entry, sha256 } => Some(Version {
                        sha256: sha256.clone(),
                        entry: entry.clone(),
                    }),
                    Origin::Builtin => None,
                },
                reason: reason.to_owned(),
                at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            });
        }
        self.persist(&mut writer, true, &next);
        self.set.store(Arc::new(next));
        drop(writer);
        tracing::warn!(
            %slot,
            from = state.current.module(),
            from_sha256 = state.current.sha256(),
            to = restored.module(),
            to_sha256 = restored.sha256(),
            reason,
            "handler rolled back"
        );
        self.lock_changes().slots.insert(
            slot.clone(),
            ChangeRecord {
                state: ChangeState::RolledBack,
                at: SystemTime::now(),
                reason: format!(
                    "{} (sha256 {}) rolled back to {} (sha256 {}): {reason}",
                    state.current.module(),
                    state.current.sha256(),
                    restored.module(),
                    restored.sha256()
                ),
                module: Some(restored.module().to_owned()),
                sha256: Some(restored.sha256().to_owned()),
            },
        );
        self.record(
            EventKind::HandlerRolledBack,
            || slot.id(),
            || {
                format!(
                    "{} (sha256 {}) rolled back to {} (sha256 {}): {reason}",
                    state.current.module(),
                    short(state.current.sha256()),
                    restored.module(),
                    short(restored.sha256())
                )
            },
        );
        let _ = self.events.send(HandlersEvent::RolledBack {
            slot: slot.clone(),
            reason: reason.to_owned(),
        });
        Ok(restored)
    }
}

/// The event message of an applied change: the module, its short digest and why.
fn change_message(record: &ChangeRecord) -> String {
    let module = record.module.as_deref().unwrap_or("-");
    match &record.sha256 {
        Some(sha) => format!("{module} (sha256 {}): {}", short(sha), record.reason),
        None => format!("{module}: {}", record.reason),
    }
}

/// The first 12 hex digits of a digest.
fn short(sha256: &str) -> &str {
    sha256.get(..12).unwrap_or(sha256)
}

/// Whether the slot of `decision` is still served by what the decision restored (else the
/// decision is void: the operator changed something since).
fn next_names(set: &HandlerSet, decision: &Decision) -> bool {
    set.slot(&decision.slot)
        .is_some_and(|s| match (&decision.restored, s.current.origin()) {
            (None, Origin::Builtin) => true,
            (Some(v), Origin::Configured { entry, sha256 }) => {
                v.entry == *entry && v.sha256 == *sha256
            }
            _ => false,
        })
}
