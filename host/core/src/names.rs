//! Typed names. Each wraps the string (or path, or number) the wire carries and adds nothing
//! but its meaning: `Display` prints the wire form, `Borrow<str>` lets maps keyed by a name be
//! looked up with a plain `&str`, and serde reads and writes the bare string.

use std::borrow::Borrow;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

macro_rules! string_name {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// Wraps a wire string.
            pub fn new(name: impl Into<String>) -> $name {
                $name(name.into())
            }

            /// The wire string.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The wire string, owned.
            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl From<String> for $name {
            fn from(name: String) -> $name {
                $name(name)
            }
        }

        impl From<&str> for $name {
            fn from(name: &str) -> $name {
                $name(name.to_owned())
            }
        }

        impl From<&String> for $name {
            fn from(name: &String) -> $name {
                $name(name.clone())
            }
        }

        impl From<$name> for String {
            fn from(name: $name) -> String {
                name.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }
    };
}

string_name!(
    /// An extended resource name such as `vendor.com/gpu`: the key of a device plugin's
    /// resource, of its devices and of its allocation policy.
    ResourceName
);

string_name!(
    /// A pod's UID, as the caller of an allocation gives it.
    PodUid
);

string_name!(
    /// A container's name within its pod.
    ContainerName
);

/// Path of a plugin's registration socket in the registry directory: the key of the plugin
/// manager's caches and of its executor.
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

impl AsRef<Path> for SocketPath {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

/// One incarnation of something that can come and go under the same name: a registration
/// socket created again at the same path, a device plugin connecting again for the same
/// resource. Each gets a new, larger generation, so news about an older incarnation is
/// recognised and ignored (the kubelet uses a random UUID per socket for the same purpose).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(pub u64);

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The wire name of the CSI plugin type.
pub const CSI_PLUGIN: &str = "CSIPlugin";
/// The wire name of the device plugin type.
pub const DEVICE_PLUGIN: &str = "DevicePlugin";
/// The wire name of the DRA plugin type.
pub const DRA_PLUGIN: &str = "DRAPlugin";

/// A plugin type from `PluginInfo.type`, parsed once at the edge.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PluginType {
    /// `CSIPlugin`: a CSI node driver.
    Csi,
    /// `DevicePlugin`: a device plugin, through either door.
    DevicePlugin,
    /// `DRAPlugin`: a dynamic resource allocation driver (no built-in handler).
    Dra,
    /// Any other string; served only if `handlers.toml` maps a handler to it.
    Other(String),
}

impl PluginType {
    /// Parses the wire string (case matters, as in the kubelet).
    pub fn parse(wire: &str) -> PluginType {
        match wire {
            CSI_PLUGIN => PluginType::Csi,
            DEVICE_PLUGIN => PluginType::DevicePlugin,
            DRA_PLUGIN => PluginType::Dra,
            other => PluginType::Other(other.to_owned()),
        }
    }

    /// The wire string.
    pub fn as_str(&self) -> &str {
        match self {
            PluginType::Csi => CSI_PLUGIN,
            PluginType::DevicePlugin => DEVICE_PLUGIN,
            PluginType::Dra => DRA_PLUGIN,
            PluginType::Other(s) => s,
        }
    }
}

impl fmt::Display for PluginType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The key under which plugin names are unique: type and name. Registrations of one key are
/// serialised, and validate is shown the plugin registered under it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PluginKey {
    /// The plugin type.
    pub plugin_type: PluginType,
    /// The plugin's name (a CSI driver name, an extended resource name, ...).
    pub name: String,
}

impl PluginKey {
    /// The key of `name` of type `plugin_type`.
    pub fn new(plugin_type: PluginType, name: impl Into<String>) -> PluginKey {
        PluginKey {
            plugin_type,
            name: name.into(),
        }
    }
}

impl fmt::Display for PluginKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.plugin_type, self.name)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

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

    #[test]
    fn names_look_up_by_str_and_serialise_bare() {
        let map = HashMap::from([(ResourceName::from("vendor.com/gpu"), 1)]);
        assert_eq!(map.get("vendor.com/gpu"), Some(&1));
        assert_eq!(
            serde_json::to_string(&PodUid::from("uid-1")).unwrap(),
            r#""uid-1""#
        );
        let back: ContainerName = serde_json::from_str(r#""ctr""#).unwrap();
        assert_eq!(back, "ctr");
    }
}
