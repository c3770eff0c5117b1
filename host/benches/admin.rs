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
//!   in-process stub device plugin (`pluglet_device_manager::stub`), answered once durable;
//!   then `Release` of its pod, timed on its own. *back to back*: the release is sent as soon as
//!   the allocation is answered (the checkpoint write the allocation asked for still to come);
//!   *settled*: 30 ms later, once allocations have been quiet long enough for that write to be
//!   done;
//! - floors: the stub's Allocate round trip over the same kind of connection, and one
//!   in-place 4 KiB write with `fdatasync` in the state directory (what a journal record costs).

use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pluglet_device_manager::stub::{Stub, devices};
use pluglet_proto::admin::v1 as pb;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_proto::v1beta1;
use pluglet_proto::v1beta1::device_plugin_client::DevicePluginClient;
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
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn pluglet run"),
    );
    let mut client = admin(root.path()).await;

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
    drop((gpu, big));
}
