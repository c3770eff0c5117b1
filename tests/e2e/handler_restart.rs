//! A restart is never stricter than a live change: with a configured module in force, a live
//! edit of the handlers directory that fails the pin, the conformance vectors or the signature
//! is refused and the module in force keeps serving; the daemon restarted on that directory is
//! ready, serves the same version (from the bytes it kept) and reports the same refusal (`ctl
//! handlers`, the log, an event). Only an entry of a slot that never had a version applied
//! fails the start.

use serde_json::Value;

use crate::device_support::{DevicePluginProcess, FLOWS, wait_allocatable};
use crate::handler_integrity::{key_pair, sign};
use crate::handler_swap::{
    GPU, POLICY_TOML, SPREAD, allocate_ok, guest, handlers_toml, rename_guest, rename_into_place,
    sha256, wait_gpu_row, wait_gpu_sha,
};
use crate::ops::{free_addr, get};
use crate::support::{DEADLINE, Daemon, TestRoot, wait_for};

/// `handlers.toml` naming `policy.wasm` for the gpu slot, pinned to `pin`.
fn pinned(pin: &str) -> String {
    format!("{POLICY_TOML}sha256 = \"{pin}\"\n")
}

/// Waits for the gpu slot to report a refusal containing `reason` while `serving` serves.
fn refusal(daemon: &Daemon, reason: &str, serving: &str) -> Value {
    let row = wait_gpu_row(daemon, &format!("reporting a refusal ({reason})"), |r| {
        r["last_change"]["state"] == "refused"
            && r["last_change"]["reason"]
                .as_str()
                .is_some_and(|why| why.contains(reason))
    });
    assert_eq!(row["sha256"], serving, "the version applied serves: {row}");
    row
}

/// Restarts the daemon on `root` with `args` (and a metrics address): it must be ready, serve
/// `serving` for the gpu slot and report the refusal `reason` as a live refusal is.
fn restart_keeps_serving(
    daemon: Daemon,
    root: &TestRoot,
    args: &[&str],
    reason: &str,
    serving: &str,
) -> Daemon {
    let status = daemon.terminate();
    assert!(status.success(), "{status}");
    let addr = free_addr();
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--metrics-addr", &addr]);
    let daemon = Daemon::start(&root.path(), &all);
    let row = refusal(&daemon, reason, serving);
    assert_eq!(
        row["module"],
        root.handlers().join("policy.wasm").to_str().unwrap(),
        "{row}"
    );
    let (status, _, body) = wait_for("/readyz ready", DEADLINE, || {
        get(&addr, "/readyz?verbose", None).filter(|(s, _, _)| *s == 200)
    });
    assert_eq!(status, 200, "{body}");
    let log = daemon.log_text();
    assert!(
        log.contains("handler change refused") && log.contains(reason),
        "the log tells the refusal:\n{log}"
    );
    let events = daemon.ctl_json("events");
    assert!(
        events.iter().any(|e| e["type"] == "handler_refused"
            && e["message"].as_str().is_some_and(|m| m.contains(reason))),
        "an event tells the refusal: {events:?}"
    );
    daemon
}

#[test]
fn a_refused_pin_or_vectors_edit_survives_a_restart_on_the_version_applied() {
    let root = TestRoot::new();
    let spread = sha256(&guest("spread-policy"));
    handlers_toml(&root, &[("spread-policy", "policy.wasm")], &pinned(&spread));
    let daemon = Daemon::start(&root.path(), &[]);
    wait_gpu_sha(&daemon, &spread);

    // The pin edited live to a digest no module has: refused.
    let wrong = "0".repeat(64);
    rename_into_place(&root, "handlers.toml", pinned(&wrong).as_bytes());
    refusal(&daemon, "does not match the pin", &spread);
    let daemon = restart_keeps_serving(daemon, &root, &[], "does not match the pin", &spread);
    let plugin = DevicePluginProcess::start(&root, FLOWS[0], GPU, &["--preferred", "--reregister"]);
    wait_allocatable(&daemon, GPU, 4);
    assert_eq!(
        allocate_ok(&daemon, "pod-0"),
        SPREAD,
        "the version applied decides"
    );

    // Back to a pin that passes, then a module failing the vectors shipped beside it.
    rename_into_place(&root, "handlers.toml", POLICY_TOML.as_bytes());
    wait_gpu_row(&daemon, "applied again", |r| {
        r["last_change"]["state"] == "applied"
    });
    std::fs::write(
        root.handlers().join("policy.vectors.json"),
        std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../examples/spread-policy/spread-policy.vectors.json"),
        )
        .unwrap(),
    )
    .unwrap();
    rename_guest(&root, "misbehave", "policy.wasm");
    refusal(&daemon, "policy.vectors.json", &spread);
    let daemon = restart_keeps_serving(daemon, &root, &[], "policy.vectors.json", &spread);
    assert_eq!(
        allocate_ok(&daemon, "pod-1"),
        SPREAD,
        "the version applied decides"
    );
    drop(plugin);
    drop(daemon);
}

#[test]
fn a_refused_signature_edit_survives_a_restart_on_the_version_applied() {
    let root = TestRoot::new();
    let keys = root.side("keys");
    std::fs::create_dir_all(&keys).unwrap();
    let (public, secret, _) = key_pair(&keys, "vendor");
    let dir = root.handlers();
    std::fs::create_dir_all(&dir).unwrap();
    let module = dir.join("policy.wasm");
    std::fs::copy(guest("spread-policy"), &module).unwrap();
    sign(&secret, &module, "spread-policy 1.0");
    handlers_toml(&root, &[], POLICY_TOML);
    let args = [
        "--require-signatures",
        "--trusted-key",
        public.to_str().unwrap(),
    ];
    let daemon = Daemon::start(&root.path(), &args);
    let spread = sha256(&guest("spread-policy"));
    wait_gpu_sha(&daemon, &spread);

    // A new module renamed into place under the old signature: refused.
    rename_guest(&root, "misbehave", "policy.wasm");
    refusal(&daemon, "does not verify", &spread);
    let daemon = restart_keeps_serving(daemon, &root, &args, "does not verify", &spread);
    let row = wait_gpu_sha(&daemon, &spread);
    assert_eq!(
        row["signature"]["trusted_comment"], "spread-policy 1.0",
        "{row}"
    );
    drop(daemon);
}

#[test]
fn a_first_start_with_a_refused_entry_still_fails() {
    let root = TestRoot::new();
    handlers_toml(
        &root,
        &[("spread-policy", "policy.wasm")],
        &pinned(&"f".repeat(64)),
    );
    let (status, log) = Daemon::spawn(&root.path(), &[]).wait_exit();
    assert!(!status.success(), "{log}");
    assert!(log.contains("does not match the pin"), "{log}");
    // Still no version applied: the next start fails alike.
    let (status, log) = Daemon::spawn(&root.path(), &[]).wait_exit();
    assert!(!status.success(), "{log}");
}
