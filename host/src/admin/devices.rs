//! The device manager's part of the admin API (issue 4): the four device RPCs on the server side
//! (wire conversions and the one mapping of [`AllocateError`] to gRPC statuses), and their
//! `pluglet ctl` output (`resources`, `allocate`, `release`, `allocations`).

use std::collections::BTreeMap;

use anyhow::Context as _;
use pluglet_core::error_chain;
use pluglet_device_manager::{AllocateError, AllocationInfo, DeviceManager, ResourceInfo};
use pluglet_proto::admin::v1 as pb;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_uds::Channel;
use serde_json::{Value, json};
use tonic::Status;

use crate::cli::{CtlCommand, OutputFormat};

// ------------------------------------------------------------------------------------------
// Server side
// ------------------------------------------------------------------------------------------

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
                id: d.id.clone(),
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
    }
}

/// Wire form of an allocation.
pub fn allocation_to_wire(a: &AllocationInfo) -> pb::Allocation {
    pb::Allocation {
        pod_uid: a.pod_uid.to_string(),
        container: a.container.to_string(),
        resource: a.resource.to_string(),
        device_ids: a.device_ids.clone(),
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
        | AllocateError::PolicyRefused { .. }
        | AllocateError::BadPolicyAnswer { .. } => Code::FailedPrecondition,
        AllocateError::InProgress { .. }
        | AllocateError::Raced { .. }
        | AllocateError::Released { .. } => Code::Aborted,
        AllocateError::Preferred { .. }
        | AllocateError::Allocate { .. }
        | AllocateError::EmptyAllocateResponse { .. }
        | AllocateError::PreStart { .. } => Code::Unknown,
        AllocateError::PolicyFailed { .. } | AllocateError::Checkpoint { .. } => Code::Internal,
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
    for (field, value) in [
        ("pod_uid", &request.pod_uid),
        ("container", &request.container),
        ("resource", &request.resource),
    ] {
        if value.is_empty() {
            return Err(Status::invalid_argument(format!(
                "{field} must not be empty"
            )));
        }
    }
    let allocation = devices
        .allocate(
            &request.pod_uid,
            &request.container,
            &request.resource,
            request.count,
        )
        .await
        .map_err(|e| allocate_status(&e))?;
    Ok(pb::AllocateResponse {
        device_ids: allocation.device_ids,
        response: Some(allocation.response),
    })
}

/// `Release`.
pub async fn release(
    devices: &DeviceManager,
    request: pb::ReleaseRequest,
) -> Result<pb::ReleaseResponse, Status> {
    if request.pod_uid.is_empty() {
        return Err(Status::invalid_argument("pod_uid must not be empty"));
    }
    let container = (!request.container.is_empty()).then_some(request.container.as_str());
    let released = devices.release(&request.pod_uid, container).await;
    Ok(pb::ReleaseResponse {
        released: released as u32,
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

// ------------------------------------------------------------------------------------------
// `pluglet ctl` side
// ------------------------------------------------------------------------------------------

/// JSON object of a resource (`ctl resources -o json`).
pub fn resource_json(r: &pb::Resource) -> Value {
    json!({
        "resource": r.resource,
        "capacity": r.capacity,
        "allocatable": r.allocatable,
        "devices": r.devices.iter().map(|d| json!({
            "id": d.id,
            "health": d.health,
            "numa": d.numa,
        })).collect::<Vec<_>>(),
        "policy": r.policy,
        "endpoint": if r.endpoint.is_empty() { Value::Null } else { json!(r.endpoint) },
        "connected": r.connected,
    })
}

fn sorted(map: &std::collections::HashMap<String, String>) -> BTreeMap<&String, &String> {
    map.iter().collect()
}

/// JSON object of an allocation answer (`ctl allocate -o json`).
pub fn allocate_json(a: &pb::AllocateResponse) -> Value {
    let r = a.response.clone().unwrap_or_default();
    json!({
        "device_ids": a.device_ids,
        "envs": sorted(&r.envs),
        "mounts": r.mounts.iter().map(|m| json!({
            "container_path": m.container_path,
            "host_path": m.host_path,
            "read_only": m.read_only,
        })).collect::<Vec<_>>(),
        "device_specs": r.devices.iter().map(|d| json!({
            "container_path": d.container_path,
            "host_path": d.host_path,
            "permissions": d.permissions,
        })).collect::<Vec<_>>(),
        "annotations": sorted(&r.annotations),
        "cdi_devices": r.cdi_devices.iter().map(|c| c.name.clone()).collect::<Vec<_>>(),
    })
}

/// JSON object of an allocation (`ctl allocations -o json`).
pub fn allocation_json(a: &pb::Allocation) -> Value {
    json!({
        "pod_uid": a.pod_uid,
        "container": a.container,
        "resource": a.resource,
        "device_ids": a.device_ids,
    })
}

fn pretty(value: &Value) -> String {
    let mut s = serde_json::to_string_pretty(value).unwrap_or_else(|_| "null".to_owned());
    s.push('\n');
    s
}

fn columns(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let all = std::iter::once(header.iter().map(|s| s.to_string()).collect::<Vec<_>>()).chain(rows);
    for row in all {
        let last = row.len().saturating_sub(1);
        for (i, (cell, w)) in row.iter().zip(&widths).enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  "));
            }
        }
        out.push('\n');
    }
    out
}

/// Runs one device subcommand of `pluglet ctl` (`resources`, `allocate`, `release`,
/// `allocations`) and returns what to print.
pub async fn render(
    client: &mut AdminClient<Channel>,
    command: &CtlCommand,
    output: OutputFormat,
) -> anyhow::Result<String> {
    match command {
        CtlCommand::Resources => resources(client, output).await,
        CtlCommand::Allocate {
            pod,
            container,
            resource,
            count,
        } => {
            let request = pb::AllocateRequest {
                pod_uid: pod.clone(),
                container: container.clone(),
                resource: resource.clone(),
                count: *count,
            };
            allocate_cmd(client, request, output).await
        }
        CtlCommand::Release { pod, container } => {
            let request = pb::ReleaseRequest {
                pod_uid: pod.clone(),
                container: container.clone().unwrap_or_default(),
            };
            release_cmd(client, request, output).await
        }
        CtlCommand::Allocations => allocations(client, output).await,
        other => anyhow::bail!("{other:?} is not a device manager command"),
    }
}

async fn resources(
    client: &mut AdminClient<Channel>,
    output: OutputFormat,
) -> anyhow::Result<String> {
    let resources = client
        .list_resources(pb::ListResourcesRequest {})
        .await
        .context("ListResources failed")?
        .into_inner()
        .resources;
    Ok(match output {
        OutputFormat::Json => pretty(&Value::Array(resources.iter().map(resource_json).collect())),
        OutputFormat::Table => columns(
            &["RESOURCE", "CAPACITY", "ALLOCATABLE", "CONNECTED", "POLICY"],
            resources
                .iter()
                .map(|r| {
                    vec![
                        r.resource.clone(),
                        r.capacity.to_string(),
                        r.allocatable.to_string(),
                        r.connected.to_string(),
                        r.policy.clone(),
                    ]
                })
                .collect(),
        ),
    })
}

async fn allocate_cmd(
    client: &mut AdminClient<Channel>,
    request: pb::AllocateRequest,
    output: OutputFormat,
) -> anyhow::Result<String> {
    let what = format!(
        "allocation of {} {} to pod {} container {}",
        request.count, request.resource, request.pod_uid, request.container
    );
    let answer = client
        .allocate(request)
        .await
        .map_err(|s| anyhow::anyhow!("{what} refused ({:?}): {}", s.code(), s.message()))?
        .into_inner();
    Ok(match output {
        OutputFormat::Json => pretty(&allocate_json(&answer)),
        OutputFormat::Table => {
            let r = answer.response.clone().unwrap_or_default();
            let mut rows = vec![vec!["devices".to_owned(), answer.device_ids.join(",")]];
            rows.extend(
                sorted(&r.envs)
                    .into_iter()
                    .map(|(k, v)| vec!["env".to_owned(), format!("{k}={v}")]),
            );
            rows.extend(r.mounts.iter().map(|m| {
                vec![
                    "mount".to_owned(),
                    format!(
                        "{} -> {}{}",
                        m.host_path,
                        m.container_path,
                        if m.read_only { " (ro)" } else { "" }
                    ),
                ]
            }));
            rows.extend(r.devices.iter().map(|d| {
                vec![
                    "device".to_owned(),
                    format!(
                        "{} -> {} ({})",
                        d.host_path, d.container_path, d.permissions
                    ),
                ]
            }));
            rows.extend(
                sorted(&r.annotations)
                    .into_iter()
                    .map(|(k, v)| vec!["annotation".to_owned(), format!("{k}={v}")]),
            );
            rows.extend(
                r.cdi_devices
                    .iter()
                    .map(|c| vec!["cdi".to_owned(), c.name.clone()]),
            );
            columns(&["WHAT", "VALUE"], rows)
        }
    })
}

async fn release_cmd(
    client: &mut AdminClient<Channel>,
    request: pb::ReleaseRequest,
    output: OutputFormat,
) -> anyhow::Result<String> {
    let pod = request.pod_uid.clone();
    let answer = client
        .release(request)
        .await
        .map_err(|s| {
            anyhow::anyhow!(
                "release of pod {pod} failed ({:?}): {}",
                s.code(),
                s.message()
            )
        })?
        .into_inner();
    Ok(match output {
        OutputFormat::Json => pretty(&json!({ "released": answer.released })),
        OutputFormat::Table => format!("released {} entries of pod {pod}\n", answer.released),
    })
}

async fn allocations(
    client: &mut AdminClient<Channel>,
    output: OutputFormat,
) -> anyhow::Result<String> {
    let allocations = client
        .list_allocations(pb::ListAllocationsRequest {})
        .await
        .context("ListAllocations failed")?
        .into_inner()
        .allocations;
    Ok(match output {
        OutputFormat::Json => pretty(&Value::Array(
            allocations.iter().map(allocation_json).collect(),
        )),
        OutputFormat::Table => columns(
            &["POD", "CONTAINER", "RESOURCE", "DEVICES"],
            allocations
                .iter()
                .map(|a| {
                    vec![
                        a.pod_uid.clone(),
                        a.container.clone(),
                        a.resource.clone(),
                        a.device_ids.join(","),
                    ]
                })
                .collect(),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pluglet_proto::v1beta1;

    #[test]
    fn allocate_json_has_the_documented_keys() {
        let answer = pb::AllocateResponse {
            device_ids: vec!["d0".into()],
            response: Some(v1beta1::ContainerAllocateResponse {
                envs: [("A".to_string(), "1".to_string())].into(),
                mounts: vec![v1beta1::Mount {
                    container_path: "/c".into(),
                    host_path: "/h".into(),
                    read_only: true,
                }],
                devices: vec![v1beta1::DeviceSpec {
                    container_path: "/dev/x".into(),
                    host_path: "/dev/null".into(),
                    permissions: "rw".into(),
                }],
                annotations: [("k".to_string(), "v".to_string())].into(),
                cdi_devices: vec![v1beta1::CdiDevice {
                    name: "vendor.com/gpu=d0".into(),
                }],
            }),
        };
        assert_eq!(
            allocate_json(&answer),
            json!({
                "device_ids": ["d0"],
                "envs": {"A": "1"},
                "mounts": [{"container_path": "/c", "host_path": "/h", "read_only": true}],
                "device_specs": [{"container_path": "/dev/x", "host_path": "/dev/null", "permissions": "rw"}],
                "annotations": {"k": "v"},
                "cdi_devices": ["vendor.com/gpu=d0"],
            })
        );
    }

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
}
