//! Spares: instances ready for a handler's next calls, in pool slots of their own, so that a
//! call only runs the guest. A spare is either made ahead (a fresh instance; what triggers its
//! making is [`crate::deferred_release`]) or, for a handler that reuses instances
//! ([`crate::Limits::reuse_instances`]), the instance of a call that succeeded, kept. A runtime
//! keeps at most [`RuntimeConfig::spare_slots`](crate::RuntimeConfig::spare_slots) of them, a
//! handler at most [`SPARES_PER_HANDLER`]; a spare serves only the node name its store was made
//! for.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use wasmtime::Store;
use wasmtime::component::{Instance, InstancePre};

use crate::call_state::CallState;
use crate::limits::Limits;
use crate::store::StoreFactory;

/// Spares one handler keeps at most: enough for the calls of one handler that run at once on
/// a small node (each core runs one), while the others' share of the runtime's spares stays.
pub(crate) const SPARES_PER_HANDLER: usize = 2;

/// A handler's spares, the last kept taken first.
pub(crate) type Spares = Mutex<Vec<Spare>>;

/// An instance ready for a call, in a pool slot of the spares.
pub(crate) struct Spare {
    store: Store<CallState>,
    instance: Instance,
    _counted: SpareCount,
}

/// One of the runtime's spares counted; given back when dropped.
struct SpareCount(Arc<StoreFactory>);

impl SpareCount {
    /// Counts one more spare, unless the runtime keeps as many as it has slots for already.
    fn take(stores: &Arc<StoreFactory>) -> Option<SpareCount> {
        let slots = stores.config.spare_slots();
        stores
            .spares_kept
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < slots).then_some(n + 1)
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

/// Takes a spare of `spares` for `node_name`: its store and instance, ready for the call's fuel
/// and deadline (the instance now counts as the call's, not as a spare). A spare made for
/// another node is dropped.
pub(crate) fn take_spare(spares: &Spares, node_name: &str) -> Option<(Store<CallState>, Instance)> {
    let spare = lock(spares)
        .pop()
        .filter(|s| s.store.data().node_name() == node_name)?;
    Some((spare.store, spare.instance))
}

/// Keeps the instance of a call that succeeded as a spare of its handler if the store may
/// serve another call ([`CallState::reset_for_reuse`]) and there is room; gives the store back
/// otherwise, to be freed.
pub(crate) fn keep_for_reuse(
    spares: &Spares,
    stores: &Arc<StoreFactory>,
    mut store: Store<CallState>,
    instance: Instance,
) -> Result<(), Store<CallState>> {
    if !store.data_mut().reset_for_reuse() {
        return Err(store);
    }
    let mut kept = lock(spares);
    if kept.len() >= SPARES_PER_HANDLER {
        return Err(store);
    }
    let Some(counted) = SpareCount::take(stores) else {
        return Err(store);
    };
    kept.push(Spare {
        store,
        instance,
        _counted: counted,
    });
    Ok(())
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
    pub(crate) spares: Arc<Spares>,
}

impl SpareBuilder {
    /// Makes the handler's spare, unless it has one or the runtime keeps as many as it has
    /// slots for already. The instantiation runs under the handler's fuel and deadline like a
    /// call; if it fails, no spare is kept (the next call instantiates, and reports the failure).
    pub(crate) fn build(self) {
        if !lock(&self.spares).is_empty() {
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
            _counted: counted,
        };
        let mut kept = lock(&self.spares);
        if kept.is_empty() {
            kept.push(spare);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
