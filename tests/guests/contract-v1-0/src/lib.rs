//! Test guest built against the 1.0.0 snapshot of the contract (guest-sdk/wit-history/1.0.0)
//! with plain wit-bindgen, registration only: the 1.1.0 host must still load and run it.

#[cfg(target_arch = "wasm32")]
#[allow(missing_docs, unsafe_code, clippy::all)]
mod bindings {
    wit_bindgen::generate!({
        path: "../../../guest-sdk/wit-history/1.0.0",
        world: "registration-handler",
    });

    use exports::pluglet::handler::registration::Guest;
    use pluglet::handler::host;
    use pluglet::handler::types::{
        Accepted, PluginInfo, Refusal, RefusalKind, RegisteredPlugin, RegistrationFacts,
    };

    struct OldGuest;

    impl Guest for OldGuest {
        fn validate(
            plugin: PluginInfo,
            _existing: Option<RegisteredPlugin>,
        ) -> Result<Accepted, Refusal> {
            host::log(
                host::Level::Info,
                &format!("1.0.0 guest validating {}", plugin.name),
            );
            if plugin.supported_versions.is_empty() {
                return Err(Refusal {
                    kind: RefusalKind::UnsupportedVersion,
                    message: "no versions".into(),
                });
            }
            Ok(Accepted {
                version: Some(super::CHOSEN.into()),
            })
        }

        fn register(_plugin: PluginInfo, _facts: RegistrationFacts) -> Result<(), Refusal> {
            Ok(())
        }

        fn deregister(_plugin: PluginInfo) {}
    }

    export!(OldGuest);
}

/// The version this guest reports when it accepts.
pub const CHOSEN: &str = "chosen-by-1.0.0";
