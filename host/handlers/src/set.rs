//! The handler set in force: an immutable snapshot of which [`Served`] version serves each slot,
//! and the version before it, kept warm. A change builds a new set and swaps it in whole.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::served::Served;
use crate::slot::SlotKey;

/// One slot: the version in force and the one before it.
#[derive(Clone, Debug)]
pub struct SlotState {
    /// The version in force.
    pub current: Arc<Served>,
    /// The version before it, kept loaded: what a rollback puts back.
    pub previous: Option<Arc<Served>>,
}

/// Which version serves which slot (see the module doc).
#[derive(Clone, Debug)]
pub struct HandlerSet {
    pub(crate) generation: u64,
    pub(crate) plugin_types: BTreeMap<String, SlotState>,
    pub(crate) resources: BTreeMap<String, SlotState>,
    pub(crate) default_policy: SlotState,
}

impl HandlerSet {
    /// Counts the sets put in force since start.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The registration handler for a plugin type: the configured one, else the built-in, else
    /// `None` (an unknown type).
    pub fn for_plugin_type(&self, plugin_type: &str) -> Option<Arc<Served>> {
        self.plugin_types
            .get(plugin_type)
            .map(|s| s.current.clone())
    }

    /// The allocation policy for a resource: its own, else the built-in default.
    pub fn for_resource(&self, resource: &str) -> Arc<Served> {
        self.resources
            .get(resource)
            .unwrap_or(&self.default_policy)
            .current
            .clone()
    }

    /// A slot's state, if the set has it.
    pub fn slot(&self, key: &SlotKey) -> Option<&SlotState> {
        match key {
            SlotKey::PluginType(t) => self.plugin_types.get(t),
            SlotKey::Resource(r) => self.resources.get(r),
            SlotKey::DefaultPolicy => Some(&self.default_policy),
        }
    }

    /// Every slot: plugin types, resources, then the default policy.
    pub fn slots(&self) -> impl Iterator<Item = (SlotKey, &SlotState)> {
        self.plugin_types
            .iter()
            .map(|(t, s)| (SlotKey::PluginType(t.clone()), s))
            .chain(
                self.resources
                    .iter()
                    .map(|(r, s)| (SlotKey::Resource(r.clone()), s)),
            )
            .chain(std::iter::once((
                SlotKey::DefaultPolicy,
                &self.default_policy,
            )))
    }

    /// This set with `key` in `state` (or without `key`), one generation on.
    pub(crate) fn with_slot(&self, key: &SlotKey, state: Option<SlotState>) -> HandlerSet {
        let mut next = self.clone();
        next.generation += 1;
        match (key, state) {
            (SlotKey::PluginType(t), Some(s)) => {
                next.plugin_types.insert(t.clone(), s);
            }
            (SlotKey::PluginType(t), None) => {
                next.plugin_types.remove(t);
            }
            (SlotKey::Resource(r), Some(s)) => {
                next.resources.insert(r.clone(), s);
            }
            (SlotKey::Resource(r), None) => {
                next.resources.remove(r);
            }
            (SlotKey::DefaultPolicy, Some(s)) => next.default_policy = s,
            (SlotKey::DefaultPolicy, None) => {}
        }
        next
    }
}
