//! Registration latency of the real `pluglet run` binary, measured from the plugin's side: from
//! the moment the plugin calls `bind()` on its registration socket until it has received
//! NotifyRegistrationStatus. The plugin servers (pluginregistration + CSI Node on one socket, so
//! every registration includes a NodeGetInfo round trip and the WASM validate and register hooks)
//! run in this process.
//!
//! Run: `cargo bench -p pluglet --bench registration` (release). Prints p50/p99 over sequential
//! registrations and the time until a burst of 1,000 sockets created after start is registered.
//! `PLUGLET_BENCH_SEQUENTIAL` and `PLUGLET_BENCH_BURST` change the counts; `PLUGLET_BIN` runs
//! another build's daemon. The part from GetInfo's arrival at the plugin to NotifyRegistrationStatus
//! is printed too.

#![allow(missing_docs)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pluglet_proto::csi::v1 as csi;
use pluglet_proto::csi::v1::node_server::{Node, NodeServer};
use pluglet_proto::pluginregistration as reg;
use pluglet_proto::pluginregistration::registration_server::{Registration, RegistrationServer};
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

/// Binds `path` (the clock starts just before `bind()`) and serves the plugin on it.
fn start_plugin(path: &Path, name: String) -> (Instant, oneshot::Receiver<Notified>) {
    let (tx, rx) = oneshot::channel();
    let plugin = Service(std::sync::Arc::new(Plugin {
        name,
        notified: Mutex::new(Some(tx)),
        get_info_at: Mutex::new(None),
    }));
    let t0 = Instant::now();
    let listener = tokio::net::UnixListener::bind(path).expect("bind plugin socket");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(plugin.clone()))
            .add_service(NodeServer::new(plugin))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    (t0, rx)
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

        // Warm-up (first connections, first handler instances), not counted.
        for i in 0..20 {
            let (_, rx) = start_plugin(&registry.join(format!("warm{i}.sock")), format!("warm{i}.example.com"));
            let (_, ok, err, _) = rx.await.expect("notified");
            assert!(ok, "warm-up registration refused: {err}");
        }

        let mut latencies = Vec::with_capacity(sequential);
        let mut info_to_notify = Vec::with_capacity(sequential);
        for i in 0..sequential {
            let (t0, rx) = start_plugin(&registry.join(format!("seq{i}.sock")), format!("seq{i}.example.com"));
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
            let (_, rx) = start_plugin(&registry.join(format!("burst{i}.sock")), format!("burst{i}.example.com"));
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
    });
    drop(daemon);
}
