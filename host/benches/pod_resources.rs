//! The pod-resources API against the real daemon, as a monitoring agent reads it: `List` and
//! `GetAllocatableResources` on a node holding many allocations, and what a client calling
//! `List` in a loop costs the node's allocations (A/B in one run).
//!
//! Run: `cargo bench -p pluglet --bench pod_resources` (prints p50, p99 and mean per row;
//! `PLUGLET_BENCH_PODS` sets the pods holding devices, default 1,000, each holding
//! `PLUGLET_BENCH_PER_POD` devices, default 10; `PLUGLET_BENCH_OPS` the calls and allocations
//! per row, default 200; `PLUGLET_BIN` runs another build's daemon).
//!
//! The release `pluglet run --root <root>` (built-in handlers, `RUST_LOG=warn`, the rate limit
//! raised out of the way), the in-process stub device plugin (`pluglet_device_manager::stub`):
//! one resource of pods × per-pod devices filled through the admin API (named pods), one of 64
//! devices for the allocation rows. Rows:
//! - `List` and `GetAllocatableResources` on one kept-open connection to the socket;
//! - floor: the admin API's bare round trip (`ListAllocations` of a resource-less filter is
//!   not there; the empty `ListResources` of a fresh connection is not either: the bare
//!   `GetAllocatableResources` of a node with no device is taken on a second daemon instead);
//! - allocate 1 of 64 + release, alternating in blocks of 10 between *quiet* and *with a
//!   client calling `List` in a loop* (its own thread, runtime and connection), so both halves
//!   meet the same machine.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pluglet_device_manager::stub::{Stub, devices};
use pluglet_proto::admin::v1 as pb;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_proto::podresources::v1 as pr;
use pluglet_proto::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;
use pluglet_proto::v1beta1;
use pluglet_uds::Channel;

fn pluglet() -> String {
    std::env::var("PLUGLET_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_pluglet").to_owned())
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let mean = samples.iter().sum::<Duration>() / samples.len() as u32;
    println!(
        "{name:<52} p50 {:>9}  p99 {:>9}  mean {:>9}  ({} calls)",
        ms(pct(&samples, 0.5)),
        ms(pct(&samples, 0.99)),
        ms(mean),
        samples.len()
    );
}

struct Daemon(Child, tempfile::TempDir);

impl Daemon {
    fn start() -> Daemon {
        let root = tempfile::Builder::new()
            .prefix("ppodres")
            .tempdir_in("/tmp")
            .expect("tempdir");
        let log = std::fs::File::create(root.path().join("pluglet.log")).expect("log file");
        let child = Command::new(pluglet())
            .args(["run", "--root"])
            .arg(root.path())
            .args([
                "--pod-resources-qps",
                "1000000",
                "--pod-resources-burst",
                "1000000",
            ])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn pluglet run");
        Daemon(child, root)
    }

    fn root(&self) -> &Path {
        self.1.path()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.0.wait();
    }
}

async fn admin(root: &Path) -> AdminClient<Channel> {
    let socket = root.join("pluglet.sock");
    let started = Instant::now();
    loop {
        if let Ok(channel) = pluglet_uds::connect(&socket, Duration::from_secs(1)).await {
            let mut client = AdminClient::new(channel);
            if client
                .list_allocations(pb::ListAllocationsRequest {})
                .await
                .is_ok()
            {
                return client;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the daemon did not answer; log:\n{}",
            std::fs::read_to_string(root.join("pluglet.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn lister(root: &Path) -> PodResourcesListerClient<Channel> {
    let channel = pluglet_uds::connect(
        &root.join("pod-resources").join("kubelet.sock"),
        Duration::from_secs(5),
    )
    .await
    .expect("dial the pod-resources socket");
    PodResourcesListerClient::new(channel)
}

/// Registers a stub plugin with `n` devices as `resource` and waits until they are allocatable.
async fn plugin(root: &Path, client: &mut AdminClient<Channel>, resource: &str, n: usize) -> Stub {
    let name = resource.rsplit('/').next().unwrap_or(resource);
    let stub = Stub::start(
        &root.join("device-plugins").join(format!("{name}.sock")),
        devices(n, 2),
        v1beta1::DevicePluginOptions::default(),
    );
    stub.register(&root.join("device-plugins").join("kubelet.sock"), resource)
        .await
        .expect("Register");
    let started = Instant::now();
    loop {
        let allocatable = client
            .list_resources(pb::ListResourcesRequest {})
            .await
            .expect("ListResources")
            .into_inner()
            .resources
            .iter()
            .find(|r| r.resource == resource)
            .map_or(0, |r| r.allocatable);
        if allocatable == n as i64 {
            return stub;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "{resource}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn allocate(client: &mut AdminClient<Channel>, pod: &str, resource: &str, count: u32) {
    let answer = client
        .allocate(pb::AllocateRequest {
            pod_uid: pod.into(),
            container: "ctr".into(),
            resource: resource.into(),
            count,
            pod_name: format!("name-{pod}"),
            pod_namespace: "bench".into(),
        })
        .await
        .expect("Allocate")
        .into_inner();
    assert_eq!(answer.device_ids.len(), count as usize);
}

#[tokio::main]
async fn main() {
    let pods = env_or("PLUGLET_BENCH_PODS", 1000);
    let per_pod = env_or("PLUGLET_BENCH_PER_POD", 10);
    let ops = env_or("PLUGLET_BENCH_OPS", 200);

    // The floor: the same call on a node with nothing to list.
    let empty = Daemon::start();
    admin(empty.root()).await;
    let mut bare = lister(empty.root()).await;
    let mut floor = Vec::with_capacity(ops);
    for _ in 0..ops {
        let started = Instant::now();
        bare.list(pr::ListPodResourcesRequest {})
            .await
            .expect("List");
        floor.push(started.elapsed());
    }
    drop(empty);

    let daemon = Daemon::start();
    let root = daemon.root();
    let mut client = admin(root).await;
    let big = plugin(root, &mut client, "bench.example.com/big", pods * per_pod).await;
    let small = plugin(root, &mut client, "bench.example.com/small", 64).await;
    for i in 0..pods {
        allocate(
            &mut client,
            &format!("held-{i}"),
            "bench.example.com/big",
            per_pod as u32,
        )
        .await;
    }
    let mut list = lister(root).await;
    let held = list
        .list(pr::ListPodResourcesRequest {})
        .await
        .expect("List")
        .into_inner();
    let listed: usize = held
        .pod_resources
        .iter()
        .flat_map(|p| &p.containers)
        .map(|c| c.devices.len())
        .sum();
    assert_eq!(held.pod_resources.len(), pods);
    assert_eq!(listed, pods * per_pod);

    println!(
        "pod-resources API, {pods} pods holding {} devices, {} devices registered",
        pods * per_pod,
        pods * per_pod + 64
    );
    report("floor: List on a node holding nothing", floor);
    let mut samples = Vec::with_capacity(ops);
    for _ in 0..ops {
        let started = Instant::now();
        list.list(pr::ListPodResourcesRequest {})
            .await
            .expect("List");
        samples.push(started.elapsed());
    }
    report(
        &format!("List, {pods} pods / {} devices", pods * per_pod),
        samples,
    );
    let mut samples = Vec::with_capacity(ops);
    for _ in 0..ops {
        let started = Instant::now();
        list.get_allocatable_resources(pr::AllocatableResourcesRequest {})
            .await
            .expect("GetAllocatableResources");
        samples.push(started.elapsed());
    }
    report(
        &format!("GetAllocatableResources, {} devices", pods * per_pod + 64),
        samples,
    );

    // Allocations with and without a client calling List in a loop.
    let looping = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let agent = {
        let (looping, stop, calls) = (looping.clone(), stop.clone(), calls.clone());
        let socket_root = root.to_owned();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let mut list = lister(&socket_root).await;
                while !stop.load(Ordering::Relaxed) {
                    if looping.load(Ordering::Relaxed) {
                        list.list(pr::ListPodResourcesRequest {})
                            .await
                            .expect("List");
                        calls.fetch_add(1, Ordering::Relaxed);
                    } else {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            });
        })
    };
    let (mut quiet, mut loaded) = (Vec::new(), Vec::new());
    let mut in_loop = Duration::ZERO;
    for i in 0..ops * 2 {
        let with_list = (i / 10) % 2 == 1;
        looping.store(with_list, Ordering::Relaxed);
        let pod = format!("ab-{i}");
        let started = Instant::now();
        allocate(&mut client, &pod, "bench.example.com/small", 1).await;
        let took = started.elapsed();
        if with_list {
            loaded.push(took);
            in_loop += took;
        } else {
            quiet.push(took);
        }
        client
            .release(pb::ReleaseRequest {
                pod_uid: pod,
                container: String::new(),
            })
            .await
            .expect("Release");
    }
    stop.store(true, Ordering::Relaxed);
    agent.join().expect("the List loop");
    report("allocate 1 of 64, quiet", quiet);
    report("allocate 1 of 64, a client calling List in a loop", loaded);
    println!(
        "  List calls answered meanwhile: {} (over {} of allocations)",
        calls.load(Ordering::Relaxed),
        ms(in_loop)
    );
    drop((big, small));
}
