//! One connected device plugin (the kubelet's `endpoint.go` and `client.go`).
//!
//! [`Endpoint::connect`] dials the plugin's socket and asks GetDevicePluginOptions; [`run`] is
//! the endpoint's task: it keeps the ListAndWatch stream and sends every update to the manager
//! as an [`Event`], tagged with the endpoint's generation. The manager applies an event only
//! while that generation is the resource's current one, so when a plugin registers again, the
//! old stream ending later cannot disconnect the new registration (the kubelet looks its client
//! up by name there and does disconnect it, facts §7.1).

use std::path::PathBuf;
use std::time::Duration;

use pluglet_proto::v1beta1::device_plugin_client::DevicePluginClient;
use pluglet_proto::v1beta1::{DevicePluginOptions, Empty, ListAndWatchResponse};
use pluglet_uds::Channel;
use tokio_util::sync::CancellationToken;

use crate::devices::Device;
use crate::error::RegisterError;
use crate::manager::DeviceManager;

/// How a plugin registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Register on `kubelet.sock`; the endpoint is a file name in the device plugins directory.
    Classic,
    /// A `DevicePlugin` socket found by the plugin watcher; the endpoint is an absolute path.
    Watcher,
}

/// A message from an endpoint task (or a timer, or the socket watcher) to the manager loop.
/// Device updates do not pass through it: the endpoint task applies them itself (one thread hop
/// less between the plugin's message and the devices being visible).
#[derive(Debug)]
pub(crate) enum Event {
    /// The ListAndWatch stream ended or could not be opened.
    StreamEnded {
        resource: String,
        generation: u64,
        reason: String,
    },
    /// A socket in the device plugins directory was removed.
    SocketRemoved(PathBuf),
    /// The grace period of a disconnected resource ran out.
    GraceExpired { resource: String, generation: u64 },
}

/// A connected plugin: its client, options and identity.
#[derive(Debug)]
pub(crate) struct Endpoint {
    /// The socket dialed.
    pub path: PathBuf,
    /// How it registered.
    pub flow: Flow,
    /// Unique per connection; events of older generations are ignored.
    pub generation: u64,
    /// What GetDevicePluginOptions said.
    pub options: DevicePluginOptions,
    /// The gRPC client (cheap to clone).
    pub client: DevicePluginClient<Channel>,
    /// Cancelled when the endpoint is replaced, disconnected or the manager stops.
    pub cancel: CancellationToken,
}

/// A ListAndWatch call as opened by [`Endpoint::connect`]: the stream, or why it did not open.
pub(crate) type Opened = Result<tonic::Streaming<ListAndWatchResponse>, tonic::Status>;

impl Endpoint {
    /// Dials `path`, asks GetDevicePluginOptions (within `timeout`) and opens ListAndWatch.
    ///
    /// ListAndWatch is opened on the same connection at the same time as the options are asked
    /// for, so the first device list is on its way when the registration is answered: one round
    /// trip less from Register to devices visible. (The kubelet starts ListAndWatch in a goroutine
    /// as it answers Register, so a plugin sees the two in no fixed order either way.) If the
    /// options fail, the stream is dropped, which cancels it.
    pub async fn connect(
        resource: &str,
        path: PathBuf,
        flow: Flow,
        generation: u64,
        timeout: Duration,
        cancel: CancellationToken,
    ) -> Result<(Endpoint, Opened), RegisterError> {
        let channel = pluglet_uds::connect(&path, timeout)
            .await
            .map_err(|source| RegisterError::Dial {
                resource: resource.to_owned(),
                endpoint: path.clone(),
                source,
            })?;
        let mut client = DevicePluginClient::new(channel);
        let mut watch_client = client.clone();
        let (options, opened) = tokio::join!(
            tokio::time::timeout(timeout, client.get_device_plugin_options(Empty {})),
            watch_client.list_and_watch(Empty {}),
        );
        let options = match options {
            Ok(Ok(options)) => options.into_inner(),
            Ok(Err(status)) => {
                return Err(RegisterError::Options {
                    resource: resource.to_owned(),
                    endpoint: path,
                    status,
                });
            }
            Err(_) => {
                return Err(RegisterError::Options {
                    resource: resource.to_owned(),
                    endpoint: path,
                    status: tonic::Status::deadline_exceeded(format!(
                        "no answer within {timeout:?}"
                    )),
                });
            }
        };
        let endpoint = Endpoint {
            path,
            flow,
            generation,
            options,
            client,
            cancel,
        };
        Ok((endpoint, opened.map(tonic::Response::into_inner)))
    }
}

/// The endpoint's task: applies every update of the ListAndWatch stream [`Endpoint::connect`]
/// opened until the stream ends or the endpoint is cancelled. A stream that ends is reported once as [`Event::StreamEnded`];
/// a cancelled endpoint reports nothing (whoever cancelled it has already updated the state).
pub(crate) async fn run(
    manager: DeviceManager,
    resource: String,
    generation: u64,
    opened: Opened,
    cancel: CancellationToken,
) {
    let events = manager.inner.events.clone();
    let mut stream = match opened {
        Ok(stream) => stream,
        Err(status) => {
            let reason = format!(
                "ListAndWatch failed: {:?}: {}",
                status.code(),
                status.message()
            );
            let _ = events
                .send(Event::StreamEnded {
                    resource,
                    generation,
                    reason,
                })
                .await;
            return;
        }
    };
    loop {
        let message = tokio::select! {
            _ = cancel.cancelled() => return,
            message = stream.message() => message,
        };
        let reason = match message {
            Ok(Some(update)) => {
                let devices = update.devices.into_iter().map(Device::from_wire).collect();
                tracing::debug!(%resource, generation, "ListAndWatch update");
                manager.apply_devices(&resource, generation, devices);
                continue;
            }
            Ok(None) => "ListAndWatch stream ended".to_owned(),
            Err(status) => format!(
                "ListAndWatch stream failed: {:?}: {}",
                status.code(),
                status.message()
            ),
        };
        let _ = events
            .send(Event::StreamEnded {
                resource,
                generation,
                reason,
            })
            .await;
        return;
    }
}
