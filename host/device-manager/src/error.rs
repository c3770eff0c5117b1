//! Errors of the device manager, one enum per boundary: [`StartError`] (the daemon cannot start
//! the device manager), [`ConnectError`] (a plugin's endpoint cannot be connected),
//! [`AllocateError`] (an allocation is refused; nothing is held afterwards), with
//! [`AnswerError`] (what is wrong with a policy's answer), [`ReleaseError`] (a release is
//! refused) and [`WriterError`] (the checkpoint writer ended).
//!
//! Causes sit in `#[source]`; print the chain (`pluglet_core::error_chain`) to see them. Mapping to gRPC
//! statuses happens in one place per service (`registration_server.rs`, the admin server).

use std::io;
use std::path::PathBuf;

use pluglet_checkpoint::CheckpointError;
use pluglet_core::{ContainerName, PodUid, ResourceName};
use pluglet_handler_runtime::{HandlerError, Refusal};
use pluglet_uds::{RpcError, UdsError};

use crate::device_id::DeviceId;

/// Why the device manager did not start. It has touched nothing in the device plugins
/// directory when it fails with [`StartError::DirectoryInUse`].
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// `kubelet.sock` answers a connect: a kubelet (or another Pluglet) owns the directory.
    #[error(
        "{socket} answers: a kubelet or another Pluglet owns this device plugins directory; stop it or give Pluglet another directory (nothing was changed)"
    )]
    DirectoryInUse {
        /// The live registration socket.
        socket: PathBuf,
    },
    /// The device plugins directory could not be created or listed.
    #[error("cannot prepare the device plugins directory {dir}: check that it is writable")]
    Directory {
        /// The directory.
        dir: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A stale socket could not be removed.
    #[error("cannot remove stale socket {path}: remove it by hand and start again")]
    RemoveStale {
        /// The socket.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The checkpoint or side file could not be read or set aside.
    #[error("cannot restore the device manager's state")]
    Restore(#[source] CheckpointError),
    /// `kubelet.sock` could not be bound.
    #[error("cannot serve the device plugin registration socket")]
    Bind(#[source] UdsError),
    /// The checkpoint writer's thread could not be started.
    #[error("cannot start the checkpoint writer thread")]
    Writer(#[source] io::Error),
    /// The device plugins directory could not be watched: a per-user inotify limit is reached.
    #[error("cannot watch {dir} for removed device plugin sockets")]
    WatchLimit {
        /// The directory.
        dir: PathBuf,
        /// The limit, its value and how to raise it.
        #[source]
        limit: pluglet_core::inotify::LimitReached,
    },
    /// The device plugins directory could not be watched for removed plugin sockets.
    #[error("cannot watch {dir} for removed device plugin sockets")]
    Watch {
        /// The directory.
        dir: PathBuf,
        /// inotify's error.
        #[source]
        source: std::io::Error,
    },
}

/// Why a device plugin's endpoint could not be connected (the activation step of its
/// registration, through either door).
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The plugin's endpoint could not be dialed.
    #[error(
        "device plugin {resource}: cannot dial its endpoint {endpoint}; it must serve v1beta1.DevicePlugin there before it registers"
    )]
    Dial {
        /// The resource the plugin advertises.
        resource: ResourceName,
        /// The endpoint dialed.
        endpoint: PathBuf,
        /// The dial error.
        #[source]
        source: UdsError,
    },
    /// GetDevicePluginOptions failed or timed out.
    #[error(
        "device plugin {resource}: GetDevicePluginOptions on {endpoint} failed; it must serve v1beta1.DevicePlugin there"
    )]
    Options {
        /// The resource the plugin advertises.
        resource: ResourceName,
        /// The endpoint dialed.
        endpoint: PathBuf,
        /// The plugin's answer (or a deadline status).
        #[source]
        status: RpcError,
    },
    /// The device manager is shutting down.
    #[error("device plugin {resource}: the device manager is shutting down")]
    Stopped {
        /// The resource the plugin advertises.
        resource: ResourceName,
    },
}

/// Why a release (or a sync of pods) was refused: it could not be made durable, so nothing
/// was released and the devices stay held.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot record the release on disk, so it was refused and {} entries stay held: free space or make the state directory writable, then retry",
    held.len()
)]
pub struct ReleaseError {
    /// What stays held.
    pub held: Vec<crate::allocator::AllocationInfo>,
    /// The journal's write error.
    #[source]
    pub source: std::sync::Arc<CheckpointError>,
}

/// Why an allocation was refused. Nothing is held after any of these.
#[derive(Debug, thiserror::Error)]
pub enum AllocateError {
    /// A request for zero devices.
    #[error("cannot allocate 0 devices of {resource}: ask for at least 1")]
    ZeroCount {
        /// The resource.
        resource: ResourceName,
    },
    /// No plugin ever registered the resource (or it was removed after its grace period).
    #[error("cannot allocate unregistered resource {resource}: no device plugin has registered it")]
    UnknownResource {
        /// The resource.
        resource: ResourceName,
    },
    /// The resource is known but its plugin is not connected (stream ended, socket removed, or
    /// not back since a restart).
    #[error(
        "no device plugin is connected for {resource}: wait for it to register again, then retry"
    )]
    NotConnected {
        /// The resource.
        resource: ResourceName,
    },
    /// The container already holds a different number of devices of this resource.
    #[error(
        "pod {pod_uid} container {container} already holds {held} devices of {resource}, not {requested}: changed request; release it first"
    )]
    ChangedRequest {
        /// The pod.
        pod_uid: PodUid,
        /// The container.
        container: ContainerName,
        /// The resource.
        resource: ResourceName,
        /// Devices held now.
        held: usize,
        /// Devices requested.
        requested: u32,
    },
    /// Another allocation for the same container and resource is still running.
    #[error(
        "an allocation of {resource} for pod {pod_uid} container {container} is already in progress; retry when it is done"
    )]
    InProgress {
        /// The pod.
        pod_uid: PodUid,
        /// The container.
        container: ContainerName,
        /// The resource.
        resource: ResourceName,
    },
    /// The pod's UID is recorded under another name or namespace.
    #[error(
        "pod {pod_uid} holds devices as {recorded}, not {given}: a pod's name and namespace cannot change; give the same ones (or none) or use another pod UID"
    )]
    PodRenamed {
        /// The pod.
        pod_uid: PodUid,
        /// `namespace/name` recorded with its allocations.
        recorded: String,
        /// `namespace/name` given now.
        given: String,
    },
    /// Fewer free healthy devices than requested (the kubelet's wording).
    #[error(
        "requested number of devices unavailable for {resource}. Requested: {requested}, Available: {available}"
    )]
    Unavailable {
        /// The resource.
        resource: ResourceName,
        /// Devices requested.
        requested: u32,
        /// Healthy devices nobody holds.
        available: usize,
    },
    /// GetPreferredAllocation failed.
    #[error("GetPreferredAllocation of the {resource} device plugin failed")]
    Preferred {
        /// The resource.
        resource: ResourceName,
        /// The plugin's answer.
        #[source]
        status: RpcError,
    },
    /// The allocation policy refused the request.
    #[error("allocation policy {module} refused {resource} ({}): {}", refusal.kind, refusal.message)]
    PolicyRefused {
        /// The resource.
        resource: ResourceName,
        /// The policy module.
        module: String,
        /// Its refusal.
        refusal: Refusal,
    },
    /// The allocation policy failed (trap, deadline, memory cap).
    #[error("allocation policy for {resource} failed")]
    PolicyFailed {
        /// The resource.
        resource: ResourceName,
        /// What went wrong in the policy.
        #[source]
        source: HandlerError,
    },
    /// The policy answered something other than `count` distinct available ids including the
    /// must-include ones.
    #[error(
        "allocation policy {module} answered {} for {count} devices of {resource}: {problem}; fix the policy (or remove it from handlers.toml)",
        shown_ids(answer)
    )]
    BadPolicyAnswer {
        /// The resource.
        resource: ResourceName,
        /// The policy module.
        module: String,
        /// What it answered.
        answer: Vec<String>,
        /// Devices requested.
        count: u32,
        /// What is wrong with the answer.
        problem: AnswerError,
    },
    /// A chosen device turned unhealthy or vanished while the policy was choosing.
    #[error("device {device} of {resource} became unavailable during the allocation; retry")]
    Raced {
        /// The resource.
        resource: ResourceName,
        /// The device.
        device: DeviceId,
    },
    /// The plugin's Allocate failed.
    #[error("Allocate of the {resource} device plugin failed for devices {devices:?}")]
    Allocate {
        /// The resource.
        resource: ResourceName,
        /// The devices asked for.
        devices: Vec<DeviceId>,
        /// The plugin's answer.
        #[source]
        status: RpcError,
    },
    /// The plugin's Allocate answered no container response.
    #[error(
        "Allocate of the {resource} device plugin returned no container response for devices {devices:?}"
    )]
    EmptyAllocateResponse {
        /// The resource.
        resource: ResourceName,
        /// The devices asked for.
        devices: Vec<DeviceId>,
    },
    /// The plugin's PreStartContainer failed.
    #[error("PreStartContainer of the {resource} device plugin failed for devices {devices:?}")]
    PreStart {
        /// The resource.
        resource: ResourceName,
        /// The devices.
        devices: Vec<DeviceId>,
        /// The plugin's answer.
        #[source]
        status: RpcError,
    },
    /// The container was released while its allocation was in flight.
    #[error(
        "pod {pod_uid} container {container} was released while its {resource} allocation was in flight"
    )]
    Released {
        /// The pod.
        pod_uid: PodUid,
        /// The container.
        container: ContainerName,
        /// The resource.
        resource: ResourceName,
    },
    /// The allocation could not be made durable (the journal could not be written): refused,
    /// nothing held.
    #[error(
        "cannot record the allocation of {resource} on disk, so it was refused and nothing is held: free space or make the state directory writable, then retry"
    )]
    Checkpoint {
        /// The resource.
        resource: ResourceName,
        /// The write error.
        #[source]
        source: std::sync::Arc<CheckpointError>,
    },
    /// The allocation could not be handed to container runtimes as a CDI device; nothing is
    /// held.
    #[error("the allocation of {resource} was refused and nothing is held")]
    Cdi {
        /// The resource.
        resource: ResourceName,
        /// Why.
        #[source]
        source: crate::cdi::CdiError,
    },
    /// The device manager is shutting down.
    #[error("the device manager is shutting down")]
    Stopped,
}

/// What is wrong with an allocation policy's answer ([`crate::check_answer`]). The ids are the
/// policy's strings as it answered them.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AnswerError {
    /// Another number of ids than requested.
    #[error("{answered} ids instead of exactly {count}")]
    Count {
        /// Ids answered.
        answered: usize,
        /// Ids requested.
        count: u32,
    },
    /// An id answered twice.
    #[error("{id} is chosen twice")]
    Twice {
        /// The id.
        id: String,
    },
    /// An id that is unknown, unhealthy or held.
    #[error("{id} is not an available device (unknown, unhealthy or held by another container)")]
    NotAvailable {
        /// The id.
        id: String,
    },
    /// A must-include id left out.
    #[error("must-include device {id} is missing")]
    MustIncludeMissing {
        /// The id.
        id: String,
    },
}

/// Why the checkpoint writer ended before it was asked to.
#[derive(Debug, thiserror::Error)]
pub enum WriterError {
    /// Its thread panicked.
    #[error("the checkpoint writer's thread panicked")]
    Panicked,
}

/// At most this many ids of a bad policy answer are shown in its error.
const SHOWN_IDS: usize = 16;

/// Longer ids are cut to this many bytes in the error.
const SHOWN_ID_BYTES: usize = 64;

/// A policy's answer for an error message: the first [`SHOWN_IDS`] ids (each cut to
/// [`SHOWN_ID_BYTES`]), then how many more (an answer may hold tens of thousands).
fn shown_ids(answer: &[String]) -> String {
    let shown: Vec<String> = answer
        .iter()
        .take(SHOWN_IDS)
        .map(|id| {
            let mut end = id.len().min(SHOWN_ID_BYTES);
            while !id.is_char_boundary(end) {
                end -= 1;
            }
            if end < id.len() {
                format!("{:?}…", &id[..end])
            } else {
                format!("{id:?}")
            }
        })
        .collect();
    match answer.len().saturating_sub(SHOWN_IDS) {
        0 => format!("[{}]", shown.join(", ")),
        more => format!("[{}, … {more} more]", shown.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_bad_answer_is_shown_in_part() {
        let mut answer: Vec<String> = (0..20_000).map(|i| format!("dev-{i}")).collect();
        answer[1] = "x".repeat(10_000);
        let shown = shown_ids(&answer);
        assert!(shown.starts_with("[\"dev-0\", \"xxx"), "{shown}");
        assert!(shown.ends_with("\"dev-15\", … 19984 more]"), "{shown}");
        assert!(shown.len() < 400, "{} bytes", shown.len());
        assert_eq!(shown_ids(&["a".into()]), "[\"a\"]");
    }
}
