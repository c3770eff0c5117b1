//! The device manager's part of the admin API, server side: the device RPCs (wire conversions
//! and the one mapping of [`AllocateError`] to gRPC statuses). `pluglet ctl` shows their answers
//! through [`crate::admin::view`].

use crate::admin::check_name;

use pluglet_core::error_chain;
use pluglet_device_manager::{
    AllocateError, AllocationInfo, DeviceId, DeviceManager, KeepList, PodName, ReleaseError,
    ResourceInfo,
};
use pluglet_proto::EncodedAnswer;
use pluglet_proto::admin::v1 as pb;
use tonic::Status;

/// Wire form of a resource.
pub fn resource_to_wire(r: &ResourceInfo) -> pb::Resource {
    pb::Resource {
        resource: r.resource.to_string(),
        capacity: r.capacity as i64,
        allocatable: r.allocatable as i64,
        devices: r
            .devices
            .iter()
            .map(|d| pb::DeviceInfo {
                id: d.id.as_str().to_owned(),
                health: d.health.as_str().to_owned(),
                numa: d.numa.clone(),
            })
            .collect(),
        policy: r.policy.clone(),
        endpoint: r
            .endpoint
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        connected: r.connected,
        last_error: r.last_error.clone().unwrap_or_default(),
    }
}

/// Wire form of an allocation.
pub fn allocation_to_wire(a: &AllocationInfo) -> pb::Allocation {
    pb::Allocation {
        pod_uid: a.pod_uid.to_string(),
        container: a.container.to_string(),
        resource: a.resource.to_string(),
        device_ids: DeviceId::to_wire(&a.device_ids),
        cdi_names: a.cdi_names.clone(),
        pod_name: a.pod.name.clone(),
        pod_namespace: a.pod.namespace.clone(),
    }
}

/// The one place allocation errors become gRPC statuses; the message is the whole error chain.
pub fn allocate_status(err: &AllocateError) -> Status {
    use tonic::Code;
    let code = match err {
        AllocateError::ZeroCount { .. } => Code::InvalidArgument,
        AllocateError::UnknownResource { .. } => Code::NotFound,
        AllocateError::NotConnected { .. } | AllocateError::Stopped => Code::Unavailable,
        AllocateError::Unavailable { .. } => Code::ResourceExhausted,
        AllocateError::ChangedRequest { .. }
        | AllocateError::PodRenamed { .. }
        | AllocateError::PolicyRefused { .. }
        | AllocateError::BadPolicyAnswer { .. } => Code::FailedPrecondition,
        AllocateError::InProgress { .. }
        | AllocateError::Raced { .. }
        | AllocateError::Released { .. } => Code::Aborted,
        AllocateError::Preferred { .. }
        | AllocateError::Allocate { .. }
        | AllocateError::EmptyAllocateResponse { .. }
        | AllocateError::PreStart { .. } => Code::Unknown,
        AllocateError::PolicyFailed { .. } => Code::Internal,
        // Not durable: retry once the disk has room or the state directory is writable.
        AllocateError::Checkpoint { .. } => Code::Unavailable,
        // The plugin's answer is unusable by a runtime, or the spec directory is not writable.
        AllocateError::Cdi { .. } => Code::FailedPrecondition,
    };
    Status::new(code, error_chain(err))
}

/// `ListResources`.
pub fn list_resources(devices: &DeviceManager) -> pb::ListResourcesResponse {
    pb::ListResourcesResponse {
        resources: devices.resources().iter().map(resource_to_wire).collect(),
    }
}

/// `Allocate`.
pub async fn allocate(
    devices: &DeviceManager,
    request: pb::AllocateRequest,
) -> Result<pb::AllocateResponse, Status> {
    check_name("pod_uid", &request.pod_uid)?;
    check_name("container", &request.container)?;
    check_name("resource", &request.resource)?;
    let pod = pod_name(&request.pod_name, &request.pod_namespace)?;
    // The request's strings become the allocation's key, moved.
    let allocation = devices
        .allocate_named(
            request.pod_uid,
            request.container,
            request.resource,
            request.count,
            pod,
        )
        .await
        .map_err(|e| allocate_status(&e))?;
    Ok(pb::AllocateResponse {
        device_ids: DeviceId::into_wire(allocation.device_ids),
        // The plugin's bytes, not decoded and encoded again (the wire form is the message's).
        response: Some(EncodedAnswer::from_bytes(allocation.answer.bytes())),
        cdi_names: allocation.cdi_names,
    })
}

/// The pod name and namespace of an allocation, checked as Kubernetes checks them (a name is a
/// DNS subdomain, a namespace a DNS label). Both empty: none given. A name alone is in
/// `default`; a namespace alone is refused.
pub fn pod_name(name: &str, namespace: &str) -> Result<Option<PodName>, Status> {
    match (name.is_empty(), namespace.is_empty()) {
        (true, true) => return Ok(None),
        (true, false) => {
            return Err(Status::invalid_argument(format!(
                "pod_namespace {namespace:?} is given without pod_name: give both, or the name alone (namespace default)"
            )));
        }
        _ => {}
    }
    let namespace = if namespace.is_empty() {
        PodName::DEFAULT_NAMESPACE
    } else {
        namespace
    };
    if !dns_subdomain(name) {
        return Err(Status::invalid_argument(format!(
            "pod_name {name:?} is not a valid pod name: at most 253 characters, lower-case letters, digits, '-' and '.', starting and ending with a letter or digit (for example web-0)"
        )));
    }
    if !dns_label(namespace) {
        return Err(Status::invalid_argument(format!(
            "pod_namespace {namespace:?} is not a valid namespace: at most 63 characters, lower-case letters, digits and '-', starting and ending with a letter or digit (for example kube-system)"
        )));
    }
    Ok(Some(PodName {
        name: name.to_owned(),
        namespace: namespace.to_owned(),
    }))
}

/// A DNS-1123 label: what Kubernetes accepts as a namespace.
fn dns_label(s: &str) -> bool {
    let ok_end = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    s.len() <= 63
        && ok_end(s.chars().next())
        && ok_end(s.chars().last())
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// A DNS-1123 subdomain: what Kubernetes accepts as a pod name.
fn dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(dns_label)
}

/// `Release`.
pub async fn release(
    devices: &DeviceManager,
    request: pb::ReleaseRequest,
) -> Result<pb::ReleaseResponse, Status> {
    check_name("pod_uid", &request.pod_uid)?;
    if !request.container.is_empty() {
        check_name("container", &request.container)?;
    }
    let container = (!request.container.is_empty()).then_some(request.container.as_str());
    let released = devices
        .release_entries(&request.pod_uid, container)
        .await
        .map_err(|e| release_status(&e))?;
    Ok(pb::ReleaseResponse {
        released: released.len() as u32,
        freed: released.iter().map(allocation_to_wire).collect(),
    })
}

/// `ListAllocations`.
pub fn list_allocations(devices: &DeviceManager) -> pb::ListAllocationsResponse {
    pb::ListAllocationsResponse {
        allocations: devices
            .allocations()
            .iter()
            .map(allocation_to_wire)
            .collect(),
    }
}

/// `SyncPods`: frees what every pod not in `keep_pod_uids` holds. An empty keep list is
/// refused unless `all` is set.
pub async fn sync_pods(
    devices: &DeviceManager,
    mut request: pb::SyncPodsRequest,
) -> Result<pb::SyncPodsResponse, Status> {
    let keep = sync_pods_keep(&mut request)?;
    let freed = devices
        .sync_pods(&keep, request.dry_run)
        .await
        .map_err(|e| release_status(&e))?;
    Ok(pb::SyncPodsResponse {
        freed: freed.iter().map(allocation_to_wire).collect(),
        dry_run: request.dry_run,
    })
}

/// The pods a `SyncPods` request keeps (its UIDs taken, not copied: a kubelet's list names
/// every active pod), or why the request is refused.
fn sync_pods_keep(request: &mut pb::SyncPodsRequest) -> Result<KeepList, Status> {
    if request
        .keep_pod_uids
        .iter()
        .any(|uid| uid.trim().is_empty())
    {
        return Err(Status::invalid_argument(
            "keep_pod_uids holds an empty pod UID",
        ));
    }
    for uid in &request.keep_pod_uids {
        check_name("keep_pod_uids", uid)?;
    }
    if request.keep_pod_uids.is_empty() && !request.all {
        return Err(Status::invalid_argument(
            "keep_pod_uids is empty, which frees the devices of every pod: set all to mean that",
        ));
    }
    Ok(std::mem::take(&mut request.keep_pod_uids)
        .into_iter()
        .collect())
}

/// The status of a refused `Release` or `SyncPods` (it could not be made durable: retry once
/// the disk has room or the state directory is writable); the message is the whole error chain.
fn release_status(err: &ReleaseError) -> Status {
    Status::unavailable(error_chain(err))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_codes() {
        let err = AllocateError::Unavailable {
            resource: "vendor.com/gpu".into(),
            requested: 2,
            available: 1,
        };
        let status = allocate_status(&err);
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.message().contains("Requested: 2, Available: 1"));
    }

    #[test]
    fn sync_pods_needs_all_for_an_empty_keep_list() {
        let mut request = pb::SyncPodsRequest::default();
        let status = sync_pods_keep(&mut request).unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().contains("set all"), "{status:?}");
        request.all = true;
        assert!(sync_pods_keep(&mut request).unwrap().is_empty());
        request.keep_pod_uids = vec!["a".into(), "".into()];
        let status = sync_pods_keep(&mut request).unwrap_err();
        assert!(status.message().contains("empty pod UID"), "{status:?}");
        request.keep_pod_uids = vec!["b".into(), "a".into()];
        request.all = false;
        assert_eq!(
            sync_pods_keep(&mut request).unwrap(),
            KeepList::from_iter(["a", "b"])
        );
    }
}
