//! Fleet rollouts of a handler: five daemons (five roots, five node names) on one real
//! kube-apiserver, the module in a real registry. A `HandlerRollout` opens its waves one after
//! the other as the nodes of each pass their soak, every node ends serving the new digest and
//! the rollout `Complete`; a module that traps on allocation rolls back on the first wave's
//! node, the rollout halts and ends `RolledBack`, later waves never apply it, and every node
//! serves what it served before.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::device_support::{DevicePluginProcess, FLOWS, wait_allocatable};
use crate::handler_registry::{flags, push, strs};
use crate::handler_swap::{GPU, SPREAD, allocate_ok, allocate_two, guest, handlers_toml, sha256};
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

/// The fleet: one root, one daemon (registering its Node, serving metrics) per node.
struct Fleet {
    roots: Vec<TestRoot>,
    daemons: Vec<Daemon>,
    names: Vec<String>,
    metrics: Vec<String>,
    args: Vec<Vec<String>>,
}

/// Starts the fleet; `prepare` readies each root first (its handlers.toml).
fn start_fleet(api: &ApiServer, registry: &OciRegistry, prepare: impl Fn(&TestRoot)) -> Fleet {
    start_fleet_with(api, registry, prepare, &[])
}

/// [`start_fleet`], each daemon given `extra` options too.
fn start_fleet_with(
    api: &ApiServer,
    registry: &OciRegistry,
    prepare: impl Fn(&TestRoot),
    extra: &[&str],
) -> Fleet {
    let mut fleet = Fleet {
        roots: Vec::new(),
        daemons: Vec::new(),
        names: Vec::new(),
        metrics: Vec::new(),
        args: Vec::new(),
    };
    for i in 0..NODES {
        let root = TestRoot::new();
        prepare(&root);
        let name = format!("rollout-node-{i}");
        let metrics = crate::ops::free_addr();
        let mut args = flags(registry, &root.path());
        args.extend([
            "--kubeconfig".into(),
            api.kubeconfig().display().to_string(),
            "--node-name".into(),
            name.clone(),
            "--register-node".into(),
            "--metrics-addr".into(),
            metrics.clone(),
        ]);
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        fleet
            .daemons
            .push(Daemon::start(&root.path(), &strs(&args)));
        fleet.args.push(args);
        fleet.roots.push(root);
        fleet.names.push(name);
        fleet.metrics.push(metrics);
    }
    fleet
}

impl Fleet {
    fn daemon(&self, node: &str) -> &Daemon {
        let i = self
            .names
            .iter()
            .position(|n| n == node)
            .expect("a node of the fleet");
        &self.daemons[i]
    }

    /// The sum over the fleet of the metric samples whose name and labels start with `key`.
    fn metric(&self, key: &str) -> f64 {
        self.metrics
            .iter()
            .flat_map(|addr| crate::ops::scrape(addr))
            .filter(|(k, _)| k.starts_with(key))
            .map(|(_, v)| v)
            .sum()
    }
}

/// Pushes guest `name` as `vendor/gpu-policy:TAG` and returns its reference pinned by digest,
/// and the digest.
fn push_pinned(registry: &OciRegistry, dir: &Path, name: &str, tag: &str) -> (String, String) {
    let reference = registry.reference(&format!("vendor/gpu-policy:{tag}"));
    let digest = push(&flags(registry, dir), &reference, &guest(name), None);
    let repo = reference.rsplit_once(':').map(|(repo, _)| repo).unwrap();
    (format!("{repo}@{digest}"), digest)
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

/// Successful requests the API server answered, by `(verb, resource, subresource)`, from its
/// `apiserver_request_total`.
fn requests(api: &ApiServer) -> std::collections::BTreeMap<(String, String, String), f64> {
    let mut out = std::collections::BTreeMap::new();
    for line in api.metrics().lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
                .unwrap_or_default()
        };
        if !label("code").starts_with('2') {
            continue;
        }
        let key = (label("verb"), label("resource"), label("subresource"));
        *out.entry(key).or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
    }
    out
}

/// Requests of `verbs` on `resource` (and `subresource`) between two [`requests`] readings.
fn delta(
    before: &std::collections::BTreeMap<(String, String, String), f64>,
    after: &std::collections::BTreeMap<(String, String, String), f64>,
    verbs: &[&str],
    resource: &str,
    subresource: &str,
) -> f64 {
    after
        .iter()
        .filter(|((v, r, sub), _)| {
            verbs.contains(&v.as_str()) && r == resource && sub == subresource
        })
        .map(|(k, n)| n - before.get(k).copied().unwrap_or(0.0))
        .sum()
}

const WRITES: &[&str] = &["POST", "PATCH", "PUT"];

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
    let (pinned, digest) = push_pinned(&registry, &pusher.path(), "spread-policy", "v2");
    let fleet = start_fleet(&api, &registry, |_| {});

    // A tag is refused by the schema.
    let tagged = rollout_object("tagged", &registry.reference("vendor/gpu-policy:v2"), "2s");
    let out = api.kubectl_input(&["create", "-f", "-"], &tagged.to_string());
    assert!(!out.status.success(), "a tag was accepted");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("spec.module"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let before = requests(&api);
    kubectl_ok(
        &api,
        &["create", "-f", "-"],
        Some(&rollout_object("gpu-v2", &pinned, "2s").to_string()),
    );
    let done = wait_phase(&api, "gpu-v2", "Complete", &fleet);
    let after = requests(&api);
    let status = &done["status"];

    // What the rollout cost: the nodes' reports and the coordinator's status writes.
    let reports = delta(&before, &after, WRITES, "nodehandlerstatuses", "");
    let statuses = delta(&before, &after, WRITES, "handlerrollouts", "status");
    eprintln!(
        "writes for {NODES} nodes: {reports} NodeHandlerStatus, {statuses} HandlerRollout status"
    );
    assert!(reports <= 3.0 * NODES as f64, "{reports} report writes");
    assert!(
        statuses <= 3.0 * NODES as f64 + 3.0,
        "{statuses} status writes"
    );
    let soak = 2.0;
    let opened: Vec<k8s_openapi::jiff::Timestamp> = status["waves"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["openedAt"].as_str().unwrap().parse().unwrap())
        .collect();
    for pair in opened.windows(2) {
        let took = pair[1].duration_since(pair[0]).as_secs_f64();
        eprintln!("a wave took {:.2}s beyond its {soak}s soak", took - soak);
    }
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
        assert_eq!(row["rollout"], "rollout/gpu-v2", "{row:#}");
        let part = &daemon.ctl_object(&["status"], Some("Status"))["rollouts"][0];
        assert_eq!(
            (&part["name"], &part["state"]),
            (&json!("gpu-v2"), &json!("Healthy")),
            "{part:#}"
        );
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

    // At rest: no request about rollouts but the watches (and the Lease's renewals).
    let rest = requests(&api);
    std::thread::sleep(Duration::from_secs(12));
    let later = requests(&api);
    for resource in ["handlerrollouts", "nodehandlerstatuses", "nodes"] {
        for sub in ["", "status"] {
            let busy = delta(
                &rest,
                &later,
                &["GET", "LIST", "POST", "PATCH", "PUT"],
                resource,
                sub,
            );
            assert_eq!(busy, 0.0, "{resource}/{sub} requests at rest");
        }
    }
    // The Lease: the holder's renewals (one every 10 s) and no daemon reading it but its watch.
    let lease_reads = delta(&rest, &later, &["GET", "LIST"], "leases", "");
    assert_eq!(lease_reads, 0.0, "Lease reads at rest");
    let renewals = delta(&rest, &later, &["PUT", "POST", "PATCH"], "leases", "");
    assert!(renewals <= 2.0, "{renewals} Lease writes in 12 s at rest");

    // One coordinator in the fleet, which opened the three waves; every node healthy.
    assert_eq!(fleet.metric("pluglet_rollout_coordinator"), 1.0);
    assert_eq!(fleet.metric("pluglet_rollout_waves_opened_total"), 3.0);
    assert_eq!(
        fleet.metric("pluglet_rollout_node_state{rollout=\"gpu-v2\",state=\"Healthy\"}"),
        5.0
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
    // ... and says so in its own report.
    for node in &fleet.names {
        let entry = wait_for(
            "the node to report the rollout reverted",
            ROLLOUT_DEADLINE,
            || {
                let report = node_report(&api, node);
                let entry = report["status"]["rollouts"]
                    .as_array()?
                    .iter()
                    .find(|r| r["name"] == "gpu-v2")?
                    .clone();
                (entry["state"] == "Reverted").then_some(entry)
            },
        );
        assert!(
            entry["reason"]
                .as_str()
                .unwrap_or_default()
                .contains("deleted"),
            "{entry:#}"
        );
    }
    drop(fleet.roots);
}

#[test]
fn a_trapping_module_halts_on_the_first_wave_and_every_node_serves_what_it_had() {
    let api_root = TestRoot::new();
    let api = ApiServer::start(&api_root.path().join("kube"));
    install_crds(&api);
    let registry = OciRegistry::start(RegistryConfig {
        tls: true,
        auth: true,
    });
    let pusher = TestRoot::new();
    let (pinned, _) = push_pinned(&registry, &pusher.path(), "misbehave", "trap");
    // Every node serves the spread policy from its own handlers.toml.
    let fleet = start_fleet(&api, &registry, |root| {
        handlers_toml(
            root,
            &[("spread-policy", "policy.wasm")],
            &format!("[resources.\"{GPU}\"]\nmodule = \"policy.wasm\"\n"),
        );
    });
    let plugins: Vec<DevicePluginProcess> = fleet
        .roots
        .iter()
        .map(|root| {
            DevicePluginProcess::start(root, FLOWS[0], GPU, &["--preferred", "--reregister"])
        })
        .collect();
    for daemon in &fleet.daemons {
        wait_allocatable(daemon, GPU, 4);
        assert_eq!(allocate_ok(daemon, "before"), SPREAD);
    }
    let spread = sha256(&guest("spread-policy"));
    let trap = sha256(&guest("misbehave"));

    // The module traps on allocation; a long soak, so only a failure ends the first wave. The
    // first wave has two nodes: one traps, the other took the module and must give it back.
    let mut object = rollout_object("gpu-trap", &pinned, "10m");
    object["spec"]["settings"] = json!({"allocate": "panic"});
    object["spec"]["waves"] = json!([{"percent": 40}, {"percent": 100}]);
    kubectl_ok(&api, &["create", "-f", "-"], Some(&object.to_string()));
    let wave: Vec<String> = wait_for_or(ROLLOUT_DEADLINE, || {
        let r = rollout(&api, "gpu-trap");
        r["status"]["waves"][0]["nodes"].as_array().map(|nodes| {
            nodes
                .iter()
                .filter_map(|n| n.as_str().map(str::to_owned))
                .collect()
        })
    })
    .expect("the first wave opens");
    assert_eq!(wave.len(), 2, "{wave:?}");
    let (opened, companion) = (wave[0].clone(), wave[1].clone());
    for node in &wave {
        wait_for(
            "the first wave's nodes to serve the module",
            ROLLOUT_DEADLINE,
            || gpu_row(fleet.daemon(node)).filter(|r| r["sha256"] == trap.as_str()),
        );
    }
    let first = fleet.daemon(&opened);
    let failed = allocate_two(first, "trapped").expect_err("the module traps");
    assert!(failed.contains("trap"), "{failed}");

    let done = wait_phase(&api, "gpu-trap", "RolledBack", &fleet);
    let condition_at = |kind: &str| -> k8s_openapi::jiff::Timestamp {
        done["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == kind)
            .and_then(|c| c["lastTransitionTime"].as_str())
            .unwrap_or_else(|| panic!("no {kind} condition: {done:#}"))
            .parse()
            .unwrap()
    };
    let halt_to_rolled_back =
        condition_at("RolledBack").duration_since(condition_at("FailureBudgetSpent"));
    eprintln!(
        "halt to every node rolled back: {:.2}s",
        halt_to_rolled_back.as_secs_f64()
    );
    let status = &done["status"];
    assert_eq!(status["waves"].as_array().unwrap().len(), 1, "{status:#}");
    assert_eq!(status["rolledBackCount"], 1, "{status:#}");
    assert_eq!(
        status["rolledBack"][0]["node"],
        opened.as_str(),
        "{status:#}"
    );
    assert!(
        status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["type"] == "FailureBudgetSpent"),
        "{status:#}"
    );
    let report = node_report(&api, &opened);
    assert_eq!(
        report["status"]["rollouts"][0]["state"], "RolledBack",
        "{report:#}"
    );
    // The other node of the wave gave the module back when the rollout halted.
    let report = node_report(&api, &companion);
    let entry = &report["status"]["rollouts"][0];
    assert_eq!(entry["state"], "Reverted", "{report:#}");
    assert!(
        entry["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("halted"),
        "{report:#}"
    );

    // The nodes of later waves never applied it (nothing to report), and every node serves
    // the spread policy again.
    for (name, daemon) in fleet.names.iter().zip(&fleet.daemons) {
        if !wave.contains(name) {
            let out = api.kubectl(&["get", "nodehandlerstatus", "-n", "pluglet-system", name]);
            assert!(
                !out.status.success(),
                "{name} reported: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        wait_for(
            "the node to serve the spread policy",
            ROLLOUT_DEADLINE,
            || gpu_row(daemon).filter(|r| r["sha256"] == spread.as_str()),
        );
        assert_eq!(allocate_ok(daemon, "after"), SPREAD);
    }
    drop(plugins);
}

/// The node holding the coordinator's Lease.
fn lease_holder(api: &ApiServer) -> Option<String> {
    let out = api.kubectl(&[
        "get",
        "lease",
        "-n",
        "pluglet-system",
        "pluglet-rollout-coordinator",
        "-o",
        "jsonpath={.spec.holderIdentity}",
    ]);
    let holder = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (out.status.success() && !holder.is_empty()).then_some(holder)
}

#[test]
fn the_coordinator_killed_and_the_api_server_stopped_mid_rollout_and_it_still_completes() {
    let api_root = TestRoot::new();
    let mut api = ApiServer::start(&api_root.path().join("kube"));
    install_crds(&api);
    let registry = OciRegistry::start(RegistryConfig {
        tls: true,
        auth: true,
    });
    let pusher = TestRoot::new();
    let (pinned, _) = push_pinned(&registry, &pusher.path(), "spread-policy", "v2");
    let mut fleet = start_fleet_with(
        &api,
        &registry,
        |_| {},
        &["--coordinator-lease-duration", "3s"],
    );
    let spread = sha256(&guest("spread-policy"));
    kubectl_ok(
        &api,
        &["create", "-f", "-"],
        Some(&rollout_object("gpu-v2", &pinned, "4s").to_string()),
    );
    wait_for_or(ROLLOUT_DEADLINE, || {
        rollout(&api, "gpu-v2")["status"]["waves"][0]["nodes"][0]
            .as_str()
            .map(str::to_owned)
    })
    .expect("the first wave opens");

    // SIGKILL the coordinator: another daemon takes the Lease within its duration.
    let holder = lease_holder(&api).expect("a coordinator");
    let i = fleet.names.iter().position(|n| *n == holder).unwrap();
    fleet.daemons.remove(i).kill();
    let next = wait_for("another daemon to take the Lease", ROLLOUT_DEADLINE, || {
        lease_holder(&api).filter(|h| *h != holder)
    });
    assert_ne!(next, holder);
    // The killed node comes back (what it took from the rollout survives its restart).
    let restarted = Daemon::start(&fleet.roots[i].path(), &strs(&fleet.args[i]));
    fleet.daemons.insert(i, restarted);

    // The API server goes away once the second wave opened: the nodes keep serving.
    let second = wait_for_or(ROLLOUT_DEADLINE, || {
        rollout(&api, "gpu-v2")["status"]["waves"][1]["nodes"]
            .as_array()
            .cloned()
    })
    .expect("the second wave opens");
    api.stop();
    for node in &second {
        let daemon = fleet.daemon(node.as_str().unwrap());
        wait_for(
            "a node of the second wave to serve the module",
            ROLLOUT_DEADLINE,
            || gpu_row(daemon).filter(|r| r["sha256"] == spread.as_str()),
        );
    }
    // A node of the second wave restarted while the API server is away keeps what it took.
    let node = second[0].as_str().unwrap();
    let j = fleet.names.iter().position(|n| n == node).unwrap();
    assert!(fleet.daemons.remove(j).terminate().success());
    fleet.daemons.insert(
        j,
        Daemon::start(&fleet.roots[j].path(), &strs(&fleet.args[j])),
    );
    let row = gpu_row(&fleet.daemons[j]).expect("the gpu slot after the restart");
    assert_eq!(row["sha256"], spread.as_str(), "{row:#}");
    assert_eq!(row["rollout"], "rollout/gpu-v2", "{row:#}");
    api.restart();

    let done = wait_phase(&api, "gpu-v2", "Complete", &fleet);
    let status = &done["status"];
    assert_eq!(status["applied"], 5, "{status:#}");
    assert_eq!(status["rolledBackCount"], 0, "{status:#}");
    let members: Vec<&Value> = status["waves"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w["nodes"].as_array().unwrap())
        .collect();
    assert_eq!(members.len(), 5, "each node in one wave: {status:#}");
    for daemon in &fleet.daemons {
        let row = gpu_row(daemon).expect("the gpu slot");
        assert_eq!(row["sha256"], spread.as_str(), "{row:#}");
    }
}

#[test]
fn a_paused_rollout_opens_no_wave_and_a_newer_one_supersedes_it() {
    let api_root = TestRoot::new();
    let api = ApiServer::start(&api_root.path().join("kube"));
    install_crds(&api);
    let registry = OciRegistry::start(RegistryConfig {
        tls: true,
        auth: true,
    });
    let pusher = TestRoot::new();
    let (spread_ref, _) = push_pinned(&registry, &pusher.path(), "spread-policy", "v2");
    let (first_fit_ref, _) = push_pinned(&registry, &pusher.path(), "misbehave", "v3");
    let fleet = start_fleet(&api, &registry, |_| {});

    let mut paused = rollout_object("gpu-a", &spread_ref, "2s");
    paused["spec"]["paused"] = json!(true);
    kubectl_ok(&api, &["create", "-f", "-"], Some(&paused.to_string()));
    let seen = wait_phase(&api, "gpu-a", "Paused", &fleet);
    assert!(
        seen["status"]["waves"].as_array().is_none_or(Vec::is_empty),
        "{seen:#}"
    );
    kubectl_ok(
        &api,
        &[
            "patch",
            "handlerrollout",
            "gpu-a",
            "--type=merge",
            "-p",
            r#"{"spec":{"paused":false}}"#,
        ],
        None,
    );
    wait_phase(&api, "gpu-a", "Complete", &fleet);

    // A newer rollout of the same slot: the older one ends Superseded, every node serves the
    // newer module.
    kubectl_ok(
        &api,
        &["create", "-f", "-"],
        Some(&rollout_object("gpu-b", &first_fit_ref, "2s").to_string()),
    );
    wait_phase(&api, "gpu-a", "Superseded", &fleet);
    wait_phase(&api, "gpu-b", "Complete", &fleet);
    let first_fit = sha256(&guest("misbehave"));
    for daemon in &fleet.daemons {
        wait_for("the newer rollout's module", ROLLOUT_DEADLINE, || {
            gpu_row(daemon)
                .filter(|r| r["sha256"] == first_fit.as_str() && r["rollout"] == "rollout/gpu-b")
        });
    }
}

#[test]
fn without_the_crds_the_daemon_says_so_once_publishes_and_joins_once_they_are_installed() {
    let api_root = TestRoot::new();
    let api = ApiServer::start(&api_root.path().join("kube"));
    let registry = OciRegistry::start(RegistryConfig {
        tls: true,
        auth: true,
    });
    let pusher = TestRoot::new();
    let (pinned, _) = push_pinned(&registry, &pusher.path(), "spread-policy", "v2");
    let fleet = start_fleet(&api, &registry, |_| {});
    let daemon = &fleet.daemons[0];
    let said = "the HandlerRollout CRD is not installed";
    if wait_for_or(ROLLOUT_DEADLINE, || {
        daemon.log_text().contains(said).then_some(())
    })
    .is_none()
    {
        panic!("the missing CRD was not reported:\n{}", daemon.log_text());
    }
    // Publishing goes on: the Node is registered.
    wait_for("the Node to be registered", ROLLOUT_DEADLINE, || {
        api.kubectl(&["get", "node", &fleet.names[0]])
            .status
            .success()
            .then_some(())
    });

    install_crds(&api);
    kubectl_ok(
        &api,
        &["create", "-f", "-"],
        Some(&rollout_object("gpu-v2", &pinned, "1s").to_string()),
    );
    wait_phase(&api, "gpu-v2", "Complete", &fleet);
    assert_eq!(daemon.log_text().matches(said).count(), 1, "said once");
}
