//! Which module serves which key: `handlers.toml` in the handlers directory, over the built-ins.
//!
//! ```toml
//! [plugin_types.CSIPlugin]           # replaces builtin:csi for CSI drivers
//! module = "strict-csi.wasm"         # relative to the handlers dir, or absolute
//! deadline_ms = 50                   # optional limits
//! memory_mib = 16
//! fuel = 50000000
//! settings = { min_version = "1.2.0" }
//!
//! [resources."vendor.com/gpu"]       # allocation policy for one resource
//! module = "spread-policy.wasm"
//! settings = {}
//! ```
//! Keys are opaque strings here: the host uses plugin type strings and resource names.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::engine::{Limits, ModuleSource, Runtime};
use crate::error::ConfigError;
use crate::handler::Handler;
use crate::types::Family;

/// The file name read from the handlers directory.
pub const HANDLERS_FILE: &str = "handlers.toml";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    plugin_types: BTreeMap<String, EntryConfig>,
    #[serde(default)]
    resources: BTreeMap<String, EntryConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EntryConfig {
    module: PathBuf,
    deadline_ms: Option<u64>,
    memory_mib: Option<u32>,
    fuel: Option<u64>,
    #[serde(default)]
    settings: BTreeMap<String, toml::Value>,
}

/// One entry of a [`HandlerSet`]: a handler and the key it serves. The default allocation policy
/// has neither a plugin type nor a resource.
#[derive(Clone, Debug)]
pub struct HandlerEntry {
    /// The plugin type it serves, for registration handlers.
    pub plugin_type: Option<String>,
    /// The resource it serves, for allocation policies configured per resource.
    pub resource: Option<String>,
    /// The handler.
    pub handler: Arc<Handler>,
}

/// Which module serves which plugin type and resource.
#[derive(Clone, Debug)]
pub struct HandlerSet {
    plugin_types: BTreeMap<String, Arc<Handler>>,
    builtin_types: BTreeMap<String, Arc<Handler>>,
    resources: BTreeMap<String, Arc<Handler>>,
    default_policy: Arc<Handler>,
}

impl HandlerSet {
    /// Reads `<dir>/handlers.toml` if present (missing file = built-ins only); module paths are
    /// relative to `dir`. Built-ins are loaded once per module id with the runtime's default
    /// limits and no settings.
    pub fn load(
        runtime: &Runtime,
        dir: &Path,
        builtin_plugin_types: Vec<(String, ModuleSource)>,
        builtin_policy: ModuleSource,
    ) -> Result<HandlerSet, ConfigError> {
        let mut builtins: BTreeMap<String, Arc<Handler>> = BTreeMap::new();
        let mut load_builtin = |source: ModuleSource| -> Result<Arc<Handler>, ConfigError> {
            let id = source.id();
            if let Some(handler) = builtins.get(&id) {
                return Ok(handler.clone());
            }
            let handler = runtime
                .load(source, BTreeMap::new(), None)
                .map_err(ConfigError::Builtin)?;
            builtins.insert(id, handler.clone());
            Ok(handler)
        };
        let mut builtin_types = BTreeMap::new();
        for (plugin_type, source) in builtin_plugin_types {
            builtin_types.insert(plugin_type, load_builtin(source)?);
        }
        let default_policy = load_builtin(builtin_policy)?;

        let path = dir.join(HANDLERS_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => return Err(ConfigError::Read { path, source }),
        };
        let config = match text {
            Some(text) => toml::from_str::<FileConfig>(&text).map_err(|e| ConfigError::Parse {
                path: path.clone(),
                message: e.message().to_string(),
            })?,
            None => FileConfig {
                plugin_types: BTreeMap::new(),
                resources: BTreeMap::new(),
            },
        };

        let defaults = runtime.config().default_limits;
        let mut plugin_types = BTreeMap::new();
        for (key, entry) in config.plugin_types {
            let name = format!("plugin_types.{key}");
            let handler = load_entry(runtime, dir, &path, &name, entry, defaults)?;
            require_family(&path, &name, &handler, Family::Registration)?;
            plugin_types.insert(key, handler);
        }
        let mut resources = BTreeMap::new();
        for (key, entry) in config.resources {
            let name = format!("resources.\"{key}\"");
            let handler = load_entry(runtime, dir, &path, &name, entry, defaults)?;
            require_family(&path, &name, &handler, Family::AllocationPolicy)?;
            resources.insert(key, handler);
        }
        Ok(HandlerSet {
            plugin_types,
            builtin_types,
            resources,
            default_policy,
        })
    }

    /// The registration handler for a plugin type: the configured one, else the built-in, else
    /// `None` (an unknown type).
    pub fn for_plugin_type(&self, plugin_type: &str) -> Option<Arc<Handler>> {
        self.plugin_types
            .get(plugin_type)
            .or_else(|| self.builtin_types.get(plugin_type))
            .cloned()
    }

    /// The allocation policy for a resource: the configured one, else the built-in default.
    pub fn for_resource(&self, resource: &str) -> Arc<Handler> {
        self.resources
            .get(resource)
            .cloned()
            .unwrap_or_else(|| self.default_policy.clone())
    }

    /// Every handler in use: per plugin type (configured or built-in), per resource, and the
    /// default policy last (with neither key).
    pub fn entries(&self) -> Vec<HandlerEntry> {
        let mut types: BTreeMap<&String, &Arc<Handler>> = self.builtin_types.iter().collect();
        types.extend(self.plugin_types.iter());
        let mut out: Vec<HandlerEntry> = types
            .into_iter()
            .map(|(plugin_type, handler)| HandlerEntry {
                plugin_type: Some(plugin_type.clone()),
                resource: None,
                handler: handler.clone(),
            })
            .collect();
        out.extend(
            self.resources
                .iter()
                .map(|(resource, handler)| HandlerEntry {
                    plugin_type: None,
                    resource: Some(resource.clone()),
                    handler: handler.clone(),
                }),
        );
        out.push(HandlerEntry {
            plugin_type: None,
            resource: None,
            handler: self.default_policy.clone(),
        });
        out
    }
}

fn load_entry(
    runtime: &Runtime,
    dir: &Path,
    path: &Path,
    name: &str,
    entry: EntryConfig,
    defaults: Limits,
) -> Result<Arc<Handler>, ConfigError> {
    let invalid = |message: String| ConfigError::InvalidEntry {
        path: path.to_path_buf(),
        entry: name.to_string(),
        message,
    };
    let mut settings = BTreeMap::new();
    for (key, value) in entry.settings {
        let text = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => {
                return Err(invalid(format!(
                    "setting {key} is a {}; settings must be strings, numbers or booleans",
                    other.type_str()
                )));
            }
        };
        settings.insert(key, text);
    }
    let mut limits = defaults;
    if let Some(ms) = entry.deadline_ms {
        if ms == 0 {
            return Err(invalid(
                "deadline_ms must be at least 1 (leave it out for the default)".into(),
            ));
        }
        limits.deadline = Duration::from_millis(ms);
    }
    if let Some(mib) = entry.memory_mib {
        limits.memory_mib = mib;
    }
    if let Some(fuel) = entry.fuel {
        limits.fuel = Some(fuel);
    }
    let module = if entry.module.is_absolute() {
        entry.module
    } else {
        dir.join(entry.module)
    };
    runtime
        .load(ModuleSource::File(module), settings, Some(limits))
        .map_err(|source| ConfigError::Load {
            path: path.to_path_buf(),
            entry: name.to_string(),
            source,
        })
}

fn require_family(
    path: &Path,
    name: &str,
    handler: &Handler,
    family: Family,
) -> Result<(), ConfigError> {
    if handler.implements(family) {
        Ok(())
    } else {
        Err(ConfigError::MissingFamily {
            path: path.to_path_buf(),
            entry: name.to_string(),
            module: handler.module().to_string(),
            family,
        })
    }
}
