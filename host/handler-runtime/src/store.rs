//! Store making: a fresh wasmtime `Store` for each call (its [`CallState`], the memory cap,
//! the transfer bound) and the deadline armed on it as a CPU-time budget. A leaf under the
//! engine: it holds what every call's store is made from and knows no handler or loader.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::time::{Duration, Instant};

use wasmtime::{Engine, Store, UpdateDeadline};

use crate::MAX_TRANSFER_BYTES;
use crate::call_gate::{CallGate, OwnedGatePermit};
use crate::call_state::CallState;
use crate::config::RuntimeConfig;
use crate::limits::{LONG_CALL_CPU, Limits};
use crate::ticker::{Ticker, Ticking};

/// What every call's store is made from, shared by the runtime and its handlers: the engine,
/// the gate in front of the instance pool, the long-call gate and the configuration.
pub(crate) struct StoreFactory {
    pub(crate) engine: Engine,
    /// Admits calls to the instance pool ([`RuntimeConfig::pool_size`] at once).
    pub(crate) pool_gate: Arc<CallGate>,
    /// Admits long calls ([`RuntimeConfig::long_calls`]).
    pub(crate) long_calls: Arc<CallGate>,
    pub(crate) config: RuntimeConfig,
    /// Instances ready for a call, kept now (at most [`RuntimeConfig::spare_slots`]).
    pub(crate) spares_kept: AtomicU32,
    /// The epoch ticker, ticking while an armed deadline's guest code runs.
    pub(crate) ticker: Arc<Ticker>,
}

impl Drop for StoreFactory {
    fn drop(&mut self) {
        self.ticker.close();
    }
}

impl StoreFactory {
    /// Waits for a slot of the instance pool (never gives up); the permit owns its gate.
    pub(crate) fn enter_pool(&self) -> Option<OwnedGatePermit> {
        self.pool_gate
            .enter(self.config.pool_size, None)
            .ok()
            .map(|permit| permit.owned(&self.pool_gate))
    }

    /// A slot of the instance pool if one is free now; `None` without waiting.
    pub(crate) fn try_enter_pool(&self) -> Option<OwnedGatePermit> {
        self.pool_gate
            .try_enter(self.config.pool_size)
            .map(|permit| permit.owned(&self.pool_gate))
    }

    /// A fresh store for one call of `module` on `node_name`: WASI, the memory cap, the transfer
    /// bound; fuel and the deadline are armed by the caller.
    pub(crate) fn new_store(
        &self,
        module: Arc<str>,
        node_name: String,
        settings: Arc<BTreeMap<String, String>>,
        limits: &Limits,
    ) -> Store<CallState> {
        let state = CallState::new(
            module,
            node_name,
            settings,
            (limits.memory_mib as usize) << 20,
        );
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.set_hostcall_fuel(MAX_TRANSFER_BYTES);
        store
    }

    /// Arms the deadline as a CPU-time budget of this thread. The epoch deadline fires after the
    /// deadline in wall time; the callback then looks at the CPU time the calling thread actually
    /// used, and only interrupts if the budget is spent (or the call has taken
    /// [`Limits::wall_cap`] in wall time). A call that was merely descheduled on
    /// a loaded machine gets the rest of its budget instead of failing spuriously.
    ///
    /// Once the call has used [`LONG_CALL_CPU`] it is long: it goes on only with a permit of the
    /// runtime's long-call gate ([`crate::RuntimeConfig::long_calls`]), waiting for one (its
    /// CPU time not counted, its wall time still capped) while other long calls hold them all.
    ///
    /// The epoch ticks while the returned guard is held: hold it until the guest code is done.
    #[must_use = "the deadline only advances while the guard is held"]
    pub(crate) fn arm_deadline(&self, limits: &Limits, store: &mut Store<CallState>) -> Ticking {
        let tick = self.config.epoch_tick;
        let budget = limits.deadline;
        let wall_cap = limits.wall_cap();
        let long_calls = self.long_calls.clone();
        let long_limit = self.config.long_calls;
        let started = Instant::now();
        let cpu_start = thread_cpu_time();
        store.data_mut().wall_end = started.checked_add(wall_cap);
        store.set_epoch_deadline(ticks(tick, budget.min(LONG_CALL_CPU)));
        store.epoch_deadline_callback(move |mut cx| {
            let used = || match (cpu_start, thread_cpu_time()) {
                (Some(start), Some(now)) => now.saturating_sub(start),
                _ => started.elapsed(),
            };
            let spent = used();
            if spent >= budget || started.elapsed() >= wall_cap {
                return Ok(UpdateDeadline::Interrupt);
            }
            if spent < LONG_CALL_CPU {
                return Ok(UpdateDeadline::Continue(ticks(tick, LONG_CALL_CPU - spent)));
            }
            // A long call does not hold an async worker: it runs again off it.
            if crate::in_place::hand_off() {
                return Ok(UpdateDeadline::Interrupt);
            }
            if cx.data().long_permit.is_none() {
                let left = wall_cap.saturating_sub(started.elapsed());
                match long_calls.enter(long_limit, Some(left)) {
                    Ok(permit) => cx.data_mut().long_permit = Some(permit.owned(&long_calls)),
                    Err(_) => return Ok(UpdateDeadline::Interrupt),
                }
            }
            Ok(UpdateDeadline::Continue(ticks(
                tick,
                budget.saturating_sub(used()),
            )))
        });
        self.ticker.start()
    }
}

/// CPU time the calling thread has used so far (`CLOCK_THREAD_CPUTIME_ID`); `None` if the clock
/// is unavailable (the deadline then counts wall time).
fn thread_cpu_time() -> Option<Duration> {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).ok()?;
    Some(Duration::new(
        u64::try_from(ts.tv_sec()).ok()?,
        u32::try_from(ts.tv_nsec()).ok()?,
    ))
}

/// Epoch ticks covering `span`: rounded up, at least one.
fn ticks(tick: Duration, span: Duration) -> u64 {
    let ticks = span.as_nanos().div_ceil(tick.as_nanos().max(1));
    u64::try_from(ticks).unwrap_or(u64::MAX).max(1)
}
