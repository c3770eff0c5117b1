//! One connected device plugin (the kubelet's `endpoint.go` and `client.go`).
//!
//! [`Endpoint::connect`] dials the plugin's socket and asks GetDevicePluginOptions; [`run`] is
//! the endpoint's task: it keeps the ListAndWatch stream and applies every update to the
//! [`Registry`] itself, on its own task (no hop to another task between the plugin's message
//! and the devices being visible), tagged with the endpoint's generation. The registry applies
//! an update only while that generation is the resource's current one, so when a plugin
//! registers again, the old stream ending later cannot disconnect the new registration (the
//! kubelet looks its client up by name there and does disconnect it; see
//! `docs/kubelet-compatibility.md`, "Register on the kubelet socket").

mod allocate_calls;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pluglet_core::{Generation, ResourceName};
use pluglet_proto::v1beta1::device_plugin_client::DevicePluginClient;
use pluglet_proto::v1beta1::{DevicePluginOptions, Empty};
use pluglet_uds::{Channel, RpcError};
use tokio_util::sync::CancellationToken;
use tonic::codegen::http::uri::PathAndQuery;

pub(crate) use allocate_calls::AllocateCalls;

use crate::answer::{AllocateRequestIds, ContainerAnswers};
use crate::device_list::{DeviceListCodec, DeviceUpdate};
use crate::error::ConnectError;
use crate::registry::Registry;

/// How a plugin registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Register on `kubelet.sock`; the endpoint is a file name in the device plugins directory.
    Classic,
    /// A `DevicePlugin` socket found by the plugin watcher; the endpoint is an absolute path.
    Watcher,
}

/// A connected plugin: its client, options and identity.
#[derive(Debug)]
pub(crate) struct Endpoint {
    /// The socket dialed.
    pub path: PathBuf,
    /// How it registered.
    pub flow: Flow,
    /// Unique per connection; news from older generations is ignored.
    pub generation: Generation,
    /// What GetDevicePluginOptions said.
    pub options: DevicePluginOptions,
    /// The plugin's connection (cheap to clone): the generated client over it, or the calls
    /// read with codecs of Pluglet's own.
    pub channel: Channel,
    /// Its Allocate calls, one at a time ([`AllocateCalls`]).
    pub calls: Arc<AllocateCalls>,
    /// Cancelled when the endpoint is replaced, disconnected or the manager stops.
    pub cancel: CancellationToken,
}

/// A ListAndWatch call as opened by [`Endpoint::connect`]: the stream of device lists, or why
/// it did not open.
pub(crate) type Opened = Result<tonic::Streaming<DeviceUpdate>, tonic::Status>;

impl Endpoint {
    /// Dials `path`, asks GetDevicePluginOptions (within `timeout`) and opens ListAndWatch.
    /// Its Allocate calls ask for at most `batch` containers each.
    ///
    /// ListAndWatch is opened on the same connection at the same time as the options are asked
    /// for, so the first device list is on its way when the registration is answered: one round
    /// trip less from Register to devices visible. (The kubelet starts ListAndWatch in a goroutine
    /// as it answers Register, so a plugin sees the two in no fixed order either way.) If the
    /// options fail, the stream is dropped, which cancels it.
    pub async fn connect(
        resource: &ResourceName,
        path: PathBuf,
        flow: Flow,
        generation: Generation,
        timeout: Duration,
        batch: usize,
        cancel: CancellationToken,
    ) -> Result<(Endpoint, Opened), ConnectError> {
        let channel = pluglet_uds::connect(&path, timeout)
            .await
            .map_err(|source| ConnectError::Dial {
                resource: resource.clone(),
                endpoint: path.clone(),
                source,
            })?;
        let mut client = DevicePluginClient::new(channel.clone());
        let (options, opened) = tokio::join!(
            pluglet_uds::with_deadline(timeout, client.get_device_plugin_options(Empty {})),
            list_and_watch(channel.clone()),
        );
        let options = options.map_err(|status| ConnectError::Options {
            resource: resource.clone(),
            endpoint: path.clone(),
            status,
        })?;
        let calls = AllocateCalls::new(
            resource.clone(),
            channel.clone(),
            batch,
            crate::allocator::ALLOCATE_TIMEOUT,
        );
        let endpoint = Endpoint {
            path,
            flow,
            generation,
            options,
            channel,
            calls: Arc::new(calls),
            cancel,
        };
        Ok((endpoint, opened.map(tonic::Response::into_inner)))
    }
}

/// The largest ListAndWatch message read (4 MiB, the gRPC default receive limit the kubelet's
/// device plugin client keeps too). It bounds what one plugin's device list costs in memory
/// (see docs/kubelet-compatibility.md, "Endpoints, health and the grace period"): a larger
/// message is refused from its length prefix, before any of it is buffered, and disconnects
/// the plugin.
pub(crate) const MAX_DEVICE_LIST_BYTES: usize = 4 << 20;

/// Whether the stream failed on a message over [`MAX_DEVICE_LIST_BYTES`]: tonic's own refusal
/// (`OutOfRange`, "message length too large"), not an `OutOfRange` the plugin sent.
fn over_the_limit(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::OutOfRange
        && status.message().contains("message length too large")
}

/// Opens ListAndWatch with the codec that reads each update straight into devices
/// ([`crate::device_list`]); the generated client would decode into the wire types first.
async fn list_and_watch(
    channel: Channel,
) -> Result<tonic::Response<tonic::Streaming<DeviceUpdate>>, tonic::Status> {
    let mut grpc =
        tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_DEVICE_LIST_BYTES);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("the plugin's connection failed: {e}")))?;
    let path = PathAndQuery::from_static("/v1beta1.DevicePlugin/ListAndWatch");
    grpc.server_streaming(tonic::Request::new(Empty {}), path, DeviceListCodec)
        .await
}

/// Calls the plugin's Allocate for the containers `request` names: the request encoded from
/// the allocations' ids, each container answer kept as its bytes (`crate::answer`); the
/// generated client would copy the one and drop the other. A unary call without tonic's client
/// (`Channel::unary`): this is every allocation's call.
async fn allocate(
    channel: Channel,
    request: AllocateRequestIds,
) -> Result<ContainerAnswers, tonic::Status> {
    let path = PathAndQuery::from_static("/v1beta1.DevicePlugin/Allocate");
    let answer = channel.unary(path, |buf| request.encode(buf)).await?;
    ContainerAnswers::read(answer)
}

/// The endpoint's task: applies every update of the ListAndWatch stream [`Endpoint::connect`]
/// opened until the stream ends or the endpoint is cancelled. A stream that ends disconnects
/// the endpoint once; a cancelled endpoint does nothing more (whoever cancelled it has already
/// updated the registry).
pub(crate) async fn run(
    registry: Registry,
    resource: ResourceName,
    generation: Generation,
    opened: Opened,
    cancel: CancellationToken,
) {
    let mut stream = match opened {
        Ok(stream) => stream,
        Err(status) => {
            let reason = format!("ListAndWatch failed: {}", RpcError(status));
            registry.disconnect(&resource, generation, &reason);
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
                tracing::debug!(%resource, %generation, "ListAndWatch update");
                if registry.apply_devices(&resource, generation, update) {
                    continue;
                }
                "the device list fell out of step with the plugin's stream (a Pluglet bug); \
                 register the plugin again"
                    .to_owned()
            }
            Ok(None) => "ListAndWatch stream ended".to_owned(),
            Err(status) if over_the_limit(&status) => format!(
                "ListAndWatch stream failed: {}; one device list may take at most {} MiB on the \
                 wire (the kubelet's limit too): spread the devices over more resources or \
                 shorten their ids",
                RpcError(status),
                MAX_DEVICE_LIST_BYTES >> 20
            ),
            Err(status) => format!("ListAndWatch stream failed: {}", RpcError(status)),
        };
        registry.disconnect(&resource, generation, &reason);
        return;
    }
}
