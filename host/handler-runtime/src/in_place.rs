//! Hook calls from async code: run on the calling tokio worker as they are, and handed off to a
//! blocking thread only when they would block it.
//!
//! A hook call takes microseconds. Handing the worker's queue to another thread before each one
//! (tokio's `block_in_place`) wakes a blocking-pool thread, moves the queue there and usually
//! back: on a busy two-core node that hop costs more CPU than the call, and without it sixteen
//! clients allocating at once got about 16 % more allocations a second (docs/performance.md).
//! So [`run_in_place`] runs the call on the worker. A call that would block the worker stops
//! instead, before it blocks:
//!
//! - it would wait for a pool slot or for its slot's permit (the gates are full);
//! - it has used [`LONG_CALL_CPU`](crate::LONG_CALL_CPU) (a runaway, or a very large request);
//! - its guest asks for a timer or for its stdio: WASI waits for those on a runtime of its own,
//!   which cannot start on a worker.
//!
//! [`run_in_place`] then runs the whole closure again after `block_in_place`, where waiting is
//! fine. A hook call's only effect is its answer, and the instance it stopped in is dropped
//! (never kept for reuse), so running it again changes only the time it takes; the stopped
//! attempt is not counted anywhere (see
//! [`HandlerFault::HandedOff`](crate::HandlerFault::HandedOff)). A handler whose call had to
//! move sends its next [`HANDED_OFF_CALLS`] calls straight to the blocking thread, so a guest
//! that prints on every call, or a node whose requests are all large, pays for the stopped
//! attempt once in that many calls.

use std::cell::Cell;

/// Calls of a handler that go straight to the blocking thread after one of its calls moved.
pub const HANDED_OFF_CALLS: u32 = 64;

/// What the calls on this thread may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Block as they need (a blocking thread, or no async runtime at all).
    Block,
    /// Run on an async worker: never block it.
    InPlace,
    /// A call ran into something that would block it: it stops, and runs again off the worker.
    HandingOff,
}

thread_local! {
    static MODE: Cell<Mode> = const { Cell::new(Mode::Block) };
}

/// Sets the thread's mode until dropped, then puts back the one before (also on a panic).
struct ModeGuard(Mode);

impl ModeGuard {
    fn set(mode: Mode) -> ModeGuard {
        ModeGuard(MODE.replace(mode))
    }

    /// Puts back the mode before; returns the one that was set.
    fn restore(self) -> Mode {
        let previous = self.0;
        std::mem::forget(self);
        MODE.replace(previous)
    }
}

impl Drop for ModeGuard {
    fn drop(&mut self) {
        MODE.set(self.0);
    }
}

/// Runs hook calls (or other short work) from async code on the calling thread. On tokio's
/// multi-thread runtime the calls run on the worker as they are; if one of them would block
/// (see the module doc), it stops, and `call` runs again from the start after the worker has
/// handed its queue to another thread (`block_in_place`). Elsewhere `call` simply runs.
///
/// `call` may therefore run twice: keep it to the hook calls and what follows from their
/// answers, and do anything else with the value it returns.
pub fn run_in_place<T>(mut call: impl FnMut() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            let guard = ModeGuard::set(Mode::InPlace);
            let first = call();
            if guard.restore() != Mode::HandingOff {
                return first;
            }
            drop(first);
            tokio::task::block_in_place(|| {
                let _blocking = ModeGuard::set(Mode::Block);
                call()
            })
        }
        _ => call(),
    }
}

/// Whether the call running on this thread must not block: it runs in place on an async worker.
pub(crate) fn in_place() -> bool {
    MODE.get() != Mode::Block
}

/// Called where the running call would block. In place, notes that the call stops to run again
/// off the worker and returns true (the caller then ends the call at once); otherwise false
/// (the caller may block).
pub fn hand_off() -> bool {
    match MODE.get() {
        Mode::Block => false,
        Mode::InPlace | Mode::HandingOff => {
            MODE.set(Mode::HandingOff);
            true
        }
    }
}

/// Whether the call on this thread is stopping to run again off the worker.
pub(crate) fn handing_off() -> bool {
    MODE.get() == Mode::HandingOff
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_runtime_calls_may_block_and_run_once() {
        let mut runs = 0;
        let blocked = run_in_place(|| {
            runs += 1;
            hand_off()
        });
        assert!(!blocked);
        assert_eq!(runs, 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_runs_once_in_place_unless_it_hands_off() {
        let mut runs = 0;
        let in_place_first = run_in_place(|| {
            runs += 1;
            in_place()
        });
        assert!(in_place_first);
        assert_eq!(runs, 1);
        assert!(!in_place(), "the mode is put back after the call");

        let mut modes = Vec::new();
        let answer = run_in_place(|| {
            let handed = hand_off();
            modes.push(handed);
            if handed { "stopped" } else { "answered" }
        });
        assert_eq!(answer, "answered", "the second run may block, and answers");
        assert_eq!(modes, [true, false]);
        assert!(!in_place() && !handing_off());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_call_leaves_the_thread_as_it_was() {
        let caught = std::panic::catch_unwind(|| run_in_place(|| panic!("guest host bug")));
        assert!(caught.is_err());
        assert!(!in_place());
    }
}
