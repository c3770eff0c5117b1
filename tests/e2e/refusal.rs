//! Story: a plugin the handler (or the host) will not take is told `false` with the reason, and
//! `ctl sockets` shows an operator why it is missing. Failures before the register step are
//! retried with backoff; a refusal in the register step stands until the socket is re-created.

use crate::support::{CsiPlugin, DEADLINE, Daemon, DevicePlugin, TestRoot, wait_for};

/// Waits for a `false` status and for `ctl sockets` to show the same reason; returns the reason.
fn refused_with_reason(
    daemon: &Daemon,
    plugin: &crate::support::plugins::PluginProcess,
    reg: &std::path::Path,
) -> String {
    let n = plugin.wait_notification("a false registration status", |n| {
        n["plugin_registered"] == false
    });
    let reason = n["error"].as_str().unwrap().to_owned();
    assert!(!reason.is_empty(), "a refusal carries a reason");
    let s = daemon.wait_socket(reg, "shows the reason", |s| {
        s["last_error"] == reason.as_str()
    });
    assert_ne!(s["state"], "registered");
    reason
}

#[test]
fn csi_plugin_supporting_only_0_3_0_is_refused_and_retried() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let reg = root.registry().join("old-csi-reg.sock");
    let plugin = CsiPlugin::start(
        &root.side("."),
        &reg,
        &["--name", "old.example.com", "--versions", "0.3.0"],
    );
    let reason = refused_with_reason(&daemon, &plugin, &reg);
    assert!(reason.contains("validation failed"), "{reason}");
    let s = daemon.socket(&reg).unwrap();
    assert_eq!(s["plugin_type"], "CSIPlugin");
    assert_eq!(s["plugin_name"], "old.example.com");
    // Validation failures are retried with backoff, each telling the plugin `false`.
    daemon.wait_socket(&reg, "retried", |s| s["attempts"].as_u64().unwrap() >= 3);
    assert!(
        plugin
            .notifications()
            .iter()
            .all(|n| n["plugin_registered"] == false)
    );
    assert!(daemon.plugin("old.example.com").is_none());
}

#[test]
fn csi_plugin_with_an_invalid_name_is_refused() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let reg = root.registry().join("bad-name-reg.sock");
    let plugin = CsiPlugin::start(&root.side("."), &reg, &["--name", "Not A Valid Name!"]);
    let reason = refused_with_reason(&daemon, &plugin, &reg);
    assert!(reason.to_lowercase().contains("name"), "{reason}");
    assert!(daemon.ctl_json("plugins").is_empty());
}

#[test]
fn device_plugin_with_an_invalid_resource_name_is_refused() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let reg = root.registry().join("bad-resource-reg.sock");
    let plugin = DevicePlugin::start(&root.side("."), &reg, "gpu", &[]);
    refused_with_reason(&daemon, &plugin, &reg);
    assert!(daemon.ctl_json("plugins").is_empty());
}

#[test]
fn unknown_plugin_type_is_refused_with_no_handler() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let reg = root.registry().join("foo-reg.sock");
    let plugin = CsiPlugin::start(
        &root.side("."),
        &reg,
        &["--type", "FooPlugin", "--name", "foo.example.com"],
    );
    let reason = refused_with_reason(&daemon, &plugin, &reg);
    assert_eq!(reason, "no handler registered for plugin type FooPlugin");
    let s = daemon.socket(&reg).unwrap();
    assert_eq!(s["plugin_type"], "FooPlugin");
}

#[test]
fn empty_node_id_refusal_stands_until_the_socket_is_recreated() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let reg = root.registry().join("no-node-reg.sock");
    let side = root.side(".");
    let mut plugin = CsiPlugin::start(
        &side,
        &reg,
        &["--name", "nonode.example.com", "--node-id", ""],
    );
    let reason = refused_with_reason(&daemon, &plugin, &reg);
    assert!(reason.contains("empty node id"), "{reason}");
    let s = daemon.wait_socket(&reg, "refused", |s| s["state"] == "refused");
    assert_eq!(s["attempts"], 1, "a register-step refusal is not retried");

    // A re-created socket is a new registration.
    plugin.terminate();
    wait_for("socket forgotten", DEADLINE, || {
        daemon.socket(&reg).is_none().then_some(())
    });
    let fixed = CsiPlugin::start(
        &side,
        &reg,
        &["--name", "nonode.example.com", "--node-id", "node-2"],
    );
    fixed.wait_registered();
    assert_eq!(
        daemon.wait_plugin("nonode.example.com")["node_id"],
        "node-2"
    );
}

#[test]
fn plugin_exiting_on_refusal_is_deregistered_cleanly() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let reg = root.registry().join("exit-reg.sock");
    let mut plugin = CsiPlugin::start(
        &root.side("."),
        &reg,
        &[
            "--name",
            "exit.example.com",
            "--versions",
            "0.3.0",
            "--exit-on-refusal",
        ],
    );
    let status = plugin.wait_exit();
    assert_eq!(status.code(), Some(1), "node-driver-registrar style exit");
    wait_for("socket forgotten", DEADLINE, || {
        daemon.socket(&reg).is_none().then_some(())
    });
}

#[test]
fn trapping_handler_refuses_its_plugin_and_the_next_plugin_still_registers() {
    let root = TestRoot::new();
    std::fs::create_dir_all(root.handlers()).unwrap();
    let misbehave = pluglet_wasm_guests::guest_path("misbehave");
    assert!(
        misbehave.exists(),
        "test guest missing at {}",
        misbehave.display()
    );
    std::fs::write(
        root.handlers().join("handlers.toml"),
        format!(
            // Retries of the refused plugin must not roll the handler back: this story is the
            // refusal, not the rollback (handler_swap.rs has that).
            "[plugin_types.CSIPlugin]\nmodule = {:?}\nsettings = {{ mode = \"panic\" }}\nrollback_after = 1000\n",
            misbehave.display().to_string()
        ),
    )
    .unwrap();
    let daemon = Daemon::start(&root.path(), &[]);
    let side = root.side(".");
    let reg = root.registry().join("trap-reg.sock");
    let trapped = CsiPlugin::start(&side, &reg, &["--name", "trap.example.com"]);
    let reason = refused_with_reason(&daemon, &trapped, &reg);
    assert!(
        reason.contains("trap") || reason.contains("panic"),
        "{reason}"
    );

    let next_reg = root.registry().join("next-reg.sock");
    let next = DevicePlugin::start(&side, &next_reg, "vendor.com/nic", &[]);
    next.wait_registered();
    daemon.wait_plugin("vendor.com/nic");
    let handlers = daemon.ctl_json("handlers");
    assert!(
        handlers.iter().any(|h| h["plugin_type"] == "CSIPlugin"
            && h["module"].as_str().unwrap().contains("misbehave")),
        "{handlers:?}"
    );
}

#[test]
fn two_csi_drivers_of_one_name_at_once_only_one_registers() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let (reg_a, reg_b) = (
        root.registry().join("same-a-reg.sock"),
        root.registry().join("same-b-reg.sock"),
    );
    // Both at once, same name and version: registrations of one name are validated one after
    // the other, so the second sees the first and the built-in CSI handler refuses it.
    let a = CsiPlugin::start(&root.side("."), &reg_a, &["--name", "same.example.com"]);
    let b = CsiPlugin::start(&root.side("."), &reg_b, &["--name", "same.example.com"]);
    let first = |p: &crate::support::plugins::PluginProcess| {
        p.wait_notification("a registration status", |_| true)["plugin_registered"] == true
    };
    let (a_in, b_in) = (first(&a), first(&b));
    assert!(a_in != b_in, "exactly one registers: a {a_in}, b {b_in}");
    let (refused_reg, refused) = if a_in { (&reg_b, &b) } else { (&reg_a, &a) };
    let reason = refused_with_reason(&daemon, refused, refused_reg);
    assert!(reason.contains("validation failed"), "{reason}");
    assert!(reason.contains("already-registered"), "{reason}");
    let plugins = daemon.ctl_json("plugins");
    let named: Vec<_> = plugins
        .iter()
        .filter(|p| p["name"] == "same.example.com")
        .collect();
    assert_eq!(named.len(), 1, "{plugins:?}");
}
