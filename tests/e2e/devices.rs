//! Device manager stories, each in both registration flows where it applies: devices appear,
//! health flips, allocation through the plugin, idempotence, changed requests, the plugin's
//! preference, PreStartContainer, per-resource policies, bad policy answers, plugin death and
//! socket removal.

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::device_support::{
    DevicePluginProcess, FLOWS, allocate, allocations, ids, release, resource, wait_allocatable,
    wait_resource,
};
use crate::support::{DEADLINE, Daemon, TestRoot, wait_for};

const GPU: &str = "vendor.com/gpu";

#[test]
fn devices_appear_and_health_flips_change_allocatable() {
    for flow in FLOWS {
        let root = TestRoot::new();
        let daemon = Daemon::start(&root.path(), &[]);
        let plugin = DevicePluginProcess::start(&root, flow, GPU, &[]);
        let r = wait_allocatable(&daemon, GPU, 4);
        assert_eq!(r["capacity"], 4, "{flow:?}: {r}");
        assert_eq!(r["policy"], "builtin:device-plugin", "{r}");
        assert_eq!(r["endpoint"], plugin.socket.display().to_string(), "{r}");
        let numa: Vec<&Value> = r["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| &d["numa"])
            .collect();
        assert_eq!(
            numa,
            [
                &serde_json::json!([0]),
                &serde_json::json!([1]),
                &serde_json::json!([0]),
                &serde_json::json!([1])
            ]
        );

        plugin.set_health("dev-1 Unhealthy\n");
        let r = wait_allocatable(&daemon, GPU, 3);
        assert_eq!(r["capacity"], 4);
        assert_eq!(r["devices"][1]["health"], "Unhealthy", "{r}");

        plugin.signal(Signal::SIGUSR1);
        wait_resource(&daemon, GPU, "all unhealthy", |r| r["allocatable"] == 0);
        plugin.signal(Signal::SIGUSR1);
        wait_allocatable(&daemon, GPU, 3);
    }
}

#[test]
fn allocation_returns_the_plugin_answer_and_is_idempotent() {
    for flow in FLOWS {
        let root = TestRoot::new();
        let daemon = Daemon::start(&root.path(), &[]);
        let plugin =
            DevicePluginProcess::start(&root, flow, GPU, &["--pre-start", "--cdi-devices"]);
        wait_allocatable(&daemon, GPU, 4);

        let got = allocate(&daemon, "pod-1", "ctr", GPU, 2).unwrap();
        let chosen = ids(&got["device_ids"]);
        // The built-in policy packs onto one NUMA node.
        assert_eq!(chosen, ["dev-0", "dev-2"], "{flow:?}");
        assert_eq!(got["envs"]["VENDOR_DEVICES"], "dev-0,dev-2", "{got}");
        assert_eq!(got["annotations"]["vendor.com/devices"], "dev-0,dev-2");
        assert_eq!(got["mounts"][0]["container_path"], "/var/run/vendor");
        assert_eq!(got["mounts"][0]["read_only"], true);
        assert_eq!(
            got["device_specs"][1]["container_path"],
            "/dev/vendor/dev-2"
        );
        assert_eq!(got["device_specs"][1]["permissions"], "rw");
        assert_eq!(
            got["cdi_devices"],
            serde_json::json!(["vendor.com/gpu=dev-0", "vendor.com/gpu=dev-2"])
        );
        // The plugin's own CDI names pass through; Pluglet's spec adds one for the container.
        assert_eq!(
            got["cdi_names"],
            serde_json::json!([
                "vendor.com/gpu=dev-0",
                "vendor.com/gpu=dev-2",
                "vendor.com/gpu=pluglet-pod-1_ctr"
            ])
        );
        let pre_start = plugin.calls_of("PreStartContainer");
        assert_eq!(pre_start.len(), 1);
        assert_eq!(
            pre_start[0]["devices"],
            serde_json::json!(["dev-0", "dev-2"])
        );

        let again = allocate(&daemon, "pod-1", "ctr", GPU, 2).unwrap();
        assert_eq!(again, got, "same answer again");
        assert_eq!(
            plugin.calls_of("Allocate").len(),
            1,
            "no second Allocate RPC"
        );

        let err = allocate(&daemon, "pod-1", "ctr", GPU, 3).unwrap_err();
        assert!(err.contains("changed request"), "{err}");
        let err = allocate(&daemon, "pod-2", "ctr", GPU, 3).unwrap_err();
        assert!(err.contains("Requested: 3, Available: 2"), "{err}");

        let held = allocations(&daemon);
        assert_eq!(held.len(), 1);
        assert_eq!(held[0]["pod_uid"], "pod-1");
        assert_eq!(held[0]["container"], "ctr");
        assert_eq!(held[0]["resource"], GPU);
        assert_eq!(ids(&held[0]["device_ids"]), chosen);

        release(&daemon, "pod-1", Some("ctr"));
        assert!(allocations(&daemon).is_empty());
        let all = allocate(&daemon, "pod-2", "ctr", GPU, 4).unwrap();
        assert_eq!(ids(&all["device_ids"]).len(), 4);
    }
}

#[test]
fn the_plugin_preference_is_asked_and_honoured() {
    for flow in FLOWS {
        let root = TestRoot::new();
        let daemon = Daemon::start(&root.path(), &[]);
        let plugin = DevicePluginProcess::start(&root, flow, GPU, &["--preferred"]);
        wait_allocatable(&daemon, GPU, 4);
        // The example plugin prefers the last available devices.
        let got = allocate(&daemon, "pod", "ctr", GPU, 2).unwrap();
        assert_eq!(ids(&got["device_ids"]), ["dev-3", "dev-2"], "{flow:?}");
        let asked = plugin.calls_of("GetPreferredAllocation");
        assert_eq!(asked.len(), 1);
        assert_eq!(asked[0]["size"], 2);
        assert_eq!(asked[0]["available"].as_array().unwrap().len(), 4);
    }
}

#[test]
fn failed_allocations_leave_nothing_held() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let _plugin = DevicePluginProcess::start(&root, FLOWS[0], GPU, &["--fail-allocate"]);
    wait_allocatable(&daemon, GPU, 4);
    let err = allocate(&daemon, "pod", "ctr", GPU, 1).unwrap_err();
    assert!(err.contains("--fail-allocate"), "{err}");
    assert!(allocations(&daemon).is_empty());
    let err = allocate(&daemon, "pod", "ctr", "vendor.com/none", 1).unwrap_err();
    assert!(
        err.contains("unregistered resource vendor.com/none"),
        "{err}"
    );
}

/// Writes `handlers.toml` with `body` and copies the named test guests next to it.
fn handlers_toml(root: &TestRoot, guests: &[(&str, &str)], body: &str) {
    std::fs::create_dir_all(root.handlers()).unwrap();
    for (name, file) in guests {
        let from = pluglet_wasm_guests::guest_path(name);
        assert!(
            from.exists(),
            "guest {name} not built at {}",
            from.display()
        );
        std::fs::copy(&from, root.handlers().join(file)).unwrap();
    }
    std::fs::write(root.handlers().join("handlers.toml"), body).unwrap();
}

#[test]
fn a_vendor_policy_from_handlers_toml_governs_only_its_resource() {
    let root = TestRoot::new();
    handlers_toml(
        &root,
        &[("spread-policy", "spread-policy.wasm")],
        "[resources.\"vendor.com/gpu\"]\nmodule = \"spread-policy.wasm\"\n",
    );
    let daemon = Daemon::start(&root.path(), &[]);
    let _gpu = DevicePluginProcess::start(&root, FLOWS[0], GPU, &[]);
    let _nic = DevicePluginProcess::start(&root, FLOWS[1], "vendor.com/nic", &[]);
    let gpu = wait_allocatable(&daemon, GPU, 4);
    let nic = wait_allocatable(&daemon, "vendor.com/nic", 4);
    assert!(
        gpu["policy"]
            .as_str()
            .unwrap()
            .ends_with("spread-policy.wasm"),
        "{gpu}"
    );
    assert_eq!(nic["policy"], "builtin:device-plugin");

    // Spread: one device per NUMA node; the built-in packs onto one node.
    let spread = allocate(&daemon, "pod", "ctr", GPU, 2).unwrap();
    assert_eq!(ids(&spread["device_ids"]), ["dev-0", "dev-1"]);
    let packed = allocate(&daemon, "pod", "ctr", "vendor.com/nic", 2).unwrap();
    assert_eq!(ids(&packed["device_ids"]), ["dev-0", "dev-2"]);

    // `ctl handlers`: the configured slot's calls running now and its limit (the default,
    // half the cores); built-ins are not limited.
    let handlers = daemon.ctl_json("handlers");
    let slot = handlers
        .iter()
        .find(|h| h["resource"] == GPU)
        .expect("the vendor.com/gpu slot");
    assert_eq!(slot["running_calls"], 0, "{slot}");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    assert_eq!(slot["max_concurrent_calls"], (cores / 2).max(1), "{slot}");
    let builtin = handlers
        .iter()
        .find(|h| h["module"] == "builtin:device-plugin")
        .expect("the default policy");
    assert_eq!(builtin["max_concurrent_calls"], serde_json::Value::Null);
}

#[test]
fn a_bad_policy_answer_is_refused_naming_the_policy() {
    let root = TestRoot::new();
    handlers_toml(
        &root,
        &[("misbehave", "bad-policy.wasm")],
        "[resources.\"vendor.com/gpu\"]\nmodule = \"bad-policy.wasm\"\nsettings = { allocate = \"unknown-id\" }\n\n\
         [resources.\"vendor.com/nic\"]\nmodule = \"bad-policy.wasm\"\nsettings = { allocate = \"duplicate\" }\n",
    );
    let daemon = Daemon::start(&root.path(), &[]);
    let gpu = DevicePluginProcess::start(&root, FLOWS[0], GPU, &[]);
    let nic = DevicePluginProcess::start(&root, FLOWS[1], "vendor.com/nic", &[]);
    wait_allocatable(&daemon, GPU, 4);
    wait_allocatable(&daemon, "vendor.com/nic", 4);

    let err = allocate(&daemon, "pod", "ctr", GPU, 2).unwrap_err();
    assert!(err.contains("bad-policy.wasm"), "{err}");
    assert!(err.contains("no-such-device"), "{err}");
    let err = allocate(&daemon, "pod", "ctr", "vendor.com/nic", 2).unwrap_err();
    assert!(
        err.contains("bad-policy.wasm") && err.contains("twice"),
        "{err}"
    );

    assert!(allocations(&daemon).is_empty());
    assert!(gpu.calls_of("Allocate").is_empty() && nic.calls_of("Allocate").is_empty());
}

#[test]
fn plugin_death_and_socket_removal_turn_devices_unhealthy_then_the_resource_goes() {
    for flow in FLOWS {
        let root = TestRoot::new();
        let daemon = Daemon::start(&root.path(), &["--device-grace-period", "2s"]);

        // Death: the ListAndWatch stream ends.
        let mut dead = DevicePluginProcess::start(&root, flow, GPU, &[]);
        wait_allocatable(&daemon, GPU, 4);
        dead.kill9();
        let r = wait_resource(&daemon, GPU, "disconnected", |r| r["connected"] == false);
        assert_eq!(
            (r["capacity"].clone(), r["allocatable"].clone()),
            (4.into(), 0.into()),
            "{flow:?}: {r}"
        );
        assert!(
            r["devices"]
                .as_array()
                .unwrap()
                .iter()
                .all(|d| d["health"] == "Unhealthy"),
            "{r}"
        );
        wait_for(&format!("{GPU} to go"), DEADLINE, || {
            resource(&daemon, GPU).is_none().then_some(())
        });

        // Socket removal.
        let nic = "vendor.com/nic";
        let plugin = DevicePluginProcess::start(&root, flow, nic, &[]);
        wait_allocatable(&daemon, nic, 4);
        std::fs::remove_file(plugin.removable_socket()).unwrap();
        let r = wait_resource(&daemon, nic, "disconnected", |r| r["connected"] == false);
        assert_eq!(r["allocatable"], 0, "{flow:?}: {r}");
        wait_for(&format!("{nic} to go"), DEADLINE, || {
            resource(&daemon, nic).is_none().then_some(())
        });
    }
}

#[test]
fn a_refused_register_reaches_the_plugin() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let mut plugin = DevicePluginProcess::start(&root, FLOWS[0], "gpu", &[]);
    let status = wait_for("the refused plugin to exit", DEADLINE, || {
        let log = plugin.log_text();
        log.contains("refused").then_some(log)
    });
    assert!(status.contains("gpu"), "{status}");
    plugin.kill9();
    assert!(resource(&daemon, "gpu").is_none());
}
