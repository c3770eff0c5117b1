//! Device plugins that register through `kubelet.sock`: `ctl plugins` lists them with their
//! door beside the ones found in the plugin registry, and after a restart of the daemon the
//! example plugin, watching `kubelet.sock` as real plugins do, registers again by itself; while
//! it has not, `ctl resources` and `ctl status` say why the resource is disconnected.

use nix::sys::signal::Signal;

use crate::device_support::{
    DevicePluginProcess, Flow, allocate, resource, wait_allocatable, wait_resource,
};
use crate::support::{DEADLINE, Daemon, TestRoot, wait_for};

const GPU: &str = "vendor.com/gpu";
const NIC: &str = "vendor.com/nic";

#[test]
fn ctl_plugins_lists_kubelet_sock_plugins_with_their_door() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let _classic = DevicePluginProcess::start(&root, Flow::Classic, GPU, &[]);
    let _watcher = DevicePluginProcess::start(&root, Flow::Watcher, NIC, &[]);
    wait_allocatable(&daemon, GPU, 4);
    wait_allocatable(&daemon, NIC, 4);
    let plugins = wait_for("both device plugins listed", DEADLINE, || {
        let plugins = daemon.ctl_json("plugins");
        (plugins.len() == 2).then_some(plugins)
    });
    let door = |name: &str| {
        plugins
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {plugins:?}"))["door"]
            .clone()
    };
    assert_eq!(door(GPU), "kubelet.sock", "{plugins:?}");
    assert_eq!(door(NIC), "registry", "{plugins:?}");
    let gpu = plugins.iter().find(|p| p["name"] == GPU).unwrap();
    assert_eq!(gpu["type"], "DevicePlugin", "{gpu}");
    assert_eq!(gpu["handler"], "builtin:device-plugin", "{gpu}");

    let table = daemon.ctl(&["plugins"]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.lines().next().is_some_and(|h| h.contains("DOOR")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with(GPU) && l.contains("kubelet.sock")),
        "{text}"
    );
}

#[test]
fn a_kubelet_sock_plugin_registers_again_after_a_daemon_restart() {
    let root = TestRoot::new();
    let args = ["--device-grace-period", "10m"];
    let daemon = Daemon::start(&root.path(), &args);
    // No --reregister: watching kubelet.sock is what brings it back.
    let plugin = DevicePluginProcess::start(&root, Flow::Classic, GPU, &[]);
    wait_allocatable(&daemon, GPU, 4);
    allocate(&daemon, "pod-1", "ctr", GPU, 1).unwrap();

    // The plugin is held still while the daemon restarts, so the resource is seen restored and
    // not yet registered again.
    plugin.signal(Signal::SIGSTOP);
    let status = daemon.terminate();
    assert!(status.success(), "{status}");
    let daemon = Daemon::start(&root.path(), &args);
    let gpu = resource(&daemon, GPU).expect("the resource restored from the checkpoint");
    assert_eq!(gpu["connected"], false, "{gpu}");
    let why = gpu["last_error"].as_str().unwrap_or_default();
    assert!(
        why.contains("restored from the checkpoint")
            && why.contains("has not registered since the daemon started")
            && why.contains("grace period ends at"),
        "{gpu}"
    );
    let status = daemon.ctl(&["status"]);
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains(&format!("{GPU}: restored from the checkpoint")),
        "{text}"
    );
    let json = daemon.ctl_object(&["status"], Some("Status"));
    assert!(
        json["resources"][0]["last_error"]
            .as_str()
            .is_some_and(|w| w.contains("restored from the checkpoint")),
        "{json}"
    );

    // Let go, the plugin sees a new kubelet.sock and registers again.
    plugin.signal(Signal::SIGCONT);
    let gpu = wait_resource(&daemon, GPU, "connected again", |r| r["connected"] == true);
    assert!(gpu["last_error"].is_null(), "{gpu}");
    let events = daemon.ctl_json("events");
    assert!(
        events
            .iter()
            .any(|e| e["type"] == "connected" && e["subject"] == GPU),
        "{events:?}"
    );
    drop(plugin);
}
