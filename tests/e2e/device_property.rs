//! Property: random concurrent allocate/release sequences through the admin API never give one
//! device to two containers, never hold more than allocatable, and releases return devices.
//! Bounded cases; failing seeds are kept in `device_property.proptest-regressions` beside this
//! file.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use pluglet_proto::admin::v1 as pb;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_uds::Channel;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};

use crate::device_support::{DevicePluginProcess, FLOWS, wait_allocatable};
use crate::support::{Daemon, TestRoot};

const GPU: &str = "vendor.com/gpu";
const DEVICES: usize = 8;

/// One admin request.
#[derive(Clone, Debug)]
enum Op {
    Allocate { pod: u8, container: u8, count: u32 },
    Release { pod: u8, container: Option<u8> },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..5u8, 0..2u8, 1..5u32).prop_map(|(pod, container, count)| Op::Allocate { pod, container, count }),
        1 => (0..5u8, proptest::option::of(0..2u8)).prop_map(|(pod, container)| Op::Release { pod, container }),
    ]
}

async fn client(socket: &std::path::Path) -> AdminClient<Channel> {
    AdminClient::new(
        pluglet_uds::connect(socket, Duration::from_secs(10))
            .await
            .expect("dial the admin socket"),
    )
}

async fn run_op(mut client: AdminClient<Channel>, op: Op) -> Result<(), String> {
    match op {
        Op::Allocate {
            pod,
            container,
            count,
        } => {
            let request = pb::AllocateRequest {
                pod_uid: format!("pod-{pod}"),
                container: format!("c{container}"),
                resource: GPU.into(),
                count,
                ..Default::default()
            };
            match client.allocate(request).await {
                Ok(answer) => {
                    let ids = answer.into_inner().device_ids;
                    let distinct: BTreeSet<&String> = ids.iter().collect();
                    if ids.len() != count as usize || distinct.len() != ids.len() {
                        return Err(format!("allocate {count} answered {ids:?}"));
                    }
                    Ok(())
                }
                // Too few free devices, a changed count, or the same container racing itself:
                // normal refusals. Anything else is a bug.
                Err(s)
                    if matches!(
                        s.code(),
                        tonic::Code::ResourceExhausted
                            | tonic::Code::FailedPrecondition
                            | tonic::Code::Aborted
                    ) =>
                {
                    Ok(())
                }
                Err(s) => Err(format!("allocate failed: {:?} {}", s.code(), s.message())),
            }
        }
        Op::Release { pod, container } => client
            .release(pb::ReleaseRequest {
                pod_uid: format!("pod-{pod}"),
                container: container.map(|c| format!("c{c}")).unwrap_or_default(),
            })
            .await
            .map(|_| ())
            .map_err(|s| format!("release failed: {s}")),
    }
}

/// Checks the invariants; returns the allocations.
async fn check(client: &mut AdminClient<Channel>) -> Result<Vec<pb::Allocation>, String> {
    let allocations = client
        .list_allocations(pb::ListAllocationsRequest {})
        .await
        .map_err(|s| s.to_string())?
        .into_inner()
        .allocations;
    let resources = client
        .list_resources(pb::ListResourcesRequest {})
        .await
        .map_err(|s| s.to_string())?
        .into_inner()
        .resources;
    let allocatable = resources
        .iter()
        .find(|r| r.resource == GPU)
        .map_or(0, |r| r.allocatable);
    let mut holder: BTreeMap<&String, (&str, &str)> = BTreeMap::new();
    for a in &allocations {
        for id in &a.device_ids {
            if let Some(other) = holder.insert(id, (&a.pod_uid, &a.container)) {
                return Err(format!(
                    "device {id} held by {other:?} and {}/{}",
                    a.pod_uid, a.container
                ));
            }
        }
    }
    if holder.len() as i64 > allocatable {
        return Err(format!(
            "{} devices held, allocatable {allocatable}",
            holder.len()
        ));
    }
    Ok(allocations)
}

async fn run_case(socket: &std::path::Path, batches: Vec<Vec<Op>>) -> Result<(), String> {
    let mut admin = client(socket).await;
    for batch in batches {
        let mut tasks = Vec::new();
        for op in batch.iter().cloned() {
            let c = admin.clone();
            tasks.push(tokio::spawn(run_op(c, op)));
        }
        for task in tasks {
            task.await.map_err(|e| e.to_string())??;
        }
        let allocations = check(&mut admin).await?;
        // A release returns the devices: a container released in this batch and not allocated
        // in it holds nothing.
        for op in &batch {
            if let Op::Release { pod, container } = op {
                let pod_uid = format!("pod-{pod}");
                let reallocated = batch.iter().any(|o| {
                    matches!(o, Op::Allocate { pod: p, container: c, .. }
                    if p == pod && container.is_none_or(|x| x == *c))
                });
                let still = allocations.iter().any(|a| {
                    a.pod_uid == pod_uid && container.is_none_or(|c| a.container == format!("c{c}"))
                });
                if still && !reallocated {
                    return Err(format!(
                        "{pod_uid} {container:?} still holds devices after release"
                    ));
                }
            }
        }
    }
    // Release everything: every device is free again.
    for pod in 0..5u8 {
        run_op(
            admin.clone(),
            Op::Release {
                pod,
                container: None,
            },
        )
        .await?;
    }
    if !check(&mut admin).await?.is_empty() {
        return Err("allocations left after releasing every pod".into());
    }
    let all = admin
        .allocate(pb::AllocateRequest {
            pod_uid: "all".into(),
            container: "c".into(),
            resource: GPU.into(),
            count: DEVICES as u32,
            ..Default::default()
        })
        .await
        .map_err(|s| format!("every device should be free: {s}"))?;
    if all.into_inner().device_ids.len() != DEVICES {
        return Err("not every device came back".into());
    }
    run_op(
        admin.clone(),
        Op::Release {
            pod: 0,
            container: None,
        },
    )
    .await?;
    admin
        .release(pb::ReleaseRequest {
            pod_uid: "all".into(),
            container: String::new(),
        })
        .await
        .map_err(|s| s.to_string())?;
    Ok(())
}

#[test]
fn concurrent_allocate_and_release_never_share_a_device() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let devices = DEVICES.to_string();
    let _plugin = DevicePluginProcess::start(&root, FLOWS[0], GPU, &["--devices", &devices]);
    wait_allocatable(&daemon, GPU, DEVICES as i64);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let mut runner = TestRunner::new(Config {
        cases: 24,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/e2e/device_property.proptest-regressions"
        )))),
        ..Config::default()
    });
    let socket = root.admin_socket();
    let strategy = proptest::collection::vec(proptest::collection::vec(op(), 1..5), 1..5);
    let result = runner.run(&strategy, |batches| {
        runtime
            .block_on(run_case(&socket, batches))
            .map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{e}\ndaemon log:\n{}", daemon.log_text());
    }
}
