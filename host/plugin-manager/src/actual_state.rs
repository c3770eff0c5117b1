//! Actual state of world: the plugins that got as far as the register hook, with the outcome.
//!
//! Single writer: the reconciler task, which owns [`ActualState`] and applies operation outcomes to
//! it; the admin API asks the reconciler for a snapshot. (The plugin registered under each type
//! and name, which a validate hook is shown, is kept by the registration pipeline, for both
//! doors.) Mirrors the kubelet's `actual_state_of_world.go`, including its quirk that a plugin
//! refused by the register step stays here (state [`RegistrationState::Refused`]) so it is not
//! retried until its socket is re-created.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use super::plugin::{Generation, SocketPath, SocketPlugin};

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
    pub record: SocketPlugin,
    /// Outcome of its registration.
    pub state: RegistrationState,
}

/// The actual state, owned by the reconciler.
#[derive(Debug, Default)]
pub struct ActualState {
    entries: BTreeMap<SocketPath, ActualEntry>,
    sockets: Arc<Mutex<BTreeSet<SocketPath>>>,
}

impl ActualState {
    /// An empty actual state.
    pub fn new() -> ActualState {
        ActualState::default()
    }

    /// The sockets in the actual state, kept up to date for readers outside the reconciler
    /// (the metrics' `plugin_manager_total_plugins`).
    pub fn sockets(&self) -> Arc<Mutex<BTreeSet<SocketPath>>> {
        self.sockets.clone()
    }

    fn published(&self) -> std::sync::MutexGuard<'_, BTreeSet<SocketPath>> {
        self.sockets.lock().unwrap_or_else(|e| e.into_inner())
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
    pub fn add_registered(&mut self, record: SocketPlugin) {
        self.published().insert(record.socket.clone());
        self.entries.insert(
            record.socket.clone(),
            ActualEntry {
                record,
                state: RegistrationState::Registered,
            },
        );
    }

    /// Records a plugin the register step refused.
    pub fn add_refused(&mut self, record: SocketPlugin, reason: String) {
        self.published().insert(record.socket.clone());
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
        self.published().remove(socket);
        self.entries.remove(socket)
    }
}
