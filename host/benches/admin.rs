//! Admin API round trips against the real daemon: the hot paths as a client of `pluglet.sock`
//! sees them, with the floors under them measured alongside.
//!
//! Run: `cargo bench -p pluglet --bench admin` (prints p50, p99 and mean per row;
//! `PLUGLET_BENCH_CALLS` sets the bare round trips, default 1,000, and `PLUGLET_BENCH_OPS` the
//! allocations per row, default 200; `PLUGLET_BIN` runs another build's daemon).
//!
//! The release `pluglet run --root <root>` (built-in handlers, `RUST_LOG=info`, log to a file)
//! and one client connection kept open for every call (`pluglet_uds::connect`, as `pluglet ctl`
//! connects). Rows:
//! - bare round trip: `ListAllocations` on a node holding nothing;
//! - allocate k of n: `Allocate` of one container through the built-in policy and the
//!   in-process stub device plugin (`pluglet_test_support::stub`), answered once durable;
//!   then `Release` of its pod, timed on its own. *back to back*: the release is sent as soon as
//!   the allocation is answered (the checkpoint write the allocation asked for still to come);
//!   *settled*: 30 ms later, once allocations have been quiet long enough for that write to be
//!   done;
//! - floors: the stub's Allocate round trip over the same kind of connection, and one
//!   in-place 4 KiB write with `fdatasync` in the state directory (what a journal record costs);
//! - the pod-resources API as a monitoring agent reads it (`pod-resources/kubelet.sock`, its
//!   rate limit raised out of the way, one kept-open connection): `List` on the node holding
//!   nothing (the floor), then with `PLUGLET_BENCH_PODS` named pods (default 1,000) holding
//!   `PLUGLET_BENCH_PER_POD` devices each (default 10), `GetAllocatableResources` of every
//!   device, and allocate 1 of 64 + release alternating in blocks of 10 between *quiet* and
//!   *with a client calling `List` in a loop* (its own thread, runtime and connection), so both
//!   halves meet the same machine.

use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pluglet_proto::admin::v1 as pb;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_proto::podresources::v1 as pr;
use pluglet_proto::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;
use pluglet_proto::v1beta1;
use pluglet_proto::v1beta1::device_plugin_client::DevicePluginClient;
use pluglet_test_support::stub::{Stub, devices};
use pluglet_uds::Channel;

/// The daemon binary: this build's, or `PLUGLET_BIN` (to compare two builds with one bench).
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
        "{name:<44} p50 {:>9}  p99 {:>9}  mean {:>9}  ({} calls)",
        ms(pct(&samples, 0.5)),
        ms(pct(&samples, 0.99)),
        ms(mean),
        samples.len()
    );
}

struct Daemon(Child);

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

async fn allocatable(client: &mut AdminClient<Channel>, resource: &str) -> i64 {
    client
        .list_resources(pb::ListResourcesRequest {})
        .await
        .expect("ListResources")
        .into_inner()
        .resources
        .iter()
        .find(|r| r.resource == resource)
        .map_or(0, |r| r.allocatable)
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
    while allocatable(client, resource).await != n as i64 {
        assert!(started.elapsed() < Duration::from_secs(30), "{resource}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stub
}

async fn allocations(
    client: &mut AdminClient<Channel>,
    resource: &str,
    count: u32,
    ops: usize,
    label: &str,
) {
    let (mut allocate, mut back_to_back, mut settled) = (vec![], vec![], vec![]);
    for i in 0..ops {
        let pod = format!("pod-{label}-{i}");
        let started = Instant::now();
        let answer = client
            .allocate(pb::AllocateRequest {
                pod_uid: pod.clone(),
                container: "ctr".into(),
                resource: resource.into(),
                count,
                ..Default::default()
            })
            .await
            .expect("Allocate")
            .into_inner();
        allocate.push(started.elapsed());
        assert_eq!(answer.device_ids.len(), count as usize);
        let settle = i % 2 == 1;
        if settle {
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        let started = Instant::now();
        let released = client
            .release(pb::ReleaseRequest {
                pod_uid: pod,
                container: String::new(),
            })
            .await
            .expect("Release")
            .into_inner();
        let took = started.elapsed();
        assert_eq!(released.released, 1);
        if settle {
            settled.push(took);
        } else {
            back_to_back.push(took);
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    report(&format!("allocate {label}"), allocate);
    report(&format!("  release {label}, back to back"), back_to_back);
    report(&format!("  release {label}, settled"), settled);
}

async fn floors(root: &Path, stub: &Stub, ops: usize) {
    let channel = pluglet_uds::connect(&stub.socket, Duration::from_secs(5))
        .await
        .expect("dial the stub");
    let mut plugin = DevicePluginClient::new(channel);
    let mut rtt = Vec::new();
    for _ in 0..ops {
        let started = Instant::now();
        plugin
            .allocate(v1beta1::AllocateRequest {
                container_requests: vec![v1beta1::ContainerAllocateRequest {
                    devices_ids: vec!["d0".into()],
                }],
            })
            .await
            .expect("stub Allocate");
        rtt.push(started.elapsed());
    }
    report("floor: stub Allocate round trip", rtt);

    let path = root.join("state").join("bench-fdatasync");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)
        .expect("open");
    file.write_all_at(&[0; 8192], 0).expect("write");
    file.sync_all().expect("fsync");
    let block = [7u8; 4096];
    let mut sync = Vec::new();
    for i in 0..ops {
        let started = Instant::now();
        file.write_all_at(&block, (i % 2 * 4096) as u64)
            .expect("write");
        file.sync_data().expect("fdatasync");
        sync.push(started.elapsed());
    }
    report("floor: 4 KiB in-place write + fdatasync", sync);
    let _ = std::fs::remove_file(path);
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

/// `ops` calls of `List` on one connection.
async fn list_calls(list: &mut PodResourcesListerClient<Channel>, ops: usize) -> Vec<Duration> {
    let mut samples = Vec::with_capacity(ops);
    for _ in 0..ops {
        let started = Instant::now();
        list.list(pr::ListPodResourcesRequest {})
            .await
            .expect("List");
        samples.push(started.elapsed());
    }
    samples
}

/// The pod-resources rows (see the module doc); `floor` is `List` of the node holding nothing.
async fn pod_resources(
    root: &Path,
    client: &mut AdminClient<Channel>,
    floor: Vec<Duration>,
    ops: usize,
) {
    let pods = env_or("PLUGLET_BENCH_PODS", 1000);
    let per_pod = env_or("PLUGLET_BENCH_PER_POD", 10);
    let held = plugin(root, client, "bench.example.com/held", pods * per_pod).await;
    let small = plugin(root, client, "bench.example.com/small", 64).await;
    for i in 0..pods {
        client
            .allocate(pb::AllocateRequest {
                pod_uid: format!("held-{i}"),
                container: "ctr".into(),
                resource: "bench.example.com/held".into(),
                count: per_pod as u32,
                pod_name: format!("name-{i}"),
                pod_namespace: "bench".into(),
            })
            .await
            .expect("Allocate");
    }
    let mut list = lister(root).await;
    let listed = list
        .list(pr::ListPodResourcesRequest {})
        .await
        .expect("List")
        .into_inner();
    assert_eq!(listed.pod_resources.len(), pods);
    println!(
        "pod-resources API, {pods} pods holding {} devices",
        pods * per_pod
    );
    report("  floor: List on the node holding nothing", floor);
    report(
        &format!("  List, {pods} pods / {} devices", pods * per_pod),
        list_calls(&mut list, ops).await,
    );
    let mut samples = Vec::with_capacity(ops);
    for _ in 0..ops {
        let started = Instant::now();
        list.get_allocatable_resources(pr::AllocatableResourcesRequest {})
            .await
            .expect("GetAllocatableResources");
        samples.push(started.elapsed());
    }
    report("  GetAllocatableResources, every device", samples);

    let looping = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let agent = {
        let (looping, stop, calls) = (looping.clone(), stop.clone(), calls.clone());
        let root = root.to_owned();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let mut list = lister(&root).await;
                while !stop.load(Ordering::Relaxed) {
                    if looping.load(Ordering::Relaxed) {
                        list_calls(&mut list, 1).await;
                        calls.fetch_add(1, Ordering::Relaxed);
                    } else {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            });
        })
    };
    let (mut quiet, mut loaded) = (Vec::new(), Vec::new());
    for i in 0..ops * 2 {
        let with_list = (i / 10) % 2 == 1;
        looping.store(with_list, Ordering::Relaxed);
        let pod = format!("ab-{i}");
        let started = Instant::now();
        client
            .allocate(pb::AllocateRequest {
                pod_uid: pod.clone(),
                container: "ctr".into(),
                resource: "bench.example.com/small".into(),
                count: 1,
                ..Default::default()
            })
            .await
            .expect("Allocate");
        let took = started.elapsed();
        if with_list { &mut loaded } else { &mut quiet }.push(took);
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
    let busy: Duration = loaded.iter().sum();
    report("  allocate 1 of 64, quiet", quiet);
    report(
        "  allocate 1 of 64, a client calling List in a loop",
        loaded,
    );
    println!(
        "  (List calls answered meanwhile: {} in {})",
        calls.load(Ordering::Relaxed),
        ms(busy)
    );
    drop((held, small));
}

#[tokio::main]
async fn main() {
    let calls = env_or("PLUGLET_BENCH_CALLS", 1000);
    let ops = env_or("PLUGLET_BENCH_OPS", 200);
    let root = tempfile::Builder::new()
        .prefix("padmin")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let log = std::fs::File::create(root.path().join("pluglet.log")).expect("log file");
    let _daemon = Daemon(
        Command::new(pluglet())
            .args(["run", "--root"])
            .arg(root.path())
            .args([
                "--pod-resources-qps",
                "1000000",
                "--pod-resources-burst",
                "1000000",
            ])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn pluglet run"),
    );
    let mut client = admin(root.path()).await;
    let floor = list_calls(&mut lister(root.path()).await, ops).await;

    for _ in 0..100 {
        client
            .list_allocations(pb::ListAllocationsRequest {})
            .await
            .expect("ListAllocations");
    }
    let mut bare = Vec::with_capacity(calls);
    for _ in 0..calls {
        let started = Instant::now();
        client
            .list_allocations(pb::ListAllocationsRequest {})
            .await
            .expect("ListAllocations");
        bare.push(started.elapsed());
    }
    report("bare round trip (ListAllocations, empty)", bare);

    let gpu = plugin(root.path(), &mut client, "bench.example.com/gpu", 8).await;
    let big = plugin(root.path(), &mut client, "bench.example.com/big", 1024).await;
    floors(root.path(), &gpu, ops).await;
    allocations(&mut client, "bench.example.com/gpu", 1, ops, "1 of 8").await;
    allocations(&mut client, "bench.example.com/big", 1, ops, "1 of 1,024").await;
    allocations(
        &mut client,
        "bench.example.com/big",
        1024,
        ops / 4,
        "1,024 of 1,024",
    )
    .await;
    pod_resources(root.path(), &mut client, floor, ops).await;
    drop((gpu, big));
}
