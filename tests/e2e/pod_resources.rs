//! The kubelet's pod-resources API, read as monitoring and topology agents read it: a stock
//! gRPC client (grpcio, whose `:authority` is the percent-encoded socket path) calling
//! `v1.PodResourcesLister` on `<root>/pod-resources/kubelet.sock`, frames written as grpc-go
//! writes them (the raw path as `:authority`), and the answers decoded with the v1 messages.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use pluglet_proto::podresources::v1 as pb;
use prost::Message as _;
use serde_json::Value;

use crate::device_authority::{Answer, unary};
use crate::device_support::{
    DevicePluginProcess, Flow, allocate_with, allocations, ids, release, resource, wait_allocatable,
};
use crate::ops::{free_addr, scrape};
use crate::support::{DEADLINE, Daemon, TestRoot, grpcio, wait_for};

const GPU: &str = "example.com/gpu";
const NIC: &str = "example.com/nic";

fn socket(root: &TestRoot) -> PathBuf {
    root.path().join("pod-resources").join("kubelet.sock")
}

/// One call of `method` with an empty request through grpcio: the answer's bytes, or the
/// status code's name and details.
fn call(socket: &Path, method: &str, request: &[u8]) -> Result<Vec<u8>, String> {
    let script = format!(
        r#"
import binascii
try:
    answer = channel.unary_unary("/v1.PodResourcesLister/{method}")(binascii.unhexlify("{request}"), timeout=30)
    print("ok", binascii.hexlify(answer).decode())
except grpc.RpcError as e:
    print("error", e.code().name, e.details())
"#,
        request = hex::encode(request)
    );
    let out = grpcio::run(socket, None, &script);
    match out.split_once(' ') {
        Some(("ok", bytes)) => Ok(hex::decode(bytes.trim()).unwrap()),
        Some(("error", status)) => Err(status.to_owned()),
        _ if out == "ok" => Ok(Vec::new()),
        _ => panic!("unexpected client output {out:?}"),
    }
}

fn list(socket: &Path) -> pb::ListPodResourcesResponse {
    pb::ListPodResourcesResponse::decode(&*call(socket, "List", &[]).unwrap()).unwrap()
}

fn allocatable(socket: &Path) -> pb::AllocatableResourcesResponse {
    pb::AllocatableResourcesResponse::decode(
        &*call(socket, "GetAllocatableResources", &[]).unwrap(),
    )
    .unwrap()
}

fn get(socket: &Path, name: &str, namespace: &str) -> Result<pb::PodResources, String> {
    let request = pb::GetPodResourcesRequest {
        pod_name: name.into(),
        pod_namespace: namespace.into(),
    };
    call(socket, "Get", &request.encode_to_vec()).map(|bytes| {
        pb::GetPodResourcesResponse::decode(&*bytes)
            .unwrap()
            .pod_resources
            .expect("a pod")
    })
}

/// (pod namespace/name, container, resource, device, NUMA node) of every device listed.
type Row = (String, String, String, String, Option<i64>);

fn rows(pods: &[pb::PodResources]) -> BTreeSet<Row> {
    let mut out = BTreeSet::new();
    for pod in pods {
        for c in &pod.containers {
            assert!(c.cpu_ids.is_empty() && c.memory.is_empty(), "{c:?}");
            for d in &c.devices {
                assert_eq!(d.device_ids.len(), 1, "one device per entry: {d:?}");
                let node = d.topology.as_ref().map(|t| {
                    assert_eq!(t.nodes.len(), 1, "{t:?}");
                    t.nodes[0].id
                });
                out.insert((
                    format!("{}/{}", pod.namespace, pod.name),
                    c.name.clone(),
                    d.resource_name.clone(),
                    d.device_ids[0].clone(),
                    node,
                ));
            }
        }
    }
    out
}

/// NUMA node of each device of `name`, as `ctl resources` shows it.
fn numa_of(daemon: &Daemon, name: &str, id: &str) -> Option<i64> {
    let r = resource(daemon, name).unwrap();
    let device = r["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["id"] == id)
        .unwrap()
        .clone();
    device["numa"]
        .as_array()
        .unwrap()
        .first()
        .map(|n| n.as_i64().unwrap())
}

fn allocate_named(
    daemon: &Daemon,
    pod: &str,
    container: &str,
    resource: &str,
    count: u32,
    name: Option<(&str, &str)>,
) -> Value {
    let extra = match name {
        Some((name, namespace)) => vec!["--pod-name", name, "--namespace", namespace],
        None => Vec::new(),
    };
    allocate_with(daemon, pod, container, resource, count, &extra)
        .unwrap_or_else(|e| panic!("ctl allocate: {e}"))
}

/// What `ctl allocations` says is held, as rows of the pod-resources API.
fn expected(daemon: &Daemon) -> BTreeSet<Row> {
    let mut out = BTreeSet::new();
    for a in allocations(daemon) {
        let resource = a["resource"].as_str().unwrap();
        for id in ids(&a["device_ids"]) {
            out.insert((
                format!(
                    "{}/{}",
                    a["pod_namespace"].as_str().unwrap(),
                    a["pod_name"].as_str().unwrap()
                ),
                a["container"].as_str().unwrap().to_owned(),
                resource.to_owned(),
                id.clone(),
                numa_of(daemon, resource, &id),
            ));
        }
    }
    out
}

fn healthy_rows(answer: &pb::AllocatableResourcesResponse) -> BTreeSet<(String, String)> {
    assert!(answer.cpu_ids.is_empty() && answer.memory.is_empty());
    answer
        .devices
        .iter()
        .map(|d| (d.resource_name.clone(), d.device_ids.concat()))
        .collect()
}

#[test]
fn agents_see_what_pods_hold_and_what_is_allocatable_across_a_restart() {
    let root = TestRoot::new();
    let addr = free_addr();
    let daemon = Daemon::start(&root.path(), &["--metrics-addr", &addr]);
    let socket = socket(&root);
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&socket).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "shows no more than the kubelet shows");
    let gpu = DevicePluginProcess::start(&root, Flow::Classic, GPU, &["--reregister"]);
    let _nic = DevicePluginProcess::start(&root, Flow::Classic, NIC, &["--reregister"]);
    wait_allocatable(&daemon, GPU, 4);
    wait_allocatable(&daemon, NIC, 4);
    assert!(list(&socket).pod_resources.is_empty());

    allocate_named(&daemon, "uid-a", "main", GPU, 2, Some(("train", "ml")));
    // The pod's name is kept for its other allocations.
    allocate_named(&daemon, "uid-a", "main", NIC, 1, None);
    allocate_named(&daemon, "uid-a", "side", GPU, 1, None);
    allocate_named(&daemon, "uid-b", "c", GPU, 1, None);
    // A pod's name cannot change; a bad name is refused saying what a name is.
    let renamed = allocate_with(
        &daemon,
        "uid-a",
        "other",
        GPU,
        1,
        &["--pod-name", "serve", "--namespace", "ml"],
    )
    .unwrap_err();
    assert!(
        renamed.contains("holds devices as ml/train, not ml/serve"),
        "{renamed}"
    );
    let bad =
        allocate_with(&daemon, "uid-c", "c", GPU, 1, &["--pod-name", "Bad_Name"]).unwrap_err();
    assert!(bad.contains("is not a valid pod name"), "{bad}");

    let listed = list(&socket);
    let want = expected(&daemon);
    assert_eq!(rows(&listed.pod_resources), want);
    assert_eq!(want.len(), 5);
    assert!(want.iter().any(|r| r.0 == "ml/train" && r.2 == NIC));
    assert!(want.iter().any(|r| r.0 == "default/uid-b"), "{want:?}");
    let names: Vec<(&str, usize)> = listed
        .pod_resources
        .iter()
        .map(|p| (p.name.as_str(), p.containers.len()))
        .collect();
    assert_eq!(names, [("train", 2), ("uid-b", 1)]);

    // Get by name and namespace, as the kubelet answers it.
    let train = get(&socket, "train", "ml").unwrap();
    assert_eq!(
        rows(&[train]),
        want.iter().filter(|r| r.0 == "ml/train").cloned().collect()
    );
    let missing = get(&socket, "train", "default").unwrap_err();
    assert_eq!(missing, "UNKNOWN pod train in namespace default not found");

    // The frames grpc-go writes, with the socket's raw path as `:authority`.
    assert_eq!(
        unary(
            &socket,
            &socket.display().to_string(),
            "/v1.PodResourcesLister/List",
            &[]
        ),
        Answer::Answered
    );

    // Every healthy device, held or not, follows health.
    let all = healthy_rows(&allocatable(&socket));
    assert_eq!(all.len(), 8, "{all:?}");
    gpu.set_health("dev-0 Unhealthy\n");
    wait_for("dev-0 to leave the allocatable devices", DEADLINE, || {
        (!healthy_rows(&allocatable(&socket)).contains(&(GPU.to_owned(), "dev-0".to_owned())))
            .then_some(())
    });
    gpu.set_health("dev-0 Healthy\n");
    wait_for("dev-0 to come back", DEADLINE, || {
        (healthy_rows(&allocatable(&socket)).len() == 8).then_some(())
    });

    // A release is gone from the list.
    release(&daemon, "uid-b", None);
    let want = expected(&daemon);
    assert_eq!(rows(&list(&socket).pod_resources), want);
    assert!(!want.iter().any(|r| r.0 == "default/uid-b"));

    let s = scrape(&addr);
    let v1 = "{server_api_version=\"v1\"}";
    for (name, at_least) in [
        ("kubelet_pod_resources_endpoint_requests_total", 7.0),
        ("kubelet_pod_resources_endpoint_requests_list", 4.0),
        ("kubelet_pod_resources_endpoint_requests_get", 2.0),
        ("kubelet_pod_resources_endpoint_errors_get", 1.0),
        (
            "kubelet_pod_resources_endpoint_requests_get_allocatable",
            3.0,
        ),
    ] {
        let key = format!("{name}{v1}");
        let value = s
            .get(&key)
            .copied()
            .unwrap_or_else(|| panic!("{key} missing"));
        assert!(value >= at_least, "{key} = {value}");
    }
    assert_eq!(
        s[&format!("kubelet_pod_resources_endpoint_errors_get{v1}")],
        1.0
    );
    assert_eq!(
        s[&format!("kubelet_pod_resources_endpoint_errors_list{v1}")],
        0.0
    );

    // After a restart: the same answers, from the checkpoint and the journal.
    daemon.terminate();
    let daemon = Daemon::start(&root.path(), &[]);
    assert_eq!(rows(&list(&socket).pod_resources), want);
    assert!(get(&socket, "train", "ml").is_ok());
    wait_allocatable(&daemon, GPU, 4);
    wait_allocatable(&daemon, NIC, 4);
    assert_eq!(healthy_rows(&allocatable(&socket)).len(), 8);
    daemon.terminate();
}

#[test]
fn the_endpoint_is_rate_limited_and_refuses_to_start_over_a_live_socket() {
    let root = TestRoot::new();
    let daemon = Daemon::start(
        &root.path(),
        &["--pod-resources-qps", "1", "--pod-resources-burst", "1"],
    );
    let socket = socket(&root);
    // Twenty calls in a row at one a second with a burst of one: some are refused, with the
    // kubelet's answer.
    const SCRIPT: &str = r#"
answers = []
for _ in range(20):
    try:
        channel.unary_unary("/v1.PodResourcesLister/List")(b"", timeout=30)
        answers.append("ok")
    except grpc.RpcError as e:
        answers.append("%s %s" % (e.code().name, e.details()))
print("\n".join(answers))
"#;
    let answers = grpcio::run(&socket, None, SCRIPT);
    assert!(answers.lines().next() == Some("ok"), "{answers}");
    assert!(
        answers
            .lines()
            .any(|a| a == "RESOURCE_EXHAUSTED rejected by rate limit"),
        "{answers}"
    );

    // A second daemon on another state directory finds the socket answering and stops.
    let other = TestRoot::new();
    let second = Daemon::spawn(
        &other.path(),
        &["--pod-resources-socket", &socket.display().to_string()],
    );
    let (status, log) = second.wait_exit();
    assert!(!status.success(), "{log}");
    assert!(log.contains("serves the pod-resources API there"), "{log}");
    assert!(socket.exists(), "the live socket was left alone");
    daemon.terminate();
    assert!(!socket.exists(), "the socket is removed at stop");

    // Turned off: no socket.
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &["--no-pod-resources"]);
    assert!(!socket_path_exists(&root));
    daemon.terminate();
}

fn socket_path_exists(root: &TestRoot) -> bool {
    socket(root).exists()
}
