//! Publishing to a Kubernetes API server, measured against a real one: kube-apiserver 1.20 with
//! etcd on loopback, as the end-to-end tests run them (`pluglet_test_support::e2e::kube`, whose
//! harness this bench shares; `scripts/kube-apiserver.sh` builds the API server), the release `pluglet`
//! binary and the example device plugin.
//!
//! ```sh
//! cargo build --release --workspace --bins
//! PLUGLET_KUBE_APISERVER=$(bash scripts/kube-apiserver.sh | tail -1) \
//!     cargo bench -p pluglet --bench fleet
//! ```
//!
//! What it prints:
//! - **health change → Node allocatable**: SIGUSR1 makes the plugin flip its 8 devices' health;
//!   from just before the signal until a watch on the Node (this process, `kube`) sees the new
//!   allocatable. Floor, same run, alternate flips: until the daemon's admin API shows it. Flips
//!   are 400 ms apart, so each is the first change after a quiet spell (rounds are at least
//!   250 ms apart).
//! - **writes under a flapping plugin**: a second plugin flips its devices' health 1,000 times a
//!   second for `PLUGLET_BENCH_FLAP_SECONDS` (10): writes and rounds per second from the
//!   daemon's status, and the API server's own count of Node writes.
//! - **a fleet at rest**: `PLUGLET_BENCH_FLEET` (5) more daemons, each with a plugin, all synced;
//!   the API server's requests on nodes and csinodes (`apiserver_request_total`) over
//!   `PLUGLET_BENCH_REST_SECONDS` (30): zero when nothing changes.

#![allow(missing_docs)]

use std::sync::mpsc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, WatchEvent, WatchParams};
use nix::sys::signal::Signal;
use pluglet_proto::admin::v1 as admin;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_test_support::e2e::devices::{DevicePluginProcess, Flow};
use pluglet_test_support::e2e::kube::ApiServer;
use pluglet_test_support::e2e::{Daemon, TestRoot, bin, wait_for};
use serde_json::Value;
use tokio_stream::StreamExt as _;

const RESOURCE: &str = "example.com/bench";
const FLAP: &str = "example.com/flap";
const DEADLINE: Duration = Duration::from_secs(60);

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // The example plugin must be built beside the release binary.
    let _ = bin("example-device-plugin");
    let samples = env_number("PLUGLET_BENCH_SAMPLES", 40) as usize;
    let flap_seconds = env_number("PLUGLET_BENCH_FLAP_SECONDS", 10);
    let fleet = env_number("PLUGLET_BENCH_FLEET", 5) as usize;
    let rest_seconds = env_number("PLUGLET_BENCH_REST_SECONDS", 30);

    let root = TestRoot::new();
    let api = ApiServer::start(&root.path().join("kube"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let daemon = start(&root, &api, "bench-0");
    let plugin = DevicePluginProcess::start(&root, Flow::Classic, RESOURCE, &["--devices", "8"]);
    wait_allocatable(&api, "bench-0", RESOURCE, "8");

    println!("== health change → Node allocatable ({samples} flips each)");
    let (api_times, floor_times) = rt.block_on(latency(&root, &api, &daemon, &plugin, samples));
    report("health flip → Node allocatable (watch)", &api_times);
    report("floor: health flip → admin API shows it", &floor_times);

    println!("== a plugin flapping 1,000 times a second for {flap_seconds} s");
    let before = publishing(&daemon);
    let writes_before = node_writes(&api);
    let flapper = DevicePluginProcess::start(
        &root,
        Flow::Classic,
        FLAP,
        &["--devices", "8", "--flap-per-second", "1000"],
    );
    let started = Instant::now();
    let window = Duration::from_secs(flap_seconds);
    std::thread::sleep(window);
    drop(flapper);
    let elapsed = started.elapsed().as_secs_f64();
    let after = publishing(&daemon);
    let writes_after = node_writes(&api);
    let per_second = |key: &str| {
        (after[key].as_u64().unwrap_or(0) - before[key].as_u64().unwrap_or(0)) as f64 / elapsed
    };
    println!(
        "daemon: {:.1} writes/s, {:.1} rounds/s; API server: {:.1} node writes/s",
        per_second("writes"),
        per_second("rounds"),
        (writes_after - writes_before) as f64 / elapsed
    );

    println!("== a fleet of {} daemons at rest", fleet + 1);
    let mut daemons = Vec::new();
    for i in 1..=fleet {
        let node_root = TestRoot::new();
        let name = format!("bench-{i}");
        let d = start(&node_root, &api, &name);
        let p =
            DevicePluginProcess::start(&node_root, Flow::Classic, RESOURCE, &["--devices", "4"]);
        wait_allocatable(&api, &name, RESOURCE, "4");
        daemons.push((node_root, d, p));
    }
    // The flapping plugin's resource leaves bench-0 only after its grace period and linger:
    // wait for it, so "at rest" means nothing pending anywhere.
    wait_for("bench-0 without the flapping resource", DEADLINE, || {
        let n = api.kubectl_json(&["get", "node", "bench-0"]);
        n["status"]["capacity"][FLAP].is_null().then_some(())
    });
    for d in std::iter::once(&daemon).chain(daemons.iter().map(|(_, d, _)| d)) {
        wait_for("the daemon synced", DEADLINE, || {
            (publishing(d)["state"] == "synced").then_some(())
        });
    }
    let requests_before = requests(&api);
    std::thread::sleep(Duration::from_secs(rest_seconds));
    let requests_after = requests(&api);
    println!(
        "API server requests on nodes and csinodes in {rest_seconds} s at rest, {} daemons: {}",
        fleet + 1,
        requests_after - requests_before
    );
    drop(plugin);
}

fn start(root: &TestRoot, api: &ApiServer, node: &str) -> Daemon {
    let kubeconfig = api.kubeconfig().display().to_string();
    Daemon::start(
        &root.path(),
        &[
            "--kubeconfig",
            &kubeconfig,
            "--node-name",
            node,
            "--register-node",
            "--device-grace-period",
            "1s",
            "--removed-resource-linger",
            "1s",
        ],
    )
}

fn wait_allocatable(api: &ApiServer, node: &str, resource: &str, value: &str) {
    wait_for(&format!("{node} {resource} = {value}"), DEADLINE, || {
        let out = api.kubectl(&["get", "node", node, "-o", "json"]);
        let n: Value = serde_json::from_slice(&out.stdout).ok()?;
        (n["status"]["allocatable"][resource] == value).then_some(())
    });
}

fn publishing(daemon: &Daemon) -> Value {
    daemon.ctl_object(&["status"], Some("Status"))["publishing"].clone()
}

/// `apiserver_request_total` summed over the lines `keep` accepts.
fn request_total(api: &ApiServer, keep: impl Fn(&str) -> bool) -> u64 {
    api.metrics()
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{") && keep(l))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Requests on nodes and csinodes, any verb.
fn requests(api: &ApiServer) -> u64 {
    request_total(api, |l| {
        l.contains("resource=\"nodes\"") || l.contains("resource=\"csinodes\"")
    })
}

/// Writes to Node objects.
fn node_writes(api: &ApiServer) -> u64 {
    request_total(api, |l| {
        l.contains("resource=\"nodes\"")
            && ["PATCH", "PUT", "POST"]
                .iter()
                .any(|v| l.contains(&format!("verb=\"{v}\"")))
    })
}

/// Alternate flips: even ones timed to the Node watch, odd ones to the admin API.
async fn latency(
    root: &TestRoot,
    api: &ApiServer,
    daemon: &Daemon,
    plugin: &DevicePluginProcess,
    samples: usize,
) -> (Vec<Duration>, Vec<Duration>) {
    let _ = daemon;
    let kubeconfig = kube::config::Kubeconfig::read_from(api.kubeconfig()).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let nodes: Api<Node> = Api::all(client);
    let (tx, rx) = mpsc::channel::<(Instant, String)>();
    let current = nodes.get("bench-0").await.unwrap();
    let rv = current.metadata.resource_version.clone().unwrap();
    let params = WatchParams::default()
        .fields("metadata.name=bench-0")
        .timeout(290);
    let mut stream = Box::pin(nodes.watch(&params, &rv).await.unwrap());
    tokio::spawn(async move {
        while let Some(event) = stream.next().await {
            if let Ok(WatchEvent::Modified(node)) = event {
                let value = node
                    .status
                    .and_then(|s| s.allocatable)
                    .and_then(|a| a.get(RESOURCE).map(|q| q.0.clone()))
                    .unwrap_or_default();
                let _ = tx.send((Instant::now(), value));
            }
        }
    });
    let channel = pluglet_uds::connect(&root.admin_socket(), Duration::from_secs(5))
        .await
        .unwrap();
    let mut admin = AdminClient::new(channel);
    let mut healthy = true;
    let (mut watched, mut floor) = (Vec::new(), Vec::new());
    for i in 0..samples * 2 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        while rx.try_recv().is_ok() {}
        healthy = !healthy;
        let want = if healthy { "8" } else { "0" };
        let t0 = Instant::now();
        plugin.signal(Signal::SIGUSR1);
        if i % 2 == 1 {
            loop {
                let r = admin
                    .list_resources(admin::ListResourcesRequest {})
                    .await
                    .unwrap()
                    .into_inner();
                let shown = r
                    .resources
                    .iter()
                    .find(|x| x.resource == RESOURCE)
                    .map(|x| x.allocatable.to_string());
                if shown.as_deref() == Some(want) {
                    floor.push(t0.elapsed());
                    break;
                }
            }
        }
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (at, value) = tokio::task::block_in_place(|| rx.recv_timeout(left))
                .expect("the Node's allocatable changed");
            if value == want {
                if i % 2 == 0 {
                    watched.push(at.duration_since(t0));
                }
                break;
            }
        }
    }
    (watched, floor)
}

fn report(what: &str, times: &[Duration]) {
    let mut ms: Vec<f64> = times.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() as f64 - 1.0) * q).round() as usize];
    println!(
        "{what}: p50 {:.2} ms, p99 {:.2} ms, min {:.2} ms ({} samples)",
        at(0.5),
        at(0.99),
        ms[0],
        ms.len()
    );
}
