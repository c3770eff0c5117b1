//! Device plugins registering through the plugin watcher (facts §2, "plugin-watcher registration
//! variant"): once the DevicePlugin handler accepted the plugin, its endpoint is handed to the
//! device manager through [`DevicePluginSink`]; when the registration socket disappears the device
//! manager is told to disconnect.
//!
//! The daemon's sink is the device manager itself (the impl at the end of this file).
//! [`DialingSink`] does only the first half of its job: dial the endpoint and call
//! GetDevicePluginOptions (a plugin that does not serve the DevicePlugin service is refused).

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use pluglet_proto::v1beta1::Empty;
use pluglet_proto::v1beta1::device_plugin_client::DevicePluginClient;
use tracing::info;

/// A boxed, sendable future (the shape of [`DevicePluginSink`]'s methods).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where the plugin manager hands device plugins registered through the watcher. The device
/// manager implements it.
pub trait DevicePluginSink: Send + Sync + 'static {
    /// Called after the DevicePlugin handler accepted a watcher-registered plugin: dial `endpoint`,
    /// GetDevicePluginOptions, start ListAndWatch. Err = registration refused with that message.
    fn connect(
        &self,
        resource: String,
        endpoint: PathBuf,
    ) -> BoxFuture<'static, Result<(), String>>;
    /// Called when the plugin's registration socket disappeared.
    fn disconnect(&self, resource: String, endpoint: PathBuf) -> BoxFuture<'static, ()>;
}

/// A sink that checks the endpoint serves the DevicePlugin API (dial + GetDevicePluginOptions)
/// and keeps nothing; used until the device manager is wired in.
#[derive(Debug, Clone)]
pub struct DialingSink {
    /// Time allowed to connect, and to answer GetDevicePluginOptions.
    pub timeout: Duration,
}

impl DevicePluginSink for DialingSink {
    fn connect(
        &self,
        resource: String,
        endpoint: PathBuf,
    ) -> BoxFuture<'static, Result<(), String>> {
        let timeout = self.timeout;
        Box::pin(async move {
            let channel = pluglet_uds::connect(&endpoint, timeout)
                .await
                .map_err(|e| crate::plugin_manager::operation::error_chain(&e))?;
            let mut client = DevicePluginClient::new(channel);
            let options = tokio::time::timeout(timeout, client.get_device_plugin_options(Empty {}))
                .await
                .map_err(|_| format!("GetDevicePluginOptions did not answer within {timeout:?}"))?
                .map_err(|s| {
                    format!(
                        "GetDevicePluginOptions failed: {:?}: {}",
                        s.code(),
                        s.message()
                    )
                })?
                .into_inner();
            info!(
                %resource,
                endpoint = %endpoint.display(),
                pre_start_required = options.pre_start_required,
                get_preferred_allocation_available = options.get_preferred_allocation_available,
                "device plugin endpoint answered GetDevicePluginOptions"
            );
            Ok(())
        })
    }

    fn disconnect(&self, resource: String, endpoint: PathBuf) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            info!(%resource, endpoint = %endpoint.display(), "device plugin disconnected");
        })
    }
}

/// The device manager receives watcher-registered device plugins (the daemon's sink).
impl DevicePluginSink for pluglet_device_manager::DeviceManager {
    fn connect(
        &self,
        resource: String,
        endpoint: PathBuf,
    ) -> BoxFuture<'static, Result<(), String>> {
        let manager = self.clone();
        Box::pin(async move {
            manager
                .connect_watcher(resource, endpoint)
                .await
                .map_err(|e| pluglet_device_manager::error_chain(&e))
        })
    }

    fn disconnect(&self, resource: String, endpoint: PathBuf) -> BoxFuture<'static, ()> {
        let manager = self.clone();
        Box::pin(async move { manager.disconnect_watcher(resource, endpoint).await })
    }
}
