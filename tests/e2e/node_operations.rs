//! Story: running the daemon on a node: a configuration file and `--print-config`, the admin
//! socket's group, JSON logs whose lines carry the registration and allocation spans, and the
//! shipped systemd unit.

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use crate::device_support::{DevicePluginProcess, Flow, allocate, release, wait_allocatable};
use crate::support::daemon::pluglet;
use crate::support::{Daemon, TestRoot};

const GPU: &str = "vendor.com/gpu";

/// `examples/deploy/<name>` in the repository.
fn deploy_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/deploy")
        .join(name)
}

/// Runs `pluglet run ARGS` to its end (only for runs that exit by themselves).
fn run(args: &[&str]) -> Output {
    Command::new(pluglet())
        .arg("run")
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run pluglet")
}

fn print_config(args: &[&str]) -> String {
    let mut all = args.to_vec();
    all.push("--print-config");
    let out = run(&all);
    assert!(
        out.status.success(),
        "pluglet run {all:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 configuration")
}

/// The value of `key = value` in printed configuration.
fn value_of<'a>(printed: &'a str, key: &str) -> &'a str {
    printed
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key} = ")))
        .unwrap_or_else(|| panic!("{key} not in\n{printed}"))
}

#[test]
fn printed_configuration_fed_back_prints_the_same() {
    let root = TestRoot::new();
    let root_dir = root.path().display().to_string();
    let first = print_config(&[
        "--root",
        &root_dir,
        "--node-name",
        "node-7",
        "--backoff-max",
        "1m",
        "--metrics-addr",
        "127.0.0.1:9810",
        "--log-format",
        "json",
        "--trusted-key",
        "/etc/pluglet/vendor.pub",
    ]);
    assert_eq!(
        value_of(&first, "registry_dir"),
        format!("\"{root_dir}/plugins_registry\"")
    );
    let file = root.path().join("printed.toml");
    std::fs::write(&file, &first).unwrap();
    let file = file.display().to_string();
    assert_eq!(print_config(&["--config", &file]), first);

    // The command line wins over the file.
    let over = print_config(&["--config", &file, "--node-name", "node-8"]);
    assert_eq!(value_of(&over, "node_name"), "\"node-8\"");
    assert_eq!(value_of(&over, "backoff_max"), "\"1m\"");
}

#[test]
fn shipped_config_is_accepted() {
    let file = deploy_file("config.toml").display().to_string();
    let printed = print_config(&["--config", &file]);
    assert_eq!(value_of(&printed, "metrics_addr"), "\"127.0.0.1:9810\"");
    assert_eq!(
        value_of(&printed, "registry_dir"),
        "\"/var/lib/kubelet/plugins_registry\""
    );
}

#[test]
fn bad_configuration_files_exit_64_naming_the_line_and_key() {
    let root = TestRoot::new();
    for (text, line, key) in [
        (
            "registry_dir = \"/x\"\n# note\nregistry-dir = \"/y\"\n",
            3,
            "registry-dir",
        ),
        (
            "node_name = \"n\"\nbackoff_initial = 500\n",
            2,
            "backoff_initial",
        ),
        ("log_format = \"xml\"\n", 1, "log_format"),
    ] {
        let file = root.path().join("bad.toml");
        std::fs::write(&file, text).unwrap();
        let out = run(&["--config", &file.display().to_string()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{stderr}");
        assert!(
            stderr.contains(&format!("line {line}")) && stderr.contains(&format!("`{key}`")),
            "names line {line} and key {key}: {stderr}"
        );
    }
    let out = run(&["--config", "/nonexistent/pluglet.toml"]);
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/pluglet.toml"));
}

#[test]
fn the_daemon_runs_with_its_configuration_file() {
    let root = TestRoot::new();
    let file = root.path().join("pluglet.toml");
    std::fs::write(
        &file,
        "admin_socket_mode = \"0640\"\nlog_level = \"warn\"\n",
    )
    .unwrap();
    let daemon = Daemon::start(&root.path(), &["--config", &file.display().to_string()]);
    let mode = std::fs::metadata(root.admin_socket())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o640, "the file's admin_socket_mode is in force");
    assert!(
        !daemon.log_text().contains("INFO"),
        "the file's log_level (warn) wins over RUST_LOG:\n{}",
        daemon.log_text()
    );
    assert!(daemon.terminate().success());
}

/// A group the admin socket can be given to by this process, other than its own when there is
/// one: any group as root, else one of its supplementary groups.
fn another_group() -> (String, u32) {
    let own = nix::unistd::getegid();
    let candidates: Vec<nix::unistd::Gid> = if nix::unistd::geteuid().is_root() {
        std::fs::read_to_string("/etc/group")
            .unwrap()
            .lines()
            .filter_map(|l| l.split(':').nth(2)?.parse().ok())
            .map(nix::unistd::Gid::from_raw)
            .collect()
    } else {
        nix::unistd::getgroups().unwrap()
    };
    let gid = candidates.into_iter().find(|g| *g != own).unwrap_or(own);
    let group = nix::unistd::Group::from_gid(gid)
        .unwrap()
        .expect("the group has a name");
    (group.name, gid.as_raw())
}

#[test]
fn admin_socket_is_given_to_its_group() {
    let root = TestRoot::new();
    let (name, gid) = another_group();
    let daemon = Daemon::start(
        &root.path(),
        &["--admin-socket-mode", "0660", "--admin-socket-group", &name],
    );
    let meta = std::fs::metadata(root.admin_socket()).unwrap();
    assert_eq!(meta.gid(), gid, "admin socket group {name}");
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    assert!(daemon.ctl(&["plugins"]).status.success());
    assert!(daemon.terminate().success());
}

#[test]
fn unknown_admin_socket_group_is_refused_at_start() {
    let root = TestRoot::new();
    let (status, log) = Daemon::spawn(
        &root.path(),
        &["--admin-socket-group", "no-such-pluglet-group"],
    )
    .wait_exit();
    assert_eq!(status.code(), Some(64), "{log}");
    assert!(
        log.contains("\"no-such-pluglet-group\" does not exist"),
        "names the group: {log}"
    );
    assert!(!root.admin_socket().exists());
}

/// Every line of `log` as JSON; fails naming a line that is not.
fn json_lines(log: &str) -> Vec<Value> {
    log.lines()
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("log line is not JSON ({e}): {line}\nlog:\n{log}"))
        })
        .collect()
}

/// The lines whose message is `message`.
fn with_message<'a>(lines: &'a [Value], message: &str) -> Vec<&'a Value> {
    lines
        .iter()
        .filter(|l| l["fields"]["message"] == message)
        .collect()
}

#[test]
fn json_logs_carry_the_registration_and_allocation_spans() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &["--log-format", "json"]);
    let watcher = DevicePluginProcess::start(&root, Flow::Watcher, GPU, &[]);
    wait_allocatable(&daemon, GPU, 4);
    let classic = DevicePluginProcess::start(&root, Flow::Classic, "vendor.com/fpga", &[]);
    wait_allocatable(&daemon, "vendor.com/fpga", 4);
    allocate(&daemon, "pod-1", "ctr-a", GPU, 2).expect("allocation");
    release(&daemon, "pod-1", Some("ctr-a"));
    let log = daemon.log_text();
    let lines = json_lines(&log);

    let registered = with_message(&lines, "plugin registered");
    let span_of = |name: &str| {
        registered
            .iter()
            .map(|l| &l["span"])
            .find(|s| s["plugin_name"] == name)
            .unwrap_or_else(|| panic!("no registration line for {name}:\n{log}"))
            .clone()
    };
    // Through the plugin watcher: the registration socket in the registry directory.
    let span = span_of(GPU);
    assert_eq!(span["name"], "registration", "{span}");
    assert_eq!(span["plugin_type"], "DevicePlugin", "{span}");
    let reg_socket = watcher.reg_socket.as_ref().expect("watcher flow");
    assert_eq!(span["socket"], reg_socket.display().to_string(), "{span}");
    // Through kubelet.sock: the plugin's own socket, as its Register named it.
    let span = span_of("vendor.com/fpga");
    assert_eq!(span["name"], "registration", "{span}");
    assert_eq!(span["plugin_type"], "DevicePlugin", "{span}");
    let endpoint = classic.socket.file_name().unwrap().to_string_lossy();
    assert_eq!(span["socket"], *endpoint, "{span}");

    let allocated = with_message(&lines, "devices allocated");
    assert_eq!(allocated.len(), 1, "{log}");
    let span = &allocated[0]["span"];
    assert_eq!(span["name"], "allocation", "{span}");
    assert_eq!(span["pod"], "pod-1", "{span}");
    assert_eq!(span["container"], "ctr-a", "{span}");
    assert_eq!(span["resource"], GPU, "{span}");
    assert_eq!(allocated[0]["spans"][0]["name"], "allocation");

    let released = with_message(&lines, "devices released");
    assert_eq!(released.len(), 1, "{log}");
    let span = &released[0]["span"];
    assert_eq!(span["name"], "release", "{span}");
    assert_eq!(span["pod"], "pod-1", "{span}");
    assert_eq!(span["container"], "ctr-a", "{span}");
}

#[test]
fn shipped_unit_passes_systemd_analyze_verify() {
    let unit = std::fs::read_to_string(deploy_file("pluglet.service")).unwrap();
    for line in [
        "Type=notify",
        "NotifyAccess=main",
        "Restart=on-failure",
        "WatchdogSec=30s",
        "ExecStart=/usr/local/bin/pluglet run --config /etc/pluglet/config.toml",
        "RuntimeDirectory=pluglet",
        "ProtectSystem=strict",
        "ReadWritePaths=/var/lib/kubelet/plugins_registry /var/lib/kubelet/device-plugins /var/lib/kubelet/pod-resources /var/lib/pluglet",
        "NoNewPrivileges=yes",
        "PrivateTmp=yes",
    ] {
        assert!(
            unit.lines().any(|l| l == line),
            "pluglet.service lacks `{line}`"
        );
    }

    let analyze = which("systemd-analyze").unwrap_or_else(|| {
        panic!(
            "systemd-analyze is not installed: it is in the Debian package `systemd` \
             (scripts/test.sh installs it when run as root; else `sudo apt-get install -y systemd`)"
        )
    });
    // The tool checks that ExecStart's program exists: verify a copy that runs the built
    // binary.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("pluglet.service");
    std::fs::write(
        &copy,
        unit.replace(
            "ExecStart=/usr/local/bin/pluglet ",
            &format!("ExecStart={} ", pluglet().display()),
        ),
    )
    .unwrap();
    let out = Command::new(analyze)
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .expect("run systemd-analyze");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "systemd-analyze verify: {stderr}");
    let about_unit: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("pluglet.service"))
        .collect();
    assert!(
        about_unit.is_empty(),
        "systemd-analyze verify warns about the unit:\n{stderr}"
    );
}

/// `program` found on `PATH`.
fn which(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

#[test]
fn container_image_checks_health_on_the_shipped_metrics_address() {
    let containerfile = std::fs::read_to_string(deploy_file("Containerfile")).unwrap();
    let config = deploy_file("config.toml").display().to_string();
    let printed = print_config(&["--config", &config]);
    let addr = value_of(&printed, "metrics_addr").trim_matches('"');
    assert!(
        containerfile.contains(&format!("curl -fsS http://{addr}/healthz")),
        "the HEALTHCHECK asks /healthz on the shipped metrics_addr {addr}"
    );
    assert!(containerfile.contains("ENTRYPOINT [\"pluglet\", \"run\"]"));
    assert!(containerfile.contains("CMD [\"--config\", \"/etc/pluglet/config.toml\"]"));
    assert!(containerfile.contains("COPY examples/deploy/config.toml /etc/pluglet/config.toml"));
    assert!(containerfile.contains("rustup target add wasm32-wasip2"));
}
