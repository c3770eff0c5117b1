//! Harness for the device manager stories: `example-device-plugin` in either registration flow,
//! and the device subcommands of `pluglet ctl`.

use std::path::{Path, PathBuf};
use std::process::Command;

use nix::sys::signal::Signal;
use serde_json::Value;

use super::daemon::{check_envelope, unique};
use super::plugins::STOP_GRACE;
use super::process::ChildGuard;
use super::{DEADLINE, Daemon, TestRoot, bin, wait_for};

/// How a device plugin registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Register on `<root>/device-plugins/kubelet.sock`.
    Classic,
    /// A registration socket in `<root>/plugins_registry`.
    Watcher,
}

/// Both flows, for stories that must hold in each.
pub const FLOWS: [Flow; 2] = [Flow::Classic, Flow::Watcher];

/// A running `example-device-plugin`; SIGTERMed (then killed) on drop.
pub struct DevicePluginProcess {
    child: ChildGuard,
    /// The flow it registered through.
    pub flow: Flow,
    /// Its DevicePlugin socket.
    pub socket: PathBuf,
    /// Its registration socket (watcher flow).
    pub reg_socket: Option<PathBuf>,
    /// Health control file.
    pub health_file: PathBuf,
    /// Every RPC it received, as JSON lines.
    pub calls_file: PathBuf,
    /// Its stderr.
    pub log: PathBuf,
}

/// `<root>/device-plugins`.
pub fn device_plugins_dir(root: &TestRoot) -> PathBuf {
    root.path().join("device-plugins")
}

impl DevicePluginProcess {
    /// Starts a plugin for `resource` registering through `flow`, with `extra` arguments
    /// (`--devices 4 --numa-nodes 2` unless given).
    pub fn start(root: &TestRoot, flow: Flow, resource: &str, extra: &[&str]) -> Self {
        let n = unique();
        // `side(".")` creates `<root>/plugins`; join from the clean path.
        let side = root.side(".").parent().expect("plugins dir").to_owned();
        let dp_dir = device_plugins_dir(root);
        let health_file = side.join(format!("dp-{n}.health"));
        let calls_file = side.join(format!("dp-{n}.calls"));
        let log = side.join(format!("dp-{n}.log"));
        let mut args: Vec<String> = vec!["--resource".into(), resource.into()];
        let (socket, reg_socket) = match flow {
            Flow::Classic => {
                let socket = dp_dir.join(format!("dp-{n}.sock"));
                args.extend([
                    "--kubelet-socket".into(),
                    dp_dir.join("kubelet.sock").display().to_string(),
                ]);
                (socket, None)
            }
            Flow::Watcher => {
                let socket = side.join(format!("dp-{n}.sock"));
                let reg = root.registry().join(format!("dp-{n}-reg.sock"));
                args.extend([
                    "--reg-socket".into(),
                    reg.display().to_string(),
                    "--status-file".into(),
                    side.join(format!("dp-{n}.status")).display().to_string(),
                ]);
                (socket, Some(reg))
            }
        };
        args.extend([
            "--socket".into(),
            socket.display().to_string(),
            "--health-file".into(),
            health_file.display().to_string(),
            "--calls-file".into(),
            calls_file.display().to_string(),
        ]);
        if !extra.contains(&"--devices") {
            args.extend(["--devices".into(), "4".into()]);
        }
        if !extra.contains(&"--numa-nodes") {
            args.extend(["--numa-nodes".into(), "2".into()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let child = ChildGuard::spawn(
            Command::new(bin("example-device-plugin"))
                .args(&args)
                .env("RUST_LOG", "info"),
            &log,
            STOP_GRACE,
        );
        DevicePluginProcess {
            child,
            flow,
            socket,
            reg_socket,
            health_file,
            calls_file,
            log,
        }
    }

    /// The plugin's pid.
    pub fn pid(&self) -> i32 {
        self.child.pid() as i32
    }

    /// Writes the health control file (`dev-1 Unhealthy` lines).
    pub fn set_health(&self, text: &str) {
        let tmp = self.health_file.with_extension("tmp");
        std::fs::write(&tmp, text).expect("write health file");
        std::fs::rename(&tmp, &self.health_file).expect("replace health file");
    }

    /// Sends `signal` to the plugin.
    pub fn signal(&self, signal: Signal) {
        self.child.signal(signal);
    }

    /// SIGKILLs the plugin (its sockets stay, its streams end).
    pub fn kill9(&mut self) {
        self.child.kill();
    }

    /// Every RPC it recorded.
    pub fn calls(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.calls_file)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The recorded calls of `method`.
    pub fn calls_of(&self, method: &str) -> Vec<Value> {
        self.calls()
            .into_iter()
            .filter(|c| c["method"] == method)
            .collect()
    }

    /// The plugin's stderr so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The socket whose removal deregisters it: the registration socket in the watcher flow,
    /// the DevicePlugin socket in the classic flow.
    pub fn removable_socket(&self) -> &Path {
        self.reg_socket.as_deref().unwrap_or(&self.socket)
    }
}

/// `ctl resources -o json`.
pub fn resources(daemon: &Daemon) -> Vec<Value> {
    daemon.ctl_json("resources")
}

/// The resource named `name`, if listed.
pub fn resource(daemon: &Daemon, name: &str) -> Option<Value> {
    resources(daemon)
        .into_iter()
        .find(|r| r["resource"] == name)
}

/// Waits until `name` is listed and satisfies `pred`.
pub fn wait_resource(
    daemon: &Daemon,
    name: &str,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    wait_for(&format!("resource {name} {what}"), DEADLINE, || {
        resource(daemon, name).filter(|r| pred(r))
    })
}

/// Waits until `name` has `n` allocatable devices.
pub fn wait_allocatable(daemon: &Daemon, name: &str, n: i64) -> Value {
    wait_resource(daemon, name, &format!("with {n} allocatable"), |r| {
        r["allocatable"] == n && r["connected"] == true
    })
}

/// `ctl allocate … -o json`: the answer object, or the error text.
pub fn allocate(
    daemon: &Daemon,
    pod: &str,
    container: &str,
    resource: &str,
    count: u32,
) -> Result<Value, String> {
    allocate_with(daemon, pod, container, resource, count, &[])
}

/// [`allocate`] with `extra` options (e.g. `--pod-name`).
pub fn allocate_with(
    daemon: &Daemon,
    pod: &str,
    container: &str,
    resource: &str,
    count: u32,
    extra: &[&str],
) -> Result<Value, String> {
    let count = count.to_string();
    let mut args = vec![
        "allocate",
        "--pod",
        pod,
        "--container",
        container,
        "--resource",
        resource,
        "--count",
        &count,
        "-o",
        "json",
    ];
    args.extend_from_slice(extra);
    let out = daemon.ctl(&args);
    if out.status.success() {
        let value = serde_json::from_slice(&out.stdout).expect("ctl allocate prints JSON");
        check_envelope(&value, Some("AllocateResult"));
        Ok(value)
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// `ctl release`.
pub fn release(daemon: &Daemon, pod: &str, container: Option<&str>) {
    let mut args = vec!["release", "--pod", pod];
    if let Some(c) = container {
        args.extend(["--container", c]);
    }
    let out = daemon.ctl(&args);
    assert!(
        out.status.success(),
        "ctl release failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `ctl allocations -o json`.
pub fn allocations(daemon: &Daemon) -> Vec<Value> {
    daemon.ctl_json("allocations")
}

/// Ids in a JSON array of strings.
pub fn ids(value: &Value) -> Vec<String> {
    value
        .as_array()
        .expect("an array")
        .iter()
        .map(|v| v.as_str().expect("a string").to_owned())
        .collect()
}

/// `<root>/device-plugins/kubelet_internal_checkpoint`.
pub fn checkpoint(root: &TestRoot) -> PathBuf {
    device_plugins_dir(root).join("kubelet_internal_checkpoint")
}
