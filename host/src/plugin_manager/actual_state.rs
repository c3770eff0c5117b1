//! Actual state of world: the plugins that got as far as the register hook, with the outcome.
//!
//! Single writer: the reconciler task, which owns [`ActualState`] and applies operation outcomes to
//! it. Readers: register operations look up "the plugin already registered under this type and name"
//! through [`RegisteredNames`] (a small map behind a lock, never held across `.await`); the admin API
//! asks the reconciler for a snapshot. Mirrors the kubelet's `actual_state_of_world.go`, including its
//! quirk that a plugin refused by the register hook stays here (state [`RegistrationState::Refused`])
//! so it is not retried until its socket is re-created.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use pluglet_handler_runtime::RegisteredPlugin;

use super::plugin::{Generation, PluginRecord, SocketPath};

/// Where a plugin in the actual state stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistrationState {
    /// Registered; stays so until its socket disappears or is re-created.
    Registered,
    /// The register step (hook, NodeGetInfo, device connect) refused it; stands until the socket is
    /// re-created, as in the kubelet.
    Refused {
        /// Why.
        reason: String,
    },
}

/// One plugin in the actual state.
#[derive(Clone, Debug)]
pub struct ActualEntry {
    /// What is known about it.
    pub record: PluginRecord,
    /// Outcome of its registration.
    pub state: RegistrationState,
}

/// Registered plugins by (type, name), with the socket that registered them.
type NameIndex = HashMap<(String, String), (SocketPath, RegisteredPlugin)>;

/// Read access to the registered plugins by (type, name), for validate's `existing` argument.
#[derive(Clone, Debug, Default)]
pub struct RegisteredNames {
    inner: Arc<RwLock<NameIndex>>,
}

impl RegisteredNames {
    /// The plugin registered under `plugin_type` and `name`, if any.
    pub fn get(&self, plugin_type: &str, name: &str) -> Option<RegisteredPlugin> {
        let map = self.inner.read().unwrap_or_else(|e| e.into_inner());
        map.get(&(plugin_type.to_owned(), name.to_owned()))
            .map(|(_, p)| p.clone())
    }
}

/// The actual state, owned by the reconciler.
#[derive(Debug, Default)]
pub struct ActualState {
    entries: BTreeMap<SocketPath, ActualEntry>,
    names: RegisteredNames,
}

impl ActualState {
    /// An empty actual state.
    pub fn new() -> ActualState {
        ActualState::default()
    }

    /// A read handle on the registered names.
    pub fn names(&self) -> RegisteredNames {
        self.names.clone()
    }

    /// Every entry, by socket path.
    pub fn entries(&self) -> &BTreeMap<SocketPath, ActualEntry> {
        &self.entries
    }

    /// The entry of one socket.
    pub fn get(&self, socket: &SocketPath) -> Option<&ActualEntry> {
        self.entries.get(socket)
    }

    /// Generation recorded for a socket.
    pub fn generation(&self, socket: &SocketPath) -> Option<Generation> {
        self.entries.get(socket).map(|e| e.record.generation)
    }

    /// Records a registered plugin.
    pub fn add_registered(&mut self, record: PluginRecord) {
        let mut names = self.names.inner.write().unwrap_or_else(|e| e.into_inner());
        names.insert(
            record.name_key(),
            (record.socket.clone(), record.as_registered()),
        );
        drop(names);
        self.entries.insert(
            record.socket.clone(),
            ActualEntry {
                record,
                state: RegistrationState::Registered,
            },
        );
    }

    /// Records a plugin the register step refused.
    pub fn add_refused(&mut self, record: PluginRecord, reason: String) {
        self.entries.insert(
            record.socket.clone(),
            ActualEntry {
                record,
                state: RegistrationState::Refused { reason },
            },
        );
    }

    /// Removes the entry of `socket` if it still has `generation`; returns it.
    pub fn remove(&mut self, socket: &SocketPath, generation: Generation) -> Option<ActualEntry> {
        if self.generation(socket) != Some(generation) {
            return None;
        }
        let entry = self.entries.remove(socket)?;
        let mut names = self.names.inner.write().unwrap_or_else(|e| e.into_inner());
        let key = entry.record.name_key();
        if names.get(&key).is_some_and(|(s, _)| s == socket) {
            names.remove(&key);
        }
        Some(entry)
    }
}
