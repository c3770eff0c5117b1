//! Per-plugin-type steps the host does natively around the WASM hooks: what facts to gather before
//! the register hook (CSI: NodeGetInfo), and what to start after it (device plugin: hand the
//! endpoint to the device manager) or stop at deregistration. The decision itself (accept or
//! refuse) belongs to the handler module; nothing here knows about WASM.

pub mod csi;
pub mod device_plugin;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pluglet_handler_runtime::{PluginInfo, RegistrationFacts};
use pluglet_uds::Channel;

use crate::plugin_manager::PluginType;
use crate::plugin_manager::plugin::CsiNodeInfo;
use device_plugin::DevicePluginSink;

/// A type-specific step that refuses the registration.
#[derive(Debug, thiserror::Error)]
pub enum TypeError {
    /// CSI NodeGetInfo failed or said something unacceptable.
    #[error(transparent)]
    Csi(#[from] csi::CsiError),
    /// The device manager refused the plugin's endpoint.
    #[error("device plugin {resource} at {endpoint}: {message}")]
    DevicePlugin {
        /// Resource name.
        resource: String,
        /// Endpoint.
        endpoint: PathBuf,
        /// Why.
        message: String,
    },
}

/// Facts gathered before the register hook.
#[derive(Clone, Debug, Default)]
pub struct GatheredFacts {
    /// What the register hook is given.
    pub facts: RegistrationFacts,
    /// CSI: what NodeGetInfo said, kept with the plugin record.
    pub csi: Option<CsiNodeInfo>,
}

/// The type-specific steps, one set per daemon.
pub struct PluginTypes {
    dial_timeout: Duration,
    node_get_info_timeout: Duration,
    device_plugins: Arc<dyn DevicePluginSink>,
}

impl PluginTypes {
    /// CSI calls use `dial_timeout` and `node_get_info_timeout`; device plugins are handed to
    /// `device_plugins`.
    pub fn new(
        dial_timeout: Duration,
        node_get_info_timeout: Duration,
        device_plugins: Arc<dyn DevicePluginSink>,
    ) -> PluginTypes {
        PluginTypes {
            dial_timeout,
            node_get_info_timeout,
            device_plugins,
        }
    }

    /// Gathers what the register hook needs (CSI: NodeGetInfo on the endpoint). `same_socket` is
    /// the registration connection, reused when the endpoint is the registration socket itself.
    pub async fn gather_facts(
        &self,
        plugin_type: &PluginType,
        plugin: &PluginInfo,
        same_socket: Option<Channel>,
    ) -> Result<GatheredFacts, TypeError> {
        match plugin_type {
            PluginType::Csi => {
                let info = csi::node_get_info(
                    &plugin.endpoint,
                    same_socket,
                    self.dial_timeout,
                    self.node_get_info_timeout,
                )
                .await?;
                Ok(GatheredFacts {
                    facts: RegistrationFacts {
                        node_id: Some(info.node_id.clone()),
                        max_volumes_per_node: Some(info.max_volumes_per_node),
                        topology: info.topology.clone(),
                    },
                    csi: Some(info),
                })
            }
            _ => Ok(GatheredFacts::default()),
        }
    }

    /// Starts what follows an accepted registration (device plugin: the device manager connects).
    pub async fn activate(
        &self,
        plugin_type: &PluginType,
        plugin: &PluginInfo,
    ) -> Result<(), TypeError> {
        match plugin_type {
            PluginType::DevicePlugin => {
                let endpoint = PathBuf::from(&plugin.endpoint);
                self.device_plugins
                    .connect(plugin.name.clone(), endpoint.clone())
                    .await
                    .map_err(|message| TypeError::DevicePlugin {
                        resource: plugin.name.clone(),
                        endpoint,
                        message,
                    })
            }
            _ => Ok(()),
        }
    }

    /// Stops what [`PluginTypes::activate`] started.
    pub async fn deactivate(&self, plugin_type: &PluginType, plugin: &PluginInfo) {
        if *plugin_type == PluginType::DevicePlugin {
            self.device_plugins
                .disconnect(plugin.name.clone(), PathBuf::from(&plugin.endpoint))
                .await;
        }
    }
}
