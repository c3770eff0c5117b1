//! Story: a plugin drops a registration socket into the registry directory and gets registered;
//! removing the socket deregisters it, re-creating it registers it again.

use serde_json::{Value, json};

use crate::support::{CsiPlugin, DEADLINE, Daemon, DevicePlugin, TestRoot, wait_for};

fn get_info_calls(events: &[Value]) -> usize {
    events
        .iter()
        .filter(|e| e["event"] == "get_info" || e["method"] == "GetInfo")
        .count()
}

#[test]
fn csi_plugin_registers_and_ctl_shows_its_node_info() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let reg = root.registry().join("csi.example.com-reg.sock");
    let plugin = CsiPlugin::start(
        &root.side("."),
        &reg,
        &[
            "--name",
            "csi.example.com",
            "--versions",
            "1.0.0,1.2.0",
            "--node-id",
            "node-7",
            "--max-volumes",
            "16",
            "--topology",
            "topology.kubernetes.io/zone=z1",
            "--topology",
            "example.com/rack=r2",
        ],
    );
    plugin.wait_registered();
    assert_eq!(
        plugin.notifications(),
        vec![json!({"event": "notify", "plugin_registered": true, "error": ""})]
    );

    let p = daemon.wait_plugin("csi.example.com");
    assert_eq!(p["type"], "CSIPlugin");
    assert_eq!(p["versions"], json!(["1.0.0", "1.2.0"]));
    assert_eq!(
        p["version"], "1.2.0",
        "highest supported 1.x version is chosen: {p}"
    );
    assert_eq!(p["handler"], "builtin:csi");
    assert_eq!(p["node_id"], "node-7");
    assert_eq!(p["max_volumes_per_node"], 16);
    assert_eq!(
        p["topology"],
        json!({"topology.kubernetes.io/zone": "z1", "example.com/rack": "r2"})
    );
    assert_eq!(p["socket_path"], reg.display().to_string());
    assert!(p["endpoint"].as_str().unwrap().ends_with(".sock"), "{p}");
    let at = p["registered_at"].as_str().unwrap();
    assert!(
        chrono::DateTime::parse_from_rfc3339(at).is_ok() && at.ends_with('Z'),
        "registered_at is RFC 3339 UTC: {at}"
    );

    let s = daemon.socket(&reg).expect("ctl sockets knows the socket");
    assert_eq!(s["state"], "registered");
    assert_eq!(s["attempts"], 1);
    assert_eq!(s["plugin_type"], "CSIPlugin");
    assert_eq!(s["plugin_name"], "csi.example.com");
    assert_eq!(s["last_error"], Value::Null);

    let table = daemon.ctl(&["plugins"]);
    assert!(table.status.success());
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(table.starts_with("NAME"), "{table}");
    assert!(
        table.contains("csi.example.com") && table.contains("node-7"),
        "{table}"
    );
}

#[test]
fn device_plugin_registers_through_the_watcher() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let reg = root.registry().join("vendor-gpu-reg.sock");
    let plugin = DevicePlugin::start(&root.side("."), &reg, "vendor.com/gpu", &[]);
    plugin.wait_registered();
    let p = daemon.wait_plugin("vendor.com/gpu");
    assert_eq!(p["type"], "DevicePlugin");
    assert_eq!(p["versions"], json!(["v1beta1"]));
    assert_eq!(p["handler"], "builtin:device-plugin");
    assert!(
        p.get("node_id").is_none(),
        "no CSI keys on a device plugin: {p}"
    );
    assert_eq!(daemon.socket(&reg).unwrap()["state"], "registered");
}

#[test]
fn removing_the_socket_deregisters_and_recreating_it_registers_again() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let reg = root.registry().join("again-reg.sock");
    let side = root.side(".");
    let mut first = CsiPlugin::start(&side, &reg, &["--name", "again.example.com"]);
    first.wait_registered();
    let registered_at = daemon.wait_plugin("again.example.com")["registered_at"].clone();

    assert!(first.terminate().success());
    assert!(!reg.exists(), "the plugin removes its socket on SIGTERM");
    wait_for("deregistration", DEADLINE, || {
        (daemon.plugin("again.example.com").is_none() && daemon.socket(&reg).is_none())
            .then_some(())
    });

    let second = CsiPlugin::start(&side, &reg, &["--name", "again.example.com"]);
    second.wait_registered();
    let p = daemon.wait_plugin("again.example.com");
    assert_ne!(p["registered_at"], registered_at, "a new registration");
    assert_eq!(
        daemon.socket(&reg).unwrap()["attempts"],
        1,
        "a new socket starts a new count"
    );
}

#[test]
fn dot_file_sockets_are_never_dialed_and_plain_files_are_not_registered() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let side = root.side(".");
    let hidden = CsiPlugin::start(
        &side,
        &root.registry().join(".hidden-reg.sock"),
        &["--name", "hidden.example.com"],
    );
    std::fs::write(root.registry().join("plain-file.sock"), b"not a socket").unwrap();
    wait_for("hidden socket bound", DEADLINE, || {
        root.registry()
            .join(".hidden-reg.sock")
            .exists()
            .then_some(())
    });
    // A visible plugin created afterwards is a barrier: once it registered, the watcher has handled
    // every earlier event.
    let visible_reg = root.registry().join("visible-reg.sock");
    let visible = CsiPlugin::start(&side, &visible_reg, &["--name", "visible.example.com"]);
    visible.wait_registered();

    assert_eq!(
        get_info_calls(&hidden.events()),
        0,
        "dot-file socket was dialed"
    );
    assert!(hidden.events().is_empty(), "{:?}", hidden.events());
    let sockets = daemon.ctl_json("sockets");
    let paths: Vec<(&str, &str)> = sockets
        .iter()
        .map(|s| (s["path"].as_str().unwrap(), s["state"].as_str().unwrap()))
        .collect();
    let plain = root
        .registry()
        .join("plain-file.sock")
        .display()
        .to_string();
    assert_eq!(
        paths,
        vec![
            (plain.as_str(), "ignored"),
            (visible_reg.display().to_string().as_str(), "registered")
        ],
        "only the visible socket is dialed; the plain file is shown as not registered"
    );
}

#[test]
fn sockets_in_nested_and_newly_created_directories_are_found() {
    let root = TestRoot::new();
    let side = root.side(".");
    // Present before the daemon starts: found by the start-up walk.
    let old_reg = root.registry().join("a/b/old-reg.sock");
    let old = CsiPlugin::start(&side, &old_reg, &["--name", "old.example.com"]);
    wait_for("old socket bound", DEADLINE, || {
        old_reg.exists().then_some(())
    });
    let daemon = Daemon::start(&root.path(), &[]);
    old.wait_registered();

    // Created after start: the plugin creates the directories and binds right away (no pause).
    let mut plugins = Vec::new();
    for i in 0..5 {
        let reg = root.registry().join(format!("new{i}/deeper/x{i}-reg.sock"));
        plugins.push(CsiPlugin::start(
            &side,
            &reg,
            &["--name", &format!("new{i}.example.com")],
        ));
    }
    for p in &plugins {
        p.wait_registered();
    }
    for i in 0..5 {
        daemon.wait_plugin(&format!("new{i}.example.com"));
    }
    daemon.wait_plugin("old.example.com");
}

#[test]
fn ctl_handlers_lists_the_builtin_handlers() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let handlers = daemon.ctl_json("handlers");
    let by_type = |t: &str| {
        handlers
            .iter()
            .find(|h| h["plugin_type"] == t)
            .unwrap_or_else(|| panic!("no handler for {t}: {handlers:?}"))
            .clone()
    };
    let csi = by_type("CSIPlugin");
    assert_eq!(csi["module"], "builtin:csi");
    assert_eq!(csi["sha256"].as_str().unwrap().len(), 64);
    assert!(!csi["contract_version"].as_str().unwrap().is_empty());
    assert!(
        csi["families"]
            .as_array()
            .unwrap()
            .contains(&json!("registration"))
    );
    let dp = by_type("DevicePlugin");
    assert_eq!(dp["module"], "builtin:device-plugin");
    let table = String::from_utf8(daemon.ctl(&["handlers"]).stdout).unwrap();
    assert!(table.contains("builtin:csi"), "{table}");
}
