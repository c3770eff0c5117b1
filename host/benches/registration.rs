//! Registration latency of the real `pluglet run` binary, measured from the plugin's side: from
//! the moment the plugin calls `bind()` on its registration socket until it has received
//! NotifyRegistrationStatus. The plugin servers (pluginregistration + CSI Node on one socket, so
//! every registration includes a NodeGetInfo round trip and the WASM validate and register hooks)
//! run in this process.
//!
//! Run: `cargo bench -p pluglet --bench registration` (release). Prints p50/p99 over sequential
//! registrations and the time until a burst of 1,000 sockets created after start is registered.
//! Then the soak: for a minute, the last 100 plugins of the burst are deregistered (sockets
//! removed) and registered again in rounds while a client allocates and releases a device of a
//! stub device plugin; it prints registrations lost (must be 0), registration p50/p99, the
//! allocations' round trips and failures, and the daemon's RSS at start and end of the soak.
//! `PLUGLET_BENCH_SEQUENTIAL`, `PLUGLET_BENCH_BURST` and `PLUGLET_BENCH_SOAK_SECS` (0: no soak)
//! change the counts; `PLUGLET_BIN` runs another build's daemon. The part from GetInfo's arrival at the plugin to NotifyRegistrationStatus
//! is printed too.

#![allow(missing_docs)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pluglet_proto::admin::v1 as pb;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_proto::csi::v1 as csi;
use pluglet_proto::csi::v1::node_server::{Node, NodeServer};
use pluglet_proto::pluginregistration as reg;
use pluglet_proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use pluglet_test_support::stub::{self, Stub};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

/// What the plugin received in NotifyRegistrationStatus, and when; and when GetInfo arrived.
type Notified = (Instant, bool, String, Option<Instant>);

struct Plugin {
    name: String,
    notified: Mutex<Option<oneshot::Sender<Notified>>>,
    get_info_at: Mutex<Option<Instant>>,
}

/// The plugin's gRPC services (one state shared by both).
#[derive(Clone)]
struct Service(std::sync::Arc<Plugin>);

#[tonic::async_trait]
impl Registration for Service {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        *self.0.get_info_at.lock().unwrap() = Some(Instant::now());
        Ok(Response::new(reg::PluginInfo {
            r#type: "CSIPlugin".into(),
            name: self.0.name.clone(),
            endpoint: String::new(),
            supported_versions: vec!["1.0.0".into()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let now = Instant::now();
        let s = request.into_inner();
        if let Some(tx) = self.0.notified.lock().unwrap().take() {
            let got_info = *self.0.get_info_at.lock().unwrap();
            let _ = tx.send((now, s.plugin_registered, s.error, got_info));
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

#[tonic::async_trait]
impl Node for Service {
    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: "bench-node".into(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}

/// Binds `path` (the clock starts just before `bind()`) and serves the plugin on it until the
/// returned stopper is dropped.
fn start_plugin(
    path: &Path,
    name: String,
) -> (Instant, oneshot::Receiver<Notified>, oneshot::Sender<()>) {
    let (tx, rx) = oneshot::channel();
    let plugin = Service(std::sync::Arc::new(Plugin {
        name,
        notified: Mutex::new(Some(tx)),
        get_info_at: Mutex::new(None),
    }));
    let (stop, stopped) = oneshot::channel::<()>();
    let t0 = Instant::now();
    let listener = tokio::net::UnixListener::bind(path).expect("bind plugin socket");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(plugin.clone()))
            .add_service(NodeServer::new(plugin))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(listener),
                async move {
                    let _ = stopped.await;
                },
            ),
    );
    (t0, rx, stop)
}

fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

struct DaemonProcess(Child);

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.0.wait();
    }
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else to parse.
    let sequential = env_count("PLUGLET_BENCH_SEQUENTIAL", 300);
    let burst = env_count("PLUGLET_BENCH_BURST", 1000);
    let soak = Duration::from_secs(env_count("PLUGLET_BENCH_SOAK_SECS", 60) as u64);
    let root = tempfile::Builder::new()
        .prefix("pbench")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let registry: PathBuf = root.path().join("plugins_registry");
    let admin = root.path().join("pluglet.sock");
    let daemon = DaemonProcess(
        Command::new(
            std::env::var("PLUGLET_BIN")
                .unwrap_or_else(|_| env!("CARGO_BIN_EXE_pluglet").to_owned()),
        )
        .args(["run", "--root"])
        .arg(root.path())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn pluglet run"),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        let start = Instant::now();
        loop {
            if tokio::net::UnixStream::connect(&admin).await.is_ok() {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(120), "daemon did not start");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        println!("daemon ready after {}", ms(start.elapsed()));

        // Every plugin keeps serving until the end, but the ones the soak restarts.
        let mut serving = Vec::new();
        // Warm-up (first connections, first handler instances), not counted.
        for i in 0..20 {
            let (_, rx, stop) = start_plugin(&registry.join(format!("warm{i}.sock")), format!("warm{i}.example.com"));
            serving.push(stop);
            let (_, ok, err, _) = rx.await.expect("notified");
            assert!(ok, "warm-up registration refused: {err}");
        }

        let mut latencies = Vec::with_capacity(sequential);
        let mut info_to_notify = Vec::with_capacity(sequential);
        for i in 0..sequential {
            let (t0, rx, stop) = start_plugin(&registry.join(format!("seq{i}.sock")), format!("seq{i}.example.com"));
            serving.push(stop);
            let (t1, ok, err, got_info) = rx.await.expect("notified");
            assert!(ok, "registration refused: {err}");
            latencies.push(t1 - t0);
            info_to_notify.push(t1 - got_info.expect("GetInfo was asked"));
        }
        latencies.sort();
        let mean = latencies.iter().sum::<Duration>() / latencies.len() as u32;
        println!(
            "sequential registrations (bind() -> NotifyRegistrationStatus received), n={sequential}: \
             p50 {}  p99 {}  mean {}  min {}  max {}",
            ms(percentile(&latencies, 0.50)),
            ms(percentile(&latencies, 0.99)),
            ms(mean),
            ms(latencies[0]),
            ms(*latencies.last().unwrap()),
        );
        info_to_notify.sort();
        println!(
            "  of which GetInfo answered -> NotifyRegistrationStatus received: p50 {}  p99 {}",
            ms(percentile(&info_to_notify, 0.50)),
            ms(percentile(&info_to_notify, 0.99)),
        );

        let t0 = Instant::now();
        let mut waits = Vec::with_capacity(burst);
        for i in 0..burst {
            let (_, rx, stop) = start_plugin(&registry.join(format!("burst{i}.sock")), format!("burst{i}.example.com"));
            serving.push(stop);
            waits.push(rx);
        }
        let created = t0.elapsed();
        let mut last = t0;
        for rx in waits {
            let (t, ok, err, _) = rx.await.expect("notified");
            assert!(ok, "burst registration refused: {err}");
            last = last.max(t);
        }
        println!(
            "burst: {burst} sockets created after start in {}, all registered (plugins notified) {} after the first bind()",
            ms(created),
            ms(last - t0),
        );

        if !soak.is_zero() {
            let flapping = serving.split_off(serving.len() - burst.min(FLAPPING));
            soak_run(&SoakSetup {
                root: root.path(),
                registry: &registry,
                admin: &admin,
                pid: daemon.0.id(),
                first_flapper: burst - flapping.len(),
                soak,
            }, flapping)
            .await;
        }
        drop(serving);
    });
    drop(daemon);
}

/// Plugins the soak deregisters and registers again, over and over (the last ones of the burst).
const FLAPPING: usize = 100;
/// Longest wait for one registration or deregistration before it counts as lost.
const LOST_AFTER: Duration = Duration::from_secs(30);
/// The resource the soak allocates from while plugins flap.
const SOAK_RESOURCE: &str = "vendor.com/soak";

struct SoakSetup<'a> {
    root: &'a Path,
    registry: &'a Path,
    admin: &'a Path,
    pid: u32,
    /// Index of the first flapping plugin in the burst.
    first_flapper: usize,
    soak: Duration,
}

/// Open file descriptors of `pid`.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("daemon fds")
        .count()
}

/// VmRSS and VmHWM of `pid`, in MB.
fn memory_mb(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("daemon status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .expect("field in /proc/<pid>/status")
            / 1024.0
    };
    (field("VmRSS:"), field("VmHWM:"))
}

async fn admin_client(admin: &Path) -> AdminClient<pluglet_uds::Channel> {
    AdminClient::new(
        pluglet_uds::connect(admin, Duration::from_secs(10))
            .await
            .expect("dial the admin socket"),
    )
}

async fn plugin_count(admin: &mut AdminClient<pluglet_uds::Channel>) -> usize {
    admin
        .list_plugins(pb::ListPluginsRequest {})
        .await
        .expect("ListPlugins")
        .into_inner()
        .plugins
        .len()
}

/// Allocates one device to a fresh pod and releases it, in a loop until `stop` is set:
/// the allocations that run while plugins flap. Returns the round trips and the failures.
async fn allocate_until(admin: PathBuf, stop: Arc<AtomicBool>) -> (Vec<Duration>, usize) {
    let mut client = admin_client(&admin).await;
    let (mut times, mut failed) = (Vec::new(), 0);
    let mut pod = 0u64;
    while !stop.load(Ordering::Relaxed) {
        pod += 1;
        let t0 = Instant::now();
        let allocated = client
            .allocate(pb::AllocateRequest {
                pod_uid: format!("soak-{pod}"),
                container: "c".into(),
                resource: SOAK_RESOURCE.into(),
                count: 1,
                ..Default::default()
            })
            .await;
        match allocated {
            Ok(_) => times.push(t0.elapsed()),
            Err(e) => {
                failed += 1;
                eprintln!("soak allocation failed: {e}");
            }
        }
        let released = client
            .release(pb::ReleaseRequest {
                pod_uid: format!("soak-{pod}"),
                container: String::new(),
            })
            .await;
        if let Err(e) = released {
            failed += 1;
            eprintln!("soak release failed: {e}");
        }
    }
    (times, failed)
}

/// The soak: the flapping plugins' sockets are removed and made again in rounds for
/// `setup.soak`, while a client allocates and releases; prints what was lost and what it cost.
async fn soak_run(setup: &SoakSetup<'_>, mut flapping: Vec<oneshot::Sender<()>>) {
    let dp_dir = setup.root.join("device-plugins");
    let stub = Stub::start(
        &dp_dir.join("soak.sock"),
        stub::devices(8, 0),
        Default::default(),
    );
    stub.register(&dp_dir.join("kubelet.sock"), SOAK_RESOURCE)
        .await
        .expect("register the soak device plugin");
    let mut admin = admin_client(setup.admin).await;
    let started = Instant::now();
    loop {
        let resources = admin
            .list_resources(pb::ListResourcesRequest {})
            .await
            .expect("ListResources")
            .into_inner()
            .resources;
        if resources
            .iter()
            .any(|r| r.resource == SOAK_RESOURCE && r.allocatable == 8)
        {
            break;
        }
        assert!(
            started.elapsed() < LOST_AFTER,
            "the soak device plugin's devices never came"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let before = plugin_count(&mut admin).await;
    let (rss_start, _) = memory_mb(setup.pid);
    let fds_start = open_fds(setup.pid);
    let stop = Arc::new(AtomicBool::new(false));
    let allocations = tokio::spawn(allocate_until(setup.admin.to_path_buf(), stop.clone()));
    let (mut registrations, mut deregistrations) = (Vec::new(), Vec::new());
    let (mut lost, mut rounds) = (0usize, 0usize);
    let end = Instant::now() + setup.soak;
    while Instant::now() < end {
        rounds += 1;
        let paths: Vec<PathBuf> = (0..flapping.len())
            .map(|i| {
                setup
                    .registry
                    .join(format!("burst{}.sock", setup.first_flapper + i))
            })
            .collect();
        let t0 = Instant::now();
        for path in &paths {
            std::fs::remove_file(path).expect("remove a flapping plugin's socket");
        }
        flapping.clear();
        loop {
            if plugin_count(&mut admin).await == before - paths.len() {
                deregistrations.push(t0.elapsed());
                break;
            }
            if t0.elapsed() > LOST_AFTER {
                lost += 1;
                eprintln!("round {rounds}: deregistrations not all seen");
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut waits = Vec::with_capacity(paths.len());
        for (i, path) in paths.iter().enumerate() {
            let name = format!("burst{}.example.com", setup.first_flapper + i);
            let (t, rx, stop) = start_plugin(path, name);
            flapping.push(stop);
            waits.push((t, rx));
        }
        for (t, rx) in waits {
            match tokio::time::timeout(LOST_AFTER, rx).await {
                Ok(Ok((at, true, _, _))) => registrations.push(at - t),
                Ok(Ok((_, false, error, _))) => {
                    lost += 1;
                    eprintln!("round {rounds}: registration refused: {error}");
                }
                _ => {
                    lost += 1;
                    eprintln!("round {rounds}: a registration was never notified");
                }
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let (mut allocs, failed) = allocations.await.expect("allocation task");
    let registered_at_end = plugin_count(&mut admin).await;
    let (rss_end, hwm) = memory_mb(setup.pid);
    let fds_end = open_fds(setup.pid);
    registrations.sort();
    deregistrations.sort();
    allocs.sort();
    println!(
        "soak: {:.0} s, {rounds} rounds of {} plugins deregistered and registered again while a \
         client allocated and released",
        setup.soak.as_secs_f64(),
        flapping.len(),
    );
    println!(
        "  registrations: {} done, lost {lost}; plugins registered at the end {registered_at_end} \
         (expected {before})",
        registrations.len(),
    );
    println!(
        "  registration (bind() -> notified) p50 {}  p99 {}  max {}",
        ms(percentile(&registrations, 0.50)),
        ms(percentile(&registrations, 0.99)),
        ms(*registrations.last().expect("registrations")),
    );
    println!(
        "  deregistration of a round ({} sockets removed -> gone from ListPlugins) p50 {}  p99 {}",
        flapping.len(),
        ms(percentile(&deregistrations, 0.50)),
        ms(percentile(&deregistrations, 0.99)),
    );
    println!(
        "  allocations meanwhile: {} (allocate round trip p50 {}  p99 {}), failed {failed}",
        allocs.len(),
        ms(percentile(&allocs, 0.50)),
        ms(percentile(&allocs, 0.99)),
    );
    println!(
        "  daemon RSS: start {rss_start:.1} MB, end {rss_end:.1} MB, peak (VmHWM) {hwm:.1} MB; \
         open files: start {fds_start}, end {fds_end}"
    );
    stub.stop();
}
