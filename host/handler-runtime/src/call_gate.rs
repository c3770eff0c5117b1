//! The call gate: a count of the calls running, with a limit given at each entry. A leaf: the
//! runtime keeps one in front of its instance pool and one for long calls, the host one per slot.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A counting gate: at most a given number of calls hold a permit at once; the others wait.
///
/// The runtime keeps one in front of its instance pool (a burst of calls waits for a slot rather
/// than failing instantiation); the host keeps one per slot, so that one runaway module cannot
/// take every permit and every core ([`CallGate::enter`] with the slot's limit). The limit is
/// given at each entry, so versions of a slot with different limits can share one count.
#[derive(Debug, Default)]
pub struct CallGate {
    state: Mutex<GateState>,
    freed: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    /// Calls holding a permit.
    running: u32,
    /// Calls waiting for one (a permit given back wakes them only if there are any).
    waiting: u32,
}

impl CallGate {
    /// A gate with no call running.
    pub fn new() -> CallGate {
        CallGate::default()
    }

    /// Waits until fewer than `limit` calls hold a permit, then holds one until the permit
    /// drops. `wait`: how long to wait at most (`None`: as long as it takes); `Err` is the time
    /// waited, when it gave up.
    pub fn enter(&self, limit: u32, wait: Option<Duration>) -> Result<GatePermit<'_>, Duration> {
        let started = Instant::now();
        let limit = limit.max(1);
        let mut state = self.lock();
        while state.running >= limit {
            state = match wait {
                None => {
                    state.waiting += 1;
                    self.freed.wait(state).unwrap_or_else(|e| e.into_inner())
                }
                Some(wait) => {
                    let Some(left) = wait.checked_sub(started.elapsed()).filter(|l| !l.is_zero())
                    else {
                        return Err(started.elapsed());
                    };
                    state.waiting += 1;
                    self.freed
                        .wait_timeout(state, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
            state.waiting -= 1;
        }
        state.running += 1;
        Ok(GatePermit { gate: self })
    }

    /// A permit if fewer than `limit` calls hold one now; `None` (without waiting) otherwise.
    pub fn try_enter(&self, limit: u32) -> Option<GatePermit<'_>> {
        let mut state = self.lock();
        if state.running >= limit.max(1) {
            return None;
        }
        state.running += 1;
        Some(GatePermit { gate: self })
    }

    /// How many calls hold a permit now.
    pub fn running(&self) -> u32 {
        self.lock().running
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One held permit of a [`CallGate`]; dropping it lets the next call in.
#[derive(Debug)]
pub struct GatePermit<'a> {
    gate: &'a CallGate,
}

impl GatePermit<'_> {
    /// The same permit, holding its gate by `Arc` so it can be kept where a borrow cannot.
    pub(crate) fn owned(self, gate: &Arc<CallGate>) -> OwnedGatePermit {
        debug_assert!(std::ptr::eq(self.gate, Arc::as_ptr(gate)));
        std::mem::forget(self);
        OwnedGatePermit { gate: gate.clone() }
    }
}

impl Drop for GatePermit<'_> {
    fn drop(&mut self) {
        self.gate.leave();
    }
}

/// A [`GatePermit`] that owns its gate.
#[derive(Debug)]
pub(crate) struct OwnedGatePermit {
    gate: Arc<CallGate>,
}

impl Drop for OwnedGatePermit {
    fn drop(&mut self) {
        self.gate.leave();
    }
}

impl CallGate {
    fn leave(&self) {
        let mut state = self.lock();
        state.running -= 1;
        if state.waiting > 0 {
            self.freed.notify_all();
        }
    }
}
