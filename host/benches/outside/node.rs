//! The daemon under measurement: its process, its memory, a fresh root for it, and everything
//! one running daemon is observed and driven through ([`Node`]).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pluglet_proto::admin::v1 as admin;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_proto::v1beta1::device_plugin_client::DevicePluginClient;
use pluglet_uds::Channel;

use crate::events::Events;
use crate::peer_handle::Peer;
use crate::{SETTLE, TIMEOUT, daemon_args, daemon_binary};

pub struct Daemon {
    pub child: Child,
}

impl Daemon {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stop(mut self) {
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
pub fn memory(pid: u32) -> (u64, u64) {
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

pub fn mb(kb: u64) -> String {
    format!("{:.1} MB", kb as f64 / 1000.0)
}

/// A fresh root under /tmp, with the compile cache of the state dir `cache` (the directory
/// `handler-cache` and its key `handler-cache.key`) copied in, so its start is warm.
pub fn fresh_root(cache: Option<&Path>) -> tempfile::TempDir {
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

pub fn copy_dir(from: &Path, to: &Path) {
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
pub fn cdi_dir() -> Option<tempfile::TempDir> {
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

/// Everything one running daemon is observed and driven through.
pub struct Node {
    pub daemon: Daemon,
    /// The `--metrics-addr` of a daemon started by [`Node::start_timed`].
    pub metrics_addr: Option<String>,
    pub _cdi_dir: Option<tempfile::TempDir>,
    pub rt: tokio::runtime::Runtime,
    pub admin: AdminClient<Channel>,
    pub events: Events,
    pub dp_dir: PathBuf,
    pub registry: PathBuf,
    pub state: PathBuf,
    pub start_to_ready: Duration,
}

impl Node {
    /// Starts `pluglet run --root <root>` and returns once the admin API answered (the
    /// creation of `pluglet.sock` is awaited through inotify, then `ListAllocations`).
    pub fn start(root: &Path) -> Node {
        Node::start_with(root, None)
    }

    /// [`Node::start`], with `/metrics` served on a free loopback port so that the
    /// allocation rows can read where each allocation's time went.
    pub fn start_timed(root: &Path) -> Node {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .to_string();
        Node::start_with(root, Some(addr))
    }

    pub fn start_with(root: &Path, metrics_addr: Option<String>) -> Node {
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

    pub fn memory(&self) -> (u64, u64) {
        memory(self.daemon.pid())
    }

    pub fn admin_rt(&mut self) -> Duration {
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
    pub fn register(
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

    pub fn dial_plugin(&self, socket: &str) -> DevicePluginClient<Channel> {
        DevicePluginClient::new(
            self.rt
                .block_on(pluglet_uds::connect(&self.dp_dir.join(socket), TIMEOUT))
                .expect("dial the peer"),
        )
    }

    pub fn settle_and_read(&mut self) -> (u64, u64) {
        self.admin_rt();
        std::thread::sleep(SETTLE);
        self.memory()
    }
}
