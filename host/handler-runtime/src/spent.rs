//! Freeing a call's instance later, off the caller's critical path.
//!
//! Every hook call runs in a fresh instance in a pool slot. Freeing it (the store's drop resets
//! the slot's memory and tables for the next call) costs tens of microseconds after the answer
//! is already known. A caller that has a wait ahead of it (an RPC to a plugin, say) runs its
//! calls inside [`keeping_spent`] and frees what they left, a [`Spent`], during that wait. Until
//! then the pool slot stays taken, so the runtime never has more instances than slots.

use std::cell::RefCell;

use wasmtime::Store;

use crate::call_state::CallState;
use crate::engine::OwnedGatePermit;

thread_local! {
    /// The instances calls on this thread leave behind while [`keeping_spent`] runs.
    static KEPT: RefCell<Option<Vec<Left>>> = const { RefCell::new(None) };
}

/// One call's store and the pool slot it holds.
struct Left {
    _store: Store<CallState>,
    _slot: Option<OwnedGatePermit>,
}

/// What the calls of a [`keeping_spent`] left behind: their instances and pool slots, freed
/// when this is dropped.
#[must_use = "dropping it frees the instances; keep it until a wait, then drop it"]
#[derive(Default)]
pub struct Spent {
    left: Vec<Left>,
}

impl Spent {
    /// How many calls' instances this holds.
    pub fn len(&self) -> usize {
        self.left.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.left.is_empty()
    }
}

impl std::fmt::Debug for Spent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spent")
            .field("calls", &self.left.len())
            .finish()
    }
}

/// Runs `f`; the hook calls it makes on this thread leave their instances in the returned
/// [`Spent`] instead of freeing them before they return.
pub fn keeping_spent<T>(f: impl FnOnce() -> T) -> (T, Spent) {
    /// Puts back what was there before if `f` panics (what was kept is then freed).
    struct Restore(Option<Option<Vec<Left>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(previous) = self.0.take() {
                drop(KEPT.with(|k| k.replace(previous)));
            }
        }
    }
    let mut guard = Restore(Some(KEPT.with(|k| k.replace(Some(Vec::new())))));
    let out = f();
    let previous = guard.0.take().flatten();
    let left = KEPT.with(|k| k.replace(previous)).unwrap_or_default();
    (out, Spent { left })
}

/// Keeps a finished call's store and slot if [`keeping_spent`] is running on this thread;
/// frees them otherwise.
pub(crate) fn finish(store: Store<CallState>, slot: Option<OwnedGatePermit>) {
    let left = Left {
        _store: store,
        _slot: slot,
    };
    let unkept = KEPT.with(|k| match k.borrow_mut().as_mut() {
        Some(kept) => {
            kept.push(left);
            None
        }
        None => Some(left),
    });
    drop(unkept);
}
