//! Slots: what a handler serves. A plugin type's registration hooks, one resource's allocation
//! policy, or the default policy of every resource without its own.

use std::fmt;

use pluglet_handler_runtime::Family;
use serde::{Deserialize, Serialize};

/// What a handler serves. Keys are the strings of `handlers.toml` and the wire.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SlotKey {
    /// Registration hooks of a plugin type (`[plugin_types.<type>]`).
    PluginType(String),
    /// Allocation policy of one resource (`[resources."<resource>"]`).
    Resource(String),
    /// The built-in allocation policy of resources without an entry.
    DefaultPolicy,
}

impl SlotKey {
    /// The hook family a module must export to serve this slot.
    pub fn family(&self) -> Family {
        match self {
            SlotKey::PluginType(_) => Family::Registration,
            SlotKey::Resource(_) | SlotKey::DefaultPolicy => Family::AllocationPolicy,
        }
    }

    /// The entry's name in `handlers.toml`: `plugin_types.CSIPlugin`, `resources."vendor.com/gpu"`.
    pub fn entry_name(&self) -> String {
        match self {
            SlotKey::PluginType(t) => format!("plugin_types.{t}"),
            SlotKey::Resource(r) => format!("resources.\"{r}\""),
            SlotKey::DefaultPolicy => "(default policy)".to_owned(),
        }
    }

    /// The slot's one name in every output, metric label and event: `plugin_type/<type>`,
    /// `resource/<name>` or `default_policy`.
    pub fn id(&self) -> String {
        match self {
            SlotKey::PluginType(t) => format!("plugin_type/{t}"),
            SlotKey::Resource(r) => format!("resource/{r}"),
            SlotKey::DefaultPolicy => "default_policy".to_owned(),
        }
    }

    /// The plugin type, for a plugin type's slot.
    pub fn plugin_type(&self) -> Option<&str> {
        match self {
            SlotKey::PluginType(t) => Some(t),
            _ => None,
        }
    }

    /// The resource, for a resource's slot.
    pub fn resource(&self) -> Option<&str> {
        match self {
            SlotKey::Resource(r) => Some(r),
            _ => None,
        }
    }
}

impl fmt::Display for SlotKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SlotKey::PluginType(t) => write!(f, "plugin type {t}"),
            SlotKey::Resource(r) => write!(f, "resource {r}"),
            SlotKey::DefaultPolicy => f.write_str("the default policy"),
        }
    }
}
