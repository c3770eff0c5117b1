//! The state on a full disk and in a read-only state directory: what cannot be made durable
//! is refused with the cause (the client sees it), nothing is held for it, reads are served
//! the whole time, and everything works again once the cause is gone.
//!
//! These tests mount file systems, so they run as root (as the tests and CI do); as another
//! user they fail saying so.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use pluglet_proto::admin::v1 as pb;
use pluglet_proto::admin::v1::admin_client::AdminClient;

use crate::device_support::{
    DevicePluginProcess, Flow, allocate, allocations, checkpoint, ids, resource, wait_allocatable,
};
use crate::support::{DEADLINE, Daemon, TestRoot, wait_for};

const GPU: &str = "vendor.com/gpu";

fn require_root(what: &str) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "{what} mounts a file system and needs root: run the tests as root (CI does)"
    );
}

/// Runs `mount`/`umount` with `args`; fails with the program's own words.
fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {program} (package mount; scripts/test.sh installs it): {e}")
        });
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A mount undone on drop (lazily, so a process still holding a file there cannot stop it).
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Fills the file system holding `dir` with `dir/filler` until it has no room left.
fn fill(dir: &Path) -> PathBuf {
    let path = dir.join("filler");
    let mut file = std::fs::File::create(&path).expect("create the filler");
    for chunk in [1 << 20, 4096, 1] {
        let bytes = vec![0u8; chunk];
        while file.write_all(&bytes).is_ok() {}
    }
    let _ = file.sync_all();
    path
}

/// Whether the daemon's log says `what` (waits for it).
fn wait_log(daemon: &Daemon, what: &str) {
    wait_for(&format!("{what:?} in the daemon log"), DEADLINE, || {
        daemon.log_text().contains(what).then_some(())
    });
}

/// `ctl allocate` that must fail: its stderr.
fn refused_allocation(daemon: &Daemon, pod: &str) -> String {
    let out = daemon.ctl(&[
        "allocate",
        "--pod",
        pod,
        "--container",
        "ctr",
        "--resource",
        GPU,
        "--count",
        "1",
    ]);
    assert!(!out.status.success(), "ctl allocate {pod} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Allocated pods, by name.
fn held_pods(daemon: &Daemon) -> Vec<String> {
    allocations(daemon)
        .iter()
        .map(|a| a["pod_uid"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn a_full_disk_refuses_what_cannot_be_made_durable_and_recovers_when_space_is_back() {
    require_root("the full-disk test");
    let root = TestRoot::new();
    // The state directory (journal, side file, handler cache) and the device plugins directory
    // (the kubelet checkpoint) each on a small file system of its own; the logs stay outside.
    let mut mounted = Vec::new();
    let mut dirs = Vec::new();
    for (name, size) in [("state", "size=64m"), ("device-plugins", "size=1m")] {
        let dir = root.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        run(
            "mount",
            &["-t", "tmpfs", "-o", size, "tmpfs", dir.to_str().unwrap()],
        );
        mounted.push(Mounted(dir.clone()));
        dirs.push(dir);
    }
    let daemon = Daemon::start(&root.path(), &[]);
    let _plugin = DevicePluginProcess::start(&root, Flow::Classic, GPU, &["--devices", "400"]);
    wait_allocatable(&daemon, GPU, 400);
    allocate(&daemon, "before", "ctr", GPU, 1).unwrap();

    let fillers: Vec<PathBuf> = dirs.iter().map(|dir| fill(dir)).collect();
    // The journal's blocks were written when it was made: allocations and releases stay
    // durable while their record fits it, though the kubelet checkpoint cannot be rewritten.
    allocate(&daemon, "on-full-disk", "ctr", GPU, 1).unwrap();
    wait_log(&daemon, "cannot write the device manager checkpoint");
    let out = daemon.ctl(&["release", "--pod", "before"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Allocate until the record outgrows the journal, which then needs room it cannot get.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let socket = root.admin_socket();
    let (acknowledged, refusal) = runtime.block_on(async {
        let channel = pluglet_uds::connect(&socket, Duration::from_secs(10))
            .await
            .expect("dial the admin socket");
        let mut admin = AdminClient::new(channel);
        let mut acknowledged = Vec::new();
        for n in 0..390 {
            let pod = format!("bulk-{n}");
            match admin
                .allocate(pb::AllocateRequest {
                    pod_uid: pod.clone(),
                    container: "ctr".into(),
                    resource: GPU.into(),
                    count: 1,
                    ..Default::default()
                })
                .await
            {
                Ok(_) => acknowledged.push(pod),
                Err(status) => return (acknowledged, (pod, status)),
            }
        }
        panic!("390 allocations on a full disk and none refused");
    });
    let (refused_pod, status) = refusal;
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    let message = status.message();
    assert!(
        message.contains("refused and nothing is held")
            && message.contains("No space left on device")
            && message.contains("device-manager.journal"),
        "{message}"
    );
    // `pluglet ctl` says the same and exits non-zero.
    let stderr = refused_allocation(&daemon, "by-ctl");
    assert!(stderr.contains("No space left on device"), "{stderr}");
    // Reads are served, and the refused ones hold nothing.
    let held = held_pods(&daemon);
    assert!(!held.contains(&refused_pod) && !held.contains(&"by-ctl".to_owned()));
    assert_eq!(held.len(), acknowledged.len() + 1, "{held:?}");
    let r = resource(&daemon, GPU).expect("resources are served");
    assert_eq!(r["allocatable"], 400);

    // Space back: the refused allocation goes through and the checkpoint catches up.
    for filler in &fillers {
        std::fs::remove_file(filler).unwrap();
    }
    allocate(&daemon, &refused_pod, "ctr", GPU, 1).unwrap();
    wait_for("the checkpoint to catch up", DEADLINE, || {
        let text = std::fs::read_to_string(checkpoint(&root)).ok()?;
        (text.contains(&format!("\"{refused_pod}\"")) && !text.contains("\"before\"")).then_some(())
    });

    // Everything answered was durable: a SIGKILL loses none of it.
    let before: Vec<String> = held_pods(&daemon);
    daemon.kill();
    let daemon = Daemon::start(&root.path(), &[]);
    assert_eq!(held_pods(&daemon), before);
    drop(daemon);
    drop(mounted);
}

#[test]
fn a_read_only_state_directory_refuses_changes_and_serves_reads() {
    require_root("the read-only state directory test");
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let _plugin = DevicePluginProcess::start(
        &root,
        Flow::Classic,
        GPU,
        &["--devices", "4", "--reregister"],
    );
    wait_allocatable(&daemon, GPU, 4);
    let held = ids(&allocate(&daemon, "pod-1", "ctr", GPU, 2).unwrap()["device_ids"]);
    assert!(daemon.terminate().success());

    let state = root.path().join("state");
    let state_arg = state.to_str().unwrap();
    run("mount", &["--bind", state_arg, state_arg]);
    let mounted = Mounted(state.clone());
    run("mount", &["-o", "remount,bind,ro", state_arg]);

    // The daemon starts, restores pod-1 and says why changes are refused.
    let daemon = Daemon::start(&root.path(), &[]);
    wait_log(&daemon, "cannot open the allocation journal for writing");
    wait_allocatable(&daemon, GPU, 4);
    let listed = allocations(&daemon);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(ids(&listed[0]["device_ids"]), held);

    let stderr = refused_allocation(&daemon, "pod-2");
    assert!(
        stderr.contains("refused and nothing is held") && stderr.contains("Read-only file system"),
        "{stderr}"
    );
    let out = daemon.ctl(&["release", "--pod", "pod-1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the release was answered as done");
    assert!(
        stderr.contains("refused") && stderr.contains("Read-only file system"),
        "{stderr}"
    );
    // Nothing changed: pod-1 holds its devices, pod-2 nothing.
    let listed = allocations(&daemon);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(ids(&listed[0]["device_ids"]), held);
    let events = daemon.ctl(&["events"]);
    let events = String::from_utf8_lossy(&events.stdout);
    assert!(events.contains("release_failed"), "{events}");

    // Writable again: the next change opens the journal and goes through.
    run("mount", &["-o", "remount,bind,rw", state_arg]);
    let out = daemon.ctl(&["release", "--pod", "pod-1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    allocate(&daemon, "pod-2", "ctr", GPU, 4).unwrap();
    daemon.kill();
    drop(mounted);
    let daemon = Daemon::start(&root.path(), &[]);
    let listed = allocations(&daemon);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["pod_uid"], "pod-2");
}
