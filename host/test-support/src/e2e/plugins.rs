//! The example plugins as separate processes, and what they recorded.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use serde_json::Value;

use super::daemon::unique;
use super::process::ChildGuard;
use super::{DEADLINE, bin, wait_for};

/// How long dropping a plugin waits after SIGTERM before SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// A plugin process; SIGTERMed (then killed) on drop.
pub struct PluginProcess {
    child: ChildGuard,
    status_file: PathBuf,
    log: PathBuf,
}

impl PluginProcess {
    fn spawn(binary: &str, args: &[String], status_file: PathBuf, log: PathBuf) -> PluginProcess {
        let child = ChildGuard::spawn(
            Command::new(bin(binary)).args(args).env("RUST_LOG", "info"),
            &log,
            STOP_GRACE,
        );
        PluginProcess {
            child,
            status_file,
            log,
        }
    }

    /// Every JSON line the plugin recorded in its status file.
    pub fn events(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.status_file)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The NotifyRegistrationStatus calls received (`plugin_registered`, `error`).
    pub fn notifications(&self) -> Vec<Value> {
        self.events()
            .into_iter()
            .filter(|e| e.get("plugin_registered").is_some())
            .collect()
    }

    /// Waits for the first NotifyRegistrationStatus and returns it.
    pub fn wait_notified(&self) -> Value {
        self.wait_notification("a registration status", |_| true)
    }

    /// Waits for a NotifyRegistrationStatus satisfying `pred`.
    pub fn wait_notification(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        wait_for(
            &format!("{what} at {}", self.status_file.display()),
            DEADLINE,
            || self.notifications().into_iter().find(|n| pred(n)),
        )
    }

    /// Waits for a `true` status; fails on the way if a `false` came first.
    pub fn wait_registered(&self) {
        let n = self.wait_notified();
        assert_eq!(
            n["plugin_registered"],
            true,
            "plugin was refused: {n}\nplugin log:\n{}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }

    /// Sends SIGTERM and waits for the exit status (the plugin removes its sockets).
    pub fn terminate(&mut self) -> ExitStatus {
        self.child
            .terminate(DEADLINE)
            .expect("plugin did not exit after SIGTERM")
    }

    /// Waits for the plugin to exit on its own.
    pub fn wait_exit(&mut self) -> ExitStatus {
        self.child.wait_exit(DEADLINE).expect("plugin did not exit")
    }
}

/// `example-csi-plugin` with a status file.
pub struct CsiPlugin;

impl CsiPlugin {
    /// Starts it with its registration socket at `reg_socket`, its CSI socket beside the status
    /// file (outside the registry), and `extra` arguments.
    pub fn start(side_dir: &Path, reg_socket: &Path, extra: &[&str]) -> PluginProcess {
        let n = unique();
        let status_file = side_dir.join(format!("csi-{n}.status"));
        let log = side_dir.join(format!("csi-{n}.log"));
        let csi_socket = side_dir.join(format!("csi-{n}.sock"));
        let mut args = vec![
            "--reg-socket".to_owned(),
            reg_socket.display().to_string(),
            "--csi-socket".to_owned(),
            csi_socket.display().to_string(),
            "--status-file".to_owned(),
            status_file.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        PluginProcess::spawn("example-csi-plugin", &args, status_file, log)
    }
}

/// `example-device-plugin` in its plugin-watcher flow.
pub struct DevicePlugin;

impl DevicePlugin {
    /// Starts it with its registration socket at `reg_socket` and its DevicePlugin socket in
    /// `side_dir`.
    pub fn start(
        side_dir: &Path,
        reg_socket: &Path,
        resource: &str,
        extra: &[&str],
    ) -> PluginProcess {
        let n = unique();
        let status_file = side_dir.join(format!("dp-{n}.status"));
        let log = side_dir.join(format!("dp-{n}.log"));
        let socket = side_dir.join(format!("dp-{n}.sock"));
        let mut args = vec![
            "--resource".to_owned(),
            resource.to_owned(),
            "--reg-socket".to_owned(),
            reg_socket.display().to_string(),
            "--socket".to_owned(),
            socket.display().to_string(),
            "--status-file".to_owned(),
            status_file.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        PluginProcess::spawn("example-device-plugin", &args, status_file, log)
    }
}
