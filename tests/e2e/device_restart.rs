//! Device manager state across daemon restarts: allocations survive a clean stop and a real
//! SIGKILL, devices held by them are not offered again when the plugin comes back, a corrupt
//! checkpoint is set aside, and a live `kubelet.sock` stops the daemon from starting.

use crate::device_support::{
    DevicePluginProcess, FLOWS, allocate, allocations, checkpoint, device_plugins_dir, ids,
    resource, wait_allocatable, wait_resource,
};
use crate::support::{Daemon, TestRoot, wait_for};

use std::time::Duration;

const GPU: &str = "vendor.com/gpu";

#[test]
fn allocations_survive_a_restart_and_a_sigkill() {
    for flow in FLOWS {
        let root = TestRoot::new();
        let daemon = Daemon::start(&root.path(), &[]);
        // --reregister: the plugin binds and registers again when a restart removes its socket.
        let _plugin = DevicePluginProcess::start(&root, flow, GPU, &["--reregister"]);
        wait_allocatable(&daemon, GPU, 4);
        let first = allocate(&daemon, "pod-1", "ctr", GPU, 2).unwrap();
        let held = ids(&first["device_ids"]);

        // Clean restart.
        let status = daemon.terminate();
        assert!(status.success(), "{status}");
        let daemon = Daemon::start(&root.path(), &[]);
        let listed = allocations(&daemon);
        assert_eq!(listed.len(), 1, "{flow:?}: {listed:?}");
        assert_eq!(ids(&listed[0]["device_ids"]), held);
        wait_allocatable(&daemon, GPU, 4);
        let again = allocate(&daemon, "pod-1", "ctr", GPU, 2).unwrap();
        assert_eq!(again, first, "the same answer after a restart");

        // Real SIGKILL: nothing runs on the way down.
        daemon.kill();
        let daemon = Daemon::start(&root.path(), &[]);
        let listed = allocations(&daemon);
        assert_eq!(listed.len(), 1, "{flow:?}: {listed:?}");
        assert_eq!(ids(&listed[0]["device_ids"]), held);

        // Once the plugin is back, the held devices are not offered to anyone else.
        wait_allocatable(&daemon, GPU, 4);
        let err = allocate(&daemon, "pod-2", "ctr", GPU, 3).unwrap_err();
        assert!(err.contains("Requested: 3, Available: 2"), "{err}");
        let other = allocate(&daemon, "pod-2", "ctr", GPU, 2).unwrap();
        for id in ids(&other["device_ids"]) {
            assert!(!held.contains(&id), "{id} given twice");
        }
    }
}

/// The checkpoint's text once `done` says it holds what the test waits for.
fn checkpoint_when(root: &TestRoot, what: &str, done: impl Fn(&str) -> bool) -> String {
    wait_for(what, Duration::from_secs(30), || {
        std::fs::read_to_string(checkpoint(root))
            .ok()
            .filter(|text| done(text))
    })
}

#[test]
fn allocations_answered_before_the_checkpoint_caught_up_come_back_from_the_journal() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let _plugin = DevicePluginProcess::start(&root, FLOWS[0], GPU, &[]);
    wait_allocatable(&daemon, GPU, 4);
    // What a crash leaves on disk if the checkpoint write that follows an allocation's answer
    // never happens: the checkpoint from before the allocation.
    let before = checkpoint_when(&root, "the devices in the checkpoint", |text| {
        text.contains(GPU) && text.contains(r#""PodDeviceEntries":null"#)
    });
    let first = allocate(&daemon, "pod-1", "ctr", GPU, 2).unwrap();
    checkpoint_when(&root, "pod-1 in the checkpoint", |text| {
        text.contains("pod-1")
    });
    daemon.kill();
    std::fs::write(checkpoint(&root), &before).unwrap();

    let daemon = Daemon::start(&root.path(), &[]);
    let listed = allocations(&daemon);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(ids(&listed[0]["device_ids"]), ids(&first["device_ids"]));
    let log = daemon.log_text();
    assert!(log.contains("restored from the journal"), "{log}");
    checkpoint_when(&root, "the checkpoint to catch up", |text| {
        text.contains("pod-1")
    });

    // A checkpoint the journal does not name (one a kubelet wrote, say) is newer: it wins.
    daemon.kill();
    std::fs::write(
        checkpoint(&root),
        r#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":3467439661}"#,
    )
    .unwrap();
    let daemon = Daemon::start(&root.path(), &[]);
    assert!(allocations(&daemon).is_empty());
    assert!(!daemon.log_text().contains("restored from the journal"));
}

#[test]
fn devices_of_a_plugin_that_has_not_come_back_are_held() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let mut plugin = DevicePluginProcess::start(&root, FLOWS[0], GPU, &[]);
    wait_allocatable(&daemon, GPU, 4);
    allocate(&daemon, "pod-1", "ctr", GPU, 1).unwrap();
    plugin.kill9();
    let status = daemon.terminate();
    assert!(status.success());

    let daemon = Daemon::start(&root.path(), &[]);
    let r = wait_resource(&daemon, GPU, "restored", |r| r["connected"] == false);
    assert_eq!(r["allocatable"], 0, "{r}");
    assert_eq!(r["capacity"], 4, "{r}");
    let err = allocate(&daemon, "pod-2", "ctr", GPU, 1).unwrap_err();
    assert!(err.contains("no device plugin is connected"), "{err}");
    assert_eq!(allocations(&daemon).len(), 1);
}

#[test]
fn a_corrupt_checkpoint_is_set_aside_and_the_daemon_starts_empty() {
    let root = TestRoot::new();
    let dir = device_plugins_dir(&root);
    std::fs::create_dir_all(&dir).unwrap();
    let garbage = r#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":42}"#;
    std::fs::write(checkpoint(&root), garbage).unwrap();
    let daemon = Daemon::start(&root.path(), &[]);
    assert!(allocations(&daemon).is_empty());
    let aside: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains(".corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(std::fs::read_to_string(&aside[0]).unwrap(), garbage);
    let log = daemon.log_text();
    assert!(log.contains("set aside"), "{log}");
    let events = set_aside_events(&daemon);
    assert_eq!(events.len(), 1, "{events:?}");
    let message = &events[0].1;
    assert!(
        message.contains("checksum mismatch: the file says 42")
            && message.contains(&aside[0].display().to_string())
            && message.contains("no journal record to recover allocations from"),
        "{message}"
    );
    // A valid, empty checkpoint took its place.
    let text = std::fs::read_to_string(checkpoint(&root)).unwrap();
    assert_eq!(
        text,
        r#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":3467439661}"#
    );
}

/// The `state_set_aside` events of `ctl events -o json`: (subject, message).
fn set_aside_events(daemon: &Daemon) -> Vec<(String, String)> {
    daemon
        .ctl_json("events")
        .into_iter()
        .filter(|e| e["type"] == "state_set_aside")
        .map(|e| {
            (
                e["subject"].as_str().unwrap_or_default().to_owned(),
                e["message"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

#[test]
fn a_checkpoint_cut_short_is_kept_aside_and_the_journal_gives_its_allocations_back() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let _plugin = DevicePluginProcess::start(&root, FLOWS[0], GPU, &["--reregister"]);
    wait_allocatable(&daemon, GPU, 4);
    let first = ids(&allocate(&daemon, "pod-1", "ctr", GPU, 1).unwrap()["device_ids"]);
    let second = ids(&allocate(&daemon, "pod-2", "ctr", GPU, 2).unwrap()["device_ids"]);
    let text = checkpoint_when(&root, "both pods in the checkpoint", |text| {
        text.contains("pod-1") && text.contains("pod-2")
    });
    daemon.kill();
    // Cut inside pod-2's entry: pod-1's is still readable, pod-2's is not.
    let cut = &text[..text.find("pod-2").unwrap() + 3];
    std::fs::write(checkpoint(&root), cut).unwrap();

    let daemon = Daemon::start(&root.path(), &[]);
    let listed = allocations(&daemon);
    let held: Vec<(String, Vec<String>)> = listed
        .iter()
        .map(|a| {
            (
                a["pod_uid"].as_str().unwrap().to_owned(),
                ids(&a["device_ids"]),
            )
        })
        .collect();
    assert_eq!(
        held,
        [("pod-1".to_owned(), first), ("pod-2".to_owned(), second)],
        "nothing lost"
    );
    let events = set_aside_events(&daemon);
    assert_eq!(events.len(), 1, "{events:?}");
    let (subject, message) = &events[0];
    assert_eq!(*subject, checkpoint(&root).display().to_string());
    assert!(
        message.contains("is corrupt: not JSON")
            && message.contains("recovered 2 allocations from the journal")
            && message.contains("kept as "),
        "{message}"
    );
    let copy = message
        .split("kept as ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(copy).unwrap(),
        cut,
        "the copy is exact"
    );
    let log = daemon.log_text();
    assert!(
        log.contains("corrupt device manager state set aside"),
        "{log}"
    );
    // The first write replaced the cut file with the recovered state.
    checkpoint_when(&root, "the recovered state in the checkpoint", |text| {
        whole(text) && text.contains("pod-1") && text.contains("pod-2")
    });
    wait_allocatable(&daemon, GPU, 4);
    let err = allocate(&daemon, "pod-3", "ctr", GPU, 2).unwrap_err();
    assert!(err.contains("Requested: 2, Available: 1"), "{err}");
}

/// Whether `text` is a whole checkpoint file: it ends with its checksum.
fn whole(text: &str) -> bool {
    text.trim_end()
        .rsplit_once(r#""Checksum":"#)
        .is_some_and(|(_, sum)| sum.trim_end_matches('}').parse::<u64>().is_ok())
}

#[test]
fn a_live_kubelet_socket_stops_the_daemon_from_starting() {
    let root = TestRoot::new();
    let dir = device_plugins_dir(&root);
    std::fs::create_dir_all(&dir).unwrap();
    let _kubelet = std::os::unix::net::UnixListener::bind(dir.join("kubelet.sock")).unwrap();
    let _plugin_socket = std::os::unix::net::UnixListener::bind(dir.join("plugin.sock")).unwrap();
    std::fs::write(checkpoint(&root), "kept as is").unwrap();

    let (status, log) = Daemon::spawn(&root.path(), &[]).wait_exit();
    assert!(!status.success(), "{status}");
    assert!(
        log.contains("kubelet.sock") && log.contains("owns"),
        "{log}"
    );
    assert!(dir.join("plugin.sock").exists(), "nothing removed");
    assert_eq!(
        std::fs::read_to_string(checkpoint(&root)).unwrap(),
        "kept as is"
    );
    assert!(resource_dir_untouched(&dir));
}

fn resource_dir_untouched(dir: &std::path::Path) -> bool {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names == ["kubelet.sock", "kubelet_internal_checkpoint", "plugin.sock"]
}

#[test]
fn stale_sockets_are_removed_at_start() {
    let root = TestRoot::new();
    let dir = device_plugins_dir(&root);
    std::fs::create_dir_all(&dir).unwrap();
    drop(std::os::unix::net::UnixListener::bind(dir.join("stale.sock")).unwrap());
    drop(std::os::unix::net::UnixListener::bind(dir.join("kubelet.sock")).unwrap());
    let daemon = Daemon::start(&root.path(), &[]);
    assert!(!dir.join("stale.sock").exists());
    assert!(dir.join("kubelet.sock").exists(), "served again");
    assert!(resource(&daemon, GPU).is_none());
}
