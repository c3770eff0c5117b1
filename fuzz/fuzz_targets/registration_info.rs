//! The built-in handlers' registration checks: any plugin info is accepted or refused with a
//! reason, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pluglet_guest::PluginInfo;

fuzz_target!(|fields: (String, String, String, Vec<String>)| {
    let (plugin_type, name, endpoint, supported_versions) = fields;
    let plugin = PluginInfo {
        plugin_type,
        name,
        endpoint,
        supported_versions,
    };
    if let Err(refusal) = pluglet_handler_device_plugin::validate(&plugin) {
        assert!(!refusal.message.is_empty());
    }
    if let Err(refusal) = pluglet_handler_csi::validate(&plugin, None) {
        assert!(!refusal.message.is_empty());
    }
});
