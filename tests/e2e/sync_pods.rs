//! `pluglet ctl sync-pods`: the devices of pods no longer active are freed (what the kubelet's
//! `UpdateAllocatedDevices` does), stay freed across a daemon restart, a dry run frees nothing,
//! and an empty keep list frees only with `--all`.

use std::collections::BTreeSet;
use std::process::Output;

use serde_json::Value;

use crate::device_support::{
    DevicePluginProcess, FLOWS, allocate, allocations, checkpoint, ids, wait_allocatable,
};
use crate::support::daemon::check_envelope;
use crate::support::{Daemon, TestRoot, wait_for};

const GPU: &str = "vendor.com/gpu";

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `ctl sync-pods <args> -o json`: the answer object.
fn sync_pods(daemon: &Daemon, args: &[&str]) -> Value {
    let mut all = vec!["sync-pods"];
    all.extend(args);
    all.extend(["-o", "json"]);
    let out = daemon.ctl(&all);
    assert!(out.status.success(), "ctl {all:?} failed: {}", stderr(&out));
    let value = serde_json::from_slice(&out.stdout).expect("ctl sync-pods prints JSON");
    check_envelope(&value, Some("SyncPodsResult"));
    value
}

/// (pod, container) of every entry of a JSON array of allocations.
fn holders(list: &[Value]) -> Vec<(String, String)> {
    list.iter()
        .map(|a| {
            (
                a["pod_uid"].as_str().unwrap().to_owned(),
                a["container"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(p, c)| (p.to_string(), c.to_string()))
        .collect()
}

#[test]
fn sync_pods_frees_the_pods_not_kept_and_they_stay_freed_after_a_restart() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    // --reregister: the plugin registers again when the restart removes its socket.
    let _plugin = DevicePluginProcess::start(&root, FLOWS[0], GPU, &["--reregister"]);
    wait_allocatable(&daemon, GPU, 4);
    let kept = ids(&allocate(&daemon, "pod-a", "ctr", GPU, 1).unwrap()["device_ids"]);
    let mut freed_ids = Vec::new();
    for (pod, container) in [("pod-b", "ctr"), ("pod-c", "one"), ("pod-c", "two")] {
        let got = allocate(&daemon, pod, container, GPU, 1).unwrap();
        freed_ids.extend(ids(&got["device_ids"]));
    }
    let before = allocations(&daemon);
    assert_eq!(before.len(), 4);
    let gone = pairs(&[("pod-b", "ctr"), ("pod-c", "one"), ("pod-c", "two")]);

    // A dry run reports and frees nothing, as JSON and as a table.
    let dry = sync_pods(&daemon, &["--keep", "pod-a", "--dry-run"]);
    assert_eq!(dry["dry_run"], true, "{dry}");
    assert_eq!(holders(dry["freed"].as_array().unwrap()), gone, "{dry}");
    let out = daemon.ctl(&["sync-pods", "--keep", "pod-a", "--dry-run"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    assert!(table.starts_with("POD "), "{table}");
    assert!(
        table.contains("dry run: would free 3 entries of 2 pods; nothing was freed"),
        "{table}"
    );
    assert_eq!(allocations(&daemon), before, "the dry run freed nothing");
    let err = allocate(&daemon, "pod-d", "ctr", GPU, 1).unwrap_err();
    assert!(err.contains("Requested: 1, Available: 0"), "{err}");

    // An empty keep list is a usage error unless --all says so; nothing is freed.
    let out = daemon.ctl(&["sync-pods"]);
    assert_eq!(out.status.code(), Some(64), "{}", stderr(&out));
    assert!(stderr(&out).contains("--all"), "{}", stderr(&out));
    let comments_only = root.side("keep-none.txt");
    std::fs::write(&comments_only, "# no pod is active\n\n").unwrap();
    let out = daemon.ctl(&["sync-pods", "--keep-file", comments_only.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(64), "{}", stderr(&out));
    assert!(stderr(&out).contains("names no pod"), "{}", stderr(&out));
    assert_eq!(allocations(&daemon), before, "a usage error freed nothing");

    // Keep pod-a (from a file with comments): the other pods' devices are free again.
    let keep = root.side("keep.txt");
    std::fs::write(&keep, "# active pods\npod-a\n\n").unwrap();
    let freed = sync_pods(&daemon, &["--keep-file", keep.to_str().unwrap()]);
    assert_eq!(freed["dry_run"], false, "{freed}");
    let freed = freed["freed"].as_array().unwrap();
    assert_eq!(holders(freed), gone);
    let mut listed: Vec<String> = freed.iter().flat_map(|a| ids(&a["device_ids"])).collect();
    listed.sort();
    freed_ids.sort();
    assert_eq!(listed, freed_ids);
    let now = allocations(&daemon);
    assert_eq!(holders(&now), pairs(&[("pod-a", "ctr")]));
    assert_eq!(ids(&now[0]["device_ids"]), kept);
    wait_for(
        "the checkpoint to drop the freed pods",
        crate::support::DEADLINE,
        || {
            std::fs::read_to_string(checkpoint(&root))
                .ok()
                .filter(|t| t.contains("pod-a") && !t.contains("pod-b") && !t.contains("pod-c"))
        },
    );

    // SIGKILL and start again: the freed pods stay freed.
    daemon.kill();
    let daemon = Daemon::start(&root.path(), &[]);
    assert_eq!(
        holders(&allocations(&daemon)),
        pairs(&[("pod-a", "ctr")]),
        "after the restart"
    );
    let text = wait_for(
        "the checkpoint after the restart",
        crate::support::DEADLINE,
        || {
            std::fs::read_to_string(checkpoint(&root))
                .ok()
                .filter(|t| t.contains("pod-a"))
        },
    );
    assert!(!text.contains("pod-b") && !text.contains("pod-c"), "{text}");
    wait_allocatable(&daemon, GPU, 4);
    let got = allocate(&daemon, "pod-d", "ctr", GPU, 3).unwrap();
    let got: BTreeSet<String> = ids(&got["device_ids"]).into_iter().collect();
    assert_eq!(
        got,
        freed_ids.iter().cloned().collect(),
        "the freed devices"
    );

    // --all with no pod to keep frees everything.
    let all = sync_pods(&daemon, &["--all"]);
    assert_eq!(
        holders(all["freed"].as_array().unwrap()),
        pairs(&[("pod-a", "ctr"), ("pod-d", "ctr")])
    );
    assert!(allocations(&daemon).is_empty());
}
