//! Daemon configuration: where things live and how long things may take.
//!
//! Defaults are the kubelet's paths (`/var/lib/kubelet/plugins_registry`,
//! `/var/lib/kubelet/device-plugins`) and Pluglet's own (`/var/lib/pluglet/{handlers,state}`, admin
//! socket `/run/pluglet/pluglet.sock`); `--root DIR` moves all of them under one directory. Timings
//! default to the kubelet's values (docs/kubelet-compatibility.md, "Registration timeouts" and
//! "Retries and backoff").
//!
//! `pluglet run --config FILE` reads the same settings from a TOML file ([`file`]); options on
//! the command line win over the file, the file over the defaults.

mod file;

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::ArgMatches;
use clap::parser::ValueSource;
use pluglet_plugin_manager::PluginManagerTimings;

pub use self::file::{ConfigFile, KEYS, to_toml};
use crate::cli::{LogFormat, RunArgs};

/// Kubelet: `<root-dir>/plugins_registry`.
pub const DEFAULT_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// Kubelet: `DevicePluginPath` (hard-coded, does not follow `--root-dir`).
pub const DEFAULT_DEVICE_PLUGINS_DIR: &str = "/var/lib/kubelet/device-plugins";
/// Pluglet: handler modules and `handlers.toml`.
pub const DEFAULT_HANDLERS_DIR: &str = "/var/lib/pluglet/handlers";
/// Pluglet: state directory holding the daemon lock.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/pluglet/state";
/// Pluglet: admin API socket.
pub const DEFAULT_ADMIN_SOCKET: &str = "/run/pluglet/pluglet.sock";
/// CDI: the spec directory runtimes read for specs made at run time (podman, containerd and
/// CRI-O read `/etc/cdi` and `/var/run/cdi`).
pub const DEFAULT_CDI_SPEC_DIR: &str = "/var/run/cdi";
/// Kubelet: the pod-resources API socket (`<root-dir>/pod-resources/kubelet.sock`).
pub const DEFAULT_POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// File name of the admin socket under `--root`.
pub const ADMIN_SOCKET_NAME: &str = "pluglet.sock";

/// A configuration the daemon cannot run with.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `--admin-socket-mode` is not an octal permission.
    #[error("admin socket mode {0:?} is not an octal permission such as 0600")]
    AdminSocketMode(String),
    /// The node name is empty.
    #[error("node name is empty: pass --node-name")]
    EmptyNodeName,
    /// The backoff cap is below its start.
    #[error("--backoff-max ({max:?}) is smaller than --backoff-initial ({initial:?})")]
    BackoffOrder {
        /// Initial backoff.
        initial: Duration,
        /// Backoff cap.
        max: Duration,
    },
    /// A duration that must not be zero is zero.
    #[error("{0} must be greater than zero")]
    ZeroDuration(&'static str),
    /// A count that must not be zero is zero.
    #[error("{0} must be at least 1")]
    ZeroCount(&'static str),
    /// The admin socket group does not exist.
    #[error(
        "admin socket group {0:?} does not exist: create it (groupadd) or name an existing group"
    )]
    UnknownGroup(String),
    /// The group database could not be read.
    #[error("cannot look up admin socket group {name:?}")]
    GroupLookup {
        /// The group asked for.
        name: String,
        /// Why.
        #[source]
        source: nix::Error,
    },
    /// The log level is not a tracing filter directive.
    #[error(
        "log level {level:?} is not a filter directive ({reason}); write one such as \"info\", \
         \"debug\" or \"info,pluglet=debug\""
    )]
    LogLevel {
        /// What was given.
        level: String,
        /// Why it does not parse.
        reason: String,
    },
    /// The configuration file could not be read.
    #[error("cannot read configuration file {path}")]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The configuration file is not valid: bad TOML, an unknown key or a value of the wrong
    /// type.
    #[error(
        "configuration file {}{}{}: {message} (keys are the `pluglet run` option names with `_` \
         for `-`; `pluglet run --print-config` prints every key)",
        path.display(),
        line.map(|l| format!(", line {l}")).unwrap_or_default(),
        key.as_ref().map(|k| format!(", key `{k}`")).unwrap_or_default()
    )]
    File {
        /// The file.
        path: PathBuf,
        /// The line of the error, when known.
        line: Option<usize>,
        /// The key of that line, when there is one.
        key: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// Both sources of an API server were given.
    #[error("--kubeconfig and --in-cluster both name an API server: give one")]
    TwoApiServers,
    /// A Node option without an API server to publish to.
    #[error("{0} needs an API server to publish to: add --kubeconfig FILE or --in-cluster")]
    NoApiServer(&'static str),
    /// A `--node-labels` entry is not `KEY=VALUE` with a non-empty key.
    #[error("node label {0:?} is not KEY=VALUE (e.g. --node-labels zone=a,rack=r1)")]
    NodeLabel(String),
    /// Signatures are required but no key is trusted.
    #[error(
        "--require-signatures needs at least one --trusted-key FILE (a minisign public key) to \
         check the signatures with"
    )]
    NoTrustedKey,
}

/// Filesystem locations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Paths {
    /// Directory watched for registration sockets.
    pub registry_dir: PathBuf,
    /// Device plugins directory (`kubelet.sock`, checkpoint).
    pub device_plugins_dir: PathBuf,
    /// Handler modules and `handlers.toml`.
    pub handlers_dir: PathBuf,
    /// State directory; holds `pluglet.lock`.
    pub state_dir: PathBuf,
    /// Admin API socket.
    pub admin_socket: PathBuf,
    /// Where allocations are written as CDI specs.
    pub cdi_spec_dir: PathBuf,
    /// The pod-resources API socket.
    pub pod_resources_socket: PathBuf,
}

impl Paths {
    /// The kubelet's and Pluglet's system paths.
    pub fn system() -> Paths {
        Paths {
            registry_dir: DEFAULT_REGISTRY_DIR.into(),
            device_plugins_dir: DEFAULT_DEVICE_PLUGINS_DIR.into(),
            handlers_dir: DEFAULT_HANDLERS_DIR.into(),
            state_dir: DEFAULT_STATE_DIR.into(),
            admin_socket: DEFAULT_ADMIN_SOCKET.into(),
            cdi_spec_dir: DEFAULT_CDI_SPEC_DIR.into(),
            pod_resources_socket: DEFAULT_POD_RESOURCES_SOCKET.into(),
        }
    }

    /// Everything under one directory (`--root DIR`).
    pub fn under_root(root: &Path) -> Paths {
        Paths {
            registry_dir: root.join("plugins_registry"),
            device_plugins_dir: root.join("device-plugins"),
            handlers_dir: root.join("handlers"),
            state_dir: root.join("state"),
            admin_socket: root.join(ADMIN_SOCKET_NAME),
            cdi_spec_dir: root.join("cdi"),
            pod_resources_socket: root.join("pod-resources").join("kubelet.sock"),
        }
    }

    /// The lock file inside the state directory.
    pub fn lock_file(&self) -> PathBuf {
        self.state_dir.join("pluglet.lock")
    }
}

/// How long things may take. Defaults mirror the kubelet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timings {
    /// First retry delay after a failed operation (kubelet `initialDurationBeforeRetry` = 500 ms).
    pub backoff_initial: Duration,
    /// Cap of the doubling retry delay (kubelet `maxDurationBeforeRetry` = 2 min 2 s).
    pub backoff_max: Duration,
    /// Connecting to a plugin socket, with quick retries while it is not listening yet (kubelet: 10 s).
    pub dial_timeout: Duration,
    /// GetInfo deadline (kubelet: 1 s).
    pub get_info_timeout: Duration,
    /// NotifyRegistrationStatus deadline (kubelet: 5 s).
    pub notify_timeout: Duration,
    /// CSI NodeGetInfo deadline (kubelet `csiTimeout` = 2 min).
    pub node_get_info_timeout: Duration,
    /// Safety-net rescan of the registry directory.
    pub resync_period: Duration,
    /// Time allowed for the stages to stop.
    pub shutdown_grace: Duration,
    /// How long a disconnected device plugin's resource is kept (kubelet
    /// `endpointStopGracePeriod` = 5 min).
    pub device_grace_period: Duration,
}

impl Default for Timings {
    fn default() -> Timings {
        Timings {
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(122),
            dial_timeout: Duration::from_secs(10),
            get_info_timeout: Duration::from_secs(1),
            notify_timeout: Duration::from_secs(5),
            node_get_info_timeout: Duration::from_secs(120),
            resync_period: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(5),
            device_grace_period: pluglet_device_manager::DEFAULT_GRACE_PERIOD,
        }
    }
}

impl From<&Timings> for PluginManagerTimings {
    fn from(t: &Timings) -> PluginManagerTimings {
        PluginManagerTimings {
            backoff_initial: t.backoff_initial,
            backoff_max: t.backoff_max,
            dial_timeout: t.dial_timeout,
            get_info_timeout: t.get_info_timeout,
            notify_timeout: t.notify_timeout,
            resync_period: t.resync_period,
        }
    }
}

/// Everything `pluglet run` needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Filesystem locations.
    pub paths: Paths,
    /// Permission bits of the admin socket.
    pub admin_socket_mode: u32,
    /// Node name handed to handlers.
    pub node_name: String,
    /// Deadlines and backoff.
    pub timings: Timings,
    /// Handler module signatures: the trusted public key files and whether a signature is
    /// required.
    pub signatures: Signatures,
    /// How the registries of `oci://` handler modules are reached.
    pub registry: pluglet_oci::RegistryOptions,
    /// Where `/metrics`, `/healthz` and `/readyz` are served; `None`: not served.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The group the admin socket is given after binding; `None`: the daemon's own.
    pub admin_socket_group: Option<SocketGroup>,
    /// Log format and filter.
    pub log: LogConfig,
    /// Whether allocations are written as CDI specs to `paths.cdi_spec_dir`.
    pub cdi: bool,
    /// The pod-resources API on `paths.pod_resources_socket`; `None`: not served.
    pub pod_resources: Option<PodResources>,
    /// Publishing to a Kubernetes API server; `None`: off.
    pub publish: Option<Publish>,
    /// How long a resource gone past its grace period stays published at 0.
    pub removed_resource_linger: Duration,
    /// Handler calls that may run at once (the WASM pool's slots).
    pub handler_pool_size: u32,
    /// The most containers one Allocate call asks a device plugin for.
    pub device_allocate_batch: u32,
}

/// `--kubeconfig` / `--in-cluster` and what goes with them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Publish {
    /// Where the API server and credentials come from.
    pub source: pluglet_fleet::Source,
    /// Create the Node when it does not exist.
    pub register_node: bool,
    /// Labels of a Node created with `register_node`.
    pub node_labels: std::collections::BTreeMap<String, String>,
    /// The Lease duration of the handler rollout coordinator.
    pub coordinator_lease_duration: Duration,
}

/// How the pod-resources API is served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodResources {
    /// The group given the socket (then mode 0660); `None`: mode 0600, the daemon's group.
    pub group: Option<SocketGroup>,
    /// The rate limit over every method.
    pub limits: pluglet_device_manager::pod_resources::Limits,
}

impl PodResources {
    /// The socket's permission bits: 0660 with a group, else 0600.
    pub fn mode(&self) -> u32 {
        if self.group.is_some() { 0o660 } else { 0o600 }
    }
}

/// `--admin-socket-group`: a group that exists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketGroup {
    /// Its name, as given.
    pub name: String,
    /// Its id.
    pub gid: u32,
}

/// `--log-format` and `--log-level`, resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogConfig {
    /// Text or JSON lines.
    pub format: LogFormat,
    /// The filter directive in force (given, else `RUST_LOG`, else `info`).
    pub level: String,
}

impl LogConfig {
    /// The filter the level describes.
    pub fn filter(&self) -> tracing_subscriber::EnvFilter {
        tracing_subscriber::EnvFilter::builder()
            .parse(&self.level)
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_LEVEL))
    }
}

/// The log level when neither `--log-level` nor `RUST_LOG` gives one.
pub const DEFAULT_LOG_LEVEL: &str = "info";

/// The filter directive to log with: `given` when there is one, else `rust_log` (the
/// environment's `RUST_LOG`) when it is a valid directive, else [`DEFAULT_LOG_LEVEL`].
pub fn log_level(given: Option<&str>, rust_log: Option<&str>) -> Result<String, ConfigError> {
    let parse = |level: &str| tracing_subscriber::EnvFilter::builder().parse(level);
    match given {
        Some(level) if level.trim().is_empty() => Err(ConfigError::LogLevel {
            level: level.to_owned(),
            reason: "it is empty".to_owned(),
        }),
        Some(level) => match parse(level) {
            Ok(_) => Ok(level.to_owned()),
            Err(e) => Err(ConfigError::LogLevel {
                level: level.to_owned(),
                reason: e.to_string(),
            }),
        },
        None => Ok(rust_log
            .filter(|l| !l.trim().is_empty() && parse(l).is_ok())
            .unwrap_or(DEFAULT_LOG_LEVEL)
            .to_owned()),
    }
}

fn socket_group(name: &str) -> Result<SocketGroup, ConfigError> {
    match nix::unistd::Group::from_name(name) {
        Ok(Some(group)) => Ok(SocketGroup {
            name: name.to_owned(),
            gid: group.gid.as_raw(),
        }),
        Ok(None) => Err(ConfigError::UnknownGroup(name.to_owned())),
        Err(source) => Err(ConfigError::GroupLookup {
            name: name.to_owned(),
            source,
        }),
    }
}

/// `--trusted-key` and `--require-signatures`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Signatures {
    /// minisign public key files.
    pub trusted_keys: Vec<PathBuf>,
    /// Whether every configured module must be signed by one of them.
    pub require: bool,
}

impl Config {
    /// Builds the configuration from `pluglet run` arguments and the configuration file they
    /// name, if any: the file sets what `matches` (the `run` subcommand's) did not get from
    /// the command line. `hostname` is the default node name, `rust_log` the environment's
    /// `RUST_LOG`.
    pub fn load(
        args: &RunArgs,
        matches: &ArgMatches,
        hostname: impl FnOnce() -> String,
        rust_log: Option<&str>,
    ) -> Result<Config, ConfigError> {
        let mut args = args.clone();
        if let Some(path) = &args.config {
            let given = |key: &str| matches.value_source(key) == Some(ValueSource::CommandLine);
            ConfigFile::read(path)?.fill(&mut args, given);
        }
        Config::from_args(&args, hostname, rust_log)
    }

    /// Builds the configuration from `pluglet run` arguments alone; `hostname` is the default
    /// node name, `rust_log` the environment's `RUST_LOG`.
    pub fn from_args(
        args: &RunArgs,
        hostname: impl FnOnce() -> String,
        rust_log: Option<&str>,
    ) -> Result<Config, ConfigError> {
        let mut paths = match &args.root {
            Some(root) => Paths::under_root(root),
            None => Paths::system(),
        };
        if let Some(p) = &args.registry_dir {
            paths.registry_dir = p.clone();
        }
        if let Some(p) = &args.device_plugins_dir {
            paths.device_plugins_dir = p.clone();
        }
        if let Some(p) = &args.handlers_dir {
            paths.handlers_dir = p.clone();
        }
        if let Some(p) = &args.state_dir {
            paths.state_dir = p.clone();
        }
        if let Some(p) = &args.admin_socket {
            paths.admin_socket = p.clone();
        }
        if let Some(p) = &args.cdi_spec_dir {
            paths.cdi_spec_dir = p.clone();
        }
        if let Some(p) = &args.pod_resources_socket {
            paths.pod_resources_socket = p.clone();
        }
        let admin_socket_mode = parse_mode(&args.admin_socket_mode)?;
        let node_name = args.node_name.clone().unwrap_or_else(hostname);
        if node_name.trim().is_empty() {
            return Err(ConfigError::EmptyNodeName);
        }
        let timings = Timings {
            backoff_initial: args.backoff_initial,
            backoff_max: args.backoff_max,
            dial_timeout: args.dial_timeout,
            get_info_timeout: args.getinfo_timeout,
            notify_timeout: args.notify_timeout,
            node_get_info_timeout: args.nodegetinfo_timeout,
            resync_period: args.resync_period,
            shutdown_grace: args.shutdown_grace,
            device_grace_period: args.device_grace_period,
        };
        for (name, d) in [
            (
                "--backoff-initial (backoff_initial)",
                timings.backoff_initial,
            ),
            ("--dial-timeout (dial_timeout)", timings.dial_timeout),
            (
                "--getinfo-timeout (getinfo_timeout)",
                timings.get_info_timeout,
            ),
            ("--notify-timeout (notify_timeout)", timings.notify_timeout),
            (
                "--nodegetinfo-timeout (nodegetinfo_timeout)",
                timings.node_get_info_timeout,
            ),
            ("--resync-period (resync_period)", timings.resync_period),
        ] {
            if d.is_zero() {
                return Err(ConfigError::ZeroDuration(name));
            }
        }
        if timings.backoff_max < timings.backoff_initial {
            return Err(ConfigError::BackoffOrder {
                initial: timings.backoff_initial,
                max: timings.backoff_max,
            });
        }
        if args.require_signatures && args.trusted_key.is_empty() {
            return Err(ConfigError::NoTrustedKey);
        }
        Ok(Config {
            paths,
            admin_socket_mode,
            node_name,
            timings,
            signatures: Signatures {
                trusted_keys: args.trusted_key.clone(),
                require: args.require_signatures,
            },
            registry: args.registry.options(),
            metrics_addr: args.metrics_addr,
            admin_socket_group: args
                .admin_socket_group
                .as_deref()
                .map(socket_group)
                .transpose()?,
            log: LogConfig {
                format: args.log_format,
                level: log_level(args.log_level.as_deref(), rust_log)?,
            },
            cdi: !args.no_cdi,
            pod_resources: pod_resources(args)?,
            publish: publish(args)?,
            removed_resource_linger: args.removed_resource_linger,
            handler_pool_size: positive(
                args.handler_pool_size,
                "--handler-pool-size (handler_pool_size)",
            )?,
            device_allocate_batch: positive(
                args.device_allocate_batch,
                "--device-allocate-batch (device_allocate_batch)",
            )?,
        })
    }
}

/// `n` when it is at least 1; zero is refused naming the option.
fn positive(n: u32, name: &'static str) -> Result<u32, ConfigError> {
    if n == 0 {
        return Err(ConfigError::ZeroCount(name));
    }
    Ok(n)
}

/// The pod-resources settings of `args`: `None` with `--no-pod-resources`.
fn pod_resources(args: &RunArgs) -> Result<Option<PodResources>, ConfigError> {
    if args.no_pod_resources {
        return Ok(None);
    }
    let nonzero = |n: u32, name: &'static str| {
        std::num::NonZeroU32::new(n).ok_or(ConfigError::ZeroCount(name))
    };
    Ok(Some(PodResources {
        group: args
            .pod_resources_socket_group
            .as_deref()
            .map(socket_group)
            .transpose()?,
        limits: pluglet_device_manager::pod_resources::Limits {
            qps: nonzero(
                args.pod_resources_qps,
                "--pod-resources-qps (pod_resources_qps)",
            )?,
            burst: nonzero(
                args.pod_resources_burst,
                "--pod-resources-burst (pod_resources_burst)",
            )?,
        },
    }))
}

/// The publishing settings of `args`: `None` without an API server.
fn publish(args: &RunArgs) -> Result<Option<Publish>, ConfigError> {
    let source = match (&args.kubeconfig, args.in_cluster) {
        (Some(_), true) => return Err(ConfigError::TwoApiServers),
        (Some(file), false) => pluglet_fleet::Source::Kubeconfig(file.clone()),
        (None, true) => pluglet_fleet::Source::InCluster,
        (None, false) => {
            if args.register_node {
                return Err(ConfigError::NoApiServer("--register-node"));
            }
            if !args.node_labels.is_empty() {
                return Err(ConfigError::NoApiServer("--node-labels"));
            }
            return Ok(None);
        }
    };
    let mut node_labels = std::collections::BTreeMap::new();
    for entry in &args.node_labels {
        match entry.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => {
                node_labels.insert(key.trim().to_owned(), value.trim().to_owned());
            }
            _ => return Err(ConfigError::NodeLabel(entry.clone())),
        }
    }
    Ok(Some(Publish {
        source,
        register_node: args.register_node,
        node_labels,
        coordinator_lease_duration: args.coordinator_lease_duration,
    }))
}

/// The machine's host name, or `localhost` when it cannot be read.
pub fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

fn parse_mode(s: &str) -> Result<u32, ConfigError> {
    let digits = s.strip_prefix("0o").unwrap_or(s);
    match u32::from_str_radix(digits, 8) {
        Ok(m) if m <= 0o7777 => Ok(m),
        _ => Err(ConfigError::AdminSocketMode(s.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    fn config(args: &[&str]) -> Result<Config, ConfigError> {
        let mut argv = vec!["pluglet", "run"];
        argv.extend_from_slice(args);
        let Command::Run(run) = Cli::try_parse_from(argv).unwrap().command else {
            panic!("not run")
        };
        Config::from_args(&run, || "node-a".to_owned(), None)
    }

    #[test]
    fn publishing_needs_one_api_server_and_plain_labels() {
        assert_eq!(config(&[]).unwrap().publish, None);
        let c = config(&[
            "--kubeconfig",
            "/k",
            "--register-node",
            "--node-labels",
            "zone=a, rack = r1",
            "--node-labels",
            "empty=",
        ])
        .unwrap();
        let p = c.publish.unwrap();
        assert_eq!(p.source, pluglet_fleet::Source::Kubeconfig("/k".into()));
        assert!(p.register_node);
        assert_eq!(
            p.node_labels,
            [("empty", ""), ("rack", "r1"), ("zone", "a")]
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .into()
        );
        assert_eq!(
            config(&["--in-cluster"]).unwrap().publish.unwrap().source,
            pluglet_fleet::Source::InCluster
        );
        assert!(matches!(
            config(&["--register-node"]),
            Err(ConfigError::NoApiServer("--register-node"))
        ));
        assert!(matches!(
            config(&["--node-labels", "a=b"]),
            Err(ConfigError::NoApiServer("--node-labels"))
        ));
        assert!(matches!(
            config(&["--kubeconfig", "/k", "--node-labels", "=b"]),
            Err(ConfigError::NodeLabel(l)) if l == "=b"
        ));
        assert!(matches!(
            config(&["--kubeconfig", "/k", "--node-labels", "novalue"]),
            Err(ConfigError::NodeLabel(_))
        ));
    }

    #[test]
    fn defaults_are_kubelet_paths_and_timings() {
        let c = config(&[]).unwrap();
        assert_eq!(c.paths, Paths::system());
        assert_eq!(
            c.paths.registry_dir,
            PathBuf::from("/var/lib/kubelet/plugins_registry")
        );
        assert_eq!(c.timings, Timings::default());
        assert_eq!(c.admin_socket_mode, 0o600);
        assert_eq!(c.node_name, "node-a");
    }

    #[test]
    fn root_puts_everything_under_one_directory_and_paths_override() {
        let c = config(&["--root", "/tmp/r", "--handlers-dir", "/h"]).unwrap();
        assert_eq!(
            c.paths.registry_dir,
            PathBuf::from("/tmp/r/plugins_registry")
        );
        assert_eq!(
            c.paths.device_plugins_dir,
            PathBuf::from("/tmp/r/device-plugins")
        );
        assert_eq!(c.paths.state_dir, PathBuf::from("/tmp/r/state"));
        assert_eq!(c.paths.admin_socket, PathBuf::from("/tmp/r/pluglet.sock"));
        assert_eq!(c.paths.handlers_dir, PathBuf::from("/h"));
        assert_eq!(
            c.paths.lock_file(),
            PathBuf::from("/tmp/r/state/pluglet.lock")
        );
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(matches!(
            config(&["--admin-socket-mode", "0999"]),
            Err(ConfigError::AdminSocketMode(_))
        ));
        assert!(matches!(
            config(&["--backoff-initial", "5s", "--backoff-max", "1s"]),
            Err(ConfigError::BackoffOrder { .. })
        ));
        assert!(matches!(
            config(&["--node-name", " "]),
            Err(ConfigError::EmptyNodeName)
        ));
        assert!(matches!(
            config(&["--require-signatures"]),
            Err(ConfigError::NoTrustedKey)
        ));
        let c = config(&[
            "--trusted-key",
            "/k1",
            "--trusted-key",
            "/k2",
            "--require-signatures",
        ])
        .unwrap();
        assert_eq!(
            c.signatures.trusted_keys,
            [Path::new("/k1"), Path::new("/k2")]
        );
        assert!(c.signatures.require);
        assert_eq!(
            config(&["--admin-socket-mode", "0660"])
                .unwrap()
                .admin_socket_mode,
            0o660
        );
        assert!(matches!(
            config(&["--admin-socket-group", "no-such-group-here"]),
            Err(ConfigError::UnknownGroup(g)) if g == "no-such-group-here"
        ));
        assert!(matches!(
            config(&["--log-level", "info,=nonsense=x"]),
            Err(ConfigError::LogLevel { .. })
        ));
        assert!(matches!(
            config(&["--log-level", ""]),
            Err(ConfigError::LogLevel { .. })
        ));
    }

    #[test]
    fn an_existing_group_is_resolved_to_its_id() {
        let group = config(&["--admin-socket-group", "root"])
            .unwrap()
            .admin_socket_group
            .unwrap();
        assert_eq!((group.name.as_str(), group.gid), ("root", 0));
    }

    #[test]
    fn log_level_is_the_option_else_rust_log_else_info() {
        assert_eq!(log_level(Some("debug"), Some("warn")).unwrap(), "debug");
        assert_eq!(log_level(None, Some("warn")).unwrap(), "warn");
        assert_eq!(log_level(None, None).unwrap(), "info");
        // An unusable RUST_LOG is ignored, as before the option existed.
        assert_eq!(log_level(None, Some("a=b=c")).unwrap(), "info");
    }
}
