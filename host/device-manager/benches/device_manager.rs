//! Device manager latencies, side by side with the kubelet's figures, each with and without the
//! checkpoint fsync. Every measured operation ends when its change is durable, as in
//! the kubelet's figures: an allocation when its journal record is on disk, a device change when
//! the checkpoint and side file are (the moment the change is visible is printed too).
//!
//! Run: `cargo bench -p pluglet-device-manager --bench device_manager` (prints medians).
//!
//! - register: Register on kubelet.sock (fresh connection, 8 devices) → devices visible;
//! - allocate k of n: one allocation through the built-in WASM policy and the plugin's
//!   Allocate, ending when the answer is durable (the journal record; the kubelet checkpoint
//!   follows after the answer). Released again between iterations, untimed, and the
//!   checkpoint writes left to finish before the next one; "100 held": the same with 100 other
//!   containers holding one device each the whole time (every journal record carries them);
//!   "1 of 64, 10,000 held": 64 devices free among 10,064, the other 10,000 held by
//!   containers restored from a kubelet checkpoint written before the start (a node that
//!   filled up), against "1 of 64, none held"; on these two nodes the release that frees each
//!   timed allocation is timed too ("then released"), and in the rows "freed by sync-pods" a
//!   sync of pods frees it instead, keeping the same 10,001 pods on either node (the full
//!   node's 10,000 and one more), timed from the keep list's sort to the change on disk;
//!   "during a rewrite": the same two nodes, each timed allocation arriving 0 to 10 ms after
//!   the checkpoint writer has started the rewrite that the release before it asked for (it
//!   starts once allocations have been quiet for `ALLOCATION_WRITE_DELAY`), as allocations
//!   arrive on a busy node at any moment of a rewrite; prints p90, p99 and the slowest too;
//!   Each timed allocation follows the checkpoint write of the release before it, which on
//!   the full node takes milliseconds: the machine idles meanwhile, and on a VM the wake-up that
//!   follows costs more than the allocation's own work. `PLUGLET_BENCH_GAP_MS=<ms>` pauses
//!   that long before every timed allocation of every row, so rows compare from the same idle;
//!   `PLUGLET_BENCH_EVICT_MB=<MB>` then writes and reads that much memory on every core, as a
//!   rewrite of the full node's checkpoint leaves the caches, so that the rows also compare
//!   from the same cold caches;
//! - update 10,000: one ListAndWatch update of 10,000 devices (one health flips) → applied;
//! - with CDI spec: the same allocation with the CDI hand-off on (the spec written before the
//!   answer, on a tmpfs as `/var/run/cdi` is on a systemd node); and the spec write alone
//!   (median and p99), on a tmpfs and in the temporary directory, against its floor: the same
//!   bytes written to a temporary file and renamed with plain `std::fs` calls.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use pluglet_core::PodUid;
use pluglet_device_manager::persistence::ALLOCATION_WRITE_DELAY;
use pluglet_device_manager::{AnswerView, Config, DeviceManager, Durability, KeepList};
use pluglet_handler_runtime::{Runtime, RuntimeConfig};
use pluglet_handlers::Handlers;
use pluglet_proto::v1beta1;
use pluglet_test_support::stub::{Stub, devices};
use tokio_util::sync::CancellationToken;

/// The daemon's allocator (see `host/src/main.rs`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `PLUGLET_BENCH_GAP_MS`: a pause before each timed allocation, the same for every row.
fn gap() -> Option<Duration> {
    let ms: u64 = std::env::var("PLUGLET_BENCH_GAP_MS").ok()?.parse().ok()?;
    Some(Duration::from_millis(ms))
}

/// `PLUGLET_BENCH_EVICT_MB`: memory streamed through every core's caches before each timed
/// allocation, after the pause.
fn evict_mb() -> Option<usize> {
    std::env::var("PLUGLET_BENCH_EVICT_MB").ok()?.parse().ok()
}

/// Writes and reads `mb` MB on one thread per core, leaving the caches as a large write does.
fn evict(mb: usize) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..cores {
            scope.spawn(|| {
                let mut buffer = vec![0u8; mb << 20];
                for (i, byte) in buffer.iter_mut().enumerate() {
                    *byte = i as u8;
                }
                std::hint::black_box(buffer.iter().map(|&b| u64::from(b)).sum::<u64>());
            });
        }
    });
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

async fn wait_for(manager: &DeviceManager, check: impl Fn(&DeviceManager) -> bool) {
    let mut changes = manager.changes();
    while !check(manager) {
        tokio::time::timeout(Duration::from_secs(30), changes.changed())
            .await
            .expect("timed out")
            .expect("manager gone");
    }
}

fn allocatable(manager: &DeviceManager, resource: &str) -> Option<usize> {
    manager.counts(resource).map(|(_, allocatable)| allocatable)
}

async fn start(
    root: &Path,
    handlers: Handlers,
    durability: Durability,
    cdi: bool,
) -> DeviceManager {
    let mut config = Config::new(
        root.join("device-plugins"),
        root.join("state"),
        "bench".into(),
    );
    config.durability = durability;
    config.cdi_spec_dir = cdi.then(|| cdi_dir().join(root.file_name().expect("a temporary root")));
    DeviceManager::start(
        config,
        pluglet_registration::Pipeline::new(handlers, "bench"),
        CancellationToken::new(),
    )
    .await
    .expect("start the device manager")
}

async fn bench_register(handlers: Handlers, durability: Durability, n: usize) -> Duration {
    let root = tempfile::tempdir().unwrap();
    let manager = start(root.path(), handlers, durability, false).await;
    let kubelet = manager.config().kubelet_socket();
    let mut samples = Vec::new();
    let mut visible = Vec::new();
    let mut stubs = Vec::new();
    for i in 0..n {
        let resource = format!("bench.example.com/r{i}");
        let stub = Stub::start(
            &manager.device_plugins_dir().join(format!("r{i}.sock")),
            devices(8, 2),
            v1beta1::DevicePluginOptions::default(),
        );
        let started = Instant::now();
        stub.register(&kubelet, &resource).await.expect("register");
        wait_for(&manager, |m| allocatable(m, &resource) == Some(8)).await;
        visible.push(started.elapsed());
        manager.wait_checkpoint().await.expect("checkpoint");
        samples.push(started.elapsed());
        stubs.push(stub);
    }
    manager.shutdown().await;
    println!(
        "{:<34} {:>12}",
        "  (visible, before the checkpoint)",
        ms(median(visible))
    );
    median(samples)
}

/// A kubelet checkpoint under `root` in which `held` containers hold one device `d<i>` of
/// `resource` each: a node that filled up, as the device manager restores it at start (filling
/// it allocation by allocation would take minutes, each journal record carrying all before it).
fn prefill(root: &Path, resource: &str, held: usize) {
    let entries = (0..held)
        .map(|i| pluglet_checkpoint::PodDevicesEntry {
            pod_uid: format!("restored-{i}"),
            container_name: "ctr".into(),
            resource_name: resource.into(),
            device_ids: Some([(i as i64 % 2, Some(vec![format!("d{i}")]))].into()),
            alloc_resp: Some(Vec::new()),
        })
        .collect();
    let data = pluglet_checkpoint::CheckpointData {
        pod_device_entries: Some(entries),
        registered_devices: Default::default(),
    };
    let dir = root.join("device-plugins");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kubelet_internal_checkpoint"), data.encode()).unwrap();
}

/// When each timed allocation of [`bench_allocate`] arrives.
#[derive(Clone, Copy, PartialEq)]
enum Arrival {
    /// Once the checkpoint writes of the iteration before have finished (and the pause).
    Settled,
    /// 0 to 10 ms after the checkpoint writer started the rewrite the release before asked for.
    DuringRewrite,
}

/// How each timed allocation is freed again before the next.
#[derive(Clone, Copy, PartialEq)]
enum Free {
    /// A release of its pod.
    Release,
    /// A sync of pods keeping every restored pod and one more (10,001 pods), not its pod.
    SyncPods,
}

/// The pods a sync of [`Free::SyncPods`] keeps: the full node's 10,000 restored pods and one
/// that holds nothing, on either node, so that two rows differ only by what the node holds.
fn kept_pods() -> Vec<PodUid> {
    (0..10_000)
        .map(|i| PodUid::new(format!("restored-{i}")))
        .chain([PodUid::new("kept")])
        .collect()
}

/// Runs `work` on a runtime worker, as the admin API's handler runs it, and times it there.
async fn on_worker<T: Send + 'static>(
    work: impl Future<Output = T> + Send + 'static,
) -> (Duration, T) {
    tokio::spawn(async move {
        let started = Instant::now();
        let out = work.await;
        (started.elapsed(), out)
    })
    .await
    .expect("timed task")
}

/// The medians of one allocation row: the allocations, and what freed each again.
struct Medians {
    allocate: Duration,
    free: Duration,
}

/// One allocation row: `count` of `devices` devices, `n` times.
#[derive(Clone, Copy)]
struct Allocations {
    devices: usize,
    count: u32,
    n: usize,
    /// The CDI hand-off on.
    cdi: bool,
    /// Other containers holding one device each, allocated before the timed ones.
    held: usize,
    /// Containers holding one device each, restored from a checkpoint written before the start.
    restored: usize,
    arrival: Arrival,
    free: Free,
    /// Print the median of what freed each allocation, below the row.
    show_free: bool,
}

impl Allocations {
    /// `count` of `devices`, `n` times, on a node holding nothing else.
    const fn of(devices: usize, count: u32, n: usize) -> Allocations {
        Allocations {
            devices,
            count,
            n,
            cdi: false,
            held: 0,
            restored: 0,
            arrival: Arrival::Settled,
            free: Free::Release,
            show_free: false,
        }
    }

    const fn showing_release(self) -> Allocations {
        Allocations {
            show_free: true,
            ..self
        }
    }

    const fn freed_by_sync_pods(self) -> Allocations {
        Allocations {
            free: Free::SyncPods,
            show_free: true,
            ..self
        }
    }

    const fn with_cdi(self) -> Allocations {
        Allocations { cdi: true, ..self }
    }

    const fn held(self, held: usize) -> Allocations {
        Allocations { held, ..self }
    }

    /// The same among 10,000 more devices, held by containers restored at the start.
    const fn on_full_node(self) -> Allocations {
        Allocations {
            devices: self.devices + 10_000,
            restored: 10_000,
            ..self
        }
    }

    const fn during_rewrite(self) -> Allocations {
        Allocations {
            arrival: Arrival::DuringRewrite,
            ..self
        }
    }
}

/// What a row of the table measures.
enum Row {
    Register,
    Update,
    Allocate(Allocations),
}

async fn bench_allocate(handlers: Handlers, durability: Durability, row: Allocations) -> Medians {
    let Allocations {
        devices: devices_n,
        count,
        n,
        cdi,
        held,
        restored,
        arrival,
        free,
        show_free: _,
    } = row;
    let root = tempfile::tempdir().unwrap();
    prefill(root.path(), "bench.example.com/gpu", restored);
    let manager = start(root.path(), handlers, durability, cdi).await;
    let resource = "bench.example.com/gpu";
    let stub = Stub::start(
        &manager.device_plugins_dir().join("gpu.sock"),
        devices(devices_n, 2),
        v1beta1::DevicePluginOptions::default(),
    );
    stub.register(&manager.config().kubelet_socket(), resource)
        .await
        .expect("register");
    wait_for(&manager, |m| allocatable(m, resource) == Some(devices_n)).await;
    manager.wait_checkpoint().await.expect("checkpoint");
    // Other containers holding one device each for the whole run (a busy node's state, which
    // every journal record carries).
    for i in 0..held {
        manager
            .allocate(&format!("holder-{i}"), "ctr", resource, 1)
            .await
            .expect("allocate a holder");
    }
    manager.wait_checkpoint().await.expect("checkpoint");
    let mut samples = Vec::new();
    let mut freed = Vec::new();
    for i in 0..n {
        let pod = format!("pod-{i}");
        let (elapsed, got) = {
            let (manager, pod) = (manager.clone(), pod.clone());
            on_worker(async move { manager.allocate(&pod, "ctr", resource, count).await }).await
        };
        samples.push(elapsed);
        assert_eq!(got.expect("allocate").device_ids.len(), count as usize);
        let freeing = manager.clone();
        let (elapsed, released) = match free {
            Free::Release => on_worker(async move { freeing.release(&pod, None).await }).await,
            Free::SyncPods => {
                let kept = kept_pods();
                on_worker(async move {
                    let keep = KeepList::from(kept);
                    let freed = freeing.sync_pods(&keep, false).await;
                    freed.map(|freed| freed.len())
                })
                .await
            }
        };
        freed.push(elapsed);
        assert_eq!(
            released.expect("free the allocation"),
            1,
            "one container freed"
        );
        if arrival == Arrival::DuringRewrite {
            // 0 to 10 ms into the rewrite (the full node's checksum and file write take
            // milliseconds), in a fixed order spread over the run.
            let into = Duration::from_micros((i as u64 * 37 % 100) * 100);
            tokio::time::sleep(ALLOCATION_WRITE_DELAY + into).await;
            continue;
        }
        // Untimed: let the checkpoint writes that follow the answers finish, so each timed
        // allocation starts on an idle node (as the kubelet's figures do).
        manager.wait_checkpoint().await.expect("checkpoint");
        if let Some(gap) = gap() {
            tokio::time::sleep(gap).await;
        }
        if let Some(mb) = evict_mb() {
            evict(mb);
        }
    }
    manager.shutdown().await;
    if arrival == Arrival::DuringRewrite {
        let mut sorted = samples.clone();
        sorted.sort();
        let at = |q: usize| ms(sorted[(sorted.len() * q / 100).min(sorted.len() - 1)]);
        println!(
            "{:<34} p90 {} p99 {} max {}",
            format!("  ({durability:?}, n = {n})"),
            at(90),
            at(99),
            ms(sorted[sorted.len() - 1])
        );
    }
    Medians {
        allocate: median(samples),
        free: median(freed),
    }
}

async fn bench_update(handlers: Handlers, durability: Durability, n: usize) -> Duration {
    let root = tempfile::tempdir().unwrap();
    let manager = start(root.path(), handlers, durability, false).await;
    let resource = "bench.example.com/many";
    let size = 10_000;
    let stub = Stub::start(
        &manager.device_plugins_dir().join("many.sock"),
        devices(size, 4),
        v1beta1::DevicePluginOptions::default(),
    );
    stub.register(&manager.config().kubelet_socket(), resource)
        .await
        .expect("register");
    wait_for(&manager, |m| allocatable(m, resource) == Some(size)).await;
    manager.wait_checkpoint().await.expect("checkpoint");
    let mut samples = Vec::new();
    let mut applied = Vec::new();
    for i in 0..n {
        let mut list = devices(size, 4);
        let want = if i % 2 == 0 {
            list[i % size].health = "Unhealthy".into();
            size - 1
        } else {
            size
        };
        let started = Instant::now();
        stub.set_devices(list);
        wait_for(&manager, |m| allocatable(m, resource) == Some(want)).await;
        applied.push(started.elapsed());
        manager.wait_checkpoint().await.expect("checkpoint");
        samples.push(started.elapsed());
    }
    manager.shutdown().await;
    println!(
        "{:<34} {:>12}",
        "  (applied, before the checkpoint)",
        ms(median(applied))
    );
    median(samples)
}

/// One unary RPC (GetDevicePluginOptions) to the stub plugin over a `pluglet_uds` channel: the
/// floor under every figure that calls the plugin.
async fn bench_rpc(iterations: usize) -> Duration {
    let root = tempfile::tempdir().unwrap();
    let socket = root.path().join("rpc.sock");
    let _stub = Stub::start(
        &socket,
        devices(8, 2),
        v1beta1::DevicePluginOptions::default(),
    );
    let channel = pluglet_uds::connect(&socket, Duration::from_secs(10))
        .await
        .expect("dial the stub");
    let mut client = v1beta1::device_plugin_client::DevicePluginClient::new(channel);
    let mut samples = Vec::new();
    for _ in 0..iterations {
        let started = Instant::now();
        client
            .get_device_plugin_options(v1beta1::Empty {})
            .await
            .expect("options");
        samples.push(started.elapsed());
    }
    median(samples)
}

/// One journal record of `size` bytes made durable (`fdatasync`), the floor under every
/// allocation figure with fsync.
fn bench_journal(size: usize, iterations: usize) -> Duration {
    let root = tempfile::tempdir().unwrap();
    let mut journal =
        pluglet_checkpoint::Journal::open(&root.path().join("journal"), Durability::Fsync)
            .expect("open a journal")
            .journal;
    let payload = vec![b'x'; size];
    let mut samples = Vec::new();
    for _ in 0..iterations {
        let started = Instant::now();
        journal.append(&payload).expect("append");
        samples.push(started.elapsed());
    }
    median(samples)
}

/// The built-in policy alone (one WASM call), choosing `count` of `n` devices on 2 NUMA nodes:
/// the median and the fuel one call used.
fn bench_policy(handlers: &Handlers, n: usize, count: u32, iterations: usize) -> (Duration, u64) {
    let policy = handlers.for_resource("bench.example.com/gpu");
    let request = pluglet_handler_runtime::AllocationRequest {
        resource: "bench.example.com/gpu".into(),
        available: (0..n)
            .map(|i| pluglet_handler_runtime::CandidateDevice {
                id: format!("d{i}"),
                numa_nodes: vec![i as i64 % 2],
            })
            .collect(),
        must_include: Vec::new(),
        count,
        preferred: None,
    };
    let cx = pluglet_handler_runtime::CallContext {
        node_name: "bench".into(),
    };
    let mut samples = Vec::new();
    let mut fuel = 0;
    for _ in 0..iterations {
        let started = Instant::now();
        let call = policy.allocate(&cx, &request).expect("policy call");
        samples.push(started.elapsed());
        fuel = call.fuel_used;
        assert_eq!(call.value.expect("chosen").len(), count as usize);
    }
    (median(samples), fuel)
}

/// Where the CDI rows write their specs: `/dev/shm`, a tmpfs like the `/run` (and so
/// `/var/run/cdi`) of a systemd node, when it exists.
fn cdi_dir() -> std::path::PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

/// Median and p99.
fn median_p99(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let p99 = samples[(samples.len() * 99 / 100).min(samples.len() - 1)];
    (samples[samples.len() / 2], p99)
}

/// The CDI spec of one allocation of `devices` device nodes written `iterations` times, and
/// the floor: the same bytes written to a temporary file and renamed over the spec.
fn bench_cdi_write(
    base: &Path,
    devices: usize,
    iterations: usize,
) -> ((Duration, Duration), (Duration, Duration)) {
    use pluglet_device_manager::cdi::Handoff;
    use pluglet_device_manager::pod_devices::HolderKey;
    let dir = tempfile::tempdir_in(base).unwrap();
    let handoff = Handoff::new(dir.path().to_owned());
    let ids: Vec<String> = (0..devices).map(|i| format!("d{i}")).collect();
    let answer = v1beta1::ContainerAllocateResponse {
        envs: [("VENDOR_DEVICES".to_owned(), ids.join(","))].into(),
        mounts: vec![v1beta1::Mount {
            container_path: "/var/run/vendor".into(),
            host_path: "/tmp/vendor".into(),
            read_only: true,
        }],
        devices: ids
            .iter()
            .map(|id| v1beta1::DeviceSpec {
                container_path: format!("/dev/vendor/{id}"),
                host_path: "/dev/null".into(),
                permissions: "rw".into(),
            })
            .collect(),
        ..Default::default()
    };
    // As the allocator has it: the plugin's bytes, read in place for each allocation.
    let answer = prost::Message::encode_to_vec(&answer);
    let key = HolderKey::new(
        "0f3e41aa-5b6c-4d7e-8f90-123456789abc",
        "main",
        "vendor.com/gpu",
    );
    let mut spec = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let started = Instant::now();
        let view = AnswerView::read(&answer).expect("the answer reads");
        handoff.write(&key, &view).expect("write the spec");
        spec.push(started.elapsed());
    }
    let file = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "json"))
        .expect("the spec");
    let bytes = std::fs::read(&file).unwrap();
    let temp = dir.path().join(".floor.tmp");
    let mut floor = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let started = Instant::now();
        std::fs::write(&temp, &bytes).unwrap();
        std::fs::rename(&temp, &file).unwrap();
        floor.push(started.elapsed());
    }
    (median_p99(spec), median_p99(floor))
}

fn main() {
    // `cargo bench … -- <text>` runs only the rows whose name contains <text>.
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let wanted = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let wasm = Runtime::new(RuntimeConfig::default()).expect("wasm runtime");
    let handlers = Handlers::builtins_only(wasm).expect("handlers");
    println!(
        "{:<34} {:>12} {:>12} {:>10}",
        "operation (median)", "fsync", "no fsync", "kubelet"
    );
    for (name, n, count, iterations) in [
        ("  of which WASM policy, 1 of 8", 8, 1, 200),
        ("  of which WASM policy, 1 of 1,024", 1024, 1, 200),
        ("  of which WASM policy, 1,024 of 1,024", 1024, 1024, 200),
        ("  of which WASM policy, 1 of 100,000", 100_000, 1, 20),
    ] {
        let (took, fuel) = bench_policy(&handlers, n, count, iterations);
        println!("{name:<34} {:>12} fuel {fuel}", ms(took));
    }
    println!(
        "{:<34} {:>12}",
        "  of which journal record, fdatasync",
        ms(bench_journal(400, 200))
    );
    for (base, fs) in [(cdi_dir(), "tmpfs"), (std::env::temp_dir(), "temp dir")] {
        for devices in [1, 1024] {
            let (spec, floor) = bench_cdi_write(&base, devices, 400);
            println!(
                "{:<34} {:>12} p99 {} (floor: write+rename {} p99 {})",
                format!("  CDI spec, {devices} node(s), {fs}"),
                ms(spec.0),
                ms(spec.1),
                ms(floor.0),
                ms(floor.1)
            );
        }
    }
    runtime.block_on(async {
        println!(
            "{:<34} {:>12}",
            "  of which one unary RPC",
            ms(bench_rpc(500).await)
        );
        let rows = [
            ("Register -> devices visible", "1.8 ms", Row::Register),
            (
                "allocate 1 of 8",
                "0.77 ms",
                Row::Allocate(Allocations::of(8, 1, 200)),
            ),
            (
                "allocate 1 of 1,024",
                "1.48 ms",
                Row::Allocate(Allocations::of(1024, 1, 200)),
            ),
            (
                "allocate 1,024 of 1,024",
                "7.8 ms",
                Row::Allocate(Allocations::of(1024, 1024, 50)),
            ),
            ("ListAndWatch update of 10,000", "10 ms", Row::Update),
            (
                "allocate 1 of 8, CDI spec",
                "-",
                Row::Allocate(Allocations::of(8, 1, 200).with_cdi()),
            ),
            (
                "allocate 1,024 of 1,024, CDI spec",
                "-",
                Row::Allocate(Allocations::of(1024, 1024, 50).with_cdi()),
            ),
            (
                "allocate 1 of 1,024, 100 held",
                "-",
                Row::Allocate(Allocations::of(1024, 1, 200).held(100)),
            ),
            (
                "allocate 1 of 100,000",
                "-",
                Row::Allocate(Allocations::of(100_000, 1, 50)),
            ),
        ];
        let mut rows: Vec<(String, &str, Row)> = rows
            .into_iter()
            .map(|(name, kubelet, row)| (name.to_owned(), kubelet, row))
            .collect();
        // The flat-cost rows: each on a node holding nothing and on the full node.
        let flat = [
            ("", Allocations::of(64, 1, 100).showing_release()),
            (
                ", freed by sync-pods",
                Allocations::of(64, 1, 100).freed_by_sync_pods(),
            ),
            (
                ", during a rewrite",
                Allocations::of(64, 1, 200).during_rewrite(),
            ),
        ];
        for (how, row) in flat {
            let full = Row::Allocate(row.on_full_node());
            rows.push((
                format!("allocate 1 of 64, none held{how}"),
                "-",
                Row::Allocate(row),
            ));
            rows.push((format!("allocate 1 of 64, 10,000 held{how}"), "-", full));
        }
        for (name, kubelet, row) in rows {
            if !wanted(&name) {
                continue;
            }
            let mut figures = Vec::new();
            let mut freed = Vec::new();
            for durability in [Durability::Fsync, Durability::NoFsync] {
                let h = handlers.clone();
                let d = match row {
                    Row::Register => bench_register(h, durability, 100).await,
                    Row::Update => bench_update(h, durability, 50).await,
                    Row::Allocate(allocations) => {
                        let medians = bench_allocate(h, durability, allocations).await;
                        freed.push(ms(medians.free));
                        medians.allocate
                    }
                };
                figures.push(ms(d));
            }
            println!(
                "{name:<34} {:>12} {:>12} {kubelet:>10}",
                figures[0], figures[1]
            );
            if let Row::Allocate(Allocations {
                show_free: true,
                free,
                ..
            }) = row
            {
                let how = match free {
                    Free::Release => "  then released",
                    Free::SyncPods => "  then freed by sync-pods",
                };
                println!("{how:<34} {:>12} {:>12}", freed[0], freed[1]);
            }
        }
    });
}
