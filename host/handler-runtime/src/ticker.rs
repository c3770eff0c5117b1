//! The epoch ticker: a dedicated thread that advances the engine's epoch every
//! [`RuntimeConfig::epoch_tick`](crate::RuntimeConfig::epoch_tick) while guest code runs, and
//! sleeps without waking while none does. Deadlines are epoch deadlines armed when guest code is
//! about to run, so a tick only matters while some runs; an idle daemon has no timer of its own.
//!
//! Whoever runs guest code (a call, or the making of a spare) holds a [`Ticking`] from arming the
//! deadline until the guest code is done. The first holder wakes the thread; it ticks until a
//! period passes in which no guest code ran or started. A call lasts tens of microseconds, far
//! less than a period, so on a busy node the thread ticks on and the calls never wake it (a wake
//! is a system call on the call's path and two context switches); a lone call costs one wake and
//! one tick, as before. A late wake-up gives one tick, never a burst (the thread sleeps one period
//! after each tick), so a stalled ticker cannot time calls out spuriously.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use wasmtime::{Engine, EngineWeak};

use crate::error::LoadError;

/// What the ticker thread and the guest-code runners share.
#[derive(Debug, Default)]
pub(crate) struct Ticker {
    state: Mutex<TickerState>,
    wake: Condvar,
}

#[derive(Debug, Default)]
struct TickerState {
    /// Holders of a [`Ticking`] now.
    running: u32,
    /// Whether a [`Ticking`] was taken since the thread last looked.
    started: bool,
    /// Set when the runtime is gone: the thread ends.
    closed: bool,
    /// The thread waits for a runner (only then does a new one wake it: while it ticks, it
    /// sees the runner at its next tick).
    asleep: bool,
}

impl Ticker {
    /// Starts the ticker thread for `engine`, ticking every `tick` while guest code runs. The
    /// thread holds only weak references to the engine and to the returned ticker, and ends when
    /// the ticker is closed ([`Ticker::close`]) or dropped.
    pub(crate) fn spawn(engine: &Engine, tick: Duration) -> Result<Arc<Ticker>, LoadError> {
        let ticker = Arc::new(Ticker::default());
        let weak_ticker = Arc::downgrade(&ticker);
        let weak_engine = engine.weak();
        std::thread::Builder::new()
            .name("pluglet-epoch".into())
            .spawn(move || run(&weak_ticker, &weak_engine, tick))
            .map_err(|e| LoadError::Engine {
                reason: "the epoch ticker thread did not start".into(),
                source: Some(Box::new(e)),
            })?;
        Ok(ticker)
    }

    /// Counts one more runner of guest code until the returned guard drops; wakes the thread.
    ///
    /// The thread is woken after the lock is released: woken under it, the thread would wake
    /// only to wait for the lock, two more system calls and a context switch on the call's path.
    pub(crate) fn start(self: &Arc<Ticker>) -> Ticking {
        let asleep = {
            let mut state = self.lock();
            state.running += 1;
            state.started = true;
            std::mem::replace(&mut state.asleep, false)
        };
        if asleep {
            self.wake.notify_one();
        }
        Ticking(self.clone())
    }

    /// Ends the thread (the runtime is gone).
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_one();
    }

    /// How many runners of guest code hold a [`Ticking`] now.
    #[cfg(test)]
    pub(crate) fn running(&self) -> u32 {
        self.lock().running
    }

    fn lock(&self) -> MutexGuard<'_, TickerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Held while guest code runs: the ticker ticks as long as one is held.
#[derive(Debug)]
pub(crate) struct Ticking(Arc<Ticker>);

impl Drop for Ticking {
    fn drop(&mut self) {
        self.0.lock().running -= 1;
    }
}

/// The ticker thread: waits until guest code runs, then ticks once per period while some runs or
/// started during the period.
fn run(ticker: &Weak<Ticker>, engine: &EngineWeak, tick: Duration) {
    loop {
        {
            let Some(shared) = ticker.upgrade() else {
                return;
            };
            let mut state = shared.lock();
            while state.running == 0 && !state.started && !state.closed {
                state.asleep = true;
                state = shared.wake.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            state.asleep = false;
            state.started = false;
            if state.closed {
                return;
            }
        }
        std::thread::sleep(tick);
        let Some(engine) = engine.upgrade() else {
            return;
        };
        engine.increment_epoch();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine() -> Engine {
        let mut config = wasmtime::Config::new();
        config.epoch_interruption(true);
        Engine::new(&config).expect("engine")
    }

    #[test]
    fn runners_are_counted_and_the_thread_ends_when_closed() {
        let engine = engine();
        let ticker = Ticker::spawn(&engine, Duration::from_millis(1)).expect("ticker");
        let first = ticker.start();
        let second = ticker.start();
        assert_eq!(ticker.running(), 2);
        drop(first);
        assert_eq!(ticker.running(), 1);
        drop(second);
        assert_eq!(ticker.running(), 0);
        ticker.close();
        // Closing twice, and after the thread has gone, is harmless.
        ticker.close();
    }
}
