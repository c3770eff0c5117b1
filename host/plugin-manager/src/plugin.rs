//! The record the plugin manager keeps for the plugin behind a registration socket once it got
//! as far as the register step ([`SocketPlugin`]).
//! Its identity types ([`SocketPath`], [`Generation`], [`PluginType`]) are the daemon-wide
//! typed names of `pluglet-core`; wire strings are parsed into them once, at the edge.

use std::sync::Arc;

use chrono::{DateTime, Utc};
pub use pluglet_core::{Generation, PluginType, SocketPath};
use pluglet_handler_runtime::PluginInfo;
use pluglet_registration::Registration;

/// The plugin behind a registration socket, once it got as far as the register step: what it
/// said and, when it registered, its registration in the pipeline (version, handler, what its
/// plugin type learned). Kept in the actual state both when it registered and when the register
/// step refused it.
#[derive(Clone, Debug)]
pub struct SocketPlugin {
    /// Registration socket it was found at.
    pub socket: SocketPath,
    /// Incarnation of that socket.
    pub generation: Generation,
    /// Parsed plugin type.
    pub plugin_type: PluginType,
    /// GetInfo's answer, with an empty endpoint already replaced by the socket path.
    pub info: PluginInfo,
    /// When the registration finished (or was refused).
    pub registered_at: DateTime<Utc>,
    /// The registration in force; `None` when the register step refused it.
    pub registration: Option<Arc<Registration>>,
}

impl SocketPlugin {
    /// The version its validate hook chose.
    pub fn version(&self) -> Option<&str> {
        self.registration.as_ref()?.version.as_deref()
    }

    /// The handler module that registered it.
    pub fn handler_module(&self) -> Option<&str> {
        Some(self.registration.as_ref()?.handler.module())
    }

    /// What its plugin type learned at registration, when that is a `T` (for CSI drivers,
    /// `pluglet_csi::CsiNodeInfo`).
    pub fn facts<T: std::any::Any>(&self) -> Option<&T> {
        self.registration.as_ref()?.facts.detail()
    }
}
