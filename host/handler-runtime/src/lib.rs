//! Pluglet's WASM handler runtime: the mechanism that runs per-plugin-type logic in sandboxed
//! WebAssembly components. It knows nothing of gRPC, sockets or plugin types.
//!
//! Start at [`Runtime`]: one wasmtime engine (pooling allocator, epoch ticker, no component-model
//! concurrency) shared by every [`Handler`]. [`Runtime::load`] compiles a component once and admits
//! it (imports checked against an allow-list, contract version and hook families read from its
//! exports); each hook call then runs in a fresh `Store` and instance from a shared `InstancePre`
//! (or, for a handler loaded with [`Limits::reuse_instances`], in one that served its calls
//! before without fault), with a CPU deadline, a memory cap, optional fuel and captured stderr.
//! A guest's refusal is a normal outcome ([`Refusal`]); a trap, a timeout or a memory blow-up
//! is a [`HandlerError`] naming the handler, the hook and the cause. Which handler serves which
//! plugin type or resource, and swapping them while the daemon runs, is the host's business
//! (crate `pluglet-handlers`), not this mechanism's.
//!
//! [`Runtime::with_cache`] keeps compiled components between starts in a private on-disk
//! [`CompileCache`] under the state directory, each entry checked with the node's secret key
//! before it is deserialised; [`Handler::from_cache`] tells whether a load came from it.
//! [`Runtime::with_options`] can also compile in a child process ([`compiler`]), so that a
//! long-running daemon never keeps the compiler's memory.
//!
//! Lifetimes (after Spin): engine and linker once ([`Runtime`]); a compiled component per module
//! ([`Handler`]); call state per invocation (`call_state`), granting only that call's WASI
//! context, limits, node name and settings. A call's instance is freed before the call returns,
//! or, inside [`defer_release`], when the caller drops the [`DeferredRelease`] it gets (during a
//! wait of its own, off its critical path); that drop also makes the handler's next instance
//! ahead (a spare), so its next call only runs the guest (at most
//! [`RuntimeConfig::spare_slots`] spares per runtime). A handler that reuses instances keeps
//! the instance of a call that succeeded as its spare instead, so its calls neither make nor
//! free one.
//!
//! The modules, each using only those below it (`scripts/check-module-cycles.py` checks that
//! no two use each other, directly or round a circle):
//!
//! ```text
//! engine            the runtime: wires the rest, links the host imports, runs the epoch
//!                   ticker, loads modules (compile, cache, admission) into handlers
//!   compiler        compiles in a child process          cache     the on-disk compile cache
//!   admission       imports and exports of a component
//! handler           one loaded module and its hook calls
//!   deferred_release  an instance freed after the call returns, on the caller's drop
//!   spare           an instance made ahead of (or kept for) the next call
//!   store           each call's Store and its deadline (store making)
//!   call_state      what one call is granted (WASI, memory limiter, host imports)
//!   answer          checks of a guest's answer
//! config            RuntimeConfig and the wasmtime configuration made from it
//! limits            per-call limits             call_gate   the counting gate of calls
//! in_place          hook calls from async code: on the worker, handed off when they would block
//! error, types, bindings   the leaves every module may use
//! ```
//!
//! ```no_run
//! use std::collections::BTreeMap;
//! use pluglet_handler_runtime::{CallContext, ModuleSource, PluginInfo, Runtime, RuntimeConfig};
//!
//! let runtime = Runtime::new(RuntimeConfig::default())?;
//! let handler = runtime.load(ModuleSource::File("strict-csi.wasm".into()), BTreeMap::new(), None)?;
//! let plugin = PluginInfo {
//!     plugin_type: "CSIPlugin".into(),
//!     name: "csi.example.com".into(),
//!     endpoint: "/var/lib/kubelet/plugins/csi.example.com/csi.sock".into(),
//!     supported_versions: vec!["1.5.0".into()],
//! };
//! let call = handler.validate(&CallContext { node_name: "node-1".into() }, &plugin, None)?;
//! match call.value {
//!     Ok(accepted) => println!("accepted, version {:?}", accepted.version),
//!     Err(refusal) => println!("refused ({}): {refusal}", refusal.kind),
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod admission;
mod answer;
mod bindings;
mod cache;
mod call_gate;
mod call_state;
mod columns;
pub mod compiler;
mod config;
mod deferred_release;
pub mod engine;
mod error;
mod handler;
mod in_place;
mod limits;
mod spare;
mod store;
mod ticker;
mod types;

pub use answer::{MAX_ANSWER_IDS, MAX_ANSWER_STRING_BYTES, MAX_TRANSFER_BYTES};
pub use bindings::CONTRACT_VERSION;
pub use cache::{CACHE_DIR, CacheError, CacheStats, CompileCache, KEY_FILE};
pub use call_gate::{CallGate, GatePermit};
pub use columns::{ListColumn, ListRun, TextColumn, TextRun};
pub use compiler::Compiler;
pub use config::{MAX_SPARES, RuntimeConfig, default_long_calls};
pub use deferred_release::{DeferredRelease, defer_release};
pub use engine::{ModuleSource, Runtime};
pub use error::{BoxError, HandlerError, HandlerFault, LoadError};
pub use handler::Handler;
pub use in_place::{HANDED_OFF_CALLS, hand_off, run_in_place};
pub use limits::{
    FUEL_PER_DEVICE, LONG_CALL_CPU, Limits, MAX_CALLS_PER_INSTANCE, MAX_MEMORY_MIB, MIN_WALL_CAP,
    WALL_CAP_FACTOR, WASM_STACK_BYTES,
};
pub use types::{
    Accepted, AllocationRequest, Call, CallContext, CandidateDevice, Candidates, ColumnRun, Family,
    GuestLog, Hook, LogLevel, PluginInfo, Refusal, RefusalKind, RegisteredPlugin,
    RegistrationFacts,
};
