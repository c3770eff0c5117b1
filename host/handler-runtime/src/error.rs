//! Errors of the handler runtime: loading a module ([`LoadError`]), calling a hook
//! ([`HandlerError`]).
//!
//! A guest's refusal is not an error: it is the `Err` inside a successful [`crate::Call`].
//!
//! Errors from wasmtime are kept whole as the `source` of the variant that reports them, so a
//! formatter that walks [`std::error::Error::source`] shows their whole chain of causes.

use std::path::PathBuf;
use std::time::Duration;

use crate::types::{Family, Hook};

/// An underlying error kept with its chain of causes (a wasmtime error becomes one with `into()`).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a module could not be loaded (compiled and admitted).
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The module file could not be read.
    #[error("cannot read handler module {path}: {source}; check the path and its permissions")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The bytes are not a WebAssembly component.
    #[error(
        "handler {module} is not a WebAssembly component ({found}); build it with \
         `cargo build --target wasm32-wasip2` against the pluglet-guest SDK"
    )]
    NotAComponent {
        /// Module id.
        module: String,
        /// What the bytes look like instead.
        found: String,
    },
    /// The component implements no family of the `pluglet:handler` contract.
    #[error(
        "handler {module} is a component of another contract: it exports {found}, but a handler \
         must export `pluglet:handler/registration@1.x` and/or `pluglet:handler/allocation-policy@1.x`; \
         build it against the pluglet-guest SDK"
    )]
    OtherContract {
        /// Module id.
        module: String,
        /// What it exports (names, or "nothing").
        found: String,
    },
    /// The component exports families of an incompatible major version of the contract.
    #[error(
        "handler {module} implements contract {found}, which this host (pluglet:handler@{host}) \
         cannot run; rebuild it against a pluglet-guest SDK of major version {host_major}"
    )]
    IncompatibleContract {
        /// Module id.
        module: String,
        /// What it exports, e.g. `pluglet:handler/registration@2.0.0`.
        found: String,
        /// The host's contract version.
        host: &'static str,
        /// The host's major version.
        host_major: u64,
    },
    /// The component imports something outside the sandbox's allow-list.
    #[error(
        "handler {module} imports {}, which handlers may not use (allowed: \
         pluglet:handler/host and the wasi:io, wasi:cli, wasi:clocks and wasi:random interfaces; \
         no files, sockets or HTTP); remove the code that uses them",
        .imports.iter().map(|i| format!("`{i}`")).collect::<Vec<_>>().join(", ")
    )]
    ForbiddenImport {
        /// Module id.
        module: String,
        /// Every forbidden import's name, e.g. `wasi:filesystem/types@0.2.6`.
        imports: Vec<String>,
    },
    /// wasmtime could not compile the component.
    #[error("handler {module} does not compile")]
    Compile {
        /// Module id.
        module: String,
        /// wasmtime's error.
        #[source]
        source: BoxError,
    },
    /// The component's imports do not type-check against what the host links.
    #[error("handler {module} does not link against the host")]
    Link {
        /// Module id.
        module: String,
        /// wasmtime's error.
        #[source]
        source: BoxError,
    },
    /// The limits asked for are out of range.
    #[error("invalid limits for handler {module}: {message}")]
    InvalidLimits {
        /// Module id.
        module: String,
        /// What is wrong.
        message: String,
    },
    /// The wasmtime engine could not be set up.
    #[error("cannot set up the WebAssembly engine: {reason}")]
    Engine {
        /// What went wrong.
        reason: String,
        /// The error behind it, if any (wasmtime's, or the ticker thread's).
        #[source]
        source: Option<BoxError>,
    },
}

/// The cause of a failed hook call (a fault, not a refusal).
#[derive(Debug, thiserror::Error)]
pub enum HandlerFault {
    /// The call ran past its CPU deadline (epoch interruption).
    #[error("deadline of {} ms exceeded; make the hook faster or raise deadline_ms in handlers.toml", .deadline.as_millis())]
    Deadline {
        /// The deadline that was exceeded.
        deadline: Duration,
    },
    /// The call used up its fuel.
    #[error(
        "fuel budget of {fuel} exhausted; make the hook cheaper or raise fuel in handlers.toml"
    )]
    Fuel {
        /// The budget.
        fuel: u64,
    },
    /// The guest tried to grow its memory past the cap.
    #[error("memory cap {mib} MiB exceeded; use less memory or raise memory_mib in handlers.toml")]
    MemoryCap {
        /// The cap.
        mib: u32,
    },
    /// The guest overflowed its call stack (recursion too deep).
    #[error(
        "stack overflow: {stack} is exhausted (recursion too deep); make the hook iterate \
         instead of recursing"
    )]
    StackOverflow {
        /// Which stack: the native call stack (its size), or the guest's own stack in its memory.
        stack: String,
    },
    /// The guest's answer (or what it passed to a host import) is larger than the host accepts.
    #[error("answer too large: {detail}; make the hook answer less")]
    AnswerTooLarge {
        /// Which bound, with the size found and the bound.
        detail: String,
    },
    /// The slot already runs as many calls as it may; this call waited for one to end and gave
    /// up after its own deadline.
    #[error(
        "busy: {limit} calls of this slot already running (max_concurrent_calls = {limit}); \
         waited {} ms for one to end; the slot's earlier calls are too slow (see its failures in \
         `pluglet ctl handlers`) or max_concurrent_calls in handlers.toml is too low",
        .waited.as_millis()
    )]
    Busy {
        /// The slot's limit.
        limit: u32,
        /// How long the call waited.
        waited: Duration,
    },
    /// The call ran in place on an async worker and would have blocked it (see
    /// [`run_in_place`](crate::run_in_place)): it stopped, and runs again on a blocking thread.
    /// Never returned from `run_in_place`; not the module's failure.
    #[error(
        "handed off: the call would have blocked the async worker it ran on; it runs again on a \
         blocking thread"
    )]
    HandedOff,
    /// The guest trapped (panicked, hit `unreachable`, …); `message` holds the guest's panic text
    /// from its stderr when it printed one.
    #[error("trapped: {message}")]
    Trapped {
        /// Panic text and trap description.
        message: String,
    },
    /// The component does not implement the family of the hook.
    #[error("does not export the {family} family")]
    MissingFamily {
        /// The family.
        family: Family,
    },
    /// The call's store could not be set up.
    #[error("cannot instantiate")]
    Instantiate {
        /// wasmtime's error.
        #[source]
        source: BoxError,
    },
    /// The call failed in wasmtime without a trap: instantiation (for example an exhausted
    /// instance pool), a host call, or the guest exiting.
    #[error("failed{}", guest_output(.output))]
    Failed {
        /// What the guest printed to stderr, if anything.
        output: String,
        /// wasmtime's error.
        #[source]
        source: BoxError,
    },
}

/// `": <output>"`, or nothing when the guest printed nothing.
fn guest_output(output: &str) -> String {
    if output.is_empty() {
        String::new()
    } else {
        format!(": {output}")
    }
}

/// A hook call that failed: names the handler, the hook and the cause.
///
/// The message includes the [`HandlerFault`]; [`std::error::Error::source`] is the fault's own
/// source (wasmtime's error, when there is one), so a chain prints each part once.
#[derive(Debug)]
pub struct HandlerError {
    /// Module id (`builtin:csi` or the file path).
    pub module: String,
    /// The hook that was called.
    pub hook: Hook,
    /// What went wrong.
    pub fault: HandlerFault,
}

impl HandlerError {
    /// What went wrong.
    pub fn fault(&self) -> &HandlerFault {
        &self.fault
    }
}

impl std::fmt::Display for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "handler {} hook {}: {}",
            self.module, self.hook, self.fault
        )
    }
}

impl std::error::Error for HandlerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.fault)
    }
}
