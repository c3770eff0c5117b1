//! What the unit tests of the parts share: the built-in handlers, a registration from the
//! pipeline, and waiting for an event.

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pluglet_handler_runtime::{HandlerSet, ModuleSource, PluginInfo, Runtime, RuntimeConfig};
use pluglet_registration::{Candidate, Door, Pipeline, Registration};
use tokio::sync::broadcast;

/// The built-in handlers, compiled once per test binary.
pub fn handlers() -> Arc<HandlerSet> {
    static SET: OnceLock<Arc<HandlerSet>> = OnceLock::new();
    SET.get_or_init(|| {
        let builtin = || ModuleSource::Builtin {
            name: "device-plugin".into(),
            bytes: pluglet_wasm_guests::DEVICE_PLUGIN,
        };
        let runtime = Runtime::new(RuntimeConfig::default()).unwrap();
        Arc::new(
            HandlerSet::load(
                &runtime,
                Path::new("/nonexistent"),
                vec![("DevicePlugin".into(), builtin())],
                builtin(),
            )
            .unwrap(),
        )
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

/// Waits (10 s at most) for the first event `pick` accepts.
pub async fn next_event<E: Clone, T>(
    events: &mut broadcast::Receiver<E>,
    what: &str,
    mut pick: impl FnMut(E) -> Option<T>,
) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Ok(event)) => {
                if let Some(found) = pick(event) {
                    return found;
                }
            }
            Ok(Err(err)) => panic!("event stream broke waiting for {what}: {err}"),
            Err(_) => panic!("timed out waiting for {what}"),
        }
    }
}
