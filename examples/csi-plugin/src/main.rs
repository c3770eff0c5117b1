//! A fake CSI node plugin, shaped like node-driver-registrar plus a CSI driver: a registration
//! socket serving `pluginregistration.Registration` (GetInfo, NotifyRegistrationStatus) and a CSI
//! socket serving `csi.v1.Identity` and `csi.v1.Node` (or both on one socket).
//!
//! For tests: `--status-file` appends one JSON line per call received (`get_info`,
//! `node_get_info`, `notify` with `plugin_registered` and `error`); `--hang-getinfo` and
//! `--hang-nodegetinfo` never answer; `--exit-on-refusal` exits 1 on a `false` notification (as
//! node-driver-registrar does); `--type` sends another plugin type. Sockets are removed on
//! SIGTERM/SIGINT.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use clap::Parser;
use pluglet_proto::csi::v1 as csi;
use pluglet_proto::csi::v1::identity_server::{Identity, IdentityServer};
use pluglet_proto::csi::v1::node_server::{Node, NodeServer};
use pluglet_proto::pluginregistration as reg;
use pluglet_proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use serde_json::json;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

/// A fake CSI node plugin registering through the plugin watcher.
#[derive(Debug, Clone, Parser)]
#[command(name = "example-csi-plugin", version, about)]
struct Args {
    /// Registration socket to create (in the registry directory).
    #[arg(long, value_name = "PATH")]
    reg_socket: PathBuf,
    /// CSI socket serving Identity and Node [default: the registration socket].
    #[arg(long, value_name = "PATH")]
    csi_socket: Option<PathBuf>,
    /// Endpoint to announce in GetInfo [default: the CSI socket, or empty when it is the
    /// registration socket].
    #[arg(long, value_name = "PATH")]
    endpoint: Option<String>,
    /// Driver name.
    #[arg(long, default_value = "csi.example.com")]
    name: String,
    /// Plugin type announced in GetInfo.
    #[arg(long = "type", default_value = "CSIPlugin")]
    plugin_type: String,
    /// Supported versions, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1.0.0")]
    versions: Vec<String>,
    /// NodeGetInfo node id (may be empty, to test refusals).
    #[arg(long, default_value = "node-1")]
    node_id: String,
    /// NodeGetInfo max volumes per node.
    #[arg(long, default_value_t = 0)]
    max_volumes: i64,
    /// NodeGetInfo topology segment KEY=VALUE (repeatable).
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_kv)]
    topology: Vec<(String, String)>,
    /// Never answer GetInfo.
    #[arg(long)]
    hang_getinfo: bool,
    /// Never answer NodeGetInfo.
    #[arg(long)]
    hang_nodegetinfo: bool,
    /// Append each call received as a JSON line to this file.
    #[arg(long, value_name = "PATH")]
    status_file: Option<PathBuf>,
    /// Exit with status 1 after a `false` registration status (like node-driver-registrar).
    #[arg(long)]
    exit_on_refusal: bool,
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

/// Appends JSON lines to the status file.
#[derive(Clone)]
struct StatusLog(Option<Arc<Mutex<std::fs::File>>>);

impl StatusLog {
    fn open(path: Option<&Path>) -> anyhow::Result<StatusLog> {
        Ok(StatusLog(match path {
            Some(p) => Some(Arc::new(Mutex::new(
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .with_context(|| format!("cannot open status file {}", p.display()))?,
            ))),
            None => None,
        }))
    }

    fn record(&self, line: serde_json::Value) {
        if let Some(f) = &self.0 {
            let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
            let _ = writeln!(f, "{line}");
            let _ = f.flush();
        }
    }
}

struct RegistrationService {
    args: Args,
    endpoint: String,
    log: StatusLog,
    refused: mpsc::UnboundedSender<String>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        self.log.record(json!({"event": "get_info"}));
        if self.args.hang_getinfo {
            std::future::pending::<()>().await;
        }
        Ok(Response::new(reg::PluginInfo {
            r#type: self.args.plugin_type.clone(),
            name: self.args.name.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: self.args.versions.clone(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        self.log.record(json!({
            "event": "notify",
            "plugin_registered": status.plugin_registered,
            "error": status.error,
        }));
        if status.plugin_registered {
            info!(name = %self.args.name, "registered");
        } else {
            warn!(name = %self.args.name, error = %status.error, "registration refused");
            if self.args.exit_on_refusal {
                let _ = self.refused.send(status.error);
            }
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

struct CsiService {
    args: Args,
    log: StatusLog,
}

#[tonic::async_trait]
impl Identity for CsiService {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: self.args.name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_owned(),
            manifest: HashMap::new(),
        }))
    }
}

#[tonic::async_trait]
impl Node for CsiService {
    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        self.log.record(json!({"event": "node_get_info"}));
        if self.args.hang_nodegetinfo {
            std::future::pending::<()>().await;
        }
        let segments: HashMap<String, String> = self.args.topology.iter().cloned().collect();
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: self.args.node_id.clone(),
            max_volumes_per_node: self.args.max_volumes,
            accessible_topology: (!segments.is_empty()).then_some(csi::Topology { segments }),
        }))
    }
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
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    let log = StatusLog::open(args.status_file.as_deref())?;
    let separate_csi = args
        .csi_socket
        .as_ref()
        .filter(|p| **p != args.reg_socket)
        .cloned();
    let endpoint = match (&args.endpoint, &separate_csi) {
        (Some(e), _) => e.clone(),
        (None, Some(csi)) => csi.display().to_string(),
        (None, None) => String::new(),
    };
    let cancel = CancellationToken::new();
    let (refused_tx, mut refused_rx) = mpsc::unbounded_channel();

    let csi_service = || CsiService {
        args: args.clone(),
        log: log.clone(),
    };
    let mut servers = Vec::new();
    // The CSI socket first, so the driver is up before the registration socket appears.
    if let Some(csi_path) = &separate_csi {
        let listener = pluglet_uds::bind(csi_path, None)
            .with_context(|| format!("cannot bind {}", csi_path.display()))?;
        let router = tonic::transport::Server::builder()
            .add_service(IdentityServer::new(csi_service()))
            .add_service(NodeServer::new(csi_service()));
        servers.push(tokio::spawn(router.serve_with_incoming_shutdown(
            pluglet_uds::incoming(listener),
            cancel.clone().cancelled_owned(),
        )));
    }
    let registration = RegistrationServer::new(RegistrationService {
        args: args.clone(),
        endpoint,
        log: log.clone(),
        refused: refused_tx,
    });
    let mut router = tonic::transport::Server::builder().add_service(registration);
    if separate_csi.is_none() {
        router = router
            .add_service(IdentityServer::new(csi_service()))
            .add_service(NodeServer::new(csi_service()));
    }
    let listener = pluglet_uds::bind(&args.reg_socket, None)
        .with_context(|| format!("cannot bind {}", args.reg_socket.display()))?;
    info!(reg_socket = %args.reg_socket.display(), name = %args.name, "serving");
    servers.push(tokio::spawn(router.serve_with_incoming_shutdown(
        pluglet_uds::incoming(listener),
        cancel.clone().cancelled_owned(),
    )));

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let exit_code = tokio::select! {
        _ = sigterm.recv() => 0,
        _ = sigint.recv() => 0,
        Some(error) = refused_rx.recv() => {
            warn!(%error, "exiting after refusal");
            1
        }
    };
    cancel.cancel();
    // A hanging call (--hang-*) never finishes; do not wait for it for long.
    let drain = async {
        for s in servers {
            let _ = s.await;
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), drain).await;
    let _ = std::fs::remove_file(&args.reg_socket);
    if let Some(p) = &separate_csi {
        let _ = std::fs::remove_file(p);
    }
    std::process::exit(exit_code);
}
