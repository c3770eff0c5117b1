//! The Kubernetes harness itself: a real etcd and kube-apiserver start, store a Node created
//! with kubectl, and still serve it after the API server alone is stopped and started again.

use serde_json::json;

use crate::support::TestRoot;
use crate::support::kube::ApiServer;

#[test]
fn a_node_survives_an_api_server_restart() {
    let root = TestRoot::new();
    let mut api = ApiServer::start(&root.path().join("kube"));

    let node = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "pluglet-e2e", "labels": {"pluglet.dev/e2e": "harness"}},
    });
    let created = api.kubectl_input(&["create", "-f", "-"], &node.to_string());
    assert!(
        created.status.success(),
        "kubectl create: {}",
        String::from_utf8_lossy(&created.stderr)
    );
    let read = api.kubectl_json(&["get", "node", "pluglet-e2e"]);
    assert_eq!(
        read["metadata"]["labels"]["pluglet.dev/e2e"], "harness",
        "{read}"
    );
    let uid = read["metadata"]["uid"].clone();
    assert!(uid.is_string(), "{read}");

    api.stop();
    assert!(!api.is_running());
    let down = api.kubectl(&["--request-timeout=5s", "get", "node", "pluglet-e2e"]);
    assert!(
        !down.status.success(),
        "kubectl reached a stopped API server"
    );

    api.restart();
    let again = api.kubectl_json(&["get", "node", "pluglet-e2e"]);
    assert_eq!(again["metadata"]["uid"], uid, "{again}");
    let nodes = api.kubectl_json(&["get", "nodes"]);
    assert_eq!(nodes["items"].as_array().map(Vec::len), Some(1), "{nodes}");
    assert!(api.metrics().contains("apiserver_request_total"));
}
