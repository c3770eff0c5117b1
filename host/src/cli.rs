//! Command-line types (clap). Parsing only: [`crate::config`] turns [`RunArgs`] into a
//! [`crate::config::Config`], [`crate::admin::ctl`] runs [`CtlArgs`].

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::handler_cmd::HandlerArgs;

/// `pluglet --version`: the package version, marked when the test hooks are compiled in.
#[cfg(not(feature = "test-hooks"))]
const VERSION: &str = env!("CARGO_PKG_VERSION");
/// `pluglet --version`: the package version, marked when the test hooks are compiled in.
#[cfg(feature = "test-hooks")]
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " +test-hooks");

/// `pluglet`: the kubelet's plugin manager and device manager as a node daemon, with per-plugin-type
/// logic in sandboxed WASM handlers.
#[derive(Debug, Parser)]
#[command(name = "pluglet", version = VERSION, about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level subcommands.
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant, reason = "parsed once per process")]
pub enum Command {
    /// Run the node daemon (plugin watcher, registration, device manager, admin API).
    Run(RunArgs),
    /// Query a running daemon over its admin socket.
    Ctl(CtlArgs),
    /// Check or exercise a handler module without a daemon.
    Handler(HandlerArgs),
    /// The daemon's compiler process: a component on stdin, its compiled artifact on stdout.
    #[command(hide = true)]
    CompileHandler,
}

/// Parses a duration such as `500ms`, `2m2s` or `10s`.
fn parse_duration(s: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(s)
}

/// What to write instead of an address that does not parse.
const SOCKET_ADDR_HINT: &str =
    "write an address and a port, such as 127.0.0.1:9810, [::1]:9810 or localhost:9810";

/// `ADDR:PORT` that is not an address and a port.
#[derive(Debug, thiserror::Error)]
pub enum SocketAddrError {
    /// A host name and port that resolve to nothing.
    #[error("{text:?} resolves to no address; {SOCKET_ADDR_HINT}")]
    NoAddress {
        /// What was given.
        text: String,
    },
    /// Neither an address nor a host name with a port.
    #[error("{text:?} is not an address and port ({source}); {SOCKET_ADDR_HINT}")]
    NotAnAddress {
        /// What was given.
        text: String,
        /// Why resolving it failed.
        #[source]
        source: std::io::Error,
    },
}

/// Parses `ADDR:PORT`: an IP address and a port, or a host name and a port (resolved now, the
/// first address taken), e.g. `127.0.0.1:9810`, `[::1]:9810`, `localhost:9810`.
pub fn parse_socket_addr(s: &str) -> Result<std::net::SocketAddr, SocketAddrError> {
    use std::net::ToSocketAddrs as _;
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    match s.to_socket_addrs() {
        Ok(mut addrs) => addrs
            .next()
            .ok_or_else(|| SocketAddrError::NoAddress { text: s.to_owned() }),
        Err(source) => Err(SocketAddrError::NotAnAddress {
            text: s.to_owned(),
            source,
        }),
    }
}

/// Format of the daemon's log lines on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line, with the current span's fields and the span list.
    Json,
}

impl LogFormat {
    /// The name used on the command line and in the configuration file.
    pub fn as_str(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

/// `pluglet run`. Every option except `--config` and `--print-config` can also be set in the
/// configuration file, under its name with `_` for `-`; the command line wins over the file.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Read settings from this TOML file (keys are the option names with `_` for `-`, e.g.
    /// `registry_dir`, `backoff_initial = "500ms"`); options given here win over the file.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration as TOML (a file that reproduces this run with
    /// `--config`) and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Put every path under DIR: DIR/plugins_registry, DIR/device-plugins, DIR/handlers,
    /// DIR/state, DIR/cdi and the admin socket DIR/pluglet.sock (for running as a non-root
    /// user).
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// Plugin registry directory watched for registration sockets
    /// [default: /var/lib/kubelet/plugins_registry, or DIR/plugins_registry with --root].
    #[arg(long, value_name = "DIR")]
    pub registry_dir: Option<PathBuf>,
    /// Device plugins directory (kubelet.sock, checkpoint)
    /// [default: /var/lib/kubelet/device-plugins, or DIR/device-plugins with --root].
    #[arg(long, value_name = "DIR")]
    pub device_plugins_dir: Option<PathBuf>,
    /// Handler modules and handlers.toml
    /// [default: /var/lib/pluglet/handlers, or DIR/handlers with --root].
    #[arg(long, value_name = "DIR")]
    pub handlers_dir: Option<PathBuf>,
    /// Pluglet's state directory (holds the daemon lock)
    /// [default: /var/lib/pluglet/state, or DIR/state with --root].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Directory each allocation is written to as a CDI spec (`pluglet-*.json`) that container
    /// runtimes read [default: /var/run/cdi, or DIR/cdi with --root, which runtimes do not
    /// read].
    #[arg(long, value_name = "DIR")]
    pub cdi_spec_dir: Option<PathBuf>,
    /// Write no CDI specs (allocations then carry only the plugin's own CDI names).
    #[arg(long)]
    pub no_cdi: bool,
    /// The kubelet's pod-resources API socket, for monitoring and topology agents
    /// [default: /var/lib/kubelet/pod-resources/kubelet.sock, or DIR/pod-resources/kubelet.sock
    /// with --root].
    #[arg(long, value_name = "PATH")]
    pub pod_resources_socket: Option<PathBuf>,
    /// Serve no pod-resources API.
    #[arg(long)]
    pub no_pod_resources: bool,
    /// Group given the pod-resources socket, which is then mode 0660 so that the group's
    /// members (a monitoring agent) can read it [default: mode 0600, the daemon's group].
    #[arg(long, value_name = "NAME")]
    pub pod_resources_socket_group: Option<String>,
    /// Requests per second the pod-resources API answers, over every method (kubelet: 100).
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub pod_resources_qps: u32,
    /// Requests the pod-resources API answers at once beyond its rate (kubelet: 10).
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub pod_resources_burst: u32,
    /// Admin API socket [default: /run/pluglet/pluglet.sock, or DIR/pluglet.sock with --root].
    #[arg(long, value_name = "PATH")]
    pub admin_socket: Option<PathBuf>,
    /// Permission bits of the admin socket, octal.
    #[arg(long, value_name = "MODE", default_value = "0600")]
    pub admin_socket_mode: String,
    /// Group given the admin socket after it is bound (with `--admin-socket-mode 0660`, members
    /// of the group can use `pluglet ctl`) [default: the daemon's own group].
    #[arg(long, value_name = "NAME")]
    pub admin_socket_group: Option<String>,
    /// Node name passed to handlers [default: the host name].
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
    /// First retry delay after a failed registration (kubelet: 500ms).
    #[arg(long, value_name = "DURATION", default_value = "500ms", value_parser = parse_duration)]
    pub backoff_initial: Duration,
    /// Cap of the doubling retry delay (kubelet: 2m2s).
    #[arg(long, value_name = "DURATION", default_value = "2m2s", value_parser = parse_duration)]
    pub backoff_max: Duration,
    /// Time allowed to connect to a plugin socket, retrying quickly while it is not yet listening
    /// (kubelet: 10s).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub dial_timeout: Duration,
    /// Deadline of GetInfo (kubelet: 1s).
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_duration)]
    pub getinfo_timeout: Duration,
    /// Deadline of NotifyRegistrationStatus (kubelet: 5s).
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub notify_timeout: Duration,
    /// Deadline of a CSI driver's NodeGetInfo at registration (kubelet: 2m).
    #[arg(long, value_name = "DURATION", default_value = "2m", value_parser = parse_duration)]
    pub nodegetinfo_timeout: Duration,
    /// Period of the safety-net rescan of the registry directory.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub resync_period: Duration,
    /// How long a device plugin resource whose plugin disconnected is kept (devices unhealthy)
    /// before it is removed, unless the plugin registers again (kubelet: 5m).
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration)]
    pub device_grace_period: Duration,
    /// The most containers one Allocate call asks a device plugin for. A plugin has one
    /// Allocate call at a time, as from the kubelet; the allocations that reach it while a
    /// call runs are asked for together in its next call. 1 asks for one container per call,
    /// as the kubelet does.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub device_allocate_batch: u32,
    /// Time allowed for stages to stop on SIGINT/SIGTERM.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// Handler calls that may run at once; more wait for a slot. Each slot reserves address
    /// space (not memory) for one call's sandbox: a smaller pool fits under tools that cannot
    /// map much, such as valgrind.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub handler_pool_size: u32,
    /// A minisign public key file (as `minisign -G` writes it) whose signatures of handler
    /// modules (`<module>.minisig`) are trusted; repeat for more keys. A present signature must
    /// verify by one of them.
    #[arg(long, value_name = "FILE")]
    pub trusted_key: Vec<PathBuf>,
    /// Refuse every configured handler module that is not signed by a trusted key.
    #[arg(long)]
    pub require_signatures: bool,
    /// How the registries of `oci://` handler modules are reached.
    #[command(flatten)]
    pub registry: crate::handler_oci::RegistryArgs,
    /// Serve `/metrics`, `/healthz` and `/readyz` over HTTP on ADDR:PORT (off unless set; the
    /// shipped unit and config use 127.0.0.1:9810).
    #[arg(long, value_name = "ADDR:PORT", value_parser = parse_socket_addr)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Publish this node's device plugin resources and CSI drivers to the Kubernetes API server
    /// of this kubeconfig file (its current context); off unless this or --in-cluster is set.
    #[arg(long, value_name = "FILE", conflicts_with = "in_cluster")]
    pub kubeconfig: Option<PathBuf>,
    /// Publish to the API server of the cluster Pluglet runs in, with its pod's service
    /// account.
    #[arg(long)]
    pub in_cluster: bool,
    /// Create the Node object named --node-name when it does not exist (with --node-labels);
    /// without it Pluglet waits for the Node to be created.
    #[arg(long)]
    pub register_node: bool,
    /// Labels of a Node created with --register-node: KEY=VALUE, comma-separated or repeated.
    #[arg(long, value_name = "KEY=VALUE", value_delimiter = ',')]
    pub node_labels: Vec<String>,
    /// How long the Lease of the handler rollout coordinator lasts unless renewed (renewed
    /// after two thirds of it); another daemon takes over within it when its holder dies.
    #[arg(long, value_name = "DURATION", default_value = "15s", value_parser = parse_duration)]
    pub coordinator_lease_duration: Duration,
    /// How long a resource whose device plugin is gone past its grace period stays on the Node
    /// at 0 before Pluglet removes it.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration)]
    pub removed_resource_linger: Duration,
    /// Format of the log lines on stderr.
    #[arg(long, value_name = "FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Which log lines to write: a tracing filter directive such as `info`, `debug` or
    /// `info,pluglet=debug` [default: RUST_LOG when set, else info].
    #[arg(long, value_name = "LEVEL")]
    pub log_level: Option<String>,
}

/// Output format of `pluglet ctl` and `pluglet handler` (`-o table|json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum OutputFormat {
    /// Aligned columns and lines for people (`text` is the same).
    #[default]
    #[value(alias = "text")]
    Table,
    /// JSON (wire strings, snake_case keys) for scripts.
    Json,
}

/// `pluglet ctl`. Its options are global: they may come before or after the subcommand.
#[derive(Debug, Clone, Args)]
pub struct CtlArgs {
    /// Talk to the daemon running with `--root DIR` (admin socket DIR/pluglet.sock).
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with = "admin_socket",
        global = true
    )]
    pub root: Option<PathBuf>,
    /// Admin socket of the daemon [default: /run/pluglet/pluglet.sock].
    #[arg(long, value_name = "PATH", global = true)]
    pub admin_socket: Option<PathBuf>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Table, global = true)]
    pub output: OutputFormat,
    /// Time allowed to reach the daemon.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration, global = true)]
    pub timeout: Duration,
    /// What to show.
    #[command(subcommand)]
    pub command: CtlCommand,
}

/// `pluglet ctl handlers` actions.
#[derive(Debug, Clone, Subcommand)]
pub enum HandlersAction {
    /// Puts the previous version of one slot back (or its built-in), by hand.
    #[command(group(clap::ArgGroup::new("slot").required(true).args(["plugin_type", "resource"])))]
    Rollback {
        /// The plugin type's slot, e.g. CSIPlugin.
        #[arg(long)]
        plugin_type: Option<String>,
        /// The resource's slot, e.g. vendor.com/gpu.
        #[arg(long)]
        resource: Option<String>,
    },
    /// Resolves the tags of `oci://` entries again (every one, or one slot's) and applies the
    /// modules whose tag moved, through the same checks as any change; waits for the outcome
    /// and exits 1 when it is refused.
    #[command(group(clap::ArgGroup::new("slot").required(false).args(["plugin_type", "resource"])))]
    Refresh {
        /// Only this plugin type's slot, e.g. CSIPlugin.
        #[arg(long)]
        plugin_type: Option<String>,
        /// Only this resource's slot, e.g. vendor.com/gpu.
        #[arg(long)]
        resource: Option<String>,
    },
}

/// `pluglet ctl` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum CtlCommand {
    /// The daemon on one screen: version, uptime, readiness, plugins by type and state,
    /// resources, the handlers in force and the last errors.
    Status,
    /// The recent events (registrations, refusals, allocations, releases, handler changes),
    /// newest last.
    Events {
        /// Keep printing new events as they happen until interrupted; with `-o json`, one JSON
        /// object per line per event.
        #[arg(long)]
        watch: bool,
    },
    /// Registered plugins.
    Plugins,
    /// Every socket the watcher knows, with its registration state.
    Sockets,
    /// The handler module in force per plugin type and per resource policy, with its counters,
    /// the previous version kept warm and the last change.
    Handlers {
        /// What to do instead of listing.
        #[command(subcommand)]
        action: Option<HandlersAction>,
    },
    /// Device plugin resources with capacity, allocatable, devices and the policy in force.
    Resources,
    /// Allocates devices of one resource to one container.
    Allocate {
        /// Pod UID.
        #[arg(long)]
        pod: String,
        /// Container name.
        #[arg(long)]
        container: String,
        /// Extended resource name, e.g. vendor.com/gpu.
        #[arg(long)]
        resource: String,
        /// Number of devices.
        #[arg(long)]
        count: u32,
        /// The pod's name, as the pod-resources API shows it [default: the name given with
        /// the pod's earlier allocations, else its UID].
        #[arg(long, value_name = "NAME")]
        pod_name: Option<String>,
        /// The pod's namespace [default: the one given with the pod's earlier allocations,
        /// else default].
        #[arg(long, value_name = "NAMESPACE")]
        namespace: Option<String>,
    },
    /// Releases what a pod (or one of its containers) holds.
    Release {
        /// Pod UID.
        #[arg(long)]
        pod: String,
        /// Only this container.
        #[arg(long)]
        container: Option<String>,
    },
    /// Who holds which devices.
    Allocations,
    /// Frees the devices of every pod not named to keep, as the kubelet does for pods that are
    /// no longer active; prints what was freed. An empty keep list frees every pod's devices,
    /// and only with --all.
    SyncPods {
        /// UID of an active pod: what it holds is kept (repeatable).
        #[arg(long, value_name = "UID")]
        keep: Vec<String>,
        /// File of active pod UIDs, one a line (`-`: standard input); blank lines and lines
        /// starting with # are ignored. Adds to --keep.
        #[arg(long, value_name = "FILE")]
        keep_file: Option<PathBuf>,
        /// Show what would be freed; free nothing.
        #[arg(long)]
        dry_run: bool,
        /// Allow an empty keep list: free the devices of every pod.
        #[arg(long)]
        all: bool,
    },
}

/// The command line asks for something that cannot be done as given (found after parsing);
/// the binary exits 64 (EX_USAGE), like for a parse error.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum UsageError {
    /// A `--keep` that is not one pod UID.
    #[error("--keep {uid:?} is not a pod UID; give one UID per --keep")]
    KeepUid {
        /// What was given.
        uid: String,
    },
    /// A line of the keep file that is not one pod UID.
    #[error(
        "keep file {} line {line}: {text:?} is not one pod UID; put one UID per line (lines \
         starting with # are comments)",
        path.display()
    )]
    KeepFileLine {
        /// The keep file.
        path: PathBuf,
        /// The line's number, from 1.
        line: usize,
        /// The line.
        text: String,
    },
    /// `sync-pods` names no pod to keep, without `--all`.
    #[error(
        "{}: sync-pods would free the devices of every pod; pass --all to do that, or name the \
         pods still active with --keep UID or --keep-file FILE",
        nothing_named(file.as_deref())
    )]
    NothingKept {
        /// The keep file, when one was given.
        file: Option<PathBuf>,
    },
}

fn nothing_named(file: Option<&std::path::Path>) -> String {
    match file {
        Some(path) => format!("the keep file {} names no pod", path.display()),
        None => "no pod to keep was named".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_defaults_are_the_kubelet_timings() {
        let cli = Cli::try_parse_from(["pluglet", "run"]).unwrap();
        let Command::Run(args) = cli.command else {
            panic!("not run")
        };
        assert_eq!(args.backoff_initial, Duration::from_millis(500));
        assert_eq!(args.backoff_max, Duration::from_secs(122));
        assert_eq!(args.getinfo_timeout, Duration::from_secs(1));
        assert_eq!(args.notify_timeout, Duration::from_secs(5));
        assert_eq!(args.dial_timeout, Duration::from_secs(10));
    }

    #[test]
    fn ctl_output_may_follow_the_subcommand() {
        let cli = Cli::try_parse_from(["pluglet", "ctl", "--root", "/x", "sockets", "-o", "json"])
            .unwrap();
        let Command::Ctl(args) = cli.command else {
            panic!("not ctl")
        };
        assert_eq!(args.output, OutputFormat::Json);
        assert!(matches!(args.command, CtlCommand::Sockets));
    }

    #[test]
    fn ctl_global_options_may_follow_the_subcommand() {
        let cli = Cli::try_parse_from([
            "pluglet",
            "ctl",
            "handlers",
            "rollback",
            "--resource",
            "r",
            "--root",
            "/x",
            "-o",
            "text",
        ])
        .unwrap();
        let Command::Ctl(args) = cli.command else {
            panic!("not ctl")
        };
        assert_eq!(args.root.as_deref(), Some(std::path::Path::new("/x")));
        assert_eq!(args.output, OutputFormat::Table);
        let cli = Cli::try_parse_from([
            "pluglet", "handler", "verify", "m.wasm", "--key", "k", "-o", "json",
        ])
        .unwrap();
        let Command::Handler(args) = cli.command else {
            panic!("not handler")
        };
        assert_eq!(args.output, OutputFormat::Json);
    }

    #[test]
    fn metrics_addr_takes_a_host_name_or_says_what_to_write() {
        assert_eq!(
            parse_socket_addr("127.0.0.1:9810").unwrap(),
            "127.0.0.1:9810".parse().unwrap()
        );
        assert!(
            parse_socket_addr("localhost:9812")
                .unwrap()
                .ip()
                .is_loopback()
        );
        let err = parse_socket_addr("9812").unwrap_err();
        assert!(
            matches!(&err, SocketAddrError::NotAnAddress { text, .. } if text == "9812"),
            "{err}"
        );
        assert!(err.to_string().contains("such as 127.0.0.1:9810"), "{err}");
    }

    #[test]
    fn ctl_root_and_admin_socket_conflict() {
        assert!(
            Cli::try_parse_from([
                "pluglet",
                "ctl",
                "--root",
                "/x",
                "--admin-socket",
                "/y",
                "plugins"
            ])
            .is_err()
        );
    }
}
