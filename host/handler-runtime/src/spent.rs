//! Freeing a call's instance later, and making the next one ahead, off the caller's critical
//! path.
//!
//! Every hook call runs in a fresh instance in a pool slot. Freeing it (the store's drop resets
//! the slot's memory and tables for the next call) costs tens of microseconds after the answer
//! is already known, and so does making the next call's store and instance before the guest
//! runs. A caller that has a wait ahead of it (an RPC to a plugin, say) runs its calls inside
//! [`keeping_spent`] and drops what they left, a [`Spent`], during that wait. Until then the
//! pool slot stays taken, so the runtime never has more instances than slots.
//!
//! Dropping a [`Spent`] frees the instances and makes, for each handler whose call succeeded,
//! one instance for its next call (a spare: a fresh store and instance, never one a call has
//! run in). The next call of that handler takes it and only runs the guest. Spares are made on
//! tokio's blocking pool when there is a runtime (the caller's task goes on at once), on the
//! dropping thread otherwise; a runtime keeps at most [`MAX_SPARES`] of them, in pool slots of
//! their own. Calls outside [`keeping_spent`] neither make nor need spares. A spare's guest
//! clock and its captured output start when it was made; its fuel and deadline are set when
//! the call takes it, so the call gets the whole budget and the instantiation's work is not
//! counted.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use wasmtime::Store;
use wasmtime::component::{Instance, InstancePre};

use crate::call_state::CallState;
use crate::engine::{Limits, MAX_SPARES, OwnedGatePermit, RuntimeInner};

thread_local! {
    /// The instances calls on this thread leave behind while [`keeping_spent`] runs.
    static KEPT: RefCell<Option<Vec<Left>>> = const { RefCell::new(None) };
}

/// One call's store, the pool slot it holds, and what makes the handler's next instance (none
/// after a failed call).
struct Left {
    store: Store<CallState>,
    slot: Option<OwnedGatePermit>,
    maker: Option<Maker>,
}

/// What the calls of a [`keeping_spent`] left behind: their instances and pool slots, freed
/// when this is dropped (which also makes each handler's next instance ahead).
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

impl Drop for Spent {
    fn drop(&mut self) {
        let left = std::mem::take(&mut self.left);
        if left.is_empty() {
            return;
        }
        let work = move || {
            for Left { store, slot, maker } in left {
                drop(store);
                drop(slot);
                if let Some(maker) = maker {
                    maker.make_spare();
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
/// frees them otherwise. `maker` is asked only when they are kept.
pub(crate) fn finish(
    store: Store<CallState>,
    slot: Option<OwnedGatePermit>,
    maker: impl FnOnce() -> Option<Maker>,
) {
    let unkept = KEPT.with(|k| match k.borrow_mut().as_mut() {
        Some(kept) => {
            kept.push(Left {
                store,
                slot,
                maker: maker(),
            });
            None
        }
        None => Some((store, slot)),
    });
    drop(unkept);
}

/// An instance made ahead of a call, in a pool slot of the spares.
pub(crate) struct Ready {
    store: Store<CallState>,
    instance: Instance,
    node_name: String,
    _counted: Counted,
}

/// One of the runtime's spares counted; given back when dropped.
struct Counted(Arc<RuntimeInner>);

impl Counted {
    /// Counts one more spare, unless the runtime keeps [`MAX_SPARES`] already.
    fn take(runtime: &Arc<RuntimeInner>) -> Option<Counted> {
        runtime
            .spares
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < MAX_SPARES).then_some(n + 1)
            })
            .ok()
            .map(|_| Counted(runtime.clone()))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.spares.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Takes the spare in `slot` if it was made for `node_name`: its store and instance, ready for
/// the call's fuel and deadline (the instance now counts as the call's, not as a spare).
pub(crate) fn take_spare(
    slot: &Mutex<Option<Ready>>,
    node_name: &str,
) -> Option<(Store<CallState>, Instance)> {
    let ready = lock(slot).take().filter(|r| r.node_name == node_name)?;
    Some((ready.store, ready.instance))
}

/// What makes a handler's spare: the runtime, the handler's compiled component, its
/// identity, settings and limits, and where the spare is kept.
pub(crate) struct Maker {
    pub(crate) runtime: Arc<RuntimeInner>,
    pub(crate) pre: InstancePre<CallState>,
    pub(crate) module: Arc<str>,
    pub(crate) node_name: String,
    pub(crate) settings: Arc<BTreeMap<String, String>>,
    pub(crate) limits: Limits,
    pub(crate) spare: Arc<Mutex<Option<Ready>>>,
}

impl Maker {
    /// Makes the handler's spare, unless it has one or the runtime keeps [`MAX_SPARES`]
    /// already. The instantiation runs under the handler's fuel and deadline like a call; if it
    /// fails, no spare is kept (the next call instantiates, and reports the failure).
    fn make_spare(self) {
        if lock(&self.spare).is_some() {
            return;
        }
        let Some(counted) = Counted::take(&self.runtime) else {
            return;
        };
        let mut store = crate::handler::new_store(
            &self.runtime,
            self.module.clone(),
            self.node_name.clone(),
            self.settings.clone(),
            &self.limits,
        );
        let instance = store
            .set_fuel(self.limits.fuel.unwrap_or(u64::MAX))
            .and_then(|()| {
                crate::handler::arm_deadline(&self.runtime, &self.limits, &mut store);
                self.pre.instantiate(&mut store)
            });
        let Ok(instance) = instance else {
            return;
        };
        store.data_mut().long_permit = None;
        let ready = Ready {
            store,
            instance,
            node_name: self.node_name,
            _counted: counted,
        };
        let mut slot = lock(&self.spare);
        if slot.is_none() {
            *slot = Some(ready);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
