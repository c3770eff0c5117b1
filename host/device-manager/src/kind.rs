//! The device plugin type's native steps in the registration pipeline ([`PluginKind`]): no
//! facts before the register hook; activation dials the plugin's endpoint and makes it the
//! resource's endpoint in the [`Registry`]; deactivation disconnects it (its devices turn
//! unhealthy and the grace period starts), unless a newer registration has replaced it.
//!
//! Both doors lead here: a `Register` on `kubelet.sock` names its endpoint as a file in the
//! device plugins directory, a `DevicePlugin` socket in the plugin registry gives an absolute
//! path.

use std::path::PathBuf;
use std::sync::Arc;

use pluglet_core::ResourceName;
use pluglet_registration::{Candidate, Door, Facts, KindError, PluginKind, Registration};

use crate::endpoint::Flow;
use crate::registry::Registry;

/// The device plugin type: activation and deactivation through the registry.
pub(crate) struct DevicePluginKind {
    /// The resources and endpoints.
    pub registry: Registry,
    /// The device plugins directory (`kubelet.sock` endpoints are file names in it).
    pub device_plugins_dir: PathBuf,
}

impl DevicePluginKind {
    fn endpoint(&self, registration: &Registration) -> (PathBuf, Flow) {
        match registration.door {
            Door::KubeletSock => (
                self.device_plugins_dir.join(&registration.info.endpoint),
                Flow::Classic,
            ),
            Door::Registry { .. } => (PathBuf::from(&registration.info.endpoint), Flow::Watcher),
        }
    }
}

#[async_trait::async_trait]
impl PluginKind for DevicePluginKind {
    async fn gather_facts(&self, _candidate: &Candidate) -> Result<Facts, KindError> {
        Ok(Facts::default())
    }

    async fn activate(&self, registration: &Arc<Registration>) -> Result<(), KindError> {
        let (path, flow) = self.endpoint(registration);
        self.registry
            .connect(
                ResourceName::from(registration.info.name.as_str()),
                path,
                flow,
                registration.clone(),
            )
            .await
            .map_err(|err| Box::new(err) as KindError)
    }

    async fn deactivate(&self, registration: &Registration) {
        let reason = match registration.door {
            Door::Registry { .. } => "its registration socket was removed",
            Door::KubeletSock => "its registration ended",
        };
        self.registry
            .disconnect_registration(registration.id, reason);
    }
}
