//! Handler swaps while the daemon serves: a resource's allocation policy replaced in the
//! handlers directory (renamed into place, as vendors do, or copied over in place), refused
//! changes that keep the old module serving, a failing new module rolled back (and the rollback
//! kept across a restart), an entry removed, a rollback by hand, and swaps under load.
//!
//! The device plugin runs with `--preferred` (it prefers the last available devices), so for
//! two of its four devices (dev-0, dev-2 on NUMA node 0; dev-1, dev-3 on node 1) each policy
//! answers differently: misbehave's first fit `[dev-0, dev-1]` (ignores the preference),
//! spread-policy `[dev-2, dev-3]` (one per node, preferred first within a node), the built-in
//! `[dev-3, dev-2]` (the plugin's preference).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::device_support::{
    DevicePluginProcess, FLOWS, allocate, ids, release, resource, wait_allocatable,
};
use crate::support::{Daemon, TestRoot, wait_for};

pub(crate) const GPU: &str = "vendor.com/gpu";
const NIC: &str = "vendor.com/nic";
pub(crate) const FIRST_FIT: [&str; 2] = ["dev-0", "dev-1"];
pub(crate) const SPREAD: [&str; 2] = ["dev-2", "dev-3"];
const BUILTIN: [&str; 2] = ["dev-3", "dev-2"];
const BUILTIN_POLICY: &str = "builtin:device-plugin";

/// How long a handler change may take to show; generous (the machine is shared).
const CHANGE_DEADLINE: Duration = Duration::from_secs(10);

/// sha256 of a file, hex (as `ctl handlers` shows it).
pub(crate) fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("run sha256sum");
    assert!(out.status.success(), "sha256sum {}", path.display());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("a digest")
        .to_owned()
}

/// A built test guest, checked to exist.
pub(crate) fn guest(name: &str) -> PathBuf {
    let path = pluglet_wasm_guests::guest_path(name);
    assert!(
        path.exists(),
        "guest {name} not built at {}",
        path.display()
    );
    path
}

/// Writes `bytes` to a temporary name in the handlers directory and renames it over `file`.
pub(crate) fn rename_into_place(root: &TestRoot, file: &str, bytes: &[u8]) {
    let tmp = root.handlers().join(format!(".{file}.tmp"));
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, root.handlers().join(file)).unwrap();
}

/// Renames the guest `name` into place as `file`.
pub(crate) fn rename_guest(root: &TestRoot, name: &str, file: &str) {
    rename_into_place(root, file, &std::fs::read(guest(name)).unwrap());
}

/// Copies the guest `name` over `file` in place.
fn copy_guest(root: &TestRoot, name: &str, file: &str) {
    std::fs::copy(guest(name), root.handlers().join(file)).unwrap();
}

/// Writes `handlers.toml` (renamed into place) after copying the named guests next to it.
pub(crate) fn handlers_toml(root: &TestRoot, guests: &[(&str, &str)], body: &str) {
    std::fs::create_dir_all(root.handlers()).unwrap();
    for (name, file) in guests {
        std::fs::copy(guest(name), root.handlers().join(file)).unwrap();
    }
    rename_into_place(root, "handlers.toml", body.as_bytes());
}

/// `ctl handlers -o json`, whole.
pub(crate) fn handlers(daemon: &Daemon) -> Value {
    daemon.ctl_object(&["handlers"], Some("HandlerList"))
}

/// The row of the `vendor.com/gpu` slot, if listed.
pub(crate) fn gpu_row(daemon: &Daemon) -> Option<Value> {
    daemon
        .ctl_json("handlers")
        .into_iter()
        .find(|h| h["resource"] == GPU)
}

/// Polls `probe` until it answers, failing with `what`, the last thing seen and the daemon log.
pub(crate) fn wait_until<T>(
    daemon: &Daemon,
    what: &str,
    mut probe: impl FnMut() -> (Option<T>, String),
) -> T {
    let start = Instant::now();
    loop {
        let (got, last) = probe();
        if let Some(v) = got {
            return v;
        }
        if start.elapsed() > CHANGE_DEADLINE {
            panic!(
                "timed out after {CHANGE_DEADLINE:?} waiting for {what}\nlast seen: {last}\n\
                 daemon log:\n{}",
                daemon.log_text()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until the gpu row satisfies `pred`.
pub(crate) fn wait_gpu_row(daemon: &Daemon, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    wait_until(daemon, &format!("{GPU} handler {what}"), || {
        let row = gpu_row(daemon);
        let seen = format!("{row:?}");
        (row.filter(|r| pred(r)), seen)
    })
}

/// Waits until the gpu slot serves the module with `sha`.
pub(crate) fn wait_gpu_sha(daemon: &Daemon, sha: &str) -> Value {
    wait_gpu_row(daemon, &format!("to serve sha256 {sha}"), |r| {
        r["sha256"] == sha
    })
}

/// Allocates two gpus for a fresh pod, releases them, and returns the ids chosen.
pub(crate) fn allocate_two(daemon: &Daemon, pod: &str) -> Result<Vec<String>, String> {
    let got = allocate(daemon, pod, "ctr", GPU, 2)?;
    release(daemon, pod, None);
    Ok(ids(&got["device_ids"]))
}

/// Like [`allocate_two`], failing with the daemon log.
pub(crate) fn allocate_ok(daemon: &Daemon, pod: &str) -> Vec<String> {
    allocate_two(daemon, pod).unwrap_or_else(|e| {
        panic!(
            "allocation for {pod} failed: {e}\ndaemon log:\n{}",
            daemon.log_text()
        )
    })
}

/// A daemon with `handlers.toml` = `body` (after copying `guests`) and a gpu plugin with four
/// devices on two NUMA nodes that states a preference.
pub(crate) fn start(
    root: &TestRoot,
    guests: &[(&str, &str)],
    body: &str,
) -> (Daemon, DevicePluginProcess) {
    handlers_toml(root, guests, body);
    let daemon = Daemon::start(&root.path(), &[]);
    let plugin = DevicePluginProcess::start(root, FLOWS[0], GPU, &["--preferred", "--reregister"]);
    wait_allocatable(&daemon, GPU, 4);
    (daemon, plugin)
}

pub(crate) const POLICY_TOML: &str = "[resources.\"vendor.com/gpu\"]\nmodule = \"policy.wasm\"\n";

#[test]
fn a_policy_renamed_into_place_serves_the_next_allocation() {
    let root = TestRoot::new();
    let (daemon, _plugin) = start(&root, &[("misbehave", "policy.wasm")], POLICY_TOML);
    let old = sha256(&guest("misbehave"));
    let new = sha256(&guest("spread-policy"));
    assert_ne!(old, new);
    let row = wait_gpu_sha(&daemon, &old);
    assert!(row["previous"].is_null(), "{row}");
    assert_eq!(allocate_ok(&daemon, "pod-0"), FIRST_FIT);

    let renamed = Instant::now();
    rename_guest(&root, "spread-policy", "policy.wasm");
    let row = wait_gpu_sha(&daemon, &new);
    eprintln!("swap visible in ctl handlers after {:?}", renamed.elapsed());
    assert_eq!(row["previous"]["sha256"], old.as_str(), "{row}");
    assert!(
        row["module"].as_str().unwrap().ends_with("policy.wasm"),
        "{row}"
    );
    assert_eq!(row["last_change"]["state"], "applied", "{row}");
    assert_eq!(row["on_probation"], true, "{row}");
    assert_eq!(allocate_ok(&daemon, "pod-1"), SPREAD);
    assert!(
        daemon.log_text().contains("handler applied"),
        "{}",
        daemon.log_text()
    );
}

#[test]
fn refused_changes_keep_the_old_module_serving_with_their_reason() {
    let root = TestRoot::new();
    let (daemon, _plugin) = start(&root, &[("misbehave", "policy.wasm")], POLICY_TOML);
    let good = sha256(&guest("misbehave"));
    wait_gpu_sha(&daemon, &good);
    assert_eq!(allocate_ok(&daemon, "pod-0"), FIRST_FIT);
    let mut pod = 0;

    // After each refusal: the old module still serves, allocations still work; then the good
    // file comes back and the refusal is over.
    let mut still_serving = |daemon: &Daemon, reason: &str| {
        let row = gpu_row(daemon).expect("gpu row");
        assert_eq!(row["sha256"], good.as_str(), "{row}");
        pod += 1;
        assert_eq!(allocate_ok(daemon, &format!("pod-{pod}")), FIRST_FIT);
        let log = daemon.log_text();
        assert!(
            log.contains("refused") && log.contains(reason),
            "the log names {reason:?}:\n{log}"
        );
    };
    let slot_refused = |daemon: &Daemon, bad: &Path, reason: &str| {
        let sha = sha256(bad);
        let row = wait_gpu_row(daemon, &format!("refusing sha256 {sha} ({reason})"), |r| {
            r["last_change"]["state"] == "refused" && r["last_change"]["sha256"] == sha.as_str()
        });
        let why = row["last_change"]["reason"].as_str().unwrap();
        assert!(why.contains(reason), "{reason:?} in {row}");
    };
    let restore = |daemon: &Daemon| {
        rename_guest(&root, "misbehave", "policy.wasm");
        wait_gpu_row(daemon, "to show no refusal", |r| {
            r["last_change"]["state"] != "refused"
        });
    };
    let policy = root.handlers().join("policy.wasm");

    // A module that does not compile (a component's header, then garbage), renamed into place.
    let mut garbage = b"\0asm\x0d\0\x01\0".to_vec();
    garbage.extend(std::iter::repeat_n(0xa5u8, 64));
    rename_into_place(&root, "policy.wasm", &garbage);
    slot_refused(&daemon, &policy, "does not compile");
    still_serving(&daemon, "policy.wasm");
    restore(&daemon);

    // A text file, copied over in place.
    std::fs::write(root.path().join("notes.txt"), "not a module\n").unwrap();
    std::fs::copy(root.path().join("notes.txt"), &policy).unwrap();
    slot_refused(&daemon, &policy, "not a WebAssembly component");
    still_serving(&daemon, "policy.wasm");
    restore(&daemon);

    // A module without the allocation-policy family.
    rename_guest(&root, "csi", "policy.wasm");
    slot_refused(&daemon, &policy, "does not export");
    still_serving(&daemon, "does not export");
    restore(&daemon);

    // A TOML syntax error: handlers.toml refused as a whole.
    let file_refused = |daemon: &Daemon, reason: &str| {
        let top = wait_until(daemon, &format!("handlers.toml refused ({reason})"), || {
            let all = handlers(daemon);
            let seen = all.to_string();
            let top = all["last_change"].clone();
            ((top["state"] == "refused").then_some(top), seen)
        });
        assert!(
            top["reason"].as_str().unwrap().contains(reason),
            "{reason:?} in {top}"
        );
    };
    let file_ok = |daemon: &Daemon| {
        rename_into_place(&root, "handlers.toml", POLICY_TOML.as_bytes());
        wait_until(daemon, "handlers.toml accepted again", || {
            let all = handlers(daemon);
            let seen = all.to_string();
            (all["last_change"].is_null().then_some(()), seen)
        });
    };
    rename_into_place(
        &root,
        "handlers.toml",
        b"[resources.\"vendor.com/gpu\"\nmodule = \"policy.wasm\"\n",
    );
    file_refused(&daemon, "not a valid handlers file");
    still_serving(&daemon, "not a valid handlers file");
    file_ok(&daemon);

    // An unknown key (written in place).
    std::fs::write(
        root.handlers().join("handlers.toml"),
        format!("{POLICY_TOML}colour = \"red\"\n"),
    )
    .unwrap();
    file_refused(&daemon, "unknown field `colour`");
    still_serving(&daemon, "unknown field `colour`");
    file_ok(&daemon);

    // The module file removed while the entry names it.
    std::fs::remove_file(&policy).unwrap();
    let row = wait_gpu_row(&daemon, "refusing a missing module", |r| {
        r["last_change"]["state"] == "refused"
    });
    assert!(
        row["last_change"]["reason"]
            .as_str()
            .unwrap()
            .contains("missing"),
        "{row}"
    );
    still_serving(&daemon, "missing");
    restore(&daemon);
    let row = gpu_row(&daemon).unwrap();
    assert_eq!(row["sha256"], good.as_str(), "{row}");
    assert_eq!(row["failures"]["trap"], 0, "{row}");
}

/// `handlers.toml` with spread-policy in force and then misbehave that panics on `allocate`
/// renamed in, with `rollback_after` and `on_failure` as given.
fn failing_over_spread(extra: &str) -> (TestRoot, Daemon, DevicePluginProcess, String, String) {
    let root = TestRoot::new();
    let (daemon, plugin) = start(
        &root,
        &[("spread-policy", "spread.wasm")],
        "[resources.\"vendor.com/gpu\"]\nmodule = \"spread.wasm\"\n",
    );
    let good = sha256(&guest("spread-policy"));
    wait_gpu_sha(&daemon, &good);
    assert_eq!(allocate_ok(&daemon, "pod-0"), SPREAD);
    let bad = sha256(&guest("misbehave"));
    copy_guest(&root, "misbehave", "bad.wasm");
    rename_into_place(
        &root,
        "handlers.toml",
        format!(
            "[resources.\"vendor.com/gpu\"]\nmodule = \"bad.wasm\"\n\
             settings = {{ allocate = \"panic\" }}\n{extra}"
        )
        .as_bytes(),
    );
    let row = wait_gpu_sha(&daemon, &bad);
    assert_eq!(row["previous"]["sha256"], good.as_str(), "{row}");
    // rollback_after = 0: no probation.
    let probation = !extra.contains("rollback_after = 0");
    assert_eq!(row["on_probation"], probation, "{row}");
    (root, daemon, plugin, good, bad)
}

/// Two failed allocations roll the panicking module back to spread-policy.
fn roll_back_after_two(daemon: &Daemon, good: &str, bad: &str) {
    for pod in ["pod-1", "pod-2"] {
        let err = allocate_two(daemon, pod).unwrap_err();
        assert!(err.contains("bad.wasm"), "{err}");
    }
    let row = wait_gpu_row(daemon, "rolled back", |r| {
        r["last_change"]["state"] == "rolled_back"
    });
    assert_eq!(row["sha256"], good, "{row}");
    assert!(
        row["module"].as_str().unwrap().ends_with("spread.wasm"),
        "{row}"
    );
    let reason = row["last_change"]["reason"].as_str().unwrap();
    assert!(
        reason.contains(bad) && reason.contains("rollback_after = 2"),
        "{row}"
    );
    // Synchronous: the very next call is served by the restored version.
    assert_eq!(allocate_ok(daemon, "pod-3"), SPREAD);
    assert!(
        daemon.log_text().contains("handler rolled back"),
        "{}",
        daemon.log_text()
    );
}

#[test]
fn a_module_that_traps_is_rolled_back_after_rollback_after_failures() {
    let (_root, daemon, _plugin, good, bad) = failing_over_spread("rollback_after = 2\n");
    roll_back_after_two(&daemon, &good, &bad);
}

#[test]
fn with_on_failure_builtin_the_failing_calls_are_answered_by_the_builtin() {
    let (_root, daemon, _plugin, _good, bad) =
        failing_over_spread("rollback_after = 0\non_failure = \"builtin\"\n");
    for i in 1..=3 {
        assert_eq!(allocate_ok(&daemon, &format!("pod-{i}")), BUILTIN);
    }
    let row = gpu_row(&daemon).unwrap();
    assert_eq!(row["sha256"], bad.as_str(), "still in force: {row}");
    assert_eq!(row["failures"]["trap"], 3, "{row}");
    assert_eq!(row["on_failure"], "builtin", "{row}");
    assert_eq!(row["last_failure"]["kind"], "trap", "{row}");
    assert!(
        row["last_failure"]["message"]
            .as_str()
            .unwrap()
            .contains("asked to panic"),
        "{row}"
    );
}

#[test]
fn a_rollback_survives_a_restart() {
    let (root, daemon, plugin, good, bad) = failing_over_spread("rollback_after = 2\n");
    roll_back_after_two(&daemon, &good, &bad);
    let status = daemon.terminate();
    assert!(status.success(), "{status}");

    // handlers.toml still names the panicking module.
    let daemon = Daemon::start(&root.path(), &[]);
    let row = wait_gpu_row(&daemon, "restored after the restart", |r| {
        r["sha256"] == good.as_str()
    });
    assert_eq!(row["last_change"]["state"], "rolled_back", "{row}");
    let reason = row["last_change"]["reason"].as_str().unwrap();
    assert!(
        reason.contains(&bad) && reason.contains("rolled back"),
        "{row}"
    );
    wait_allocatable(&daemon, GPU, 4);
    assert_eq!(allocate_ok(&daemon, "pod-4"), SPREAD);
    drop(plugin);
}

#[test]
fn removing_an_entry_returns_the_slot_to_the_builtin() {
    let root = TestRoot::new();
    let (daemon, _plugin) = start(&root, &[("misbehave", "policy.wasm")], POLICY_TOML);
    let sha = sha256(&guest("misbehave"));
    wait_gpu_sha(&daemon, &sha);
    assert_eq!(allocate_ok(&daemon, "pod-0"), FIRST_FIT);

    rename_into_place(&root, "handlers.toml", b"# no entries\n");
    let row = wait_gpu_row(&daemon, "back to the built-in", |r| {
        r["module"] == BUILTIN_POLICY
    });
    assert_eq!(row["previous"]["sha256"], sha.as_str(), "{row}");
    assert!(
        row["last_change"]["reason"]
            .as_str()
            .unwrap()
            .contains("entry removed"),
        "{row}"
    );
    assert_eq!(allocate_ok(&daemon, "pod-1"), BUILTIN);
}

#[test]
fn a_rollback_by_hand_puts_the_previous_module_back() {
    let root = TestRoot::new();
    let (daemon, _plugin) = start(&root, &[("misbehave", "policy.wasm")], POLICY_TOML);
    let old = sha256(&guest("misbehave"));
    let new = sha256(&guest("spread-policy"));
    wait_gpu_sha(&daemon, &old);
    copy_guest(&root, "spread-policy", "policy.wasm");
    wait_gpu_sha(&daemon, &new);
    assert_eq!(allocate_ok(&daemon, "pod-0"), SPREAD);

    let out = daemon.ctl(&["handlers", "rollback", "--resource", GPU]);
    assert!(
        out.status.success(),
        "ctl handlers rollback: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = gpu_row(&daemon).unwrap();
    assert_eq!(row["sha256"], old.as_str(), "{row}");
    assert_eq!(row["last_change"]["state"], "rolled_back", "{row}");
    assert!(
        row["last_change"]["reason"]
            .as_str()
            .unwrap()
            .contains("by hand"),
        "{row}"
    );
    assert_eq!(allocate_ok(&daemon, "pod-1"), FIRST_FIT);

    // Nothing left to go back to but the built-in; a second rollback takes it.
    let out = daemon.ctl(&["handlers", "rollback", "--resource", GPU]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(gpu_row(&daemon).unwrap()["module"], BUILTIN_POLICY);
    assert_eq!(allocate_ok(&daemon, "pod-2"), BUILTIN);
}

#[test]
fn a_hundred_swaps_under_load_fail_no_call() {
    let root = Arc::new(TestRoot::new());
    let (daemon, _plugin) = start(&root, &[("misbehave", "policy.wasm")], POLICY_TOML);
    let daemon = Arc::new(daemon);
    let guests = [
        ("misbehave", sha256(&guest("misbehave"))),
        ("spread-policy", sha256(&guest("spread-policy"))),
    ];
    wait_gpu_sha(&daemon, &guests[0].1);
    let stop = Arc::new(AtomicBool::new(false));

    let load = {
        let daemon = daemon.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut answers = [0usize; 2];
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let got = allocate_ok(&daemon, &format!("load-{n}"));
                if got == FIRST_FIT {
                    answers[0] += 1;
                } else if got == SPREAD {
                    answers[1] += 1;
                } else {
                    panic!("allocation {n} answered {got:?}, by neither policy");
                }
            }
            answers
        })
    };
    // Another resource's plugin registering again and again meanwhile.
    let churn = {
        let stop = stop.clone();
        let root = root.clone();
        let daemon = daemon.clone();
        std::thread::spawn(move || {
            let mut rounds = 0;
            while !stop.load(Ordering::SeqCst) {
                let plugin = DevicePluginProcess::start(&root, FLOWS[1], NIC, &[]);
                let socket = plugin.socket.display().to_string();
                wait_for("vendor.com/nic registered", Duration::from_secs(30), || {
                    resource(&daemon, NIC)
                        .filter(|r| r["connected"] == true && r["endpoint"] == socket.as_str())
                });
                drop(plugin);
                rounds += 1;
            }
            rounds
        })
    };

    let started = Instant::now();
    for i in 1..=100 {
        let (name, sha) = &guests[i % 2];
        if i % 10 == 0 {
            copy_guest(&root, name, "policy.wasm");
        } else {
            rename_guest(&root, name, "policy.wasm");
        }
        wait_gpu_sha(&daemon, sha);
    }
    let swaps = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    let answers = load.join().expect("the allocation loop");
    let rounds = churn.join().expect("the re-registration loop");
    eprintln!(
        "100 swaps in {swaps:?}; allocations by first fit / spread: {answers:?}; \
         nic plugin registrations: {rounds}"
    );
    let row = gpu_row(&daemon).unwrap();
    for kind in ["trap", "deadline", "memory", "fuel", "other"] {
        assert_eq!(row["failures"][kind], 0, "{row}");
    }
    assert!(answers.iter().sum::<usize>() > 0, "no allocation ran");
    assert!(swaps < Duration::from_secs(60), "100 swaps took {swaps:?}");
}
