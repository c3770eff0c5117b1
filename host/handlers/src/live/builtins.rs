//! The built-in modules, loaded once: what serves a slot that `handlers.toml` does not
//! configure, and what an entry with `on_failure = "builtin"` falls back to.

use std::collections::BTreeMap;
use std::sync::Arc;

use pluglet_handler_runtime::{Handler, Limits, LoadError, ModuleSource, Runtime};

use crate::slot::SlotKey;

/// The built-in modules, loaded once.
#[derive(Clone, Debug)]
pub struct Builtins {
    pub(super) plugin_types: BTreeMap<String, Arc<Handler>>,
    pub(super) policy: Arc<Handler>,
}

impl Builtins {
    /// The modules embedded in the binary: `builtin:csi` for `CSIPlugin`,
    /// `builtin:device-plugin` for `DevicePlugin` and as the default allocation policy.
    pub fn embedded(runtime: &Runtime) -> Result<Builtins, LoadError> {
        let device_plugin = || ModuleSource::Builtin {
            name: "device-plugin".to_owned(),
            bytes: pluglet_wasm_guests::DEVICE_PLUGIN,
        };
        Builtins::load(
            runtime,
            vec![
                (
                    pluglet_core::names::CSI_PLUGIN.to_owned(),
                    ModuleSource::Builtin {
                        name: "csi".to_owned(),
                        bytes: pluglet_wasm_guests::CSI,
                    },
                ),
                (
                    pluglet_core::names::DEVICE_PLUGIN.to_owned(),
                    device_plugin(),
                ),
            ],
            device_plugin(),
        )
    }

    /// Loads each distinct module once, with the runtime's default limits and no settings.
    /// Built-ins keep nothing in the guest between calls, so their instances are reused
    /// ([`Limits::reuse_instances`]).
    pub fn load(
        runtime: &Runtime,
        plugin_types: Vec<(String, ModuleSource)>,
        policy: ModuleSource,
    ) -> Result<Builtins, LoadError> {
        let limits = Limits {
            reuse_instances: true,
            ..runtime.config().default_limits
        };
        let mut loaded: BTreeMap<String, Arc<Handler>> = BTreeMap::new();
        let mut load = |source: ModuleSource| -> Result<Arc<Handler>, LoadError> {
            let id = source.id();
            if let Some(handler) = loaded.get(&id) {
                return Ok(handler.clone());
            }
            let handler = runtime.load(source, BTreeMap::new(), Some(limits))?;
            loaded.insert(id, handler.clone());
            Ok(handler)
        };
        let mut types = BTreeMap::new();
        for (plugin_type, source) in plugin_types {
            types.insert(plugin_type, load(source)?);
        }
        let policy = load(policy)?;
        Ok(Builtins {
            plugin_types: types,
            policy,
        })
    }

    /// The built-in that serves `slot` when nothing is configured, if there is one.
    pub fn for_slot(&self, slot: &SlotKey) -> Option<&Arc<Handler>> {
        match slot {
            SlotKey::PluginType(t) => self.plugin_types.get(t),
            SlotKey::Resource(_) | SlotKey::DefaultPolicy => Some(&self.policy),
        }
    }
}
