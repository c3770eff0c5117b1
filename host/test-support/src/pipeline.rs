//! What the unit tests of the parts share: the built-in handlers and a registration from the
//! pipeline (waiting for an event is [`crate::stub::next_event`]).

use std::sync::{Arc, OnceLock};

use pluglet_handler_runtime::{PluginInfo, Runtime, RuntimeConfig};
use pluglet_handlers::Handlers;
use pluglet_registration::{Candidate, Door, Pipeline, Registration};

/// The built-in handlers, compiled once per test binary.
pub fn handlers() -> Handlers {
    static SET: OnceLock<Handlers> = OnceLock::new();
    SET.get_or_init(|| {
        let runtime = Runtime::new(RuntimeConfig::default()).unwrap();
        Handlers::builtins_only(runtime).unwrap()
    })
    .clone()
}

/// A registration of `resource` made by a pipeline with no device plugin steps, for a part
/// tested without the others.
pub async fn registration(resource: &str) -> Arc<Registration> {
    Pipeline::new(handlers(), "node-1")
        .register(Candidate {
            info: PluginInfo {
                plugin_type: "DevicePlugin".into(),
                name: resource.into(),
                endpoint: "gpu.sock".into(),
                supported_versions: vec!["v1beta1".into()],
            },
            door: Door::KubeletSock,
            connection: None,
        })
        .await
        .unwrap()
}
