//! `example-device-plugin`: a fake Kubernetes device plugin for tests and demos.
//!
//! It serves `v1beta1.DevicePlugin` on its own socket with `--devices N` fake devices named
//! `dev-0`, `dev-1`, … spread round-robin over `--numa-nodes K` NUMA nodes (0: no topology), and
//! registers in one or both of the kubelet's two ways:
//!
//! - classic: `--kubelet-socket PATH` calls `v1beta1.Registration/Register` on the kubelet's
//!   socket once its own service is up (the endpoint it sends is the file name of its socket, which
//!   must therefore sit in the same directory as the kubelet's socket). As real plugins do, it
//!   watches the kubelet's socket: when it is created again (the kubelet restarted, and removed
//!   the sockets beside it), the plugin serves its own socket again if it was removed and
//!   registers again;
//! - plugin watcher: `--reg-socket PATH` serves `pluginregistration.Registration` (type
//!   `DevicePlugin`, name = the resource, endpoint = the absolute path of its device socket,
//!   versions `["v1beta1"]`) and appends every `NotifyRegistrationStatus` to `--status-file` as a
//!   JSON line `{"plugin_registered":bool,"error":"..."}`.
//!
//! Test controls:
//! - `--health-file PATH`: polled every 20 ms; each line `<device id> <health>` (for example
//!   `dev-3 Unhealthy`) sets that device's health, devices not listed are `Healthy`; a change is
//!   sent on every open ListAndWatch stream as the full list. A line `+<id> <numa>` adds a device.
//! - `SIGUSR1` flips every device to `Unhealthy`, the next `SIGUSR1` back to the file's state.
//! - `--preferred` offers GetPreferredAllocation and answers the must-include ids plus the
//!   *last* available ids (by device number), so a test can tell the preference was honoured.
//! - `--pre-start` asks for PreStartContainer; `--fail-allocate` / `--fail-pre-start` make those
//!   RPCs fail; `--calls-file PATH` records every RPC as a JSON line `{"method":..,..}`.
//! - `--reregister`: when its device socket disappears (a kubelet restart deletes it), bind it
//!   again and register again, as real plugins do.
//!
//! Allocate answers, for the ids `a,b`: env `VENDOR_DEVICES=a,b`, a mount
//! `/var/run/vendor` → `/tmp/vendor/<resource with / as _>` (read-only), one device spec per id
//! (`/dev/vendor/<id>` → `/dev/null`, `rw`), annotation `vendor.com/devices=a,b`, and with
//! `--cdi-devices` one CDI device name `<resource>=<id>` per id (as a plugin that installs its
//! own CDI spec would; this one installs none, so a runtime cannot resolve those names).
//!
//! On SIGTERM or SIGINT it removes its sockets and exits 0. It prints `READY` on stdout once it
//! serves and (in the classic flow) has registered.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Parser;
use pluglet_proto::pluginregistration as reg;
use pluglet_proto::v1beta1;
use pluglet_proto::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt as _};
use tonic::{Request, Response, Status};

/// Command line.
#[derive(Parser, Debug, Clone)]
#[command(version, about = "A fake Kubernetes device plugin with test controls")]
#[command(group(clap::ArgGroup::new("door").required(true).multiple(true).args(["kubelet_socket", "reg_socket"])))]
struct Args {
    /// Extended resource name the devices are advertised under.
    #[arg(long, default_value = "vendor.com/gpu")]
    resource: String,
    /// Number of fake devices (`dev-0` … `dev-<N-1>`).
    #[arg(long, default_value_t = 2)]
    devices: usize,
    /// NUMA nodes the devices are spread over round-robin; 0 = devices without topology.
    #[arg(long, default_value_t = 1)]
    numa_nodes: i64,
    /// Socket serving v1beta1.DevicePlugin. Default (classic flow): `<resource>.sock` with `/`
    /// replaced by `_`, beside the kubelet socket.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Classic flow: the kubelet's registration socket to call Register on.
    #[arg(long)]
    kubelet_socket: Option<PathBuf>,
    /// Plugin-watcher flow: the registration socket to serve pluginregistration.Registration on.
    #[arg(long)]
    reg_socket: Option<PathBuf>,
    /// Watcher flow: where NotifyRegistrationStatus calls are appended as JSON lines.
    #[arg(long)]
    status_file: Option<PathBuf>,
    /// Control file with `<id> <health>` lines, polled every 20 ms.
    #[arg(long)]
    health_file: Option<PathBuf>,
    /// Offer GetPreferredAllocation (answers the last available ids).
    #[arg(long)]
    preferred: bool,
    /// Ask for PreStartContainer.
    #[arg(long)]
    pre_start: bool,
    /// Make every Allocate fail.
    #[arg(long)]
    fail_allocate: bool,
    /// Make every PreStartContainer fail.
    #[arg(long)]
    fail_pre_start: bool,
    /// Append every RPC received as a JSON line.
    #[arg(long)]
    calls_file: Option<PathBuf>,
    /// API version sent in Register / GetInfo (to test refusals).
    #[arg(long, default_value = "v1beta1")]
    api_version: String,
    /// Bind and register again when the device socket disappears (in the classic flow the
    /// plugin also registers again whenever the kubelet's socket is created again).
    #[arg(long)]
    reregister: bool,
    /// Answer Allocate with a CDI device name `<resource>=<id>` per device.
    #[arg(long)]
    cdi_devices: bool,
    /// Answer Allocate as the Kubernetes sample device plugin does: one identical device spec
    /// `/dev/null` → `/dev/null` (`rw`) per device allocated, and nothing else.
    #[arg(long)]
    dev_null_per_device: bool,
    /// Flip every device's health this many times a second, as SIGUSR1 does (load tests of
    /// what follows device health); 0: never.
    #[arg(long, default_value_t = 0)]
    flap_per_second: u32,
}

/// Device list as ListAndWatch sends it, plus the inputs it is computed from.
struct DeviceState {
    /// `(id, numa node or None)` in device order.
    devices: Vec<(String, Option<i64>)>,
    /// Health per id from the control file (absent = Healthy).
    overrides: BTreeMap<String, String>,
    /// SIGUSR1 toggles this: every device unhealthy.
    all_unhealthy: bool,
}

impl DeviceState {
    fn render(&self) -> Vec<v1beta1::Device> {
        self.devices
            .iter()
            .map(|(id, numa)| {
                let health = if self.all_unhealthy {
                    "Unhealthy".to_string()
                } else {
                    self.overrides
                        .get(id)
                        .cloned()
                        .unwrap_or_else(|| "Healthy".to_string())
                };
                v1beta1::Device {
                    id: id.clone(),
                    health,
                    topology: numa.map(|n| v1beta1::TopologyInfo {
                        nodes: vec![v1beta1::NumaNode { id: n }],
                    }),
                }
            })
            .collect()
    }
}

/// The plugin's shared state.
struct Plugin {
    args: Args,
    state: Mutex<DeviceState>,
    list: watch::Sender<Vec<v1beta1::Device>>,
    calls: Option<Mutex<std::fs::File>>,
}

impl Plugin {
    fn record(&self, line: serde_json::Value) {
        if let Some(file) = &self.calls {
            let mut file = file.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(err) = writeln!(file, "{line}") {
                tracing::warn!(%err, "cannot write the calls file");
            }
        }
    }

    /// Records a call of `method` with the device ids it got, and fails it when `fail` (the
    /// command-line `flag` that asked for it) is set.
    fn record_or_fail(
        &self,
        method: &str,
        devices: serde_json::Value,
        fail: bool,
        flag: &str,
    ) -> Result<(), Status> {
        self.record(serde_json::json!({
            "method": method,
            "devices": devices,
            "failed": fail,
        }));
        if fail {
            return Err(Status::internal(format!(
                "example-device-plugin: {method} fails on purpose ({flag})"
            )));
        }
        Ok(())
    }

    fn publish(&self) {
        let list = self
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .render();
        self.list.send_if_modified(|current| {
            if *current == list {
                false
            } else {
                *current = list;
                true
            }
        });
    }

    /// Reads the health control file and publishes the result when it changed.
    fn apply_health_file(&self, text: &str) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut overrides = BTreeMap::new();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let (Some(first), Some(second)) = (words.next(), words.next()) else {
                continue;
            };
            if let Some(id) = first.strip_prefix('+') {
                if !state.devices.iter().any(|(d, _)| d == id) {
                    state.devices.push((id.to_string(), second.parse().ok()));
                }
            } else {
                overrides.insert(first.to_string(), second.to_string());
            }
        }
        state.overrides = overrides;
        drop(state);
        self.publish();
    }

    /// Flips every device's health without a log line (`--flap-per-second`).
    fn toggle_all_unhealthy_quietly(&self) {
        {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.all_unhealthy = !state.all_unhealthy;
        }
        self.publish();
    }

    fn toggle_all_unhealthy(&self) {
        {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.all_unhealthy = !state.all_unhealthy;
            tracing::info!(
                all_unhealthy = state.all_unhealthy,
                "SIGUSR1: health flipped"
            );
        }
        self.publish();
    }

    fn device_number(id: &str) -> u64 {
        id.trim_start_matches(|c: char| !c.is_ascii_digit())
            .parse()
            .unwrap_or(u64::MAX)
    }

    fn options(&self) -> v1beta1::DevicePluginOptions {
        v1beta1::DevicePluginOptions {
            pre_start_required: self.args.pre_start,
            get_preferred_allocation_available: self.args.preferred,
        }
    }

    fn allocate_response(&self, ids: &[String]) -> v1beta1::ContainerAllocateResponse {
        if self.args.dev_null_per_device {
            let dev_null = v1beta1::DeviceSpec {
                container_path: "/dev/null".into(),
                host_path: "/dev/null".into(),
                permissions: "rw".into(),
            };
            return v1beta1::ContainerAllocateResponse {
                devices: vec![dev_null; ids.len()],
                ..Default::default()
            };
        }
        let joined = ids.join(",");
        v1beta1::ContainerAllocateResponse {
            envs: [("VENDOR_DEVICES".to_string(), joined.clone())].into(),
            mounts: vec![v1beta1::Mount {
                container_path: "/var/run/vendor".into(),
                host_path: format!("/tmp/vendor/{}", self.args.resource.replace('/', "_")),
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
            annotations: [("vendor.com/devices".to_string(), joined)].into(),
            cdi_devices: ids
                .iter()
                .filter(|_| self.args.cdi_devices)
                .map(|id| v1beta1::CdiDevice {
                    name: format!("{}={id}", self.args.resource),
                })
                .collect(),
        }
    }
}

/// The DevicePlugin service.
#[derive(Clone)]
struct DevicePluginService(Arc<Plugin>);

type DeviceStream =
    Pin<Box<dyn Stream<Item = Result<v1beta1::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for DevicePluginService {
    async fn get_device_plugin_options(
        &self,
        _request: Request<v1beta1::Empty>,
    ) -> Result<Response<v1beta1::DevicePluginOptions>, Status> {
        self.0
            .record(serde_json::json!({"method": "GetDevicePluginOptions"}));
        Ok(Response::new(self.0.options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _request: Request<v1beta1::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        self.0.record(serde_json::json!({"method": "ListAndWatch"}));
        let stream = tokio_stream::wrappers::WatchStream::new(self.0.list.subscribe())
            .map(|devices| Ok(v1beta1::ListAndWatchResponse { devices }));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<v1beta1::PreferredAllocationRequest>,
    ) -> Result<Response<v1beta1::PreferredAllocationResponse>, Status> {
        let mut responses = Vec::new();
        for req in request.into_inner().container_requests {
            let size = usize::try_from(req.allocation_size).unwrap_or(0);
            let mut answer: Vec<String> = req.must_include_device_i_ds.clone();
            let mut rest: Vec<&String> = req
                .available_device_i_ds
                .iter()
                .filter(|id| !answer.contains(id))
                .collect();
            rest.sort_by_key(|id| Plugin::device_number(id));
            while answer.len() < size {
                let Some(id) = rest.pop() else { break };
                answer.push(id.clone());
            }
            self.0.record(serde_json::json!({
                "method": "GetPreferredAllocation",
                "available": req.available_device_i_ds,
                "must_include": req.must_include_device_i_ds,
                "size": req.allocation_size,
                "answer": answer,
            }));
            responses.push(v1beta1::ContainerPreferredAllocationResponse {
                device_i_ds: answer,
            });
        }
        Ok(Response::new(v1beta1::PreferredAllocationResponse {
            container_responses: responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<v1beta1::AllocateRequest>,
    ) -> Result<Response<v1beta1::AllocateResponse>, Status> {
        let requests = request.into_inner().container_requests;
        let ids: Vec<&Vec<String>> = requests.iter().map(|r| &r.devices_ids).collect();
        let fail = self.0.args.fail_allocate;
        self.0
            .record_or_fail("Allocate", serde_json::json!(ids), fail, "--fail-allocate")?;
        let container_responses = requests
            .iter()
            .map(|r| self.0.allocate_response(&r.devices_ids))
            .collect();
        Ok(Response::new(v1beta1::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        request: Request<v1beta1::PreStartContainerRequest>,
    ) -> Result<Response<v1beta1::PreStartContainerResponse>, Status> {
        let ids = request.into_inner().devices_ids;
        let fail = self.0.args.fail_pre_start;
        self.0.record_or_fail(
            "PreStartContainer",
            serde_json::json!(ids),
            fail,
            "--fail-pre-start",
        )?;
        Ok(Response::new(v1beta1::PreStartContainerResponse {}))
    }
}

/// The plugin-watcher Registration service.
struct RegistrationService {
    plugin: Arc<Plugin>,
    endpoint: PathBuf,
    status_file: Option<Mutex<std::fs::File>>,
}

#[tonic::async_trait]
impl reg::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _request: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        self.plugin.record(serde_json::json!({"method": "GetInfo"}));
        Ok(Response::new(reg::PluginInfo {
            r#type: "DevicePlugin".into(),
            name: self.plugin.args.resource.clone(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: vec![self.plugin.args.api_version.clone()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        let line = serde_json::json!({
            "plugin_registered": status.plugin_registered,
            "error": status.error,
        });
        tracing::info!(%line, "NotifyRegistrationStatus");
        self.plugin.record(serde_json::json!({
            "method": "NotifyRegistrationStatus",
            "plugin_registered": status.plugin_registered,
            "error": status.error,
        }));
        if let Some(file) = &self.status_file {
            let mut file = file.lock().unwrap_or_else(|e| e.into_inner());
            writeln!(file, "{line}").map_err(|e| Status::internal(e.to_string()))?;
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

fn append_file(path: &Path) -> anyhow::Result<Mutex<std::fs::File>> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot open {} for appending", path.display()))?;
    Ok(Mutex::new(file))
}

/// Binds `path` and serves the DevicePlugin service on it in a background task.
fn serve_device_plugin(plugin: &Arc<Plugin>, path: &Path) -> anyhow::Result<()> {
    let listener = pluglet_uds::bind(path, None)
        .with_context(|| format!("cannot bind the device plugin socket {}", path.display()))?;
    let service = DevicePluginServer::new(DevicePluginService(plugin.clone()));
    let path = path.to_path_buf();
    tokio::spawn(async move {
        let result = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(pluglet_uds::incoming(listener))
            .await;
        if let Err(err) = result {
            tracing::error!(%err, socket = %path.display(), "device plugin server stopped");
        }
    });
    Ok(())
}

/// Calls Register on the kubelet socket (classic flow).
async fn register(args: &Args, kubelet_socket: &Path, socket: &Path) -> anyhow::Result<()> {
    let endpoint = socket
        .file_name()
        .context("the device socket has no file name")?
        .to_string_lossy()
        .into_owned();
    let channel = pluglet_uds::connect(kubelet_socket, Duration::from_secs(10))
        .await
        .with_context(|| {
            format!(
                "cannot dial the kubelet socket {}",
                kubelet_socket.display()
            )
        })?;
    let mut client = v1beta1::registration_client::RegistrationClient::new(channel);
    client
        .register(v1beta1::RegisterRequest {
            version: args.api_version.clone(),
            endpoint,
            resource_name: args.resource.clone(),
            options: Some(v1beta1::DevicePluginOptions {
                pre_start_required: args.pre_start,
                get_preferred_allocation_available: args.preferred,
            }),
        })
        .await
        .with_context(|| {
            format!(
                "Register of {} refused by {}",
                args.resource,
                kubelet_socket.display()
            )
        })?;
    tracing::info!(resource = %args.resource, "registered with the kubelet");
    Ok(())
}

/// Polls the health control file.
async fn watch_health_file(plugin: Arc<Plugin>, path: PathBuf) {
    let mut last: Option<String> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tick.tick().await;
        let text = tokio::fs::read_to_string(&path).await.unwrap_or_default();
        if last.as_deref() != Some(text.as_str()) {
            plugin.apply_health_file(&text);
            last = Some(text);
        }
    }
}

/// Watches the directory of the kubelet's socket (inotify) and sends a unit each time the
/// socket is created there; the watcher lives as long as the returned value.
fn watch_kubelet_socket(
    kubelet: &Path,
) -> anyhow::Result<(
    notify::RecommendedWatcher,
    tokio::sync::mpsc::UnboundedReceiver<()>,
)> {
    use notify::Watcher as _;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let name = kubelet.file_name().map(ToOwned::to_owned);
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        if matches!(event.kind, notify::EventKind::Create(_))
            && event.paths.iter().any(|p| p.file_name() == name.as_deref())
        {
            let _ = tx.send(());
        }
    })?;
    let dir = kubelet
        .parent()
        .context("the kubelet socket path has no directory")?;
    watcher
        .watch(dir, notify::RecursiveMode::NonRecursive)
        .with_context(|| format!("cannot watch {}", dir.display()))?;
    Ok((watcher, rx))
}

/// Keeps the plugin registered. In the classic flow it watches the kubelet's socket, as real
/// plugins do: when it is created again (the kubelet restarted, removing the sockets beside
/// it), the plugin serves its device socket again if it is gone and registers again (retried
/// every 50 ms, [`REGISTER_TRIES`] times at most). With `--reregister` a device socket that
/// disappears is served again (and registered again) too.
async fn keep_registered(plugin: Arc<Plugin>, socket: PathBuf) {
    /// Register attempts after a restart of the kubelet before the plugin waits for the next.
    const REGISTER_TRIES: u32 = 40;
    let kubelet = plugin.args.kubelet_socket.clone();
    let (_watcher, mut created) = match kubelet.as_deref().map(watch_kubelet_socket) {
        Some(Ok((watcher, created))) => (Some(watcher), Some(created)),
        Some(Err(err)) => {
            tracing::error!("{err:#}; the plugin will not register again by itself");
            (None, None)
        }
        None => (None, None),
    };
    let mut must_register = false;
    let mut tries = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        let kubelet_created = async {
            match created.as_mut() {
                Some(created) => created.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tick.tick() => {}
            Some(()) = kubelet_created => {
                tracing::info!("the kubelet's socket was created again: registering again");
                must_register = true;
                tries = 0;
            }
        }
        let gone = !socket.exists();
        if gone && (must_register || plugin.args.reregister) {
            tracing::info!(socket = %socket.display(), "device socket gone: serving it again");
            if let Err(err) = serve_device_plugin(&plugin, &socket) {
                tracing::error!("{err:#}");
                continue;
            }
            must_register = true;
        }
        if !must_register {
            continue;
        }
        match &kubelet {
            Some(kubelet) => match register(&plugin.args, kubelet, &socket).await {
                Ok(()) => must_register = false,
                Err(err) if tries + 1 >= REGISTER_TRIES => {
                    tracing::error!(
                        "{err:#}; waiting for the kubelet's socket to be created again"
                    );
                    must_register = false;
                }
                Err(err) => {
                    tries += 1;
                    tracing::warn!("{err:#}; trying again");
                }
            },
            None => must_register = false,
        }
    }
}

fn default_socket(args: &Args) -> anyhow::Result<PathBuf> {
    if let Some(socket) = &args.socket {
        return Ok(socket.clone());
    }
    let Some(kubelet) = &args.kubelet_socket else {
        bail!("--socket is required with --reg-socket alone");
    };
    let dir = kubelet
        .parent()
        .context("the kubelet socket path has no directory")?;
    Ok(dir.join(format!("{}.sock", args.resource.replace('/', "_"))))
}

/// Runs the plugin; an error is printed as one `error:` line with its causes (no backtrace),
/// exit status 1.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[tokio::main]
async fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let socket = default_socket(&args)?;
    let socket = std::path::absolute(&socket)
        .with_context(|| format!("cannot make {} absolute", socket.display()))?;
    if let Some(kubelet) = &args.kubelet_socket
        && socket.parent() != std::path::absolute(kubelet)?.parent()
    {
        bail!(
            "the device socket {} must sit beside the kubelet socket {} (Register sends its file name)",
            socket.display(),
            kubelet.display()
        );
    }

    let devices = (0..args.devices)
        .map(|i| {
            let numa = (args.numa_nodes > 0).then(|| i as i64 % args.numa_nodes);
            (format!("dev-{i}"), numa)
        })
        .collect();
    let state = DeviceState {
        devices,
        overrides: BTreeMap::new(),
        all_unhealthy: false,
    };
    let initial = state.render();
    let calls = args.calls_file.as_deref().map(append_file).transpose()?;
    let plugin = Arc::new(Plugin {
        args: args.clone(),
        state: Mutex::new(state),
        list: watch::Sender::new(initial),
        calls,
    });
    if let Some(path) = &args.health_file {
        if let Ok(text) = std::fs::read_to_string(path) {
            plugin.apply_health_file(&text);
        }
        tokio::spawn(watch_health_file(plugin.clone(), path.clone()));
    }

    let mut usr1 = signal(SignalKind::user_defined1())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;

    serve_device_plugin(&plugin, &socket)?;
    tracing::info!(socket = %socket.display(), resource = %args.resource, devices = args.devices, "serving DevicePlugin");

    if let Some(reg_socket) = &args.reg_socket {
        let listener = pluglet_uds::bind(reg_socket, None).with_context(|| {
            format!(
                "cannot bind the registration socket {}",
                reg_socket.display()
            )
        })?;
        let service = reg::registration_server::RegistrationServer::new(RegistrationService {
            plugin: plugin.clone(),
            endpoint: socket.clone(),
            status_file: args.status_file.as_deref().map(append_file).transpose()?,
        });
        tokio::spawn(async move {
            if let Err(err) = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(pluglet_uds::incoming(listener))
                .await
            {
                tracing::error!(%err, "registration server stopped");
            }
        });
        tracing::info!(socket = %reg_socket.display(), "serving pluginregistration.Registration");
    }
    if let Some(kubelet) = &args.kubelet_socket {
        register(&args, kubelet, &socket).await?;
    }
    if args.reregister || args.kubelet_socket.is_some() {
        tokio::spawn(keep_registered(plugin.clone(), socket.clone()));
    }
    if args.flap_per_second > 0 {
        let plugin = plugin.clone();
        let period = Duration::from_secs(1) / args.flap_per_second;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tick.tick().await;
                plugin.toggle_all_unhealthy_quietly();
            }
        });
    }
    println!("READY");

    loop {
        tokio::select! {
            _ = usr1.recv() => plugin.toggle_all_unhealthy(),
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
    for path in std::iter::once(&socket).chain(args.reg_socket.as_ref()) {
        if let Err(err) = std::fs::remove_file(path)
            && err.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(%err, socket = %path.display(), "cannot remove socket");
        }
    }
    tracing::info!("stopped");
    // ListAndWatch streams never end on their own, so a graceful server drain would wait forever.
    std::process::exit(0)
}
