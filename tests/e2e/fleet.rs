//! The fleet: the daemon publishes its node's device plugin resources (`Node.status`) and CSI
//! drivers (`CSINode`, the node id annotation, topology labels) to a real kube-apiserver with
//! etcd, and a fleet of daemons is listed with `kubectl get nodes`.

use std::path::Path;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};

use crate::device_support::{DevicePluginProcess, Flow, allocate, wait_allocatable};
use crate::support::kube::ApiServer;
use crate::support::{CsiPlugin, DEADLINE, Daemon, TestRoot, wait_for};

/// Long enough for an API server restart and a backoff of a few seconds.
const CONVERGE: Duration = Duration::from_secs(60);

fn create_node(api: &ApiServer, name: &str) {
    let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
    let out = api.kubectl_input(&["create", "-f", "-"], &node.to_string());
    assert!(
        out.status.success(),
        "kubectl create node: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Gives the Node status written by someone else: cpu, memory and another agent's resource.
fn seed_other_status(api: &ApiServer, name: &str) {
    let patch = json!({"status": {
        "capacity": {"cpu": "2", "memory": "1Gi", "other.io/thing": "3"},
        "allocatable": {"cpu": "2", "memory": "1Gi", "other.io/thing": "3"},
    }});
    let out = api.kubectl(&[
        "patch",
        "node",
        name,
        "--subresource=status",
        "--type=merge",
        "-p",
        &patch.to_string(),
    ]);
    assert!(
        out.status.success(),
        "kubectl patch node status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn node(api: &ApiServer, name: &str) -> Value {
    api.kubectl_json(&["get", "node", name])
}

/// Waits until the Node satisfies `pred`.
fn wait_node(api: &ApiServer, name: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    wait_for(&format!("Node {name}: {what}"), CONVERGE, || {
        let n = node(api, name);
        pred(&n).then_some(n)
    })
}

fn status_list<'a>(node: &'a Value, list: &str, resource: &str) -> &'a Value {
    &node["status"][list][resource]
}

fn publishing(daemon: &Daemon) -> Value {
    daemon.ctl_object(&["status"], Some("Status"))["publishing"].clone()
}

fn kubeconfig_args(api: &ApiServer) -> Vec<String> {
    vec![
        "--kubeconfig".into(),
        api.kubeconfig().display().to_string(),
    ]
}

fn start_daemon(root: &Path, api: &ApiServer, node: &str, extra: &[&str]) -> Daemon {
    let mut args: Vec<String> = kubeconfig_args(api);
    args.extend(["--node-name".into(), node.into()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Daemon::start(root, &args)
}

const GPU: &str = "example.com/fleet-gpu";

#[test]
fn device_resources_follow_health_and_go_to_zero_then_away_leaving_others_untouched() {
    let root = TestRoot::new();
    let api = ApiServer::start(&root.path().join("kube"));
    let daemon = start_daemon(
        &root.path(),
        &api,
        "fleet-devices",
        &[
            "--device-grace-period",
            "2s",
            "--removed-resource-linger",
            "2s",
        ],
    );

    // No Node yet, no --register-node: the daemon works and says what it waits for.
    let waiting = wait_for("publishing to wait for the Node", DEADLINE, || {
        let p = publishing(&daemon);
        (p["state"] == "waiting-for-node").then_some(p)
    });
    assert!(
        waiting["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("--register-node")),
        "{waiting}"
    );
    let mut plugin = DevicePluginProcess::start(&root, Flow::Classic, GPU, &["--devices", "4"]);
    wait_allocatable(&daemon, GPU, 4);

    create_node(&api, "fleet-devices");
    seed_other_status(&api, "fleet-devices");
    let n = wait_node(&api, "fleet-devices", "gpu 4/4", |n| {
        status_list(n, "capacity", GPU) == "4" && status_list(n, "allocatable", GPU) == "4"
    });
    assert_eq!(status_list(&n, "capacity", "other.io/thing"), "3", "{n}");
    let p = publishing(&daemon);
    assert_eq!(p["state"], "synced", "{p}");
    assert_eq!(p["node"], "fleet-devices", "{p}");
    assert_eq!(p["resources"], 1, "{p}");

    // A device turns unhealthy: allocatable follows, capacity stays.
    plugin.set_health("dev-1 Unhealthy\n");
    wait_node(&api, "fleet-devices", "gpu allocatable 3", |n| {
        status_list(n, "allocatable", GPU) == "3" && status_list(n, "capacity", GPU) == "4"
    });

    // Someone else changes the Node: the daemon's next write carries a stale resourceVersion,
    // is refused (409) and is made again from a fresh read.
    let out = api.kubectl(&["label", "node", "fleet-devices", "someone=else"]);
    assert!(out.status.success());
    plugin.set_health("dev-1 Unhealthy\ndev-2 Unhealthy\n");
    let n = wait_node(&api, "fleet-devices", "gpu allocatable 2", |n| {
        status_list(n, "allocatable", GPU) == "2"
    });
    assert_eq!(n["metadata"]["labels"]["someone"], "else", "{n}");
    let p = publishing(&daemon);
    assert!(p["conflicts"].as_u64() >= Some(1), "{p}");

    // The plugin stops: allocatable 0 at once, capacity 0 after the grace period, then the
    // resource is removed; nobody else's numbers are touched.
    plugin.signal(Signal::SIGTERM);
    plugin.kill9();
    wait_node(&api, "fleet-devices", "gpu allocatable 0", |n| {
        status_list(n, "allocatable", GPU) == "0"
    });
    wait_node(&api, "fleet-devices", "gpu capacity 0", |n| {
        status_list(n, "capacity", GPU) == "0"
    });
    // The record of what was published shrinks only after the status write it covers, in a
    // write of its own: wait for both.
    let n = wait_node(&api, "fleet-devices", "gpu removed, no record left", |n| {
        status_list(n, "capacity", GPU).is_null()
            && status_list(n, "allocatable", GPU).is_null()
            && n["metadata"]["annotations"]
                .get("pluglet.io/published")
                .is_none()
    });
    for (key, value) in [("cpu", "2"), ("memory", "1Gi"), ("other.io/thing", "3")] {
        assert_eq!(status_list(&n, "capacity", key), value, "{n}");
        assert_eq!(status_list(&n, "allocatable", key), value, "{n}");
    }
}

#[test]
fn a_csi_driver_is_published_to_csinode_annotation_and_labels_and_removed() {
    let root = TestRoot::new();
    let api = ApiServer::start(&root.path().join("kube"));
    create_node(&api, "fleet-csi");
    let out = api.kubectl(&["label", "node", "fleet-csi", "zone=theirs"]);
    assert!(out.status.success());
    let daemon = start_daemon(&root.path(), &api, "fleet-csi", &[]);

    let reg = root.registry().join("csi.fleet.example-reg.sock");
    let mut csi = CsiPlugin::start(
        &root.side("."),
        &reg,
        &[
            "--name",
            "csi.fleet.example",
            "--node-id",
            "nid-7",
            "--max-volumes",
            "7",
            "--topology",
            "topology.fleet.example/zone=z1",
        ],
    );
    csi.wait_registered();
    daemon.wait_plugin("csi.fleet.example");

    let csinode = wait_for("the CSINode driver entry", CONVERGE, || {
        let out = api.kubectl(&["get", "csinode", "fleet-csi", "-o", "json"]);
        let v: Value = serde_json::from_slice(&out.stdout).ok()?;
        v["spec"]["drivers"]
            .as_array()?
            .iter()
            .any(|d| d["name"] == "csi.fleet.example")
            .then_some(v)
    });
    assert_eq!(
        csinode["spec"]["drivers"],
        json!([{
            "name": "csi.fleet.example",
            "nodeID": "nid-7",
            "topologyKeys": ["topology.fleet.example/zone"],
            "allocatable": {"count": 7},
        }]),
        "{csinode}"
    );
    let owner = &csinode["metadata"]["ownerReferences"][0];
    assert_eq!(
        (&owner["kind"], &owner["name"]),
        (&json!("Node"), &json!("fleet-csi"))
    );
    let n = wait_node(&api, "fleet-csi", "node id annotation and label", |n| {
        n["metadata"]["labels"]["topology.fleet.example/zone"] == "z1"
    });
    assert_eq!(
        n["metadata"]["annotations"]["csi.volume.kubernetes.io/nodeid"],
        r#"{"csi.fleet.example":"nid-7"}"#,
        "{n}"
    );

    // The driver goes: its entry, its node id and its label go; others' label stays.
    csi.terminate();
    wait_for("the CSINode driver entry removed", CONVERGE, || {
        let v = api.kubectl_json(&["get", "csinode", "fleet-csi"]);
        v["spec"]["drivers"]
            .as_array()
            .is_none_or(|d| d.is_empty())
            .then_some(())
    });
    let n = wait_node(
        &api,
        "fleet-csi",
        "node id annotation and label removed",
        |n| {
            n["metadata"]["labels"]
                .get("topology.fleet.example/zone")
                .is_none()
                && n["metadata"]["annotations"]
                    .get("csi.volume.kubernetes.io/nodeid")
                    .is_none()
        },
    );
    assert_eq!(n["metadata"]["labels"]["zone"], "theirs", "{n}");
}

#[test]
fn the_node_converges_after_the_api_server_was_down_with_nothing_lost() {
    let root = TestRoot::new();
    let mut api = ApiServer::start(&root.path().join("kube"));
    create_node(&api, "fleet-outage");
    let daemon = start_daemon(&root.path(), &api, "fleet-outage", &[]);
    let plugin = DevicePluginProcess::start(&root, Flow::Watcher, GPU, &["--devices", "4"]);
    wait_allocatable(&daemon, GPU, 4);
    wait_node(&api, "fleet-outage", "gpu 4/4", |n| {
        status_list(n, "allocatable", GPU) == "4"
    });

    api.stop();
    plugin.set_health("dev-0 Unhealthy\ndev-1 Unhealthy\n");
    wait_for("publishing to fail", CONVERGE, || {
        let p = publishing(&daemon);
        (p["state"] == "failing").then_some(p)
    });
    // The node keeps working without its API server.
    allocate(&daemon, "pod-1", "main", GPU, 1).expect("allocation while the API server is down");
    plugin.set_health("dev-1 Unhealthy\n");
    wait_allocatable(&daemon, GPU, 3);
    let p = publishing(&daemon);
    assert!(p["pending_changes"].as_u64() > Some(0), "{p}");
    assert!(p["last_error"].is_string(), "{p}");

    api.restart();
    let n = wait_node(&api, "fleet-outage", "gpu allocatable 3", |n| {
        status_list(n, "allocatable", GPU) == "3"
    });
    assert_eq!(status_list(&n, "capacity", GPU), "4", "{n}");
    let p = wait_for("publishing to recover", CONVERGE, || {
        let p = publishing(&daemon);
        (p["state"] == "synced").then_some(p)
    });
    assert_eq!(p["pending_changes"], 0, "{p}");
    assert!(p["last_error"].is_null(), "{p}");
}

#[test]
fn three_daemons_form_a_fleet_each_node_showing_only_its_own() {
    let root = TestRoot::new();
    let api = ApiServer::start(&root.path().join("kube"));
    let mut daemons = Vec::new();
    let mut plugins = Vec::new();
    for i in 1..=3u32 {
        let node_root = TestRoot::new();
        let name = format!("fleet-{i}");
        let daemon = start_daemon(
            &node_root.path(),
            &api,
            &name,
            &["--register-node", "--node-labels", "pluglet.io/fleet=e2e"],
        );
        let count = i.to_string();
        plugins.push(DevicePluginProcess::start(
            &node_root,
            Flow::Classic,
            "example.com/fleet",
            &["--devices", &count],
        ));
        let own = format!("example.com/only-{i}");
        plugins.push(DevicePluginProcess::start(
            &node_root,
            Flow::Classic,
            &own,
            &["--devices", "1"],
        ));
        daemons.push((node_root, daemon));
    }
    let nodes = wait_for("three nodes with their resources", CONVERGE, || {
        let list = api.kubectl_json(&["get", "nodes", "-l", "pluglet.io/fleet=e2e"]);
        let items = list["items"].as_array()?.clone();
        let complete = items.len() == 3
            && items.iter().all(|n| {
                let name = n["metadata"]["name"].as_str().unwrap_or_default();
                let i = name.trim_start_matches("fleet-");
                n["status"]["allocatable"]["example.com/fleet"] == i
                    && n["status"]["allocatable"][format!("example.com/only-{i}")] == "1"
            });
        complete.then_some(items)
    });
    for n in &nodes {
        let name = n["metadata"]["name"].as_str().unwrap();
        let i = name.trim_start_matches("fleet-");
        let theirs: Vec<&String> = n["status"]["capacity"]
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| k.starts_with("example.com/only-"))
            .collect();
        assert_eq!(theirs, [&format!("example.com/only-{i}")], "{n}");
        assert_eq!(n["status"]["capacity"]["example.com/fleet"], i, "{n}");
    }
    // At rest, nothing more is written.
    for (_, daemon) in &daemons {
        let p = publishing(daemon);
        assert_eq!(p["state"], "synced", "{p}");
    }
}

#[test]
fn a_kubeconfig_that_cannot_be_used_stops_the_start_with_the_reason() {
    let root = TestRoot::new();
    let missing = root.path().join("no-such-kubeconfig");
    let missing = missing.display().to_string();
    let (status, log) = Daemon::spawn(&root.path(), &["--kubeconfig", &missing]).wait_exit();
    assert!(!status.success());
    assert!(log.contains("cannot use kubeconfig"), "{log}");
    let (status, log) = Daemon::spawn(&root.path(), &["--register-node"]).wait_exit();
    assert!(!status.success());
    assert!(log.contains("--kubeconfig FILE or --in-cluster"), "{log}");
}

#[test]
fn refused_credentials_are_reported_while_the_node_keeps_working() {
    let root = TestRoot::new();
    let api = ApiServer::start(&root.path().join("kube"));
    create_node(&api, "fleet-refused");
    let text = std::fs::read_to_string(api.kubeconfig()).unwrap();
    assert!(text.contains(api.token()));
    let bad = root.path().join("bad-kubeconfig");
    std::fs::write(&bad, text.replace(api.token(), "not-the-token")).unwrap();
    let bad = bad.display().to_string();
    let daemon = Daemon::start(
        &root.path(),
        &["--kubeconfig", &bad, "--node-name", "fleet-refused"],
    );
    let _plugin = DevicePluginProcess::start(&root, Flow::Classic, GPU, &["--devices", "2"]);
    wait_allocatable(&daemon, GPU, 2);
    let p = wait_for("publishing to fail with 401", CONVERGE, || {
        let p = publishing(&daemon);
        (p["state"] == "failing").then_some(p)
    });
    let error = p["last_error"].as_str().unwrap_or_default();
    assert!(
        error.contains("401") || error.contains("Unauthorized"),
        "{p}"
    );
    allocate(&daemon, "pod-1", "main", GPU, 1).expect("allocation with the API server refusing");
    let n = node(&api, "fleet-refused");
    assert!(status_list(&n, "capacity", GPU).is_null(), "{n}");
}
