//! The plugin manager's views: registered plugins (`ctl plugins`) and registration sockets
//! (`ctl sockets`).

use std::collections::BTreeMap;

use pluglet_proto::admin::v1 as pb;
use serde::{Deserialize, Serialize};

use super::{Listed, Table, dash, non_empty, sorted};

/// A registered plugin (`ctl plugins`), and the plugin record of `handler test --event`. CSI
/// facts are flat keys, present only for CSI drivers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginView {
    /// Plugin name.
    pub name: String,
    /// Wire type string: `CSIPlugin`, `DevicePlugin`, ...
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// The plugin's endpoint.
    #[serde(default)]
    pub endpoint: String,
    /// Supported versions as GetInfo reported them.
    #[serde(default)]
    pub versions: Vec<String>,
    /// Version chosen by the handler.
    #[serde(default)]
    pub version: Option<String>,
    /// Handler module in force (empty in an event file).
    #[serde(default)]
    pub handler: String,
    /// RFC 3339, UTC (empty in an event file).
    #[serde(default)]
    pub registered_at: String,
    /// Registration socket the plugin was found at (empty in an event file, and for a device
    /// plugin registered through `kubelet.sock`).
    #[serde(default)]
    pub socket_path: String,
    /// How it registered: `registry` (a socket in the plugin registry) or `kubelet.sock` (a
    /// device plugin's `Register`); empty in an event file.
    #[serde(default)]
    pub door: String,
    /// CSI: NodeGetInfo's node id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// CSI: NodeGetInfo's max volumes per node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_volumes_per_node: Option<i64>,
    /// CSI: NodeGetInfo's accessible topology.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<BTreeMap<String, String>>,
}

impl From<&pb::Plugin> for PluginView {
    fn from(p: &pb::Plugin) -> PluginView {
        PluginView {
            name: p.name.clone(),
            plugin_type: p.r#type.clone(),
            endpoint: p.endpoint.clone(),
            versions: p.versions.clone(),
            version: non_empty(&p.version),
            handler: p.handler.clone(),
            registered_at: p.registered_at.clone(),
            socket_path: p.socket_path.clone(),
            door: p.door.clone(),
            node_id: p.csi.as_ref().map(|c| c.node_id.clone()),
            max_volumes_per_node: p.csi.as_ref().map(|c| c.max_volumes_per_node),
            topology: p.csi.as_ref().map(|c| sorted(&c.topology)),
        }
    }
}

/// A socket the watcher knows (`ctl sockets`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SocketView {
    /// The socket's path.
    pub path: String,
    /// `registered`, `refused`, `retrying`, `in_progress`, `pending`, or `ignored` (named `*.sock`
    /// but not a socket; `last_error` says why).
    pub state: String,
    /// Registration attempts so far.
    pub attempts: u32,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// From GetInfo, once known.
    pub plugin_type: Option<String>,
    /// From GetInfo, once known.
    pub plugin_name: Option<String>,
    /// Milliseconds until the next attempt when retrying; 0 otherwise.
    pub next_retry_ms: u64,
}

impl From<&pb::SocketStatus> for SocketView {
    fn from(s: &pb::SocketStatus) -> SocketView {
        SocketView {
            path: s.path.clone(),
            state: s.state.clone(),
            attempts: s.attempts,
            last_error: non_empty(&s.last_error),
            plugin_type: non_empty(&s.plugin_type),
            plugin_name: non_empty(&s.plugin_name),
            next_retry_ms: s.next_retry_ms,
        }
    }
}

impl Listed for PluginView {
    const LIST_KIND: &'static str = "PluginList";
}

impl Listed for SocketView {
    const LIST_KIND: &'static str = "SocketList";
}

impl Table for PluginView {
    const HEADER: &'static [&'static str] = &[
        "NAME",
        "TYPE",
        "DOOR",
        "VERSION",
        "NODE ID",
        "ENDPOINT",
        "HANDLER",
        "REGISTERED AT",
    ];
    fn row(&self) -> Vec<String> {
        vec![
            self.name.clone(),
            self.plugin_type.clone(),
            dash(&self.door),
            dash(self.version.as_deref().unwrap_or_default()),
            dash(self.node_id.as_deref().unwrap_or_default()),
            self.endpoint.clone(),
            self.handler.clone(),
            self.registered_at.clone(),
        ]
    }
}

impl Table for SocketView {
    const HEADER: &'static [&'static str] =
        &["PATH", "STATE", "ATTEMPTS", "TYPE", "NAME", "LAST ERROR"];
    fn row(&self) -> Vec<String> {
        vec![
            self.path.clone(),
            self.state.clone(),
            self.attempts.to_string(),
            dash(self.plugin_type.as_deref().unwrap_or_default()),
            dash(self.plugin_name.as_deref().unwrap_or_default()),
            dash(self.last_error.as_deref().unwrap_or_default()),
        ]
    }
}
