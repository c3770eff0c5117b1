//! What one hook call is granted: the state of its `Store`, built for the call and dropped with
//! it (or, for a handler that reuses instances, cleared for its next call). It holds only that
//! call's WASI context (empty environment and arguments, captured stdout/stderr, no preopens, no
//! network), its memory limiter, its node name, its handler's settings and the log lines it
//! produced. The host imports (`pluglet:handler/host`) are implemented here, one impl block per
//! WIT interface.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmtime::component::ResourceTable;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::bindings::pluglet::handler::{host, types as wit_types};
use crate::call_gate::OwnedGatePermit;
use crate::config::MEMORY_KEEP_RESIDENT;
use crate::limits::MAX_CALLS_PER_INSTANCE;
use crate::types::{GuestLog, LogLevel};

/// At most this many log lines are kept per call; more are counted and dropped, so a chatty or
/// hostile guest cannot flood the daemon's log.
pub(crate) const MAX_LOG_LINES: usize = 64;
/// Longer log lines are cut to this many bytes.
pub(crate) const MAX_LOG_LINE_BYTES: usize = 4096;
/// Captured stdout+stderr per call; the panic text of a guest is a few hundred bytes.
pub(crate) const OUTPUT_CAPTURE_BYTES: usize = 16 << 10;

/// The `Store` data of one call.
pub(crate) struct CallState {
    wasi: WasiCtx,
    table: ResourceTable,
    /// Memory limiter; records a refused growth so the error can say "memory cap exceeded".
    pub(crate) limiter: CallLimiter,
    /// The guest's captured stdout and stderr (panic messages land here).
    pub(crate) output: MemoryOutputPipe,
    /// Lines logged through the `log` import.
    pub(crate) logs: Vec<GuestLog>,
    /// Lines dropped past [`MAX_LOG_LINES`].
    pub(crate) dropped_logs: usize,
    node_name: String,
    settings: Arc<BTreeMap<String, String>>,
    module: Arc<str>,
    /// Zero of the guest's monotonic clock (see [`CallClock`]).
    clock_origin: Instant,
    /// When the call's wall time runs out; no guest sleep lasts past it (see
    /// [`crate::engine`]'s capped sleeps).
    pub(crate) wall_end: Option<Instant>,
    /// Held once the call is long (see [`crate::RuntimeConfig::long_calls`]); dropped with
    /// the store when the call ends.
    pub(crate) long_permit: Option<OwnedGatePermit>,
    /// Calls this store's instance has served (see [`crate::Limits::reuse_instances`]).
    calls: u32,
}

/// The guest's `wasi:clocks/monotonic-clock`: nanoseconds since the call's store was made.
struct CallClock {
    origin: Instant,
}

impl wasmtime_wasi::clocks::HostMonotonicClock for CallClock {
    fn resolution(&self) -> u64 {
        1
    }

    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// The error that stops a call running in place before it blocks (see [`crate::in_place`]).
pub(crate) const HANDED_OFF: &str = "handed off: would block the async worker";

/// A guest timer (`subscribe-duration` / `subscribe-instant`) that ends at the requested time or
/// when the call's wall time runs out, whichever comes first. When it ends early the guest runs
/// on into the epoch deadline and the call fails as a deadline, instead of the host thread
/// sleeping as long as the guest asked.
pub(crate) struct CappedSleep {
    until: Option<tokio::time::Instant>,
}

#[async_trait::async_trait]
impl wasmtime_wasi::p2::Pollable for CappedSleep {
    async fn ready(&mut self) {
        match self.until {
            Some(until) => tokio::time::sleep_until(until).await,
            None => tokio::task::yield_now().await,
        }
    }
}

impl CallState {
    /// State for one call of `module`'s hook with a memory cap of `memory_bytes`.
    pub(crate) fn new(
        module: Arc<str>,
        node_name: String,
        settings: Arc<BTreeMap<String, String>>,
        memory_bytes: usize,
    ) -> CallState {
        let output = MemoryOutputPipe::new(OUTPUT_CAPTURE_BYTES);
        let clock_origin = Instant::now();
        // The default builder already has no env, no args, no preopens and stdin closed; network
        // is switched off explicitly (admission refuses wasi:sockets anyway).
        let wasi = WasiCtxBuilder::new()
            .stdout(output.clone())
            .stderr(output.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .monotonic_clock(CallClock {
                origin: clock_origin,
            })
            .build();
        CallState {
            wasi,
            table: ResourceTable::new(),
            limiter: CallLimiter::new(memory_bytes),
            output,
            logs: Vec::new(),
            dropped_logs: 0,
            node_name,
            settings,
            module,
            clock_origin,
            wall_end: None,
            long_permit: None,
            calls: 0,
        }
    }

    /// The node name the store's calls see.
    pub(crate) fn node_name(&self) -> &str {
        &self.node_name
    }

    /// After a call that succeeded: whether this store's instance may serve another call of
    /// its handler (see [`crate::Limits::reuse_instances`]); if so, what the call left in the
    /// state is cleared. Not when it has served [`MAX_CALLS_PER_INSTANCE`] calls; not when its
    /// memory is larger than half the cap (a guest that keeps growing would meet the cap in a
    /// later call that did nothing wrong) or than what the pool keeps resident of a freed
    /// instance (`MEMORY_KEEP_RESIDENT`: a kept instance holds its memory while it waits, and an
    /// idle node should hold no more than it did with fresh instances); not when its guest
    /// printed (the captured output cannot be cleared, and it would land in a later call's
    /// error).
    pub(crate) fn reset_for_reuse(&mut self) -> bool {
        self.calls += 1;
        let memory_bound = (self.limiter.memory_bytes / 2).min(MEMORY_KEEP_RESIDENT);
        if self.calls >= MAX_CALLS_PER_INSTANCE
            || self.limiter.largest > memory_bound
            || !self.output.contents().is_empty()
        {
            return false;
        }
        self.logs.clear();
        self.dropped_logs = 0;
        self.long_permit = None;
        true
    }

    /// A pollable for a guest timer ending after `nanos` (capped as [`CappedSleep`] says).
    pub(crate) fn sleep_for(
        &mut self,
        nanos: u64,
    ) -> wasmtime::Result<wasmtime::component::Resource<wasmtime_wasi::p2::DynPollable>> {
        let requested = Instant::now().checked_add(Duration::from_nanos(nanos));
        self.sleep_until(requested)
    }

    /// A pollable for a guest timer ending at `when` on the guest's monotonic clock.
    pub(crate) fn sleep_until_instant(
        &mut self,
        when: u64,
    ) -> wasmtime::Result<wasmtime::component::Resource<wasmtime_wasi::p2::DynPollable>> {
        let requested = self.clock_origin.checked_add(Duration::from_nanos(when));
        self.sleep_until(requested)
    }

    fn sleep_until(
        &mut self,
        requested: Option<Instant>,
    ) -> wasmtime::Result<wasmtime::component::Resource<wasmtime_wasi::p2::DynPollable>> {
        // Waiting for a timer blocks the thread: not on an async worker.
        if crate::in_place::hand_off() {
            return Err(wasmtime::Error::msg(HANDED_OFF));
        }
        // `None` from the addition: further away than a clock can say; the cap applies.
        let until = match (requested, self.wall_end) {
            (Some(requested), Some(end)) => Some(requested.min(end)),
            (Some(requested), None) => Some(requested),
            (None, end) => end,
        };
        let sleep = CappedSleep {
            until: until
                .filter(|&t| t > Instant::now())
                .map(tokio::time::Instant::from_std),
        };
        let resource = self.table.push(sleep)?;
        wasmtime_wasi::p2::subscribe(&mut self.table, resource)
    }

    /// The guest's captured output as text, without the Rust "note: run with RUST_BACKTRACE" hint,
    /// lines joined with a space; empty when the guest printed nothing.
    pub(crate) fn output_text(&self) -> String {
        let bytes = self.output.contents();
        let text = String::from_utf8_lossy(&bytes);
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with("note: run with `RUST_BACKTRACE=1`"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// A memory limiter that refuses growth past the cap by trapping, and remembers that it did.
pub(crate) struct CallLimiter {
    memory_bytes: usize,
    /// The largest size in bytes any memory of the instance has been given.
    largest: usize,
    /// Set when a growth past the cap was refused.
    pub(crate) refused: bool,
}

impl CallLimiter {
    fn new(memory_bytes: usize) -> CallLimiter {
        CallLimiter {
            memory_bytes,
            largest: 0,
            refused: false,
        }
    }
}

/// The trap raised when a guest grows its memory past the cap.
#[derive(Debug)]
pub(crate) struct MemoryCapExceeded;

impl std::fmt::Display for MemoryCapExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("memory cap exceeded")
    }
}

impl std::error::Error for MemoryCapExceeded {}

impl wasmtime::ResourceLimiter for CallLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory_bytes {
            self.refused = true;
            // Trap rather than return -1: a Rust guest would abort with a bare `unreachable`.
            return Err(wasmtime::Error::new(MemoryCapExceeded));
        }
        self.largest = self.largest.max(desired);
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }

    fn instances(&self) -> usize {
        32
    }

    fn tables(&self) -> usize {
        32
    }

    fn memories(&self) -> usize {
        4
    }
}

impl wit_types::Host for CallState {}

impl host::Host for CallState {
    fn log(&mut self, level: host::Level, mut message: String) {
        if self.logs.len() >= MAX_LOG_LINES {
            self.dropped_logs += 1;
            return;
        }
        if message.len() > MAX_LOG_LINE_BYTES {
            let mut end = MAX_LOG_LINE_BYTES;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
            message.push_str(" …");
        }
        let level = match level {
            host::Level::Trace => LogLevel::Trace,
            host::Level::Debug => LogLevel::Debug,
            host::Level::Info => LogLevel::Info,
            host::Level::Warn => LogLevel::Warn,
            host::Level::Error => LogLevel::Error,
        };
        let module = &*self.module;
        match level {
            LogLevel::Trace => {
                tracing::trace!(target: "pluglet::guest", handler = module, "{message}")
            }
            LogLevel::Debug => {
                tracing::debug!(target: "pluglet::guest", handler = module, "{message}")
            }
            LogLevel::Info => {
                tracing::info!(target: "pluglet::guest", handler = module, "{message}")
            }
            LogLevel::Warn => {
                tracing::warn!(target: "pluglet::guest", handler = module, "{message}")
            }
            LogLevel::Error => {
                tracing::error!(target: "pluglet::guest", handler = module, "{message}")
            }
        }
        self.logs.push(GuestLog { level, message });
    }

    fn node_name(&mut self) -> String {
        self.node_name.clone()
    }

    fn setting(&mut self, key: String) -> Option<String> {
        self.settings.get(&key).cloned()
    }

    fn settings(&mut self) -> Vec<wit_types::KeyValue> {
        self.settings
            .iter()
            .map(|(key, value)| wit_types::KeyValue {
                key: key.clone(),
                value: value.clone(),
            })
            .collect()
    }
}
