//! The configuration file of `pluglet run --config FILE` and the TOML `--print-config` writes.
//!
//! Keys are the `pluglet run` option names with `_` for `-`; durations are strings such as
//! `"500ms"` or `"2m2s"`, the admin socket mode an octal string such as `"0600"`. A key the
//! command line sets keeps the command line's value: the file only fills in what was not given.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use super::{Config, ConfigError};
use crate::cli::{LogFormat, RunArgs};

/// Every key of the configuration file, in the order `--print-config` writes them.
pub const KEYS: &[&str] = &[
    "root",
    "registry_dir",
    "device_plugins_dir",
    "handlers_dir",
    "state_dir",
    "cdi_spec_dir",
    "no_cdi",
    "pod_resources_socket",
    "no_pod_resources",
    "pod_resources_socket_group",
    "pod_resources_qps",
    "pod_resources_burst",
    "admin_socket",
    "admin_socket_mode",
    "admin_socket_group",
    "node_name",
    "backoff_initial",
    "backoff_max",
    "dial_timeout",
    "getinfo_timeout",
    "notify_timeout",
    "nodegetinfo_timeout",
    "resync_period",
    "device_grace_period",
    "device_allocate_batch",
    "shutdown_grace",
    "handler_pool_size",
    "trusted_key",
    "require_signatures",
    "registry_auth",
    "registry_ca",
    "insecure_registries",
    "registry_max_module_size",
    "registry_timeout",
    "metrics_addr",
    "log_format",
    "log_level",
    "kubeconfig",
    "in_cluster",
    "register_node",
    "node_labels",
    "removed_resource_linger",
    "coordinator_lease_duration",
];

/// The settings a configuration file holds; a key left out is `None`.
#[derive(Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    root: Option<PathBuf>,
    registry_dir: Option<PathBuf>,
    device_plugins_dir: Option<PathBuf>,
    handlers_dir: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    cdi_spec_dir: Option<PathBuf>,
    no_cdi: Option<bool>,
    pod_resources_socket: Option<PathBuf>,
    no_pod_resources: Option<bool>,
    pod_resources_socket_group: Option<String>,
    pod_resources_qps: Option<u32>,
    pod_resources_burst: Option<u32>,
    admin_socket: Option<PathBuf>,
    admin_socket_mode: Option<String>,
    admin_socket_group: Option<String>,
    node_name: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    backoff_initial: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    backoff_max: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    dial_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    getinfo_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    notify_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    nodegetinfo_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    resync_period: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    device_grace_period: Option<Duration>,
    device_allocate_batch: Option<u32>,
    #[serde(default, deserialize_with = "duration")]
    shutdown_grace: Option<Duration>,
    handler_pool_size: Option<u32>,
    #[serde(default, deserialize_with = "one_or_many")]
    trusted_key: Option<Vec<PathBuf>>,
    require_signatures: Option<bool>,
    registry_auth: Option<PathBuf>,
    #[serde(default, deserialize_with = "registry_cas")]
    registry_ca: Option<Vec<pluglet_oci::RegistryCa>>,
    #[serde(default, deserialize_with = "insecure_registries")]
    insecure_registries: Option<Vec<String>>,
    #[serde(default, deserialize_with = "size")]
    registry_max_module_size: Option<u64>,
    #[serde(default, deserialize_with = "duration")]
    registry_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "socket_addr")]
    metrics_addr: Option<SocketAddr>,
    log_format: Option<LogFormat>,
    log_level: Option<String>,
    kubeconfig: Option<PathBuf>,
    in_cluster: Option<bool>,
    register_node: Option<bool>,
    node_labels: Option<Vec<String>>,
    #[serde(default, deserialize_with = "duration")]
    removed_resource_linger: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    coordinator_lease_duration: Option<Duration>,
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text).map(Some).map_err(|e| {
        serde::de::Error::custom(format!(
            "{text:?} is not a duration ({e}); write one such as \"500ms\", \"2m2s\" or \"10s\""
        ))
    })
}

fn registry_cas<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<pluglet_oci::RegistryCa>>, D::Error> {
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|text| text.parse().map_err(serde::de::Error::custom))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn insecure_registries<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|text| {
            pluglet_oci::options::parse_insecure_registry(text).map_err(serde::de::Error::custom)
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// A size: a number of bytes, or a string with a unit (`"64MiB"`).
fn size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Size::deserialize(d)? {
        Size::Bytes(n) => Ok(Some(n)),
        Size::Text(text) => crate::handler_oci::parse_size(&text)
            .map(Some)
            .map_err(serde::de::Error::custom),
    }
}

/// One path, or a list of them.
fn one_or_many<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<PathBuf>>, D::Error> {
    struct Paths;
    impl<'de> serde::de::Visitor<'de> for Paths {
        type Value = Vec<PathBuf>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a path or a list of paths")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Vec<PathBuf>, E> {
            Ok(vec![PathBuf::from(v)])
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<Vec<PathBuf>, A::Error> {
            Vec::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))
        }
    }
    d.deserialize_any(Paths).map(Some)
}

fn socket_addr<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    let text = String::deserialize(d)?;
    crate::cli::parse_socket_addr(&text)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

impl ConfigFile {
    /// Reads and parses the file at `path`.
    pub fn read(path: &Path) -> Result<ConfigFile, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
            path: path.to_owned(),
            source,
        })?;
        ConfigFile::parse(&text, path)
    }

    /// Parses `text`; errors name `path`, the line and the key.
    pub fn parse(text: &str, path: &Path) -> Result<ConfigFile, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let line = e
                .span()
                .map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1);
            let key = line.and_then(|line| key_of(text, line, e.message()));
            ConfigError::File {
                path: path.to_owned(),
                line,
                key,
                message: e.message().trim().to_owned(),
            }
        })
    }

    /// Sets every field of `args` that the file has and the command line did not give
    /// (`given(key)` says whether the command line gave the option of that key).
    pub fn fill(self, args: &mut RunArgs, given: impl Fn(&str) -> bool) {
        // Every key is also the name of its `RunArgs` field; `Some` marks optional fields.
        macro_rules! fill {
            ($($key:ident $(as $wrap:ident)?),* $(,)?) => {
                $(if let Some(value) = self.$key && !given(stringify!($key)) {
                    args.$key = fill!(@value value $($wrap)?);
                })*
            };
            (@value $v:ident Some) => { Some($v) };
            (@value $v:ident) => { $v };
        }
        fill!(
            root as Some,
            registry_dir as Some,
            device_plugins_dir as Some,
            handlers_dir as Some,
            state_dir as Some,
            cdi_spec_dir as Some,
            no_cdi,
            pod_resources_socket as Some,
            no_pod_resources,
            pod_resources_socket_group as Some,
            pod_resources_qps,
            pod_resources_burst,
            admin_socket as Some,
            admin_socket_mode,
            admin_socket_group as Some,
            node_name as Some,
            backoff_initial,
            backoff_max,
            dial_timeout,
            getinfo_timeout,
            notify_timeout,
            nodegetinfo_timeout,
            resync_period,
            device_grace_period,
            device_allocate_batch,
            shutdown_grace,
            handler_pool_size,
            trusted_key,
            require_signatures,
            metrics_addr as Some,
            log_format,
            log_level as Some,
            kubeconfig as Some,
            in_cluster,
            register_node,
            node_labels,
            removed_resource_linger,
            coordinator_lease_duration,
        );
        let registry = &mut args.registry;
        if let Some(v) = self.registry_auth
            && !given("registry_auth")
        {
            registry.registry_auth = Some(v);
        }
        if let Some(v) = self.registry_ca
            && !given("registry_ca")
        {
            registry.registry_ca = v;
        }
        if let Some(v) = self.insecure_registries
            && !given("insecure_registries")
        {
            registry.insecure_registries = v;
        }
        if let Some(v) = self.registry_max_module_size
            && !given("registry_max_module_size")
        {
            registry.registry_max_module_size = Some(v);
        }
        if let Some(v) = self.registry_timeout
            && !given("registry_timeout")
        {
            registry.registry_timeout = Some(v);
        }
    }
}

/// The key an error at `line` (1-based) is about: the unknown key the message names, else the
/// key set on that line or, for a value spanning lines (an array), on the nearest line above.
fn key_of(text: &str, line: usize, message: &str) -> Option<String> {
    if let Some(rest) = message.strip_prefix("unknown field `") {
        return rest.split('`').next().map(str::to_owned);
    }
    let lines: Vec<&str> = text.lines().collect();
    for l in lines[..line.min(lines.len())].iter().rev() {
        let l = l.trim();
        if l.starts_with('[') {
            return Some(l.trim_matches(['[', ']']).trim().to_owned());
        }
        let Some((key, _)) = l.split_once('=') else {
            continue;
        };
        let key = key.trim();
        let plain = !key.is_empty()
            && key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if plain {
            return Some(key.to_owned());
        }
    }
    None
}

/// `config` as the TOML file that reproduces it: every key, in [`KEYS`] order; a key with no
/// value (nothing to set) is written as a comment saying why. `root` is always such a comment:
/// the paths it would set are written out.
pub fn to_toml(config: &Config) -> String {
    fn string(s: &str) -> String {
        toml::Value::String(s.to_owned()).to_string()
    }
    fn path(p: &Path) -> String {
        string(&p.to_string_lossy())
    }
    fn duration(d: Duration) -> String {
        string(&humantime::format_duration(d).to_string().replace(' ', ""))
    }
    let paths = &config.paths;
    let t = &config.timings;
    let mut out = String::from(
        "# The effective configuration of `pluglet run` (`pluglet run --print-config`):\n\
         # `pluglet run --config FILE` with this file runs the daemon the same way.\n",
    );
    let mut line = |key: &str, value: Option<String>, unset: &str| {
        let _ = match value {
            Some(v) => writeln!(out, "{key} = {v}"),
            None => writeln!(out, "# {key}: {unset}"),
        };
    };
    line("root", None, "not needed, every path below is explicit");
    line("registry_dir", Some(path(&paths.registry_dir)), "");
    line(
        "device_plugins_dir",
        Some(path(&paths.device_plugins_dir)),
        "",
    );
    line("handlers_dir", Some(path(&paths.handlers_dir)), "");
    line("state_dir", Some(path(&paths.state_dir)), "");
    line("cdi_spec_dir", Some(path(&paths.cdi_spec_dir)), "");
    line("no_cdi", Some((!config.cdi).to_string()), "");
    line(
        "pod_resources_socket",
        Some(path(&paths.pod_resources_socket)),
        "",
    );
    let pod_resources = config.pod_resources.as_ref();
    line(
        "no_pod_resources",
        Some(pod_resources.is_none().to_string()),
        "",
    );
    line(
        "pod_resources_socket_group",
        pod_resources
            .and_then(|p| p.group.as_ref())
            .map(|g| string(&g.name)),
        "not set, the socket is 0600 in the daemon's group",
    );
    let limits = pod_resources.map(|p| p.limits).unwrap_or_default();
    line("pod_resources_qps", Some(limits.qps.to_string()), "");
    line("pod_resources_burst", Some(limits.burst.to_string()), "");
    line("admin_socket", Some(path(&paths.admin_socket)), "");
    line(
        "admin_socket_mode",
        Some(string(&format!("{:04o}", config.admin_socket_mode))),
        "",
    );
    line(
        "admin_socket_group",
        config.admin_socket_group.as_ref().map(|g| string(&g.name)),
        "not set, the socket keeps the daemon's group",
    );
    line("node_name", Some(string(&config.node_name)), "");
    line("backoff_initial", Some(duration(t.backoff_initial)), "");
    line("backoff_max", Some(duration(t.backoff_max)), "");
    line("dial_timeout", Some(duration(t.dial_timeout)), "");
    line("getinfo_timeout", Some(duration(t.get_info_timeout)), "");
    line("notify_timeout", Some(duration(t.notify_timeout)), "");
    line(
        "nodegetinfo_timeout",
        Some(duration(t.node_get_info_timeout)),
        "",
    );
    line("resync_period", Some(duration(t.resync_period)), "");
    line(
        "device_grace_period",
        Some(duration(t.device_grace_period)),
        "",
    );
    line(
        "device_allocate_batch",
        Some(config.device_allocate_batch.to_string()),
        "",
    );
    line("shutdown_grace", Some(duration(t.shutdown_grace)), "");
    line(
        "handler_pool_size",
        Some(config.handler_pool_size.to_string()),
        "",
    );
    let keys: Vec<String> = config
        .signatures
        .trusted_keys
        .iter()
        .map(|k| path(k))
        .collect();
    line("trusted_key", Some(format!("[{}]", keys.join(", "))), "");
    line(
        "require_signatures",
        Some(config.signatures.require.to_string()),
        "",
    );
    let r = &config.registry;
    line(
        "registry_auth",
        r.auth_file.as_deref().map(path),
        "not set, registries are asked anonymously",
    );
    let list = |items: Vec<String>| format!("[{}]", items.join(", "));
    line(
        "registry_ca",
        Some(list(
            r.cas
                .iter()
                .map(|ca| string(&format!("{}={}", ca.registry, ca.file.display())))
                .collect(),
        )),
        "",
    );
    line(
        "insecure_registries",
        Some(list(r.insecure.iter().map(|h| string(h)).collect())),
        "",
    );
    line(
        "registry_max_module_size",
        Some(if r.max_module_size.is_multiple_of(1 << 20) {
            string(&format!("{}MiB", r.max_module_size >> 20))
        } else {
            r.max_module_size.to_string()
        }),
        "",
    );
    line("registry_timeout", Some(duration(r.timeout)), "");
    line(
        "metrics_addr",
        config.metrics_addr.map(|a| string(&a.to_string())),
        "not set, no metrics or health endpoint",
    );
    line("log_format", Some(string(config.log.format.as_str())), "");
    line("log_level", Some(string(&config.log.level)), "");
    let publish = config.publish.as_ref();
    line(
        "kubeconfig",
        publish.and_then(|p| match &p.source {
            pluglet_fleet::Source::Kubeconfig(file) => Some(path(file)),
            pluglet_fleet::Source::InCluster => None,
        }),
        "not set, nothing is published to a Kubernetes API server",
    );
    line(
        "in_cluster",
        Some(
            publish
                .is_some_and(|p| p.source == pluglet_fleet::Source::InCluster)
                .to_string(),
        ),
        "",
    );
    line(
        "register_node",
        Some(publish.is_some_and(|p| p.register_node).to_string()),
        "",
    );
    let labels: Vec<String> = publish
        .map(|p| {
            p.node_labels
                .iter()
                .map(|(k, v)| string(&format!("{k}={v}")))
                .collect()
        })
        .unwrap_or_default();
    line("node_labels", Some(format!("[{}]", labels.join(", "))), "");
    line(
        "removed_resource_linger",
        Some(duration(config.removed_resource_linger)),
        "",
    );
    line(
        "coordinator_lease_duration",
        publish.map(|p| duration(p.coordinator_lease_duration)),
        "not set, no handler rollouts without a Kubernetes API server",
    );
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use clap::{CommandFactory, FromArgMatches};

    use super::*;
    use crate::cli::Cli;

    /// The shipped example configuration.
    const EXAMPLE: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/deploy/config.toml"
    ));

    /// `pluglet run ARGS` with `file` as its configuration file, as the binary builds it.
    fn load(args: &[&str], file: Option<&str>) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let mut argv = vec!["pluglet".to_owned(), "run".to_owned()];
        if let Some(text) = file {
            let path = dir.path().join("config.toml");
            std::fs::write(&path, text).unwrap();
            argv.extend(["--config".to_owned(), path.display().to_string()]);
        }
        argv.extend(args.iter().map(|a| a.to_string()));
        let matches = Cli::command().try_get_matches_from(argv).unwrap();
        let run = matches.subcommand_matches("run").unwrap();
        let args = RunArgs::from_arg_matches(run).unwrap();
        Config::load(&args, run, || "node-a".to_owned(), None)
    }

    fn file_error(text: &str) -> (Option<usize>, Option<String>, String) {
        match ConfigFile::parse(text, Path::new("c.toml")) {
            Err(ConfigError::File {
                line, key, message, ..
            }) => (line, key, message),
            other => panic!("expected a file error, got {other:?}"),
        }
    }

    #[test]
    fn every_run_option_is_a_key_and_every_key_an_option() {
        let cmd = Cli::command();
        let run = cmd.find_subcommand("run").unwrap();
        let options: BTreeSet<&str> = run
            .get_arguments()
            .map(|a| a.get_id().as_str())
            .filter(|id| !matches!(*id, "config" | "print_config" | "help" | "version"))
            .collect();
        assert_eq!(options, KEYS.iter().copied().collect::<BTreeSet<_>>());
    }

    #[test]
    fn the_file_sets_what_the_command_line_does_not() {
        let file = r#"
            registry_dir = "/file/registry"
            backoff_initial = "1s"
            backoff_max = "4s"
            admin_socket_mode = "0660"
            trusted_key = "/file/k.pub"
            metrics_addr = "127.0.0.1:9810"
            log_format = "json"
            log_level = "debug"
        "#;
        let c = load(&[], Some(file)).unwrap();
        assert_eq!(c.paths.registry_dir, Path::new("/file/registry"));
        assert_eq!(c.timings.backoff_initial, Duration::from_secs(1));
        assert_eq!(c.timings.backoff_max, Duration::from_secs(4));
        assert_eq!(c.admin_socket_mode, 0o660);
        assert_eq!(c.signatures.trusted_keys, [Path::new("/file/k.pub")]);
        assert_eq!(c.metrics_addr, Some("127.0.0.1:9810".parse().unwrap()));
        assert_eq!(c.log.format, LogFormat::Json);
        assert_eq!(c.log.level, "debug");
        // Untouched keys keep their defaults.
        assert_eq!(c.timings.dial_timeout, Duration::from_secs(10));
        assert_eq!(
            c.paths.device_plugins_dir,
            Path::new("/var/lib/kubelet/device-plugins")
        );

        // Options on the command line win, even when they equal the default.
        let c = load(
            &[
                "--registry-dir",
                "/flag/registry",
                "--admin-socket-mode",
                "0600",
                "--trusted-key",
                "/flag/k.pub",
                "--log-format",
                "text",
            ],
            Some(file),
        )
        .unwrap();
        assert_eq!(c.paths.registry_dir, Path::new("/flag/registry"));
        assert_eq!(c.admin_socket_mode, 0o600);
        assert_eq!(c.signatures.trusted_keys, [Path::new("/flag/k.pub")]);
        assert_eq!(c.log.format, LogFormat::Text);
        assert_eq!(c.timings.backoff_initial, Duration::from_secs(1));
    }

    #[test]
    fn a_root_in_the_file_moves_the_paths_and_single_paths_still_override() {
        let c = load(
            &["--state-dir", "/flag/state"],
            Some("root = \"/r\"\nhandlers_dir = \"/h\"\n"),
        )
        .unwrap();
        assert_eq!(c.paths.registry_dir, Path::new("/r/plugins_registry"));
        assert_eq!(c.paths.admin_socket, Path::new("/r/pluglet.sock"));
        assert_eq!(c.paths.handlers_dir, Path::new("/h"));
        assert_eq!(c.paths.state_dir, Path::new("/flag/state"));
    }

    #[test]
    fn unknown_keys_and_wrong_types_name_the_line_and_the_key() {
        let (line, key, message) = file_error("registry_dir = \"/x\"\n\nbogus_key = 1\n");
        assert_eq!(line, Some(3));
        assert_eq!(key.as_deref(), Some("bogus_key"));
        assert!(message.contains("unknown field `bogus_key`"), "{message}");

        let (line, key, message) = file_error("# c\nbackoff_max = 5\n");
        assert_eq!((line, key.as_deref()), (Some(2), Some("backoff_max")));
        assert!(message.contains("expected a string"), "{message}");

        let (line, key, message) = file_error("dial_timeout = \"soon\"\n");
        assert_eq!((line, key.as_deref()), (Some(1), Some("dial_timeout")));
        assert!(message.contains("\"soon\" is not a duration"), "{message}");

        // An element of a multi-line array: the key is the one the array belongs to.
        let (line, key, _) = file_error("trusted_key = [\n  \"/a\",\n  5,\n]\n");
        assert_eq!((line, key.as_deref()), (Some(3), Some("trusted_key")));

        let (line, key, _) = file_error("log_format = \"xml\"\n");
        assert_eq!((line, key.as_deref()), (Some(1), Some("log_format")));

        // Tables and dotted keys are unknown keys of their own.
        let (line, key, _) = file_error("node_name = \"n\"\n[logging]\nlevel = 1\n");
        assert_eq!((line, key.as_deref()), (Some(2), Some("logging")));
        let (line, key, _) = file_error("node_name = \"n\"\nlog.level = 1\n");
        assert_eq!((line, key.as_deref()), (Some(2), Some("log")));

        let err = ConfigFile::parse("node_name = [\n", Path::new("/etc/p.toml")).unwrap_err();
        assert!(err.to_string().contains("/etc/p.toml, line"), "{err}");
    }

    #[test]
    fn printed_configuration_reproduces_the_run() {
        for args in [
            &[][..],
            &[
                "--root",
                "/srv/p",
                "--admin-socket-mode",
                "0660",
                "--admin-socket-group",
                "root",
                "--node-name",
                "n \"quoted\" é",
                "--backoff-initial",
                "250ms",
                "--backoff-max",
                "1h2m3s4ms",
                "--trusted-key",
                "/k/a.pub",
                "--trusted-key",
                "/k/b c.pub",
                "--require-signatures",
                "--metrics-addr",
                "[::1]:9810",
                "--log-format",
                "json",
                "--log-level",
                "info,pluglet=debug",
            ][..],
        ] {
            let first = load(args, None).unwrap();
            let printed = to_toml(&first);
            let again = load(&[], Some(&printed)).unwrap();
            assert_eq!(again, first, "{printed}");
            assert_eq!(to_toml(&again), printed);
            for key in KEYS {
                assert!(
                    printed.contains(&format!("\n{key} = "))
                        || printed.contains(&format!("\n# {key}: ")),
                    "{key} missing from\n{printed}"
                );
            }
        }
    }

    #[test]
    fn the_example_file_documents_every_key_and_loads() {
        for key in KEYS {
            assert!(
                EXAMPLE.contains(&format!("{key} = ")),
                "examples/deploy/config.toml does not document {key}"
            );
        }
        let c = load(&[], Some(EXAMPLE)).unwrap();
        assert_eq!(c.metrics_addr, Some("127.0.0.1:9810".parse().unwrap()));
    }

    #[test]
    fn the_example_file_shows_the_defaults() {
        // Every `# key = value` line uncommented: the defaults, whatever the file says.
        let mut shown = BTreeSet::new();
        let uncommented: String = EXAMPLE
            .lines()
            .map(|line| match line.strip_prefix("# ") {
                Some(rest)
                    if rest
                        .split_once(" = ")
                        .is_some_and(|(key, _)| KEYS.contains(&key)) =>
                {
                    shown.insert(rest.split_once(" = ").unwrap().0.to_owned());
                    format!("{rest}\n")
                }
                _ => format!("{line}\n"),
            })
            .collect();
        let with_defaults = load(&[], Some(&uncommented)).unwrap();
        let mut defaults = load(&[], None).unwrap();
        defaults.metrics_addr = with_defaults.metrics_addr;
        assert_eq!(with_defaults, defaults);
        // Every key with a default shows it (the others have an example).
        let without_default = [
            "root",
            "admin_socket_group",
            "pod_resources_socket_group",
            "node_name",
            "metrics_addr",
            "kubeconfig",
            "registry_auth",
        ];
        for key in KEYS.iter().filter(|k| !without_default.contains(k)) {
            assert!(shown.contains(*key), "no `# {key} = <default>` line");
        }
    }
}
