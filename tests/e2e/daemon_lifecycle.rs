//! Story: running the daemon: one per state directory, clean stop on SIGTERM, usage errors.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use crate::support::daemon::pluglet;
use crate::support::{Daemon, TestRoot};

#[test]
fn second_daemon_on_the_same_root_is_refused_naming_the_holder() {
    let root = TestRoot::new();
    let first = Daemon::start(&root.path(), &[]);
    let (status, log) = Daemon::spawn(&root.path(), &[]).wait_exit();
    assert!(!status.success());
    assert!(
        log.contains(&format!("pid {}", first.pid())),
        "message names the holder: {log}"
    );
    // The first daemon is unaffected (its admin socket was not touched).
    assert!(first.ctl(&["plugins"]).status.success());
}

#[test]
fn sigterm_exits_zero_and_removes_the_admin_socket() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let mode = std::fs::metadata(root.admin_socket())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "admin socket mode");
    let status = daemon.terminate();
    assert!(status.success(), "exit status {status}");
    assert!(!root.admin_socket().exists(), "admin socket removed");
    // The lock is released: a new daemon starts on the same root.
    let again = Daemon::start(&root.path(), &[]);
    assert!(again.terminate().success());
}

#[test]
fn bad_usage_exits_64_and_errors_go_to_stderr() {
    let out = Command::new(pluglet())
        .args(["ctl", "--root", "/nonexistent", "bogus"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let out = Command::new(pluglet())
        .args([
            "run",
            "--root",
            "/nonexistent",
            "--admin-socket-mode",
            "999",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let out = Command::new(pluglet())
        .args(["ctl", "--root", "/nonexistent-root", "plugins"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("/nonexistent-root/pluglet.sock"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}

/// The daemon's heap and handler memories must not be backed by transparent huge pages: one
/// touched byte would make 2 MiB resident (BENCHMARKS.md, "Memory"). Where the kernel's THP mode
/// is `madvise`, an area becomes huge only when advised with `MADV_HUGEPAGE`, which the kernel
/// shows as the `hg` flag in `smaps`; no area of the daemon may carry it.
#[test]
fn no_memory_is_advised_to_use_huge_pages() {
    let root = TestRoot::new();
    // Started: the built-in handlers are compiled and loaded, the admin API answers.
    let daemon = Daemon::start(&root.path(), &[]);
    let smaps = std::fs::read_to_string(format!("/proc/{}/smaps", daemon.pid()))
        .expect("read the daemon's /proc/PID/smaps");
    let mut area = "";
    let advised: Vec<&str> = smaps
        .lines()
        .filter_map(|line| {
            if line.split_whitespace().next().is_some_and(|first| {
                first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
            }) {
                area = line;
            }
            let flags = line.strip_prefix("VmFlags:")?;
            flags.split_whitespace().any(|f| f == "hg").then_some(area)
        })
        .collect();
    assert!(
        smaps.contains("VmFlags:"),
        "this kernel's smaps shows no VmFlags; the check cannot run"
    );
    assert!(
        advised.is_empty(),
        "areas advised MADV_HUGEPAGE: {advised:#?}"
    );
    assert!(daemon.terminate().success());
}
