//! One command-line grammar: every `pluglet ctl` and `pluglet handler` subcommand takes the
//! global options (`--root`, `--admin-socket`, `--timeout`, `-o`) after the subcommand as well
//! as before it, `-o json` prints JSON that parses, and under `-o json` an error is one JSON
//! object on stderr (kind `Error`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use crate::device_support::{DevicePluginProcess, Flow, wait_allocatable};
use crate::support::daemon::pluglet;
use crate::support::{Daemon, TestRoot};

const GPU: &str = "vendor.com/gpu";

/// A file of the repository.
fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn run(args: &[&str]) -> Output {
    Command::new(pluglet())
        .args(args)
        .output()
        .expect("run pluglet")
}

/// Runs `pluglet <args>`; it must succeed and print one JSON object in the envelope.
fn json_ok(args: &[&str]) -> Value {
    let out = run(args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "pluglet {args:?}: {}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let value: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("pluglet {args:?} printed no JSON ({e}): {stdout}"));
    assert_eq!(value["api_version"], "pluglet/v1", "{args:?}: {value}");
    assert!(value["kind"].is_string(), "{args:?}: {value}");
    value
}

/// Runs `pluglet <args>`; it must fail with `code` and print one JSON error on stderr.
fn json_error(args: &[&str], code: i32) -> Value {
    let out = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "pluglet {args:?}: {stderr}");
    assert!(out.stdout.is_empty(), "{args:?}");
    let value: Value = serde_json::from_str(stderr.trim())
        .unwrap_or_else(|e| panic!("pluglet {args:?}: stderr is no JSON object ({e}): {stderr}"));
    assert_eq!(value["kind"], "Error", "{value}");
    assert_eq!(value["exit_code"], code, "{value}");
    assert!(
        value["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{value}"
    );
    value
}

#[test]
fn every_subcommand_takes_the_global_options_after_it_and_prints_json() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let _plugin = DevicePluginProcess::start(&root, Flow::Classic, GPU, &[]);
    wait_allocatable(&daemon, GPU, 4);
    let r = root.path();
    let r = r.to_str().unwrap();
    let socket = root.admin_socket();
    let socket = socket.to_str().unwrap();

    for (args, kind) in [
        (vec!["status"], "Status"),
        (vec!["events"], "EventList"),
        (vec!["plugins"], "PluginList"),
        (vec!["sockets"], "SocketList"),
        (vec!["handlers"], "HandlerList"),
        (vec!["resources"], "ResourceList"),
        (vec!["allocations"], "AllocationList"),
        (
            vec![
                "allocate",
                "--pod",
                "pod-1",
                "--container",
                "ctr",
                "--resource",
                GPU,
                "--count",
                "1",
            ],
            "AllocateResult",
        ),
        (vec!["release", "--pod", "pod-1"], "ReleaseResult"),
        (
            vec!["sync-pods", "--keep", "pod-2", "--dry-run"],
            "SyncPodsResult",
        ),
    ] {
        let mut after: Vec<&str> = vec!["ctl"];
        after.extend(&args);
        after.extend(["--root", r, "--timeout", "10s", "-o", "json"]);
        assert_eq!(json_ok(&after)["kind"], kind, "{after:?}");
        let mut socket_after: Vec<&str> = vec!["ctl"];
        socket_after.extend(&args);
        socket_after.extend(["--admin-socket", socket, "--output=json"]);
        if args[0] != "allocate" && args[0] != "release" {
            assert_eq!(json_ok(&socket_after)["kind"], kind, "{socket_after:?}");
        }
        let mut before = vec!["ctl", "--root", r, "-o", "json"];
        before.extend(&args);
        if args[0] != "allocate" && args[0] != "release" {
            assert_eq!(json_ok(&before)["kind"], kind, "{before:?}");
        }
    }
    // `text` is still accepted for the table.
    let out = run(&["ctl", "status", "--root", r, "-o", "text"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A rollback with nothing to go back to: the error as JSON.
    let err = json_error(
        &[
            "ctl",
            "handlers",
            "rollback",
            "--resource",
            GPU,
            "--root",
            r,
            "-o",
            "json",
        ],
        1,
    );
    assert!(err["error"].as_str().unwrap().contains(GPU), "{err}");

    // pluglet handler: check, test (one hook and vectors), verify.
    let allocate = repo("examples/events/allocate.json");
    let vectors = repo("examples/spread-policy/spread-policy.vectors.json");
    let spread = crate::handler_swap::guest("spread-policy");
    let fixtures = repo("host/handlers/tests/fixtures");
    for (args, kind) in [
        (
            vec!["check".to_owned(), "builtin:csi".to_owned()],
            "HandlerCheck",
        ),
        (
            vec![
                "test".to_owned(),
                "builtin:device-plugin".to_owned(),
                "--hook".to_owned(),
                "allocate".to_owned(),
                "--event".to_owned(),
                allocate.display().to_string(),
            ],
            "HandlerTest",
        ),
        (
            vec![
                "test".to_owned(),
                spread.display().to_string(),
                "--vectors".to_owned(),
                vectors.display().to_string(),
            ],
            "HandlerVectors",
        ),
        (
            vec![
                "verify".to_owned(),
                fixtures.join("module.bin").display().to_string(),
                "--key".to_owned(),
                fixtures.join("trusted.pub").display().to_string(),
            ],
            "HandlerVerify",
        ),
    ] {
        let mut after: Vec<&str> = vec!["handler"];
        after.extend(args.iter().map(String::as_str));
        after.extend(["-o", "json"]);
        let value = json_ok(&after);
        assert_eq!(value["kind"], kind, "{after:?}");
        let mut before: Vec<&str> = vec!["handler", "-o", "json"];
        before.extend(args.iter().map(String::as_str));
        assert_eq!(json_ok(&before)["kind"], kind, "{before:?}");
    }
    let verified = json_ok(&[
        "handler",
        "verify",
        fixtures.join("module.bin").to_str().unwrap(),
        "--key",
        fixtures.join("trusted.pub").to_str().unwrap(),
        "-o",
        "json",
    ]);
    assert!(verified["key_id"].is_string(), "{verified}");
    assert!(verified["trusted_comment"].is_string(), "{verified}");

    // Errors under -o json: one JSON object on stderr.
    let missing = root.side("no-such-root");
    json_error(
        &[
            "ctl",
            "status",
            "--root",
            missing.to_str().unwrap(),
            "-o",
            "json",
        ],
        1,
    );
    json_error(
        &[
            "handler",
            "verify",
            fixtures.join("module.bin").to_str().unwrap(),
            "--key",
            fixtures.join("other.pub").to_str().unwrap(),
            "-o",
            "json",
        ],
        1,
    );
    json_error(&["ctl", "no-such-command", "-o", "json"], 64);
    drop(daemon);
}
