//! Story: device plugins that misbehave at the `kubelet.sock` door: one crashes in the middle of
//! its ListAndWatch stream and comes back, one lists 100,000 devices (and 1 and 1,000 of them are
//! allocated), one lists empty,
//! duplicated or 10 KB long ids, and two register the same resource. The daemon stays up,
//! `ctl resources` says what is wrong, allocations are kept. The registry-door cases are in
//! `misbehaving_plugins.rs`.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pluglet_proto::v1beta1;
use pluglet_proto::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status};

use crate::device_support::{
    DevicePluginProcess, FLOWS, allocate, allocations, device_plugins_dir, ids, resource,
    wait_allocatable, wait_resource,
};
use crate::misbehaving_plugins::peer_runtime;
use crate::support::{DEADLINE, Daemon, TestRoot, wait_for};

const GPU: &str = "vendor.com/gpu";

/// A device plugin written here: it lists whatever the test sets, and says when the daemon
/// closed its ListAndWatch stream.
#[derive(Clone)]
struct FakeDevicePlugin {
    list: watch::Receiver<Vec<v1beta1::Device>>,
    stream_closed: Arc<AtomicBool>,
}

type DeviceStream =
    tokio_stream::wrappers::ReceiverStream<Result<v1beta1::ListAndWatchResponse, Status>>;

#[tonic::async_trait]
impl DevicePlugin for FakeDevicePlugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<v1beta1::Empty>,
    ) -> Result<Response<v1beta1::DevicePluginOptions>, Status> {
        Ok(Response::new(v1beta1::DevicePluginOptions::default()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<v1beta1::Empty>,
    ) -> Result<Response<DeviceStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let mut list = self.list.clone();
        let closed = self.stream_closed.clone();
        tokio::spawn(async move {
            loop {
                let devices = list.borrow_and_update().clone();
                if tx
                    .send(Ok(v1beta1::ListAndWatchResponse { devices }))
                    .await
                    .is_err()
                {
                    break;
                }
                tokio::select! {
                    _ = tx.closed() => break,
                    changed = list.changed() => if changed.is_err() { break },
                }
            }
            closed.store(true, Ordering::SeqCst);
        });
        Ok(Response::new(DeviceStream::new(rx)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<v1beta1::PreferredAllocationRequest>,
    ) -> Result<Response<v1beta1::PreferredAllocationResponse>, Status> {
        Ok(Response::new(Default::default()))
    }

    async fn allocate(
        &self,
        request: Request<v1beta1::AllocateRequest>,
    ) -> Result<Response<v1beta1::AllocateResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|_| v1beta1::ContainerAllocateResponse::default())
            .collect();
        Ok(Response::new(v1beta1::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<v1beta1::PreStartContainerRequest>,
    ) -> Result<Response<v1beta1::PreStartContainerResponse>, Status> {
        Ok(Response::new(Default::default()))
    }
}

/// A running [`FakeDevicePlugin`]: set its list, ask whether its stream was closed.
struct FakeHandle {
    list: watch::Sender<Vec<v1beta1::Device>>,
    stream_closed: Arc<AtomicBool>,
}

impl FakeHandle {
    /// Serves `<device-plugins>/<endpoint>` listing `ids` (all healthy), then registers
    /// `resource` on `kubelet.sock`.
    fn start(
        rt: &tokio::runtime::Runtime,
        root: &TestRoot,
        endpoint: &str,
        resource: &str,
        ids: &[String],
    ) -> FakeHandle {
        let (list, rx) = watch::channel(devices(ids));
        let stream_closed = Arc::new(AtomicBool::new(false));
        let plugin = FakeDevicePlugin {
            list: rx,
            stream_closed: stream_closed.clone(),
        };
        let dir = device_plugins_dir(root);
        let socket = dir.join(endpoint);
        let (endpoint, resource) = (endpoint.to_owned(), resource.to_owned());
        rt.block_on(async move {
            let listener = pluglet_uds::bind(&socket, None).expect("bind the fake plugin");
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(DevicePluginServer::new(plugin))
                    .serve_with_incoming(pluglet_uds::incoming(listener)),
            );
            register(&dir.join("kubelet.sock"), &endpoint, &resource).await;
        });
        FakeHandle {
            list,
            stream_closed,
        }
    }

    fn closed(&self) -> bool {
        self.stream_closed.load(Ordering::SeqCst)
    }
}

async fn register(kubelet: &Path, endpoint: &str, resource: &str) {
    let channel = pluglet_uds::connect(kubelet, Duration::from_secs(10))
        .await
        .expect("dial kubelet.sock");
    v1beta1::registration_client::RegistrationClient::new(channel)
        .register(v1beta1::RegisterRequest {
            version: "v1beta1".into(),
            endpoint: endpoint.into(),
            resource_name: resource.into(),
            options: None,
        })
        .await
        .expect("Register answered");
}

fn devices(ids: &[String]) -> Vec<v1beta1::Device> {
    ids.iter()
        .map(|id| v1beta1::Device {
            id: id.clone(),
            health: "Healthy".into(),
            topology: None,
        })
        .collect()
}

fn strings(ids: &[&str]) -> Vec<String> {
    ids.iter().map(|s| s.to_string()).collect()
}

fn device_ids(r: &Value) -> Vec<String> {
    r["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn a_plugin_that_crashes_mid_stream_comes_back_with_its_devices_and_allocations_kept() {
    for flow in FLOWS {
        let root = TestRoot::new();
        let daemon = Daemon::start(&root.path(), &[]);
        let mut first = DevicePluginProcess::start(&root, flow, GPU, &[]);
        wait_allocatable(&daemon, GPU, 4);
        let held = ids(&allocate(&daemon, "pod-1", "ctr", GPU, 2).unwrap()["device_ids"]);

        // SIGKILL while its ListAndWatch stream is open.
        first.kill9();
        let r = wait_resource(&daemon, GPU, "disconnected", |r| r["connected"] == false);
        let error = r["last_error"].as_str().unwrap_or_default();
        assert!(
            error.contains("disconnected") && error.contains("ListAndWatch"),
            "{flow:?}: {r}"
        );
        assert_eq!(allocations(&daemon).len(), 1);

        let _again = DevicePluginProcess::start(&root, flow, GPU, &[]);
        let r = wait_allocatable(&daemon, GPU, 4);
        assert_eq!(r["last_error"], Value::Null, "{flow:?}: {r}");
        let listed = allocations(&daemon);
        assert_eq!(listed.len(), 1, "{flow:?}: {listed:?}");
        assert_eq!(ids(&listed[0]["device_ids"]), held);
        let err = allocate(&daemon, "pod-2", "ctr", GPU, 3).unwrap_err();
        assert!(
            err.contains("Requested: 3, Available: 2"),
            "{flow:?}: {err}"
        );
    }
}

#[test]
fn a_hundred_thousand_devices_are_served() {
    const N: i64 = 100_000;
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let start = Instant::now();
    let _plugin = DevicePluginProcess::start(&root, FLOWS[0], GPU, &["--devices", "100000"]);
    wait_for(
        &format!("{N} devices of {GPU}"),
        Duration::from_secs(120),
        || {
            let out = daemon.ctl(&["resources"]);
            let table = String::from_utf8_lossy(&out.stdout).into_owned();
            table
                .lines()
                .any(|l| l.starts_with(GPU) && l.split_whitespace().nth(2) == Some("100000"))
                .then_some(())
        },
    );
    println!(
        "{N} devices visible in ctl resources after {:?}",
        start.elapsed()
    );
    let r = resource(&daemon, GPU).expect("listed in -o json too");
    assert_eq!(
        (r["capacity"].as_i64(), r["allocatable"].as_i64()),
        (Some(N), Some(N))
    );
    assert!(
        r["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["health"] == "Healthy")
    );
    // The built-in policy chooses among all of them within its limits.
    let listed: HashSet<String> = (0..N).map(|i| format!("dev-{i}")).collect();
    let mut held: HashSet<String> = HashSet::new();
    for (pod, count) in [("pod-1", 1), ("pod-1000", 1_000)] {
        let got = allocate(&daemon, pod, "ctr", GPU, count)
            .unwrap_or_else(|e| panic!("allocating {count} of {N}: {e}"));
        let got = ids(&got["device_ids"]);
        assert_eq!(got.len(), count as usize, "{pod}: {got:?}");
        for id in got {
            assert!(listed.contains(&id), "{pod}: {id} is not a listed device");
            assert!(held.insert(id.clone()), "{pod}: {id} given twice");
        }
    }
    assert_eq!(
        resource(&daemon, GPU).unwrap()["capacity"],
        N,
        "the daemon is still up"
    );
}

#[test]
fn empty_duplicated_and_10_kb_device_ids_are_reported_or_served() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let rt = peer_runtime();
    let long = "x".repeat(10 * 1024);
    let listed = vec![
        String::new(),
        "a".to_owned(),
        "a".to_owned(),
        "b".to_owned(),
        long.clone(),
    ];
    let fake = FakeHandle::start(&rt, &root, "odd-ids.sock", GPU, &listed);
    let r = wait_resource(&daemon, GPU, "with the odd ids reported", |r| {
        r["last_error"].is_string()
    });
    let error = r["last_error"].as_str().unwrap();
    assert!(error.contains("1 device(s) with an empty id"), "{error}");
    assert!(error.contains("1 with an id listed before (a)"), "{error}");
    // A 10 KB id is served as it is, as the kubelet does.
    assert_eq!(device_ids(&r), ["a", "b", long.as_str()], "{r}");
    let table = String::from_utf8(daemon.ctl(&["resources"]).stdout).unwrap();
    assert!(table.contains("empty id"), "{table}");
    let got = allocate(&daemon, "pod", "ctr", GPU, 3).unwrap();
    assert!(ids(&got["device_ids"]).contains(&long));

    // A clean list clears the report.
    fake.list.send_replace(devices(&strings(&["a", "b", "c"])));
    let r = wait_resource(&daemon, GPU, "clean", |r| r["last_error"].is_null());
    assert_eq!(device_ids(&r), ["a", "b", "c"]);
    drop(rt);
}

#[test]
fn a_second_plugin_for_the_same_resource_replaces_the_first_and_closes_its_stream() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let rt = peer_runtime();
    let first = FakeHandle::start(&rt, &root, "first.sock", GPU, &strings(&["a0", "a1"]));
    let r = wait_allocatable(&daemon, GPU, 2);
    assert!(
        r["endpoint"].as_str().unwrap().ends_with("first.sock"),
        "{r}"
    );
    assert!(!first.closed());

    let second = FakeHandle::start(&rt, &root, "second.sock", GPU, &strings(&["b0"]));
    let r = wait_resource(&daemon, GPU, "served by the second plugin", |r| {
        r["endpoint"]
            .as_str()
            .is_some_and(|e| e.ends_with("second.sock"))
    });
    assert_eq!(device_ids(&r), ["b0"], "the later one wins: {r}");
    wait_for("the first plugin's stream closed", DEADLINE, || {
        first.closed().then_some(())
    });
    // The first plugin's news no longer counts.
    first
        .list
        .send_replace(devices(&strings(&["a0", "a1", "a2"])));
    second.list.send_replace(devices(&strings(&["b0", "b1"])));
    let r = wait_allocatable(&daemon, GPU, 2);
    assert_eq!(device_ids(&r), ["b0", "b1"]);
    assert!(!second.closed());
    assert!(daemon.log_text().contains("replaces the old one"));
}
