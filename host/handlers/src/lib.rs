//! Pluglet's handler set: which WASM handler serves which plugin type and resource, read from
//! `handlers.toml` in the handlers directory over the built-ins, and changed while the daemon
//! runs.
//!
//! The data flow, one module per stage:
//!
//! ```text
//! handlers dir ─ watch (inotify, debounced) ─▶ file (handlers.toml parsed)
//!   ─▶ live: transaction (read, hash, integrity: pin and signature, compile and admit what
//!      changed; all or nothing)
//!   ─▶ set (immutable snapshot, swapped in whole through ArcSwap)
//!   ─▶ served (each hook call: counted; probation; on_failure; rollback) ─▶ state (rollbacks
//!      kept across restarts)
//! ```
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
pub use state::{Applied, Decision, StateStore, Version};
pub use stats::{CallStats, FailureCounts, FailureKind, LastFailure, StatsSnapshot};
pub use vectors::{
    Case, CaseResult, ModuleVectorsError, VECTORS_NODE_NAME, VECTORS_SUFFIX, Vectors, VectorsError,
    check_module, run_all, run_case, vectors_path,
};
pub use watch::{HANDLERS_OPEN_QUIET, SETTLE, WRITING_QUIET, WatchError};
