//! Story: an operator asks the daemon how it is (`ctl status`) and what happened lately (`ctl
//! events`), and follows what happens next (`ctl events --watch`); scripts read the same in
//! versioned JSON.

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

use serde_json::Value;

use crate::device_support::{DevicePluginProcess, Flow, allocate, release, wait_allocatable};
use crate::support::daemon::{check_envelope, pluglet};
use crate::support::{CsiPlugin, DEADLINE, Daemon, TestRoot};

const GPU: &str = "vendor.com/gpu";

/// The row of `plugin_type` in the status's plugin counts.
fn plugin_row<'a>(status: &'a Value, plugin_type: &str) -> &'a Value {
    status["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["type"] == plugin_type)
        .unwrap_or_else(|| panic!("no {plugin_type} in {status}"))
}

#[test]
fn status_reports_ready_with_plugins_resources_and_handlers() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let reg = root.registry().join("csi.example.com-reg.sock");
    let csi = CsiPlugin::start(&root.side("."), &reg, &["--name", "csi.example.com"]);
    csi.wait_registered();
    daemon.wait_plugin("csi.example.com");
    let _gpu = DevicePluginProcess::start(&root, Flow::Classic, GPU, &[]);
    wait_allocatable(&daemon, GPU, 4);
    allocate(&daemon, "pod-1", "ctr", GPU, 2).unwrap();

    let status = daemon.ctl_object(&["status"], Some("Status"));
    assert_eq!(status["version"], env!("CARGO_PKG_VERSION"), "{status}");
    assert_eq!(status["live"], true, "{status}");
    assert_eq!(status["ready"], true, "{status}");
    assert_eq!(status["waiting_for"], serde_json::json!([]), "{status}");
    assert!(status["uptime_ms"].is_u64(), "{status}");
    assert_eq!(
        plugin_row(&status, "CSIPlugin"),
        &serde_json::json!({"type": "CSIPlugin", "registered": 1, "failing": 0, "waiting": 0})
    );
    assert_eq!(plugin_row(&status, "DevicePlugin")["registered"], 1);
    assert_eq!(
        status["resources"],
        serde_json::json!([{
            "resource": GPU,
            "capacity": 4,
            "allocatable": 4,
            "allocated": 2,
            "connected": true,
        }])
    );
    let csi_slot = status["handlers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["slot"] == "plugin_type/CSIPlugin")
        .unwrap_or_else(|| panic!("no CSIPlugin handler in {status}"));
    assert_eq!(csi_slot["module"], "builtin:csi");
    assert_eq!(csi_slot["sha256"].as_str().unwrap().len(), 64);
    assert_eq!(status["last_errors"], serde_json::json!([]), "{status}");

    let out = daemon.ctl(&["status"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with(&format!("pluglet {}, up ", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    assert!(text.lines().nth(1) == Some("ready"), "{text}");
    for part in ["PLUGINS", "RESOURCES", "HANDLERS", "LAST ERRORS"] {
        assert!(text.lines().any(|l| l == part), "no {part}: {text}");
    }
}

/// `ctl events -o json`: the items of the `EventList`.
fn events(daemon: &Daemon) -> Vec<Value> {
    let list = daemon.ctl_object(&["events"], Some("EventList"));
    list["items"].as_array().unwrap().clone()
}

/// The position of the first event of `kind` about `subject`.
fn position(events: &[Value], kind: &str, subject: &str) -> usize {
    events
        .iter()
        .position(|e| e["type"] == kind && e["subject"] == subject)
        .unwrap_or_else(|| panic!("no {kind} event about {subject} in {events:#?}"))
}

#[test]
fn events_show_a_registration_an_allocation_and_a_release_in_order() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let _gpu = DevicePluginProcess::start(&root, Flow::Classic, GPU, &[]);
    wait_allocatable(&daemon, GPU, 4);
    allocate(&daemon, "pod-1", "ctr", GPU, 2).unwrap();
    release(&daemon, "pod-1", None);
    let refused = allocate(&daemon, "pod-2", "ctr", GPU, 9).unwrap_err();

    let events = events(&daemon);
    let registered = position(&events, "registered", &format!("DevicePlugin {GPU}"));
    let allocated = position(&events, "allocated", GPU);
    let released = position(&events, "released", GPU);
    let failed = position(&events, "allocate_failed", GPU);
    assert!(
        registered < allocated && allocated < released && released < failed,
        "{events:#?}"
    );
    let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "newest last: {seqs:?}"
    );
    assert!(
        events[allocated]["message"]
            .as_str()
            .unwrap()
            .ends_with("to pod pod-1 container ctr"),
        "{}",
        events[allocated]
    );
    assert!(events[allocated]["at"].as_str().unwrap().ends_with('Z'));

    // The failed allocation is one of the status's last errors.
    let status = daemon.ctl_object(&["status"], Some("Status"));
    let errors = status["last_errors"].as_array().unwrap();
    assert_eq!(
        errors.last().unwrap()["type"],
        "allocate_failed",
        "{status}"
    );
    assert!(
        refused.contains(GPU),
        "the refusal names the resource: {refused}"
    );

    let out = daemon.ctl(&["events"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let header: Vec<&str> = text.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["TIME", "KIND", "SUBJECT", "MESSAGE"], "{text}");
    assert_eq!(text.lines().count(), events.len() + 1, "{text}");
}

/// `pluglet ctl events --watch -o json` with its stdout read line by line on a thread; killed
/// on drop.
struct Watch {
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: std::path::PathBuf,
}

impl Watch {
    fn start(root: &TestRoot) -> Watch {
        let stderr = root.side("watch.err");
        let mut child = Command::new(pluglet())
            .arg("ctl")
            .arg("--root")
            .arg(root.path())
            .args(["events", "--watch", "-o", "json"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("spawn pluglet ctl events --watch");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Watch {
            child,
            lines,
            stderr,
        }
    }

    /// Reads lines until one is an event satisfying `pred`, failing after [`DEADLINE`].
    fn wait_event(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = std::time::Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("no line with {what} from ctl events --watch: {e}"));
            let event: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("not one JSON object per line: {e}: {line}"));
            check_envelope(&event, Some("Event"));
            if pred(&event) {
                return event;
            }
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn events_watch_streams_an_event_that_happens_after_it_started() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let _gpu = DevicePluginProcess::start(&root, Flow::Classic, GPU, &[]);
    wait_allocatable(&daemon, GPU, 4);

    let watch = Watch::start(&root);
    // The registration happened before: it comes from the recent events, which means the
    // watcher follows the log from here on.
    watch.wait_event("the registration", |e| {
        e["type"] == "registered" && e["subject"] == format!("DevicePlugin {GPU}")
    });
    allocate(&daemon, "pod-9", "ctr", GPU, 1).unwrap();
    let allocated = watch.wait_event("the allocation", |e| e["type"] == "allocated");
    assert_eq!(allocated["subject"], GPU, "{allocated}");
    assert!(
        allocated["message"]
            .as_str()
            .unwrap()
            .ends_with("to pod pod-9 container ctr"),
        "{allocated}"
    );

    // Stopping the daemon ends the stream (rather than leaving it open until the process is
    // gone): the watcher says so and exits non-zero.
    let status = daemon.terminate();
    assert!(status.success(), "{status}");
    let mut watch = watch;
    let exit = watch.child.wait().unwrap();
    assert!(!exit.success(), "{exit}");
    let stderr = std::fs::read_to_string(&watch.stderr).unwrap();
    assert!(
        stderr.contains("the daemon ended the event stream"),
        "{stderr}"
    );
}
