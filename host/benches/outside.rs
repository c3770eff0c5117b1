//! Pluglet measured from outside: the real `pluglet run` binary and real peer processes, timed
//! only at points a black-box observer sees, the way the kubelet's own device manager and
//! plugin manager code was measured for the comparison in `BENCHMARKS.md` ("Measured from
//! outside").
//!
//! Run: `cargo bench -p pluglet --bench outside`. `PLUGLET_BENCH_ITERS` (default 200) sets the
//! iterations per timed row, `PLUGLET_BENCH_FIRST_RUNS` (default 10) the daemons started for
//! the "first registration of 10,000 devices" row and the memory per 10,000 devices;
//! `PLUGLET_BENCH_DAEMON_ARGS` adds options to every `pluglet run` (e.g. `--no-cdi`);
//! `PLUGLET_BENCH_BIN` names another `pluglet` binary to measure (an A/B of two builds).
//!
//! # Processes
//!
//! - the daemon: `pluglet run --root <tempdir>` (the release binary cargo builds for this
//!   bench), `RUST_LOG=warn`, its log in `<root>/pluglet.log`; its CDI specs in a fresh
//!   directory on the tmpfs `/dev/shm` (`--cdi-spec-dir`), as `/var/run/cdi` is a tmpfs on a
//!   systemd node (`PLUGLET_BENCH_CDI_DIR=root` leaves them under the root, on its disk); the
//!   daemon of the timed rows also serves `/metrics` on a loopback port, from which the
//!   allocation and release rows read how long each step inside the daemon took
//!   (`pluglet_device_stage_duration_seconds`, read after each allocation and its release,
//!   outside the timed calls; printed as p50 per step under the table);
//! - the peer: this same bench executable started again with `PLUGLET_OUTSIDE_PEER=<kubelet.sock
//!   path>` (so nothing else has to be built). It is a separate process with its own tokio
//!   runtime serving tonic gRPC on unix sockets: device plugins (`v1beta1.DevicePlugin`,
//!   registered the classic way by calling `Register` on `kubelet.sock`) and CSI drivers
//!   (`pluginregistration.Registration` + CSI `Node` on one socket in `plugins_registry/`, found
//!   by the daemon's watcher). The bench drives it with one command per line on its stdin; the
//!   peer answers on stdout with wall-clock timestamps (ns since the epoch, `CLOCK_REALTIME`,
//!   the clock both processes share): when it sent `Register`, when it sent a ListAndWatch
//!   update, when it received `GetInfo` and `NotifyRegistrationStatus`.
//!   With `PLUGLET_BENCH_PEER=python` the peer is `benches/outside_peer.py` instead (same
//!   commands, grpcio; the kubelet's figures were taken with Python peers): the bench makes a
//!   venv `<target>/outside-python` on first use (`pip install grpcio grpcio-tools`, so it needs
//!   the network once) unless `PLUGLET_BENCH_PYTHON` names an interpreter that has them, and
//!   generates the stubs from `proto/proto` on every run.
//!
//! # Observation points
//!
//! - "devices visible": the inotify event of the rename of `kubelet_internal_checkpoint` in the
//!   device plugins directory that carries them (the device manager writes it as the kubelet
//!   does: temporary file, fsync, rename). On each rename event the bench reads the file and
//!   checks for the devices it waits for; as it reads right after the event, the timestamp can
//!   be attributed to an earlier rename only when a later one happened within that read's few
//!   tens of µs. No polling.
//! - "socket created": the inotify create event of the CSI peer's socket in `plugins_registry/`.
//! - `Register` sent, ListAndWatch update sent, `GetInfo` received, `Notify` received: the peer's
//!   own timestamps.
//! - allocations, releases and the bare admin round trip: `Allocate`, `Release` and
//!   `ListAllocations` of the admin API (`proto/proto/admin.proto`) called from this process on
//!   one kept-open connection to `<root>/pluglet.sock`, timed around the call.
//!
//! # Rows and floors
//!
//! Every iteration of a row also takes one sample of its floor, what the row cannot avoid, from
//! freshly measured parts (the floor's p50 is that of the per-iteration sums):
//!
//! - peer RT: one `GetDevicePluginOptions` round trip from the bench to the peer's device plugin
//!   socket (a bare tonic unary call on a unix socket, kept-open connection);
//! - peer Allocate RT: the peer's `Allocate` called directly with the same device ids, right
//!   after the daemon's call in even iterations and right before it in odd ones (a peer that has
//!   just answered answers faster than one woken from a wait, as the daemon's call always finds
//!   it; the samples taken after the daemon's call are also printed on their own);
//! - fsync: `pwrite` of 64 bytes + `fdatasync` of a file in the directory the daemon writes to
//!   (device plugins dir for the checkpoint rows, state dir for the allocation journal); for the
//!   10,000-device rows, a file of the checkpoint's size; the same small write and
//!   `fdatasync` is also sampled right after the 1-id peer `Allocate`s taken after the daemon's
//!   call and printed on its own (not part of any floor): what one `fdatasync` costs when it
//!   follows a peer's answer, as the daemon's journal record does;
//! - admin RT: `ListAllocations` with no allocations.
//! - peer delivery (10k): the peer flips device 0 of another plugin of 10,000 devices that it
//!   serves without registering (`serve`), and a bare ListAndWatch receiver in the bench (a
//!   codec that reads only the message's length) times from the peer's `SENT` to the last byte
//!   in: what any receiver waits before it can start on such an update (the peer clones,
//!   encodes and writes 10,000 devices; the daemon pays that too).
//!
//! | row | from → to | floor |
//! |---|---|---|
//! | Register → visible | peer sends `Register` (8 new device ids for one resource, re-registered on a new socket each time) → checkpoint rename carrying them | 2 × peer RT + fsync |
//! | 10k update → visible | peer sends one ListAndWatch update of 10,000 devices (device 0's health flipped) → checkpoint rename reflecting it | peer delivery (10k) + fsync (checkpoint size) |
//! | first registration of 10k | `Register` of a new resource of 10,000 devices on a freshly started daemon (warm compile cache) → visible | 2 × peer RT + fsync (checkpoint size) |
//! | allocate k of n | admin `Allocate` round trip (one new pod each time) | admin RT + peer Allocate RT + fsync |
//! | release | admin `Release` of that pod | admin RT + fsync |
//! | admin bare RT | `ListAllocations`, no allocations | peer RT |
//! | GetInfo → Notify | the CSI peer receives `GetInfo` → receives `NotifyRegistrationStatus` | 2 × peer RT |
//! | socket created → Notify | inotify create of the CSI peer's socket → the peer receives `Notify` | 3 × peer RT |
//!
//! The kubelet's figures (same rows, kubelet v1.24 code, Python peers, 2-core VM) are constants
//! below; the table prints Pluglet / kubelet for p50 and p99.
//!
//! # Memory
//!
//! `VmRSS` and `VmHWM` from `/proc/<daemon pid>/status`:
//! - start with a cold compile cache (fresh root) and a warm one (second start on that root):
//!   read when the admin socket first answers and again after the settle;
//! - idle, no plugin, and idle with one device plugin of 8 devices;
//! - added per device plugin (10 more plugins of 8 devices) and per 10,000 devices (median
//!   over the first-registration daemons).
//!
//! "Idle" means: the event awaited happened (devices visible in the checkpoint, admin
//! `ListAllocations` answered), then a fixed settle of `SETTLE` (1 s) so that work the
//! allocators release lazily is counted as it stands at rest; that settle is part of the
//! definition, not a guess at readiness.

#![allow(missing_docs)]

use std::fs::File;
use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pluglet_proto::admin::v1 as admin;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_proto::v1beta1;
use pluglet_proto::v1beta1::device_plugin_client::DevicePluginClient;
use pluglet_uds::Channel;

const PLUGLET: &str = env!("CARGO_BIN_EXE_pluglet");
/// Set (to the `kubelet.sock` path) when this executable runs as the peer.
const PEER_ENV: &str = "PLUGLET_OUTSIDE_PEER";
/// The settle before an idle memory reading (part of the definition of "idle").
const SETTLE: Duration = Duration::from_secs(1);
/// How long any single awaited event may take before the bench gives up.
const TIMEOUT: Duration = Duration::from_secs(60);
const CHECKPOINT: &str = "kubelet_internal_checkpoint";
/// The daemon measured: `PLUGLET_BENCH_BIN` if set (to compare two builds in alternating runs
/// under the same VM state), else the `pluglet` this bench was built with.
fn daemon_binary() -> String {
    std::env::var("PLUGLET_BENCH_BIN").unwrap_or_else(|_| PLUGLET.to_owned())
}

/// Options `PLUGLET_BENCH_DAEMON_ARGS` adds to `pluglet run` (split at whitespace).
fn daemon_args() -> Vec<String> {
    std::env::var("PLUGLET_BENCH_DAEMON_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// The Python peer (`PLUGLET_BENCH_PEER=python`).
const PYTHON_PEER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/outside_peer.py");

/// The kubelet's figures, ms (p50, p99; one figure given as both).
const KUBELET_REGISTER: (f64, f64) = (7.77, 11.3);
const KUBELET_UPDATE_10K: (f64, f64) = (11.4, 16.8);
const KUBELET_FIRST_10K: (f64, f64) = (60.5, 60.5);
const KUBELET_ALLOC_1_OF_8: (f64, f64) = (1.30, 1.88);
const KUBELET_ALLOC_1_OF_1024: (f64, f64) = (1.46, 4.97);
const KUBELET_ALLOC_1024_OF_1024: (f64, f64) = (11.0, 15.6);
const KUBELET_RELEASE: (f64, f64) = (0.05, 0.07);
const KUBELET_ADMIN_RT: (f64, f64) = (0.09, 0.17);
const KUBELET_GETINFO_NOTIFY: (f64, f64) = (1.44, 5.03);
const KUBELET_SOCKET_NOTIFY: (f64, f64) = (522.0, 993.0);
/// The kubelet's resident memory, MB (device manager alone, one plugin of 8 devices).
const KUBELET_IDLE_RSS_MB: f64 = 31.9;

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos() as u64
}

fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    if let Some(kubelet) = std::env::var_os(PEER_ENV) {
        peer::run(PathBuf::from(kubelet));
        return;
    }
    bench::run();
}

/// The peer process: device plugins and CSI drivers driven by stdin commands.
mod peer {
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use pluglet_proto::csi::v1 as csi;
    use pluglet_proto::csi::v1::node_server::{Node, NodeServer};
    use pluglet_proto::pluginregistration as reg;
    use pluglet_proto::pluginregistration::registration_server::{
        Registration, RegistrationServer,
    };
    use pluglet_proto::v1beta1;
    use pluglet_proto::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
    use tokio::io::AsyncBufReadExt as _;
    use tokio::sync::watch;
    use tokio_stream::{Stream, StreamExt as _};
    use tonic::{Request, Response, Status};

    use super::now_ns;

    /// One fake device plugin: `n` devices `<prefix>-<k>`; device 0 can be flipped unhealthy.
    struct Devices {
        prefix: String,
        n: usize,
        zero_unhealthy: Mutex<bool>,
        list: watch::Sender<Vec<v1beta1::Device>>,
    }

    impl Devices {
        fn render(&self, zero_unhealthy: bool) -> Vec<v1beta1::Device> {
            (0..self.n)
                .map(|k| v1beta1::Device {
                    id: format!("{}-{k}", self.prefix),
                    health: if k == 0 && zero_unhealthy {
                        "Unhealthy"
                    } else {
                        "Healthy"
                    }
                    .into(),
                    topology: Some(v1beta1::TopologyInfo {
                        nodes: vec![v1beta1::NumaNode { id: 0 }],
                    }),
                })
                .collect()
        }
    }

    #[derive(Clone)]
    struct DeviceService(Arc<Devices>);

    type ListStream =
        Pin<Box<dyn Stream<Item = Result<v1beta1::ListAndWatchResponse, Status>> + Send>>;

    #[tonic::async_trait]
    impl DevicePlugin for DeviceService {
        async fn get_device_plugin_options(
            &self,
            _: Request<v1beta1::Empty>,
        ) -> Result<Response<v1beta1::DevicePluginOptions>, Status> {
            Ok(Response::new(v1beta1::DevicePluginOptions::default()))
        }

        type ListAndWatchStream = ListStream;

        async fn list_and_watch(
            &self,
            _: Request<v1beta1::Empty>,
        ) -> Result<Response<ListStream>, Status> {
            let stream = tokio_stream::wrappers::WatchStream::new(self.0.list.subscribe())
                .map(|devices| Ok(v1beta1::ListAndWatchResponse { devices }));
            Ok(Response::new(Box::pin(stream)))
        }

        async fn get_preferred_allocation(
            &self,
            _: Request<v1beta1::PreferredAllocationRequest>,
        ) -> Result<Response<v1beta1::PreferredAllocationResponse>, Status> {
            Err(Status::unimplemented("not offered"))
        }

        async fn allocate(
            &self,
            request: Request<v1beta1::AllocateRequest>,
        ) -> Result<Response<v1beta1::AllocateResponse>, Status> {
            let container_responses = request
                .into_inner()
                .container_requests
                .iter()
                .map(|r| v1beta1::ContainerAllocateResponse {
                    envs: [("BENCH_DEVICES".to_string(), r.devices_ids.join(","))].into(),
                    devices: r
                        .devices_ids
                        .iter()
                        .map(|id| v1beta1::DeviceSpec {
                            container_path: format!("/dev/bench/{id}"),
                            host_path: "/dev/null".into(),
                            permissions: "rw".into(),
                        })
                        .collect(),
                    ..Default::default()
                })
                .collect();
            Ok(Response::new(v1beta1::AllocateResponse {
                container_responses,
            }))
        }

        async fn pre_start_container(
            &self,
            _: Request<v1beta1::PreStartContainerRequest>,
        ) -> Result<Response<v1beta1::PreStartContainerResponse>, Status> {
            Ok(Response::new(v1beta1::PreStartContainerResponse {}))
        }
    }

    /// One CSI driver found through the watcher; prints `NOTIFY <name> <GetInfo received>
    /// <Notify received> <registered>` when notified.
    #[derive(Clone)]
    struct CsiService {
        name: String,
        get_info_at: Arc<Mutex<u64>>,
    }

    #[tonic::async_trait]
    impl Registration for CsiService {
        async fn get_info(
            &self,
            _: Request<reg::InfoRequest>,
        ) -> Result<Response<reg::PluginInfo>, Status> {
            *self.get_info_at.lock().unwrap() = now_ns();
            Ok(Response::new(reg::PluginInfo {
                r#type: "CSIPlugin".into(),
                name: self.name.clone(),
                endpoint: String::new(),
                supported_versions: vec!["1.0.0".into()],
            }))
        }

        async fn notify_registration_status(
            &self,
            request: Request<reg::RegistrationStatus>,
        ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
            let at = now_ns();
            let status = request.into_inner();
            let got = *self.get_info_at.lock().unwrap();
            println!(
                "NOTIFY {} {got} {at} {}",
                self.name, status.plugin_registered
            );
            Ok(Response::new(reg::RegistrationStatusResponse {}))
        }
    }

    #[tonic::async_trait]
    impl Node for CsiService {
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

    /// Binds `socket` and serves a device plugin of `n` devices `<prefix>-<k>` on it.
    fn serve_devices(socket: &Path, prefix: &str, n: usize) -> Arc<Devices> {
        let devices = Arc::new(Devices {
            prefix: prefix.into(),
            n,
            zero_unhealthy: Mutex::new(false),
            list: watch::Sender::new(Vec::new()),
        });
        devices.list.send_replace(devices.render(false));
        let listener = pluglet_uds::bind(socket, None).expect("bind device plugin socket");
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DevicePluginServer::new(DeviceService(devices.clone())))
                .serve_with_incoming(pluglet_uds::incoming(listener)),
        );
        devices
    }

    /// Binds `socket`, serves the device plugin, calls `Register`; prints `REG <sent> <answered>`.
    async fn device_plugin(
        kubelet: &Path,
        resource: &str,
        socket: &Path,
        prefix: &str,
        n: usize,
    ) -> Arc<Devices> {
        let devices = serve_devices(socket, prefix, n);
        let channel = pluglet_uds::connect(kubelet, Duration::from_secs(10))
            .await
            .expect("dial kubelet.sock");
        let mut client = v1beta1::registration_client::RegistrationClient::new(channel);
        let request = v1beta1::RegisterRequest {
            version: "v1beta1".into(),
            endpoint: socket
                .file_name()
                .expect("socket file name")
                .to_string_lossy()
                .into_owned(),
            resource_name: resource.into(),
            options: Some(v1beta1::DevicePluginOptions::default()),
        };
        let sent = now_ns();
        client.register(request).await.expect("Register");
        println!("REG {sent} {}", now_ns());
        devices
    }

    /// Serves a CSI driver on `socket`; prints `BOUND <name> <bind returned>`.
    fn csi_driver(socket: &Path, name: &str) {
        let listener = pluglet_uds::bind(socket, None).expect("bind CSI socket");
        println!("BOUND {name} {}", now_ns());
        let service = CsiService {
            name: name.into(),
            get_info_at: Arc::new(Mutex::new(0)),
        };
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(service.clone()))
                .add_service(NodeServer::new(service))
                .serve_with_incoming(pluglet_uds::incoming(listener)),
        );
    }

    pub fn run(kubelet: PathBuf) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("peer runtime");
        rt.block_on(async {
            let mut plugins: HashMap<String, Arc<Devices>> = HashMap::new();
            let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
            while let Some(line) = lines.next_line().await.expect("read stdin") {
                let words: Vec<&str> = line.split_whitespace().collect();
                match words.as_slice() {
                    ["dp", resource, socket, prefix, n] => {
                        let devices = device_plugin(
                            &kubelet,
                            resource,
                            Path::new(socket),
                            prefix,
                            n.parse().expect("device count"),
                        )
                        .await;
                        plugins.insert((*socket).to_string(), devices);
                    }
                    ["serve", socket, prefix, n] => {
                        let devices =
                            serve_devices(Path::new(socket), prefix, n.parse().expect("count"));
                        plugins.insert((*socket).to_string(), devices);
                        println!("SERVING {}", now_ns());
                    }
                    ["flip", socket] => {
                        let devices = &plugins[*socket];
                        let mut zero = devices.zero_unhealthy.lock().unwrap();
                        *zero = !*zero;
                        let list = devices.render(*zero);
                        let sent = now_ns();
                        devices.list.send_replace(list);
                        println!("SENT {sent}");
                    }
                    ["csi", socket, name] => csi_driver(Path::new(socket), name),
                    _ => panic!("peer: unknown command {line:?}"),
                }
            }
        });
        // Servers and ListAndWatch streams never end on their own.
        std::process::exit(0);
    }
}

/// The measuring side.
mod bench {
    use super::*;

    pub struct Daemon {
        child: Child,
    }

    impl Daemon {
        fn pid(&self) -> u32 {
            self.child.id()
        }

        fn stop(mut self) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = self.child.wait();
        }
    }

    impl Drop for Daemon {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// `(VmRSS, VmHWM)` of `pid`, kB.
    fn memory(pid: u32) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    fn mb(kb: u64) -> String {
        format!("{:.1} MB", kb as f64 / 1000.0)
    }

    /// inotify events (timestamp taken in the watcher's callback, ns) of the watched dirs.
    struct Events {
        watcher: notify::RecommendedWatcher,
        rx: mpsc::Receiver<(u64, notify::Event)>,
    }

    impl Events {
        fn new() -> Events {
            let (tx, rx) = mpsc::channel();
            let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
                if let Ok(event) = res {
                    let _ = tx.send((now_ns(), event));
                }
            })
            .expect("inotify watcher");
            Events { watcher, rx }
        }

        fn watch(&mut self, dir: &Path) {
            use notify::Watcher as _;
            self.watcher
                .watch(dir, notify::RecursiveMode::NonRecursive)
                .unwrap_or_else(|e| panic!("watch {}: {e}", dir.display()));
        }

        fn unwatch(&mut self, dir: &Path) {
            use notify::Watcher as _;
            let _ = self.watcher.unwatch(dir);
        }

        fn drain(&self) {
            while self.rx.try_recv().is_ok() {}
        }

        /// Waits for an event naming `path` (created, or renamed to it), not older than `since`
        /// (ns), for which `check` holds; returns its timestamp.
        fn wait_for(&self, path: &Path, since: u64, mut check: impl FnMut() -> bool) -> u64 {
            use notify::EventKind;
            use notify::event::ModifyKind;
            let deadline = Instant::now() + TIMEOUT;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let (at, event) = self
                    .rx
                    .recv_timeout(left)
                    .unwrap_or_else(|_| panic!("no awaited event on {}", path.display()));
                let kind_fits = matches!(
                    event.kind,
                    EventKind::Create(_) | EventKind::Modify(ModifyKind::Name(_))
                );
                if kind_fits
                    && at >= since
                    && event.paths.last().is_some_and(|p| p == path)
                    && check()
                {
                    return at;
                }
            }
        }

        /// Waits for a checkpoint rename in `dir`, not older than `since`, whose content
        /// satisfies `check`.
        fn checkpoint(&self, dir: &Path, since: u64, check: impl Fn(&str) -> bool) -> u64 {
            let path = dir.join(CHECKPOINT);
            self.wait_for(&path, since, || {
                std::fs::read_to_string(&path).is_ok_and(|text| check(&text))
            })
        }
    }

    /// The peer process and its stdout lines.
    struct Peer {
        child: Child,
        stdin: ChildStdin,
        lines: mpsc::Receiver<String>,
    }

    impl Peer {
        fn start(kubelet: &Path) -> Peer {
            let mut command = match python() {
                Some((python, stubs)) => {
                    let mut c = Command::new(python);
                    c.arg(PYTHON_PEER).arg(stubs).arg(kubelet);
                    c
                }
                None => {
                    let mut c = Command::new(std::env::current_exe().expect("own executable"));
                    c.env(PEER_ENV, kubelet).env("RUST_LOG", "warn");
                    c
                }
            };
            let mut child = command
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn peer");
            let stdin = child.stdin.take().expect("peer stdin");
            let stdout = child.stdout.take().expect("peer stdout");
            let (tx, lines) = mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
            Peer {
                child,
                stdin,
                lines,
            }
        }

        fn send(&mut self, command: &str) {
            writeln!(self.stdin, "{command}").expect("write to peer");
            self.stdin.flush().expect("flush peer stdin");
        }

        /// The next line, split in words, whose first word is `tag`.
        fn expect(&self, tag: &str) -> Vec<String> {
            let line = self
                .lines
                .recv_timeout(TIMEOUT)
                .unwrap_or_else(|_| panic!("the peer sent no {tag} line"));
            let words: Vec<String> = line.split_whitespace().map(str::to_string).collect();
            assert_eq!(words.first().map(String::as_str), Some(tag), "peer: {line}");
            words
        }

        /// Starts a device plugin and registers it; returns when `Register` was sent (ns).
        fn device_plugin(&mut self, resource: &str, socket: &Path, prefix: &str, n: usize) -> u64 {
            self.send(&format!("dp {resource} {} {prefix} {n}", socket.display()));
            self.expect("REG")[1].parse().expect("REG time")
        }
    }

    impl Drop for Peer {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// With `PLUGLET_BENCH_PEER=python`: the interpreter and the generated stubs directory.
    /// The interpreter is `PLUGLET_BENCH_PYTHON`, or a venv `<target>/outside-python` created
    /// on first use with `pip install grpcio grpcio-tools`; the stubs are generated from
    /// `proto/proto` into `<target>/outside-python/stubs` on every run.
    fn python() -> Option<(PathBuf, PathBuf)> {
        static SETUP: std::sync::OnceLock<Option<(PathBuf, PathBuf)>> = std::sync::OnceLock::new();
        SETUP
            .get_or_init(|| {
                if std::env::var("PLUGLET_BENCH_PEER").ok()? != "python" {
                    return None;
                }
                // <target>/release/deps/outside-<hash>
                let exe = std::env::current_exe().expect("own executable");
                let target = exe.ancestors().nth(3).expect("target dir").to_path_buf();
                let home = target.join("outside-python");
                let python = match std::env::var_os("PLUGLET_BENCH_PYTHON") {
                    Some(p) => PathBuf::from(p),
                    None => {
                        let python = home.join("bin/python");
                        if !python.exists() {
                            run_setup(Command::new("python3").args(["-m", "venv"]).arg(&home));
                            run_setup(Command::new(&python).args([
                                "-m",
                                "pip",
                                "install",
                                "-q",
                                "grpcio",
                                "grpcio-tools",
                            ]));
                        }
                        python
                    }
                };
                let stubs = home.join("stubs");
                std::fs::create_dir_all(&stubs).expect("stubs dir");
                let protos = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/proto");
                run_setup(
                    Command::new(&python)
                        .args(["-m", "grpc_tools.protoc", "-I"])
                        .arg(&protos)
                        .arg(format!("--python_out={}", stubs.display()))
                        .arg(format!("--grpc_python_out={}", stubs.display()))
                        .args([
                            "deviceplugin.proto",
                            "pluginregistration.proto",
                            "csi.proto",
                        ]),
                );
                println!("peer: Python ({})", python.display());
                Some((python, stubs))
            })
            .clone()
    }

    fn run_setup(command: &mut Command) {
        let status = command.status().expect("run a setup command");
        assert!(status.success(), "{command:?} failed: {status}");
    }

    /// A file for the fsync floor: 64 bytes (or `size`) rewritten in place, then `fdatasync`.
    struct SyncFloor {
        file: File,
        data: Vec<u8>,
    }

    impl SyncFloor {
        fn new(dir: &Path, size: usize) -> SyncFloor {
            let file = File::options()
                .create(true)
                .truncate(true)
                .read(true)
                .write(true)
                .open(dir.join(format!(".bench-floor-{size}")))
                .expect("floor file");
            SyncFloor {
                file,
                data: vec![b'x'; size],
            }
        }

        fn sample(&mut self) -> Duration {
            self.data[0] = self.data[0].wrapping_add(1);
            let t = Instant::now();
            self.file.write_all_at(&self.data, 0).expect("floor write");
            self.file.sync_data().expect("fdatasync");
            t.elapsed()
        }
    }

    fn ns_between(from: u64, to: u64) -> Duration {
        Duration::from_nanos(to.saturating_sub(from))
    }

    /// A fresh root under /tmp, with the compile cache of the state dir `cache` (the directory
    /// `handler-cache` and its key `handler-cache.key`) copied in, so its start is warm.
    fn fresh_root(cache: Option<&Path>) -> tempfile::TempDir {
        let root = tempfile::Builder::new()
            .prefix("poutside")
            .tempdir_in("/tmp")
            .expect("tempdir");
        if let Some(state) = cache {
            copy_dir(
                &state.join("handler-cache"),
                &root.path().join("state/handler-cache"),
            );
            std::fs::copy(
                state.join("handler-cache.key"),
                root.path().join("state/handler-cache.key"),
            )
            .expect("copy the cache key");
        }
        root
    }

    fn copy_dir(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).expect("create cache copy");
        for entry in std::fs::read_dir(from).expect("read cache") {
            let entry = entry.expect("cache entry");
            let target = to.join(entry.file_name());
            if entry.file_type().expect("file type").is_dir() {
                copy_dir(&entry.path(), &target);
            } else {
                std::fs::copy(entry.path(), &target).expect("copy cache entry");
            }
        }
    }

    /// Where the daemon writes its CDI specs: a fresh directory on the tmpfs `/dev/shm`, as
    /// `/var/run/cdi` is on a systemd node, unless `PLUGLET_BENCH_CDI_DIR=root` (then the
    /// daemon's default under `--root`, on the disk of the temporary directory). `None`: the
    /// default.
    fn cdi_dir() -> Option<tempfile::TempDir> {
        if std::env::var("PLUGLET_BENCH_CDI_DIR").is_ok_and(|v| v == "root") {
            return None;
        }
        Some(
            tempfile::Builder::new()
                .prefix("pluglet-outside-cdi")
                .tempdir_in("/dev/shm")
                .expect("a directory in /dev/shm (set PLUGLET_BENCH_CDI_DIR=root to do without)"),
        )
    }

    /// Every step of the daemon's allocations and releases so far (`/metrics`,
    /// `pluglet_device_stage_duration_seconds`): (operation, stage) → seconds in total.
    type StageSums = std::collections::BTreeMap<(String, String), f64>;

    /// Reads [`StageSums`] from the daemon's `/metrics` at `addr` (one HTTP/1.1 GET).
    fn stage_sums(addr: &str) -> StageSums {
        use std::io::Read as _;
        let mut stream = std::net::TcpStream::connect(addr).expect("connect to /metrics");
        write!(
            stream,
            "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )
        .expect("send the GET");
        let mut text = String::new();
        stream.read_to_string(&mut text).expect("read /metrics");
        let mut sums = StageSums::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("pluglet_device_stage_duration_seconds_sum{") else {
                continue;
            };
            let Some((labels, value)) = rest.split_once("} ") else {
                continue;
            };
            let label = |name: &str| {
                labels.split(',').find_map(|kv| {
                    kv.strip_prefix(name)
                        .and_then(|v| v.strip_prefix("=\""))
                        .and_then(|v| v.strip_suffix('"'))
                        .map(str::to_owned)
                })
            };
            if let (Some(operation), Some(stage), Ok(value)) =
                (label("operation"), label("stage"), value.trim().parse())
            {
                sums.insert((operation, stage), value);
            }
        }
        sums
    }

    /// Everything one running daemon is observed and driven through.
    struct Node {
        daemon: Daemon,
        /// The `--metrics-addr` of a daemon started by [`Node::start_timed`].
        metrics_addr: Option<String>,
        _cdi_dir: Option<tempfile::TempDir>,
        rt: tokio::runtime::Runtime,
        admin: AdminClient<Channel>,
        events: Events,
        dp_dir: PathBuf,
        registry: PathBuf,
        state: PathBuf,
        start_to_ready: Duration,
    }

    impl Node {
        /// Starts `pluglet run --root <root>` and returns once the admin API answered (the
        /// creation of `pluglet.sock` is awaited through inotify, then `ListAllocations`).
        fn start(root: &Path) -> Node {
            Node::start_with(root, None)
        }

        /// [`Node::start`], with `/metrics` served on a free loopback port so that the
        /// allocation rows can read where each allocation's time went.
        fn start_timed(root: &Path) -> Node {
            let addr = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free loopback port")
                .to_string();
            Node::start_with(root, Some(addr))
        }

        fn start_with(root: &Path, metrics_addr: Option<String>) -> Node {
            let cdi_dir = cdi_dir();
            let mut extra: Vec<std::ffi::OsString> = Vec::new();
            if let Some(dir) = &cdi_dir {
                extra.push("--cdi-spec-dir".into());
                extra.push(dir.path().into());
            }
            if let Some(addr) = &metrics_addr {
                extra.push("--metrics-addr".into());
                extra.push(addr.into());
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            let mut events = Events::new();
            events.watch(root);
            let sock = root.join("pluglet.sock");
            let t0 = Instant::now();
            let daemon = Daemon {
                child: Command::new(daemon_binary())
                    .args(["run", "--root"])
                    .arg(root)
                    .args(extra)
                    .args(daemon_args())
                    .env("RUST_LOG", "warn")
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(File::create(root.join("pluglet.log")).expect("log file"))
                    .spawn()
                    .expect("spawn pluglet run"),
            };
            events.wait_for(&sock, 0, || true);
            let channel = rt
                .block_on(pluglet_uds::connect(&sock, TIMEOUT))
                .expect("dial the admin socket");
            let mut admin = AdminClient::new(channel);
            rt.block_on(admin.list_allocations(admin::ListAllocationsRequest {}))
                .expect("ListAllocations");
            let start_to_ready = t0.elapsed();
            events.unwatch(root);
            let dp_dir = root.join("device-plugins");
            let registry = root.join("plugins_registry");
            events.watch(&dp_dir);
            events.watch(&registry);
            events.drain();
            Node {
                daemon,
                metrics_addr,
                _cdi_dir: cdi_dir,
                rt,
                admin,
                events,
                dp_dir,
                registry,
                state: root.join("state"),
                start_to_ready,
            }
        }

        fn memory(&self) -> (u64, u64) {
            memory(self.daemon.pid())
        }

        fn admin_rt(&mut self) -> Duration {
            let t = Instant::now();
            self.rt
                .block_on(
                    self.admin
                        .list_allocations(admin::ListAllocationsRequest {}),
                )
                .expect("ListAllocations");
            t.elapsed()
        }

        /// Registers a plugin of `n` devices `<prefix>-<k>` for `resource` on `socket` (in the
        /// device plugins dir) and waits until they are visible; returns (Register sent,
        /// visible), ns.
        fn register(
            &mut self,
            peer: &mut Peer,
            resource: &str,
            socket: &str,
            prefix: &str,
            n: usize,
        ) -> (u64, u64) {
            let marker = format!("\"{prefix}-0\"");
            self.events.drain();
            let sent = peer.device_plugin(resource, &self.dp_dir.join(socket), prefix, n);
            let visible = self
                .events
                .checkpoint(&self.dp_dir, sent, |t| t.contains(&marker));
            (sent, visible)
        }

        fn dial_plugin(&self, socket: &str) -> DevicePluginClient<Channel> {
            DevicePluginClient::new(
                self.rt
                    .block_on(pluglet_uds::connect(&self.dp_dir.join(socket), TIMEOUT))
                    .expect("dial the peer"),
            )
        }

        fn settle_and_read(&mut self) -> (u64, u64) {
            self.admin_rt();
            std::thread::sleep(SETTLE);
            self.memory()
        }
    }

    fn peer_rt(rt: &tokio::runtime::Runtime, client: &mut DevicePluginClient<Channel>) -> Duration {
        let t = Instant::now();
        rt.block_on(client.get_device_plugin_options(v1beta1::Empty {}))
            .expect("GetDevicePluginOptions");
        t.elapsed()
    }

    fn peer_allocate(
        rt: &tokio::runtime::Runtime,
        client: &mut DevicePluginClient<Channel>,
        ids: &[String],
    ) -> Duration {
        let t = Instant::now();
        rt.block_on(client.allocate(v1beta1::AllocateRequest {
            container_requests: vec![v1beta1::ContainerAllocateRequest {
                devices_ids: ids.to_vec(),
            }],
        }))
        .expect("peer Allocate");
        t.elapsed()
    }

    /// A ListAndWatch codec that reads nothing of a message but its length: the floor's bare
    /// receiver, which has an update once its last byte is in.
    #[derive(Clone, Copy, Default)]
    struct LengthOnly;

    impl tonic::codec::Codec for LengthOnly {
        type Encode = v1beta1::Empty;
        type Decode = usize;
        type Encoder = LengthOnly;
        type Decoder = LengthOnly;

        fn encoder(&mut self) -> LengthOnly {
            LengthOnly
        }

        fn decoder(&mut self) -> LengthOnly {
            LengthOnly
        }
    }

    impl tonic::codec::Encoder for LengthOnly {
        type Item = v1beta1::Empty;
        type Error = tonic::Status;

        fn encode(
            &mut self,
            _: v1beta1::Empty,
            _: &mut tonic::codec::EncodeBuf<'_>,
        ) -> Result<(), tonic::Status> {
            Ok(())
        }
    }

    impl tonic::codec::Decoder for LengthOnly {
        type Item = usize;
        type Error = tonic::Status;

        fn decode(
            &mut self,
            buf: &mut tonic::codec::DecodeBuf<'_>,
        ) -> Result<Option<usize>, tonic::Status> {
            use prost::bytes::Buf as _;
            let len = buf.remaining();
            buf.advance(len);
            Ok(Some(len))
        }
    }

    /// Opens a ListAndWatch stream of its own on `socket` and reads its first update.
    fn bare_watch(rt: &tokio::runtime::Runtime, socket: &Path) -> tonic::Streaming<usize> {
        rt.block_on(async {
            let channel = pluglet_uds::connect(socket, TIMEOUT)
                .await
                .expect("dial the peer");
            let mut grpc = tonic::client::Grpc::new(channel);
            grpc.ready().await.expect("peer ready");
            let path = tonic::codegen::http::uri::PathAndQuery::from_static(
                "/v1beta1.DevicePlugin/ListAndWatch",
            );
            let mut stream = grpc
                .server_streaming(tonic::Request::new(v1beta1::Empty {}), path, LengthOnly)
                .await
                .expect("open ListAndWatch")
                .into_inner();
            stream
                .message()
                .await
                .expect("first update")
                .expect("a first update");
            stream
        })
    }

    /// One printed row.
    struct Row {
        name: &'static str,
        samples: Vec<Duration>,
        floor: Vec<Duration>,
        kubelet: Option<(f64, f64)>,
        /// Per step inside the daemon (stage label → seconds, one per operation).
        stages: std::collections::BTreeMap<String, Vec<f64>>,
    }

    impl Row {
        fn new(name: &'static str, kubelet: Option<(f64, f64)>) -> Row {
            Row {
                name,
                samples: Vec::new(),
                floor: Vec::new(),
                kubelet,
                stages: Default::default(),
            }
        }
    }

    fn pct(sorted: &[Duration], p: f64) -> f64 {
        let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
        sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e3
    }

    fn print_rows(rows: &mut [Row]) {
        println!(
            "\n{:<42} {:>5} {:>9} {:>9} {:>9} {:>7}   {:>17} {:>13}",
            "row (ms)",
            "n",
            "p50",
            "p99",
            "floor p50",
            "p50/fl",
            "kubelet p50/p99",
            "ratio p50/p99"
        );
        for row in rows.iter_mut() {
            if row.samples.is_empty() {
                continue;
            }
            row.samples.sort();
            row.floor.sort();
            let (p50, p99) = (pct(&row.samples, 0.5), pct(&row.samples, 0.99));
            let floor = if row.floor.is_empty() {
                f64::NAN
            } else {
                pct(&row.floor, 0.5)
            };
            let (kubelet, ratio) = match row.kubelet {
                Some((k50, k99)) => (
                    format!("{k50:.2} / {k99:.2}"),
                    format!("{:.2} / {:.2}", p50 / k50, p99 / k99),
                ),
                None => ("—".into(), "—".into()),
            };
            println!(
                "{:<42} {:>5} {:>9.3} {:>9.3} {:>9} {:>7}   {:>17} {:>13}",
                row.name,
                row.samples.len(),
                p50,
                p99,
                if floor.is_nan() {
                    "—".to_string()
                } else {
                    format!("{floor:.3}")
                },
                if floor.is_nan() {
                    "—".to_string()
                } else {
                    format!("{:.2}", p50 / floor)
                },
                kubelet,
                ratio
            );
        }
    }

    /// The steps of the daemon's allocations and releases, in their order (the `stage` values
    /// of `pluglet_device_stage_duration_seconds`).
    const STAGES: [&str; 9] = [
        "queue",
        "candidates",
        "preferred",
        "policy",
        "reserve",
        "plugin",
        "cdi",
        "commit",
        "cdi_remove",
    ];

    /// Where the rows' time went inside the daemon: p50 of each step, µs.
    fn print_stages(rows: &mut [Row]) {
        let shown: Vec<&str> = STAGES
            .into_iter()
            .filter(|stage| rows.iter().any(|r| r.stages.contains_key(*stage)))
            .collect();
        if shown.is_empty() {
            return;
        }
        println!(
            "\ninside the daemon, p50 per step in µs (/metrics pluglet_device_stage_duration_seconds; the p50s do not add up to the row's p50)"
        );
        let mut header = format!("{:<42}", "row");
        for stage in &shown {
            header += &format!(" {stage:>10}");
        }
        println!("{header}");
        for row in rows.iter_mut() {
            if row.stages.is_empty() {
                continue;
            }
            let mut line = format!("{:<42}", row.name);
            for stage in &shown {
                match row.stages.get_mut(*stage) {
                    Some(samples) if !samples.is_empty() => {
                        samples.sort_by(f64::total_cmp);
                        let p50 = samples[(samples.len() - 1) / 2] * 1e6;
                        line += &format!(" {p50:>10.0}");
                    }
                    _ => line += &format!(" {:>10}", "—"),
                }
            }
            println!("{line}");
        }
    }

    /// Adds what each step took since `before` to `allocate` (operation `allocate`) and
    /// `release` (operation `release`); returns the sums now.
    fn take_stages(
        addr: &str,
        before: &StageSums,
        allocate: &mut Row,
        release: &mut Row,
    ) -> StageSums {
        let now = stage_sums(addr);
        for ((operation, stage), total) in &now {
            let spent = total
                - before
                    .get(&(operation.clone(), stage.clone()))
                    .unwrap_or(&0.0);
            let row = match operation.as_str() {
                "allocate" => &mut *allocate,
                "release" => &mut *release,
                _ => continue,
            };
            if spent > 0.0 {
                row.stages.entry(stage.clone()).or_default().push(spent);
            }
        }
        now
    }

    pub fn run() {
        let iters = env_count("PLUGLET_BENCH_ITERS", 200);
        let first_runs = env_count("PLUGLET_BENCH_FIRST_RUNS", 10);
        println!(
            "pluglet measured from outside: {iters} iterations per row, {first_runs} first-registration daemons, {} peer, CDI specs {}",
            if python().is_some() { "Python" } else { "Rust" },
            if std::env::var("PLUGLET_BENCH_CDI_DIR").is_ok_and(|v| v == "root") {
                "under --root (PLUGLET_BENCH_CDI_DIR=root)"
            } else {
                "in /dev/shm (a tmpfs, as /var/run/cdi on a systemd node)"
            }
        );
        let mut memory_lines: Vec<String> = Vec::new();
        let mut note = |line: String| {
            println!("{line}");
            memory_lines.push(line);
        };

        // Cold start (fresh root), then warm start (same root, compile cache filled).
        let cache_root = fresh_root(None);
        let cold = Node::start(cache_root.path());
        let (rss, hwm) = cold.memory();
        let ready = cold.start_to_ready;
        std::thread::sleep(SETTLE);
        let (rss_s, hwm_s) = cold.memory();
        note(format!(
            "start, cold cache: ready in {:.0} ms; at ready RSS {} HWM {}; after settle RSS {} peak (HWM) {}",
            ready.as_secs_f64() * 1e3,
            mb(rss),
            mb(hwm),
            mb(rss_s),
            mb(hwm_s)
        ));
        cold.daemon.stop();

        let mut node = Node::start(cache_root.path());
        let (rss, hwm) = node.memory();
        let (rss_s, hwm_s) = node.settle_and_read();
        note(format!(
            "start, warm cache: ready in {:.0} ms; at ready RSS {} HWM {}; after settle RSS {} peak (HWM) {}",
            node.start_to_ready.as_secs_f64() * 1e3,
            mb(rss),
            mb(hwm),
            mb(rss_s),
            mb(hwm_s)
        ));
        note(format!(
            "idle, no plugin (`pluglet run --root`): RSS {} (HWM {})",
            mb(rss_s),
            mb(hwm_s)
        ));

        let mut peer = Peer::start(&node.dp_dir.join("kubelet.sock"));
        node.register(&mut peer, "bench.com/idle", "idle.sock", "i", 8);
        let (rss_one, hwm_one) = node.settle_and_read();
        note(format!(
            "idle, one plugin of 8 devices: RSS {} (HWM {}); kubelet device manager alone {KUBELET_IDLE_RSS_MB} MB",
            mb(rss_one),
            mb(hwm_one)
        ));
        let more = 10;
        for j in 0..more {
            node.register(
                &mut peer,
                &format!("bench.com/m{j}"),
                &format!("m{j}.sock"),
                &format!("m{j}"),
                8,
            );
        }
        let (rss_more, hwm_more) = node.settle_and_read();
        note(format!(
            "per device plugin (10 more of 8 devices): +{:.0} kB each (RSS {}, HWM {})",
            (rss_more as f64 - rss_one as f64) / more as f64,
            mb(rss_more),
            mb(hwm_more)
        ));
        node.register(&mut peer, "bench.com/m10k", "m10k.sock", "n", 10_000);
        let (rss_10k, hwm_10k) = node.settle_and_read();
        note(format!(
            "one more plugin of 10,000 devices on that daemon: +{:.1} MB (RSS {}, HWM {})",
            (rss_10k as f64 - rss_more as f64) / 1000.0,
            mb(rss_10k),
            mb(hwm_10k)
        ));
        let handler_cache = cache_root.path().join("state");
        drop(peer);
        node.daemon.stop();
        drop(node.events);

        // The timed rows, on a fresh root with the warm compile cache copied in.
        let root = fresh_root(Some(&handler_cache));
        let mut node = Node::start_timed(root.path());
        let mut peer = Peer::start(&node.dp_dir.join("kubelet.sock"));
        let mut rows = timed_rows(&mut node, &mut peer, iters);
        drop(peer);
        node.daemon.stop();
        drop(node.events);

        // First registration of 10,000 devices: one fresh daemon each (warm cache).
        let mut first = Row::new(
            "first registration of 10k → visible",
            Some(KUBELET_FIRST_10K),
        );
        let mut per_10k = Vec::new();
        for run in 0..first_runs {
            let root = fresh_root(Some(&handler_cache));
            let mut node = Node::start(root.path());
            let mut peer = Peer::start(&node.dp_dir.join("kubelet.sock"));
            node.register(&mut peer, "bench.com/warm", "warm.sock", "w", 1);
            let (before, _) = node.settle_and_read();
            let (sent, visible) =
                node.register(&mut peer, "bench.com/first", "first.sock", "f", 10_000);
            first.samples.push(ns_between(sent, visible));
            let size = std::fs::metadata(node.dp_dir.join(CHECKPOINT))
                .map(|m| m.len() as usize)
                .unwrap_or(1);
            let (after, _) = node.settle_and_read();
            per_10k.push(after as i64 - before as i64);
            let mut client = node.dial_plugin("first.sock");
            let mut sync = SyncFloor::new(&node.dp_dir, size);
            let floor =
                peer_rt(&node.rt, &mut client) + peer_rt(&node.rt, &mut client) + sync.sample();
            first.floor.push(floor);
            println!(
                "first registration daemon {run}: ready in {:.0} ms, checkpoint with 10,001 devices {size} bytes, RSS before {} after {}",
                node.start_to_ready.as_secs_f64() * 1e3,
                mb(before),
                mb(after)
            );
            drop(peer);
            node.daemon.stop();
        }
        per_10k.sort();
        if !per_10k.is_empty() {
            note(format!(
                "per 10,000 devices on a fresh daemon (one plugin, settled, median of {}): {:+.1} MB (range {:+.1} to {:+.1})",
                per_10k.len(),
                per_10k[per_10k.len() / 2] as f64 / 1000.0,
                per_10k[0] as f64 / 1000.0,
                per_10k[per_10k.len() - 1] as f64 / 1000.0
            ));
        }
        rows.insert(2, first);

        println!("\nmemory (VmRSS / VmHWM of the daemon):");
        for line in &memory_lines {
            println!("  {line}");
        }
        print_rows(&mut rows);
        print_stages(&mut rows);
    }

    /// Every row timed on one daemon.
    fn timed_rows(node: &mut Node, peer: &mut Peer, iters: usize) -> Vec<Row> {
        let mut admin_row = Row::new("admin bare round trip", Some(KUBELET_ADMIN_RT));
        let mut register = Row::new("Register → devices visible", Some(KUBELET_REGISTER));
        let mut update = Row::new(
            "ListAndWatch update of 10k → visible",
            Some(KUBELET_UPDATE_10K),
        );
        let mut a1_8 = Row::new("allocate 1 of 8", Some(KUBELET_ALLOC_1_OF_8));
        let mut a1_1024 = Row::new("allocate 1 of 1,024", Some(KUBELET_ALLOC_1_OF_1024));
        let mut a1024 = Row::new("allocate 1,024 of 1,024", Some(KUBELET_ALLOC_1024_OF_1024));
        let mut release = Row::new("release", Some(KUBELET_RELEASE));
        let mut get_info = Row::new("watcher: GetInfo → Notify", Some(KUBELET_GETINFO_NOTIFY));
        let mut created = Row::new(
            "watcher: socket created → Notify",
            Some(KUBELET_SOCKET_NOTIFY),
        );

        // The plugins the allocation rows use, and one for the floors' peer round trips.
        node.register(peer, "bench.com/a8", "a8.sock", "e", 8);
        node.register(peer, "bench.com/a1024", "a1024.sock", "k", 1024);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let dial = |socket: &str| {
            DevicePluginClient::new(
                rt.block_on(pluglet_uds::connect(&node.dp_dir.join(socket), TIMEOUT))
                    .expect("dial the peer"),
            )
        };
        let mut floor_client = dial("a8.sock");
        let mut a1024_client = dial("a1024.sock");
        let mut dp_sync = SyncFloor::new(&node.dp_dir, 64);
        // The floors' parts, printed as rows of their own.
        let mut part_peer = Row::new("  part: peer RT (GetDevicePluginOptions)", None);
        let mut part_dp_sync = Row::new("  part: fsync 64 B, device plugins dir", None);
        let mut part_state_sync = Row::new("  part: fsync 64 B, state dir", None);
        let mut part_big_sync = Row::new("  part: fsync checkpoint-size file", None);
        let mut part_alloc_1 = Row::new("  part: peer Allocate RT, 1 id", None);
        let mut part_alloc_1024 = Row::new("  part: peer Allocate RT, 1,024 ids", None);
        let mut part_alloc_1_after = Row::new("    of which right after the daemon's call", None);
        let mut part_delivery = Row::new("  part: peer delivers a 10k update", None);
        let mut state_sync = SyncFloor::new(&node.state, 64);
        let mut part_sync_after_peer = Row::new("  part: fsync 64 B, after a peer Allocate", None);

        // Warm-up, not counted.
        for _ in 0..20 {
            node.admin_rt();
            peer_rt(&rt, &mut floor_client);
        }

        // Admin bare round trip (no allocations).
        for _ in 0..iters {
            admin_row.samples.push(node.admin_rt());
            let part = peer_rt(&rt, &mut floor_client);
            part_peer.samples.push(part);
            admin_row.floor.push(part);
        }

        // Register → visible: one resource, re-registered on a new socket with new ids.
        for i in 0..iters {
            let (sent, visible) = node.register(
                peer,
                "bench.com/reg",
                &format!("reg{i}.sock"),
                &format!("r{i}"),
                8,
            );
            register.samples.push(ns_between(sent, visible));
            let sync = dp_sync.sample();
            part_dp_sync.samples.push(sync);
            register
                .floor
                .push(peer_rt(&rt, &mut floor_client) + peer_rt(&rt, &mut floor_client) + sync);
        }

        // Allocations and releases: one new pod each time, released right after.
        let ids_1: Vec<String> = vec!["k-0".into()];
        let ids_1024: Vec<String> = (0..1024).map(|k| format!("k-{k}")).collect();
        let mut pod = 0usize;
        let metrics_addr = node.metrics_addr.clone();
        let mut sums = metrics_addr.as_deref().map(stage_sums);
        for iteration in 0..iters {
            // The peer's Allocate is sampled after the daemon's call in even iterations and
            // before it in odd ones, so that the floor meets the peer as often just woken from
            // a wait as the daemon's call does (a peer that has just answered answers faster).
            let floor_first = iteration % 2 == 1;
            for (row, resource, count) in [
                (&mut a1_8, "bench.com/a8", 1u32),
                (&mut a1_1024, "bench.com/a1024", 1),
                (&mut a1024, "bench.com/a1024", 1024),
            ] {
                pod += 1;
                let uid = format!("pod-{pod}");
                let (client, ids) = if resource == "bench.com/a8" {
                    (&mut floor_client, &ids_1)
                } else if count == 1 {
                    (&mut a1024_client, &ids_1)
                } else {
                    (&mut a1024_client, &ids_1024)
                };
                let before = floor_first.then(|| peer_allocate(&rt, client, ids));
                let t = Instant::now();
                let answer = node
                    .rt
                    .block_on(node.admin.allocate(admin::AllocateRequest {
                        pod_uid: uid.clone(),
                        container: "c".into(),
                        resource: resource.into(),
                        count,
                        ..Default::default()
                    }))
                    .expect("admin Allocate");
                row.samples.push(t.elapsed());
                assert_eq!(answer.into_inner().device_ids.len(), count as usize);
                let peer_part = match before {
                    Some(before) => before,
                    None => {
                        let after = peer_allocate(&rt, client, ids);
                        if count == 1 {
                            part_sync_after_peer.samples.push(state_sync.sample());
                            part_alloc_1_after.samples.push(after);
                        }
                        after
                    }
                };
                if count == 1 {
                    part_alloc_1.samples.push(peer_part);
                } else {
                    part_alloc_1024.samples.push(peer_part);
                }

                let t = Instant::now();
                node.rt
                    .block_on(node.admin.release(admin::ReleaseRequest {
                        pod_uid: uid,
                        container: String::new(),
                    }))
                    .expect("admin Release");
                release.samples.push(t.elapsed());

                let admin_part = node.admin_rt();
                let sync_part = state_sync.sample();
                part_state_sync.samples.push(sync_part);
                row.floor.push(admin_part + peer_part + sync_part);
                release.floor.push(admin_part + state_sync.sample());
                if let (Some(addr), Some(before)) = (metrics_addr.as_deref(), sums.as_ref()) {
                    sums = Some(take_stages(addr, before, row, &mut release));
                }
            }
        }

        // One ListAndWatch update of 10,000 devices: device 0's health flipped each time.
        node.register(peer, "bench.com/u10k", "u10k.sock", "u", 10_000);
        let size = std::fs::metadata(node.dp_dir.join(CHECKPOINT))
            .map(|m| m.len() as usize)
            .unwrap_or(1);
        let mut big_sync = SyncFloor::new(&node.dp_dir, size);
        let socket = node.dp_dir.join("u10k.sock");
        // The floor's delivery part: the same 10,000 devices served by the peer on a socket the
        // daemon does not know, read by a bare receiver of the bench's own.
        let bare_socket = node.dp_dir.join("f10k.sock");
        peer.send(&format!("serve {} f 10000", bare_socket.display()));
        peer.expect("SERVING");
        let mut bare = bare_watch(&rt, &bare_socket);
        for i in 0..iters {
            let unhealthy = i % 2 == 0;
            node.events.drain();
            peer.send(&format!("flip {}", socket.display()));
            let sent: u64 = peer.expect("SENT")[1].parse().expect("SENT time");
            let visible = node.events.checkpoint(&node.dp_dir, sent, |t| {
                t.contains("\"u-1\"") && t.contains("\"u-0\"") != unhealthy
            });
            update.samples.push(ns_between(sent, visible));
            let sync = big_sync.sample();
            part_big_sync.samples.push(sync);
            peer.send(&format!("flip {}", bare_socket.display()));
            let sent: u64 = peer.expect("SENT")[1].parse().expect("SENT time");
            rt.block_on(bare.message())
                .expect("the bare receiver's update")
                .expect("an update");
            let delivered = ns_between(sent, now_ns());
            part_delivery.samples.push(delivered);
            update.floor.push(delivered + sync);
        }
        drop(bare);

        // The watcher: one new CSI driver socket each time.
        for i in 0..iters {
            let name = format!("csi{i}.bench.com");
            let socket = node.registry.join(format!("csi{i}.sock"));
            node.events.drain();
            peer.send(&format!("csi {} {name}", socket.display()));
            peer.expect("BOUND");
            let made = node.events.wait_for(&socket, 0, || true);
            let words = peer.expect("NOTIFY");
            assert_eq!(words[1], name);
            assert_eq!(words[4], "true", "CSI registration refused");
            let got: u64 = words[2].parse().expect("GetInfo time");
            let notified: u64 = words[3].parse().expect("Notify time");
            get_info.samples.push(ns_between(got, notified));
            created.samples.push(ns_between(made, notified));
            let (a, b, c) = (
                peer_rt(&rt, &mut floor_client),
                peer_rt(&rt, &mut floor_client),
                peer_rt(&rt, &mut floor_client),
            );
            get_info.floor.push(a + b);
            created.floor.push(a + b + c);
        }

        vec![
            register,
            update,
            a1_8,
            a1_1024,
            a1024,
            release,
            admin_row,
            get_info,
            created,
            part_peer,
            part_alloc_1,
            part_alloc_1_after,
            part_alloc_1024,
            part_dp_sync,
            part_state_sync,
            part_sync_after_peer,
            part_big_sync,
            part_delivery,
        ]
    }
}
