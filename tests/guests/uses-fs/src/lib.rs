//! Test guest that reads a file with `std::fs` in a hook: it imports `wasi:filesystem`, so the
//! host must refuse it at load.

use pluglet_guest::{Accepted, PluginInfo, Refusal, RefusalKind, RegisteredPlugin, Registration};

/// The handler reading a file.
pub struct UsesFs;

impl Registration for UsesFs {
    fn validate(
        plugin: PluginInfo,
        _existing: Option<RegisteredPlugin>,
    ) -> Result<Accepted, Refusal> {
        match std::fs::read_to_string(&plugin.endpoint) {
            Ok(text) => Ok(Accepted {
                version: Some(text),
            }),
            Err(e) => Err(Refusal::new(RefusalKind::Other, e.to_string())),
        }
    }
}

pluglet_guest::export_handler!(UsesFs: registration);
