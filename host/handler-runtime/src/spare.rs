//! Spares: an instance made ahead of a handler's next call, in a pool slot of its own, so that
//! the call only runs the guest. A runtime keeps at most [`MAX_SPARES`] of them; a spare is made
//! only for the node name it will serve. What triggers their making is [`crate::deferred_release`].

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use wasmtime::Store;
use wasmtime::component::{Instance, InstancePre};

use crate::call_state::CallState;
use crate::config::MAX_SPARES;
use crate::limits::Limits;
use crate::store::StoreFactory;

/// An instance made ahead of a call, in a pool slot of the spares.
pub(crate) struct Spare {
    store: Store<CallState>,
    instance: Instance,
    node_name: String,
    _counted: SpareCount,
}

/// One of the runtime's spares counted; given back when dropped.
struct SpareCount(Arc<StoreFactory>);

impl SpareCount {
    /// Counts one more spare, unless the runtime keeps [`MAX_SPARES`] already.
    fn take(stores: &Arc<StoreFactory>) -> Option<SpareCount> {
        stores
            .spares_kept
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < MAX_SPARES).then_some(n + 1)
            })
            .ok()
            .map(|_| SpareCount(stores.clone()))
    }
}

impl Drop for SpareCount {
    fn drop(&mut self) {
        self.0.spares_kept.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Takes the spare in `slot` if it was made for `node_name`: its store and instance, ready for
/// the call's fuel and deadline (the instance now counts as the call's, not as a spare).
pub(crate) fn take_spare(
    slot: &Mutex<Option<Spare>>,
    node_name: &str,
) -> Option<(Store<CallState>, Instance)> {
    let spare = lock(slot).take().filter(|r| r.node_name == node_name)?;
    Some((spare.store, spare.instance))
}

/// What makes a handler's spare: the runtime, the handler's compiled component, its
/// identity, settings and limits, and where the spare is kept.
pub(crate) struct SpareBuilder {
    pub(crate) stores: Arc<StoreFactory>,
    pub(crate) pre: InstancePre<CallState>,
    pub(crate) module: Arc<str>,
    pub(crate) node_name: String,
    pub(crate) settings: Arc<BTreeMap<String, String>>,
    pub(crate) limits: Limits,
    pub(crate) spare: Arc<Mutex<Option<Spare>>>,
}

impl SpareBuilder {
    /// Makes the handler's spare, unless it has one or the runtime keeps [`MAX_SPARES`]
    /// already. The instantiation runs under the handler's fuel and deadline like a call; if it
    /// fails, no spare is kept (the next call instantiates, and reports the failure).
    pub(crate) fn build(self) {
        if lock(&self.spare).is_some() {
            return;
        }
        let Some(counted) = SpareCount::take(&self.stores) else {
            return;
        };
        let mut store = self.stores.new_store(
            self.module.clone(),
            self.node_name.clone(),
            self.settings.clone(),
            &self.limits,
        );
        let instance = store
            .set_fuel(self.limits.fuel.unwrap_or(u64::MAX))
            .and_then(|()| {
                let _ticking = self.stores.arm_deadline(&self.limits, &mut store);
                self.pre.instantiate(&mut store)
            });
        let Ok(instance) = instance else {
            return;
        };
        store.data_mut().long_permit = None;
        let spare = Spare {
            store,
            instance,
            node_name: self.node_name,
            _counted: counted,
        };
        let mut slot = lock(&self.spare);
        if slot.is_none() {
            *slot = Some(spare);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
