//! Deferred release: freeing a call's instance later, and making the next one ahead, off the
//! caller's critical path.
//!
//! A hook call runs in an instance in a pool slot (a fresh one unless its handler reuses
//! instances, whose calls that succeed give theirs back to the handler and leave nothing
//! here). Freeing it (the store's drop resets
//! the slot's memory and tables for the next call) costs tens of microseconds after the answer
//! is already known, and so does making the next call's store and instance before the guest
//! runs. A caller that has a wait ahead of it (an RPC to a plugin, say) runs its calls inside
//! [`defer_release`] and drops what they left, a [`DeferredRelease`], during that wait. Until then the
//! pool slot stays taken, so the runtime never has more instances than slots.
//!
//! Dropping a [`DeferredRelease`] frees the instances and makes, for each handler whose call succeeded,
//! one instance for its next call (a spare: a fresh store and instance, never one a call has
//! run in). The next call of that handler takes it and only runs the guest. Spares are made on
//! tokio's blocking pool when there is a runtime (the caller's task goes on at once), on the
//! dropping thread otherwise; a runtime keeps at most
//! [`RuntimeConfig::spare_slots`](crate::RuntimeConfig::spare_slots) of them, in pool slots of
//! their own. Calls outside [`defer_release`] neither make nor need spares. A spare's guest
//! clock and its captured output start when it was made; its fuel and deadline are set when
//! the call takes it, so the call gets the whole budget and the instantiation's work is not
//! counted.

use std::cell::RefCell;

use wasmtime::Store;

use crate::call_gate::OwnedGatePermit;
use crate::call_state::CallState;
use crate::spare::SpareBuilder;

thread_local! {
    /// The instances calls on this thread leave behind while [`defer_release`] runs.
    static DEFERRED: RefCell<Option<Vec<UsedInstance>>> = const { RefCell::new(None) };
}

/// One call's store, the pool slot it holds, and what makes the handler's next instance (none
/// after a failed call).
struct UsedInstance {
    store: Store<CallState>,
    slot: Option<OwnedGatePermit>,
    spare_builder: Option<SpareBuilder>,
}

/// What the calls of a [`defer_release`] left behind: their instances and pool slots, freed
/// when this is dropped (which also makes each handler's next instance ahead).
#[must_use = "dropping it frees the instances; keep it until a wait, then drop it"]
#[derive(Default)]
pub struct DeferredRelease {
    used: Vec<UsedInstance>,
}

impl DeferredRelease {
    /// How many calls' instances this holds.
    pub fn len(&self) -> usize {
        self.used.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.used.is_empty()
    }
}

impl std::fmt::Debug for DeferredRelease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeferredRelease")
            .field("calls", &self.used.len())
            .finish()
    }
}

impl Drop for DeferredRelease {
    fn drop(&mut self) {
        let used = std::mem::take(&mut self.used);
        if used.is_empty() {
            return;
        }
        let work = move || {
            for UsedInstance {
                store,
                slot,
                spare_builder,
            } in used
            {
                drop(store);
                drop(slot);
                if let Some(builder) = spare_builder {
                    builder.build();
                }
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(work)),
            Err(_) => work(),
        }
    }
}

/// Runs `f`; the hook calls it makes on this thread leave their instances in the returned
/// [`DeferredRelease`] instead of freeing them before they return.
pub fn defer_release<T>(f: impl FnOnce() -> T) -> (T, DeferredRelease) {
    /// Puts back what was there before if `f` panics (what was kept is then freed).
    struct Restore(Option<Option<Vec<UsedInstance>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(previous) = self.0.take() {
                drop(DEFERRED.with(|k| k.replace(previous)));
            }
        }
    }
    let mut guard = Restore(Some(DEFERRED.with(|k| k.replace(Some(Vec::new())))));
    let out = f();
    let previous = guard.0.take().flatten();
    let used = DEFERRED.with(|k| k.replace(previous)).unwrap_or_default();
    (out, DeferredRelease { used })
}

/// Keeps a finished call's store and slot if [`defer_release`] is running on this thread;
/// frees them otherwise. `spare_builder` is asked only when they are kept.
pub(crate) fn release_or_defer(
    store: Store<CallState>,
    slot: Option<OwnedGatePermit>,
    spare_builder: impl FnOnce() -> Option<SpareBuilder>,
) {
    let unkept = DEFERRED.with(|k| match k.borrow_mut().as_mut() {
        Some(kept) => {
            kept.push(UsedInstance {
                store,
                slot,
                spare_builder: spare_builder(),
            });
            None
        }
        None => Some((store, slot)),
    });
    drop(unkept);
}
