//! Pluglet's handler set: which WASM handler serves which plugin type and resource, read from
//! `handlers.toml` in the handlers directory over the built-ins, and changed while the daemon
//! runs.
//!
//! The data flow (each name a module; `live` owns the set and is the only writer):
//!
//! ```text
//! handlers dir ─ watch (inotify, debounced) ─▶ live: Handlers::reload
//!   source: each `oci://` entry given its digest (the one in force, or resolved and pulled
//!     into <state>/handlers/oci/<hex>/, checked when read); an entry that cannot be pulled
//!     is refused like the transaction refuses one
//!   live::transaction, all or nothing:
//!     file (handlers.toml read and parsed; pins checked to be digests by integrity)
//!     ─▶ each module read and hashed; its pin and signature checked (integrity's checks)
//!     ─▶ what changed compiled and admitted (pluglet-handler-runtime); the vectors beside it
//!        run (vectors, event)
//!     ─▶ the next set (set of served versions) swapped in whole through ArcSwap; versions
//!        applied and rollback decisions saved (state)
//! hook calls ─▶ set ─▶ served (the slot's gate, counted in stats, probation, on_failure)
//! served ─ a failed probation, through the callback live gave it ─▶ live::rollback
//!   ─▶ the previous version swapped back in, the decision saved (state)
//! ```
//!
//! Below `live` and `watch` no module uses one above it: `slot`, `stats`, `integrity` and
//! `event` use none of the others; `file` uses `slot` and `integrity`; `served` uses `file`,
//! `integrity`, `slot` and `stats`; `set` uses `served`; `state` uses `file`, `integrity`
//! and `slot`; `vectors` uses `event`; `source` uses `file`, `integrity`, `slot` and `vectors` (`scripts/check-module-cycles.py` checks for circles).
//!
//! Callers take a [`Served`] from [`Handlers`] and keep it for the whole of their work, so one
//! registration or one allocation is decided by one version; the next call sees the next set.
//! A module with conformance vectors beside it (`NAME.vectors.json`, see [`Vectors`]) must pass
//! them before it is applied; `pluglet handler test --vectors` runs the same cases.
//! The WASM mechanism itself (compiling, sandboxing, calling) is `pluglet-handler-runtime`,
//! which knows nothing of slots, files or swaps.

mod event;
mod file;
mod integrity;
mod live;
mod served;
mod set;
mod slot;
mod source;
mod state;
mod stats;
mod vectors;
mod watch;

pub use event::{
    ALLOCATE_EVENT_SHAPE, Event, Outcome, PLUGIN_EVENT_SHAPE, PluginEvent, PluginRecord, run_hook,
};
pub use file::{
    DEFAULT_ROLLBACK_AFTER, FileError, HANDLERS_FILE, HandlersFile, OnFailure, SlotEntry,
    default_max_concurrent_calls, parse, read,
};
pub use integrity::{
    KeyDecodeError, KeyError, PinError, SIGNATURE_SUFFIX, SignatureError, SignatureInfo, Trust,
    TrustedKey, parse_pin, signature_path, verify,
};
pub use live::{
    Builtins, ChangeRecord, ChangeState, EntryRefusal, Handlers, HandlersEvent, ReloadOutcome,
    RollbackError, SlotStatus, StartError, Status,
};
pub use served::{MIN_SLOT_WAIT, Origin, PROBATION_CLEAN_CALLS, Served};
pub use set::{HandlerSet, SlotState};
pub use slot::SlotKey;
pub use source::{PULL_BUCKETS, PullStats};
pub use state::{Applied, Decision, StateStore, Version};
pub use stats::{CallStats, FailureCounts, FailureKind, LastFailure, StatsSnapshot};
pub use vectors::{
    Case, CaseResult, ModuleVectorsError, VECTORS_NODE_NAME, VECTORS_SUFFIX, Vectors, VectorsError,
    check_module, run_all, run_case, vectors_path,
};
pub use watch::{HANDLERS_OPEN_QUIET, SETTLE, WRITING_QUIET, WatchError};
