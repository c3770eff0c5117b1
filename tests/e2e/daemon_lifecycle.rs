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
