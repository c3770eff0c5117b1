//! Fleet rollouts of a handler: five daemons (five roots, five node names) on one real
//! kube-apiserver, the module in a real registry. A `HandlerRollout` opens its waves one after
//! the other as the nodes of each pass their soak, every node ends serving the new digest and
//! the rollout `Complete`; a module that traps on allocation rolls back on the first wave's
//! node, the rollout halts and ends `RolledBack`, later waves never apply it, and every node
//! serves what it served before.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::handler_registry::{flags, push, strs};
use crate::handler_swap::{GPU, guest, sha256};
use crate::support::kube::ApiServer;
use crate::support::{Daemon, OciRegistry, RegistryConfig, TestRoot, wait_for};

/// Long enough for five daemons to start, pull and soak on a shared machine.
const ROLLOUT_DEADLINE: Duration = Duration::from_secs(180);

const NODES: usize = 5;

fn kubectl_ok(api: &ApiServer, args: &[&str], input: Option<&str>) {
    let out = match input {
        Some(text) => api.kubectl_input(args, text),
        None => api.kubectl(args),
    };
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Installs the two CRDs and the namespace, as an operator does.
fn install_crds(api: &ApiServer) {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/deploy");
    for file in ["handlerrollout-crd.yaml", "nodehandlerstatus-crd.yaml"] {
        kubectl_ok(
            api,
            &["apply", "-f", deploy.join(file).to_str().unwrap()],
            None,
        );
    }
    kubectl_ok(api, &["create", "namespace", "pluglet-system"], None);
    wait_for("the CRDs to be served", ROLLOUT_DEADLINE, || {
        api.kubectl(&["get", "handlerrollouts,nodehandlerstatuses", "-A"])
            .status
            .success()
            .then_some(())
    });
}

/// The fleet: one root and one daemon per node, registering its Node.
struct Fleet {
    roots: Vec<TestRoot>,
    daemons: Vec<Daemon>,
    names: Vec<String>,
}

fn start_fleet(api: &ApiServer, registry: &OciRegistry) -> Fleet {
    let mut fleet = Fleet {
        roots: Vec::new(),
        daemons: Vec::new(),
        names: Vec::new(),
    };
    for i in 0..NODES {
        let root = TestRoot::new();
        let name = format!("rollout-node-{i}");
        let mut args = flags(registry, &root.path());
        args.extend([
            "--kubeconfig".into(),
            api.kubeconfig().display().to_string(),
            "--node-name".into(),
            name.clone(),
            "--register-node".into(),
        ]);
        fleet
            .daemons
            .push(Daemon::start(&root.path(), &strs(&args)));
        fleet.roots.push(root);
        fleet.names.push(name);
    }
    fleet
}

/// The GPU slot's row of `ctl handlers`, if the slot is listed.
fn gpu_row(daemon: &Daemon) -> Option<Value> {
    daemon
        .ctl_json("handlers")
        .into_iter()
        .find(|h| h["resource"] == GPU)
}

fn rollout(api: &ApiServer, name: &str) -> Value {
    api.kubectl_json(&["get", "handlerrollout", name])
}

fn wait_phase(api: &ApiServer, name: &str, phase: &str, fleet: &Fleet) -> Value {
    let mut last = Value::Null;
    let found = wait_for_or(ROLLOUT_DEADLINE, || {
        last = rollout(api, name);
        (last["status"]["phase"] == phase).then(|| last.clone())
    });
    found.unwrap_or_else(|| {
        let logs: Vec<String> = fleet.daemons.iter().map(Daemon::log_text).collect();
        panic!(
            "rollout {name} never reached {phase}; last seen:\n{last:#}\nlogs:\n{}",
            logs.join("\n-----\n")
        )
    })
}

fn wait_for_or<T>(deadline: Duration, mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let start = std::time::Instant::now();
    loop {
        if let Some(v) = probe() {
            return Some(v);
        }
        if start.elapsed() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn rollout_object(name: &str, module: &str, soak: &str) -> Value {
    json!({
        "apiVersion": "pluglet.io/v1alpha1",
        "kind": "HandlerRollout",
        "metadata": {"name": name},
        "spec": {
            "slot": {"resource": GPU},
            "module": module,
            "limits": {"rollback_after": 1},
            "waves": [{"percent": 20}, {"percent": 60}, {"percent": 100}],
            "soak": {"duration": soak, "calls": 1},
        },
    })
}

fn node_report(api: &ApiServer, node: &str) -> Value {
    api.kubectl_json(&["get", "nodehandlerstatus", "-n", "pluglet-system", node])
}

#[test]
fn a_good_module_completes_wave_by_wave_on_every_node() {
    let api_root = TestRoot::new();
    let api = ApiServer::start(&api_root.path().join("kube"));
    install_crds(&api);
    let registry = OciRegistry::start(RegistryConfig {
        tls: true,
        auth: true,
    });
    let pusher = TestRoot::new();
    let reference = registry.reference("vendor/gpu-policy:v2");
    let digest = push(
        &flags(&registry, &pusher.path()),
        &reference,
        &guest("spread-policy"),
        None,
    );
    let pinned = format!(
        "{}@{digest}",
        reference.rsplit_once(':').map(|(repo, _)| repo).unwrap()
    );
    let fleet = start_fleet(&api, &registry);

    // A tag is refused by the schema.
    let tagged = rollout_object("tagged", &reference, "2s");
    let out = api.kubectl_input(&["create", "-f", "-"], &tagged.to_string());
    assert!(!out.status.success(), "a tag was accepted");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("spec.module"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    kubectl_ok(
        &api,
        &["create", "-f", "-"],
        Some(&rollout_object("gpu-v2", &pinned, "2s").to_string()),
    );
    let done = wait_phase(&api, "gpu-v2", "Complete", &fleet);
    let status = &done["status"];
    let waves = status["waves"].as_array().unwrap();
    let sizes: Vec<usize> = waves
        .iter()
        .map(|w| w["nodes"].as_array().unwrap().len())
        .collect();
    assert_eq!(sizes, [1, 2, 2], "{status:#}");
    assert_eq!(status["applied"], 5, "{status:#}");
    assert_eq!(status["rolledBackCount"], 0, "{status:#}");

    // Each wave opened only once every node of the one before had passed its soak.
    for pair in waves.windows(2) {
        let opened: k8s_openapi::jiff::Timestamp =
            pair[1]["openedAt"].as_str().unwrap().parse().unwrap();
        for node in pair[0]["nodes"].as_array().unwrap() {
            let report = node_report(&api, node.as_str().unwrap());
            let mine = &report["status"]["rollouts"][0];
            assert_eq!(mine["state"], "Healthy", "{report:#}");
            let healthy: k8s_openapi::jiff::Timestamp =
                mine["since"].as_str().unwrap().parse().unwrap();
            assert!(
                healthy <= opened,
                "{node} healthy at {healthy}, next wave at {opened}"
            );
        }
    }

    // Every node serves the pushed digest, from the rollout.
    let spread = sha256(&guest("spread-policy"));
    for daemon in &fleet.daemons {
        let row = gpu_row(daemon).expect("the gpu slot");
        assert_eq!(row["sha256"], spread.as_str(), "{row:#}");
        assert_eq!(row["digest"], digest.as_str(), "{row:#}");
    }

    let table = api.kubectl(&["get", "handlerrollouts"]);
    let table = String::from_utf8_lossy(&table.stdout).into_owned();
    assert!(
        table.contains("PHASE") && table.contains("ROLLED-BACK"),
        "{table}"
    );
    assert!(
        table.contains("gpu-v2") && table.contains("Complete"),
        "{table}"
    );

    // Deleted: every node returns the slot to its built-in.
    kubectl_ok(&api, &["delete", "handlerrollout", "gpu-v2"], None);
    for daemon in &fleet.daemons {
        wait_for(
            "the slot to return to the built-in",
            ROLLOUT_DEADLINE,
            || {
                gpu_row(daemon)
                    .is_none_or(|r| r["sha256"] != spread.as_str())
                    .then_some(())
            },
        );
    }
    drop(fleet.roots);
}
