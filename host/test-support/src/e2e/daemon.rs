//! The real `pluglet run` binary on a temporary root, and `pluglet ctl` against it.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output};
use std::time::Duration;

use serde_json::Value;

use super::compiled;
use super::process::ChildGuard;
use super::{DEADLINE, wait_for};

/// Short timings so tests never wait for the kubelet's minutes.
pub const FAST_TIMINGS: &[&str] = &[
    "--backoff-initial",
    "50ms",
    "--backoff-max",
    "400ms",
    "--getinfo-timeout",
    "1s",
    "--nodegetinfo-timeout",
    "2s",
    "--notify-timeout",
    "2s",
    "--dial-timeout",
    "2s",
];

/// A running `pluglet run --root <root>`; SIGTERMed (then killed) on drop.
pub struct Daemon {
    root: PathBuf,
    child: ChildGuard,
    log: PathBuf,
    /// The default state directory (`<root>/state`), unless `--state-dir` moved it.
    state: Option<PathBuf>,
}

/// How long dropping a [`Daemon`] waits after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// The `pluglet` binary.
pub fn pluglet() -> PathBuf {
    super::bin("pluglet")
}

impl Daemon {
    /// Starts the daemon with [`FAST_TIMINGS`] and `extra` arguments and waits until its admin
    /// API answers.
    pub fn start(root: &Path, extra: &[&str]) -> Daemon {
        let mut d = Daemon::spawn(root, extra);
        d.wait_ready();
        d
    }

    /// Like [`Daemon::start`], but a fresh root is not given the built-ins another daemon of
    /// this process compiled ([`compiled`](super::compiled)): the daemon compiles them itself.
    pub fn start_cold(root: &Path, extra: &[&str]) -> Daemon {
        let mut d = Daemon::launch(root, extra, &[], false);
        d.wait_ready();
        d
    }

    /// Starts the daemon without waiting.
    pub fn spawn(root: &Path, extra: &[&str]) -> Daemon {
        Daemon::spawn_with_env(root, extra, &[])
    }

    /// Starts the daemon without waiting, with `env` added to its environment.
    pub fn spawn_with_env(root: &Path, extra: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Daemon {
        Daemon::launch(root, extra, env, true)
    }

    /// Starts the daemon; `seed`: a fresh default state directory first gets the built-ins
    /// compiled by an earlier daemon of this process.
    fn launch(root: &Path, extra: &[&str], env: &[(&str, &std::ffi::OsStr)], seed: bool) -> Daemon {
        let state = compiled::default_state(root, extra);
        if let Some(state) = state.as_deref().filter(|_| seed) {
            compiled::seed(state);
        }
        let log = root.join(format!("pluglet-{}.log", unique()));
        // `extra` wins over the fast defaults.
        let timings: Vec<&str> = FAST_TIMINGS
            .chunks(2)
            .filter(|pair| !extra.contains(&pair[0]))
            .flatten()
            .copied()
            .collect();
        let child = ChildGuard::spawn(
            Command::new(pluglet())
                .arg("run")
                .arg("--root")
                .arg(root)
                .args(timings)
                .args(extra)
                .env("RUST_LOG", "info,pluglet=debug")
                .envs(env.iter().copied()),
            &log,
            STOP_GRACE,
        );
        Daemon {
            root: root.to_owned(),
            child,
            log,
            state,
        }
    }

    /// Waits until `ctl plugins` succeeds (fails early if the daemon exits).
    pub fn wait_ready(&mut self) {
        wait_for("the daemon's admin API", Duration::from_secs(120), || {
            if let Some(status) = self.child.exited() {
                panic!(
                    "pluglet exited during start-up with {status}; log:\n{}",
                    self.log_text()
                );
            }
            self.ctl(&["plugins"]).status.success().then_some(())
        });
        if let Some(state) = &self.state {
            compiled::capture(state);
        }
    }

    /// The daemon's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Runs `pluglet ctl --root <root> <args>`.
    pub fn ctl(&self, args: &[&str]) -> Output {
        Command::new(pluglet())
            .arg("ctl")
            .arg("--root")
            .arg(&self.root)
            .args(args)
            .output()
            .expect("run pluglet ctl")
    }

    /// Runs `pluglet ctl --root <root> <what> -o json` and returns the `items` of the list it
    /// prints (checking its envelope: `api_version` and a `kind` ending in `List`).
    pub fn ctl_json(&self, what: &str) -> Vec<Value> {
        let mut list = self.ctl_object(&[what], None);
        let kind = list["kind"].as_str().unwrap_or_default().to_owned();
        assert!(
            kind.ends_with("List"),
            "ctl {what} -o json printed a {kind}, not a list"
        );
        match list["items"].take() {
            Value::Array(items) => items,
            other => panic!("ctl {what} -o json printed items {other}"),
        }
    }

    /// Runs `pluglet ctl --root <root> <args> -o json`, which must succeed, and returns the
    /// object it prints, after checking that it carries `api_version` `pluglet/v1` and `kind`
    /// (when given).
    pub fn ctl_object(&self, args: &[&str], kind: Option<&str>) -> Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let out = self.ctl(&all);
        assert!(
            out.status.success(),
            "ctl {all:?} failed: {}\ndaemon log:\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.log_text()
        );
        let value: Value = serde_json::from_slice(&out.stdout).expect("ctl prints JSON");
        check_envelope(&value, kind);
        value
    }

    /// The registered plugin named `name`, if any.
    pub fn plugin(&self, name: &str) -> Option<Value> {
        self.ctl_json("plugins")
            .into_iter()
            .find(|p| p["name"] == name)
    }

    /// The socket status of `path`, if the watcher knows it.
    pub fn socket(&self, path: &Path) -> Option<Value> {
        let path = path.display().to_string();
        self.ctl_json("sockets")
            .into_iter()
            .find(|s| s["path"] == path.as_str())
    }

    /// Waits until `ctl plugins` lists `name`, returning its JSON.
    pub fn wait_plugin(&self, name: &str) -> Value {
        wait_for(&format!("plugin {name} in ctl plugins"), DEADLINE, || {
            self.plugin(name)
        })
    }

    /// Waits until the socket at `path` has a status satisfying `pred`.
    pub fn wait_socket(&self, path: &Path, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        wait_for(
            &format!("socket {} {what}", path.display()),
            DEADLINE,
            || self.socket(path).filter(|s| pred(s)),
        )
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(mut self) -> ExitStatus {
        self.child
            .terminate(DEADLINE)
            .expect("pluglet did not exit after SIGTERM")
    }

    /// Sends SIGTERM, waits for the exit status, and returns it with the whole log.
    pub fn terminate_with_log(mut self) -> (ExitStatus, String) {
        let status = self
            .child
            .terminate(DEADLINE)
            .expect("pluglet did not exit after SIGTERM");
        (status, self.log_text())
    }

    /// SIGKILLs the daemon (none of its clean-up runs) and reaps it.
    pub fn kill(mut self) {
        self.child.kill();
    }

    /// Waits for the daemon to exit on its own (e.g. refused at start-up).
    pub fn wait_exit(mut self) -> (ExitStatus, String) {
        let status = self
            .child
            .wait_exit(DEADLINE)
            .expect("pluglet did not exit");
        (status, self.log_text())
    }
}

/// Asserts that `value` is an object in the `-o json` envelope (`api_version` `pluglet/v1`),
/// of `kind` when given.
pub fn check_envelope(value: &Value, kind: Option<&str>) {
    assert_eq!(value["api_version"], "pluglet/v1", "no envelope: {value}");
    assert!(value["kind"].is_string(), "no kind: {value}");
    if let Some(kind) = kind {
        assert_eq!(value["kind"], kind, "{value}");
    }
}

/// A number unique within this test process.
pub fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
