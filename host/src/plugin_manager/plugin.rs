//! Identity types of the plugin manager: which socket, which incarnation of it, which plugin type,
//! and the record kept for a plugin once it has registered.
//!
//! Wire strings (`"CSIPlugin"`, …) are parsed once here into [`PluginType`]; everything else in the
//! plugin manager works with these types and turns them back into strings only for logs and the wire.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use pluglet_handler_runtime::{Handler, PluginInfo, RegisteredPlugin};
use pluglet_proto::constants;

/// Path of a registration socket inside the registry directory; the key of every cache and of the
/// executor.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SocketPath(PathBuf);

impl SocketPath {
    /// Wraps a path.
    pub fn new(path: impl Into<PathBuf>) -> SocketPath {
        SocketPath(path.into())
    }

    /// The path.
    pub fn as_path(&self) -> &Path {
        &self.0
    }
}

impl fmt::Display for SocketPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.display())
    }
}

/// One incarnation of a socket: every time the watcher sees a socket created (again) at a path it
/// hands out a new generation, so a socket deleted and re-created is a new registration (the
/// kubelet uses a random UUID for the same purpose).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(pub u64);

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The plugin type from `PluginInfo.type`, parsed once at the edge.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PluginType {
    /// `CSIPlugin`: a CSI node driver.
    Csi,
    /// `DevicePlugin`: a device plugin using the plugin watcher flow.
    DevicePlugin,
    /// `DRAPlugin`: a dynamic resource allocation driver (no built-in handler).
    Dra,
    /// Any other string; served only if `handlers.toml` maps a handler to it.
    Other(String),
}

impl PluginType {
    /// Parses the wire string.
    pub fn parse(wire: &str) -> PluginType {
        match wire {
            constants::CSI_PLUGIN => PluginType::Csi,
            constants::DEVICE_PLUGIN => PluginType::DevicePlugin,
            constants::DRA_PLUGIN => PluginType::Dra,
            other => PluginType::Other(other.to_owned()),
        }
    }

    /// The wire string.
    pub fn as_str(&self) -> &str {
        match self {
            PluginType::Csi => constants::CSI_PLUGIN,
            PluginType::DevicePlugin => constants::DEVICE_PLUGIN,
            PluginType::Dra => constants::DRA_PLUGIN,
            PluginType::Other(s) => s,
        }
    }
}

impl fmt::Display for PluginType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a CSI driver's NodeGetInfo said, kept with its plugin record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CsiNodeInfo {
    /// Node id; never empty for a registered driver.
    pub node_id: String,
    /// Maximum volumes per node (0: not given).
    pub max_volumes_per_node: i64,
    /// Accessible topology segments.
    pub topology: BTreeMap<String, String>,
}

/// A plugin that got as far as the register hook: what it said, which handler took it and what the
/// host learned. Kept in the actual state both when it registered and when register refused it.
#[derive(Clone, Debug)]
pub struct PluginRecord {
    /// Registration socket it was found at.
    pub socket: SocketPath,
    /// Incarnation of that socket.
    pub generation: Generation,
    /// Parsed plugin type.
    pub plugin_type: PluginType,
    /// GetInfo's answer, with an empty endpoint already replaced by the socket path.
    pub info: PluginInfo,
    /// Version chosen by the handler's validate hook.
    pub version: Option<String>,
    /// The handler that validated and registered it (deregistration uses the same one).
    pub handler: Arc<Handler>,
    /// When the registration finished.
    pub registered_at: DateTime<Utc>,
    /// CSI facts from NodeGetInfo.
    pub csi: Option<CsiNodeInfo>,
}

impl PluginRecord {
    /// The form handed to a handler's validate hook as `existing`.
    pub fn as_registered(&self) -> RegisteredPlugin {
        RegisteredPlugin {
            info: self.info.clone(),
            version: self.version.clone(),
        }
    }

    /// The key under which names are unique: type and name.
    pub fn name_key(&self) -> (String, String) {
        (self.info.plugin_type.clone(), self.info.name.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plugin_type_round_trips_wire_strings() {
        for wire in ["CSIPlugin", "DevicePlugin", "DRAPlugin", "Custom"] {
            assert_eq!(PluginType::parse(wire).as_str(), wire);
        }
        assert_eq!(PluginType::parse("CSIPlugin"), PluginType::Csi);
        assert_eq!(
            PluginType::parse("csiplugin"),
            PluginType::Other("csiplugin".into())
        );
    }
}
