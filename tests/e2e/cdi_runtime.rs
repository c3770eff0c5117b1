//! Runtime hand-off: allocations become CDI devices. A real container runtime (podman with
//! runc, as root) injects the plugin's environment, device node and mount by the name
//! `ctl allocate` answers; after a release the name no longer resolves. Start-up
//! reconciliation and `--no-cdi` are checked on the spec directory under `--root`.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use crate::device_support::{
    DevicePluginProcess, Flow, allocate, allocations, ids, release, wait_allocatable,
};
use crate::support::daemon::unique;
use crate::support::{Daemon, TestRoot};

/// The directory podman reads specs made at run time from.
const RUNTIME_CDI_DIR: &str = "/var/run/cdi";

/// A lock held by each test that allocates into [`RUNTIME_CDI_DIR`] for as long as it runs: a
/// spec one test's release removes while another test's podman scans the directory can make
/// that scan see no device at all (docs/cdi.md, "The runtimes"), and a daemon starting on the
/// directory removes the specs of allocations it does not hold. A file lock, so that test runs
/// of two checkouts on one machine take turns too.
const RUNTIME_CDI_DIR_LOCK: &str = "/var/run/pluglet-e2e-cdi.lock";

fn runtime_cdi_dir_alone() -> std::fs::File {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(RUNTIME_CDI_DIR_LOCK)
        .unwrap_or_else(|e| panic!("open {RUNTIME_CDI_DIR_LOCK}: {e}"));
    file.lock()
        .unwrap_or_else(|e| panic!("lock {RUNTIME_CDI_DIR_LOCK}: {e}"));
    file
}

const WIDGET: &str = "example.com/widget";

/// `podman ARGS` with its own image store under `root` (vfs: no overlay mounts, nothing left in
/// the machine's store), failing with a clear message when podman cannot be started.
fn podman(root: &Path, args: &[&str]) -> Output {
    let store = root.join("podman");
    Command::new("podman")
        .arg("--root")
        .arg(store.join("storage"))
        .arg("--runroot")
        .arg(store.join("run"))
        .args(["--storage-driver", "vfs"])
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run podman ({e}): this test needs podman, runc and busybox-static \
             (scripts/test.sh installs them as root: apt-get install -y podman runc busybox-static)"
            )
        })
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A minimal image holding only a statically linked busybox, imported from a tarball (no
/// registry is reachable here).
fn busybox_image(root: &Path) -> String {
    let busybox = Path::new("/bin/busybox");
    assert!(
        busybox.exists(),
        "/bin/busybox is missing: install busybox-static (scripts/test.sh does as root)"
    );
    let ldd = Command::new("ldd").arg(busybox).output();
    if let Ok(out) = ldd {
        assert!(
            !out.status.success(),
            "/bin/busybox is dynamically linked (Debian's busybox); the image needs busybox-static"
        );
    }
    let tree = root.join("image");
    std::fs::create_dir_all(tree.join("bin")).unwrap();
    std::fs::copy(busybox, tree.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", tree.join("bin/sh")).unwrap();
    let tar = root.join("image.tar");
    let out = Command::new("tar")
        .args([
            "-C",
            &tree.display().to_string(),
            "-cf",
            &tar.display().to_string(),
            ".",
        ])
        .output()
        .expect("run tar");
    assert!(out.status.success(), "tar: {}", text(&out));
    let image = "localhost/pluglet-e2e-busybox:latest";
    let out = podman(root, &["import", "-q", &tar.display().to_string(), image]);
    assert!(out.status.success(), "podman import: {}", text(&out));
    image.to_owned()
}

/// `podman run` of `script` in `image` with `device`, as these 2-core VMs run it.
fn run_with_device(root: &Path, image: &str, device: &str, script: &str) -> Output {
    podman(
        root,
        &[
            "run",
            "--rm",
            "--runtime",
            "runc",
            "--cgroup-manager",
            "cgroupfs",
            "--network",
            "none",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
            "--device",
            device,
            image,
            "/bin/busybox",
            "sh",
            "-c",
            script,
        ],
    )
}

/// Pluglet's spec files in `dir`.
fn own_specs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut specs: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("pluglet-") && name.ends_with(".json")
        })
        .collect();
    specs.sort();
    specs
}

fn names(value: &Value) -> Vec<String> {
    ids(value)
}

#[test]
fn podman_injects_an_allocation_by_its_cdi_name_until_it_is_released() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "podman runs containers as root here: run the tests as root (CI does)"
    );
    let root = TestRoot::new();
    let version = podman(&root.path(), &["--version"]);
    assert!(
        version.status.success(),
        "podman --version: {}",
        text(&version)
    );
    let image = busybox_image(&root.path());
    let _alone = runtime_cdi_dir_alone();
    // The plugin's mount source (read-only bind mount of the allocation).
    std::fs::create_dir_all(format!("/tmp/vendor/{}", WIDGET.replace('/', "_"))).unwrap();

    let daemon = Daemon::start(&root.path(), &["--cdi-spec-dir", RUNTIME_CDI_DIR]);
    let _plugin = DevicePluginProcess::start(&root, Flow::Classic, WIDGET, &[]);
    wait_allocatable(&daemon, WIDGET, 4);
    let pod = format!("pod-{}", unique());
    let got = allocate(&daemon, &pod, "main", WIDGET, 1).unwrap();
    let device = ids(&got["device_ids"]).remove(0);
    let expected = format!("{WIDGET}=pluglet-{pod}_main");
    assert_eq!(names(&got["cdi_names"]), [expected.as_str()], "{got}");
    let listed = allocations(&daemon);
    let mine = listed
        .iter()
        .find(|a| a["pod_uid"] == pod.as_str())
        .unwrap();
    assert_eq!(names(&mine["cdi_names"]), [expected.as_str()]);

    let spec_path =
        Path::new(RUNTIME_CDI_DIR).join(format!("pluglet-example.com=widget={pod}_main.json"));
    let meta =
        std::fs::metadata(&spec_path).unwrap_or_else(|e| panic!("{}: {e}", spec_path.display()));
    assert_eq!(meta.permissions().mode() & 0o777, 0o644);
    let spec: Value = serde_json::from_slice(&std::fs::read(&spec_path).unwrap()).unwrap();
    // A host path that differs from the container path needs cdiVersion 0.5.0.
    assert_eq!(spec["cdiVersion"], "0.5.0", "{spec}");

    let out = run_with_device(
        &root.path(),
        &image,
        &expected,
        "echo \"VENDOR_DEVICES=$VENDOR_DEVICES\"; \
         test -c /dev/vendor/$VENDOR_DEVICES && echo node-ok; \
         test -d /var/run/vendor && echo mount-ok",
    );
    let said = text(&out);
    assert!(out.status.success(), "podman run with {expected}: {said}");
    assert!(
        said.contains(&format!("VENDOR_DEVICES={device}\n")),
        "{said}"
    );
    assert!(said.contains("node-ok"), "device node missing: {said}");
    assert!(said.contains("mount-ok"), "mount missing: {said}");

    release(&daemon, &pod, None);
    assert!(!spec_path.exists(), "spec left after the release");
    let out = run_with_device(&root.path(), &image, &expected, "true");
    assert!(!out.status.success(), "a released name still resolves");
    assert!(
        text(&out).contains("unresolvable CDI devices"),
        "{}",
        text(&out)
    );
    daemon.terminate();
}

/// A plugin that answers as the Kubernetes sample device plugin does (one identical
/// `/dev/null` spec per device) is allocated 2 and 8 devices: each allocation's spec holds the
/// node once, and podman runs a container with it.
#[test]
fn identical_device_specs_are_one_node_and_run_in_podman() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "podman runs containers as root here: run the tests as root (CI does)"
    );
    let root = TestRoot::new();
    let image = busybox_image(&root.path());
    let _alone = runtime_cdi_dir_alone();
    let daemon = Daemon::start(&root.path(), &["--cdi-spec-dir", RUNTIME_CDI_DIR]);
    let _plugin = DevicePluginProcess::start(
        &root,
        Flow::Classic,
        WIDGET,
        &["--devices", "10", "--dev-null-per-device"],
    );
    wait_allocatable(&daemon, WIDGET, 10);
    for count in [2, 8] {
        let pod = format!("pod-{}", unique());
        let got = allocate(&daemon, &pod, "main", WIDGET, count)
            .unwrap_or_else(|e| panic!("allocate {count}: {e}"));
        assert_eq!(ids(&got["device_ids"]).len(), count as usize, "{got}");
        let expected = format!("{WIDGET}=pluglet-{pod}_main");
        assert_eq!(names(&got["cdi_names"]), [expected.as_str()], "{got}");
        assert_eq!(
            got["device_specs"].as_array().map(Vec::len),
            Some(count as usize),
            "the plugin's answer is kept as it gave it: {got}"
        );
        let spec_path =
            Path::new(RUNTIME_CDI_DIR).join(format!("pluglet-example.com=widget={pod}_main.json"));
        let spec: Value = serde_json::from_slice(&std::fs::read(&spec_path).unwrap()).unwrap();
        assert_eq!(
            spec["devices"][0]["containerEdits"]["deviceNodes"],
            serde_json::json!([{"path": "/dev/null", "permissions": "rw"}]),
            "{spec}"
        );
        let out = run_with_device(
            &root.path(),
            &image,
            &expected,
            "test -c /dev/null && echo node-ok",
        );
        let said = text(&out);
        assert!(out.status.success(), "podman run with {expected}: {said}");
        assert!(said.contains("node-ok"), "{said}");
        release(&daemon, &pod, None);
        assert!(!spec_path.exists(), "spec left after the release");
    }
    daemon.terminate();
}

#[test]
fn specs_are_reconciled_at_start_and_cdi_can_be_turned_off() {
    let root = TestRoot::new();
    let cdi = root.path().join("cdi");
    let daemon = Daemon::start(&root.path(), &[]);
    let plugin = DevicePluginProcess::start(&root, Flow::Classic, WIDGET, &["--cdi-devices"]);
    wait_allocatable(&daemon, WIDGET, 4);
    let got = allocate(&daemon, "pod-a", "main", WIDGET, 2).unwrap();
    let chosen = ids(&got["device_ids"]);
    let mut want: Vec<String> = chosen.iter().map(|id| format!("{WIDGET}={id}")).collect();
    want.push(format!("{WIDGET}=pluglet-pod-a_main"));
    assert_eq!(names(&got["cdi_names"]), want, "the plugin's names first");
    allocate(&daemon, "pod-b", "main", WIDGET, 1).unwrap();
    let specs = own_specs(&cdi);
    assert_eq!(specs.len(), 2, "{specs:?}");
    daemon.kill();

    // While it is down: one spec lost, a stale one of Pluglet's, and a vendor's own file.
    let lost = cdi.join("pluglet-example.com=widget=pod-b_main.json");
    std::fs::remove_file(&lost).unwrap();
    let stale = cdi.join("pluglet-example.com=widget=pod-gone_main.json");
    std::fs::copy(&specs[0], &stale).unwrap();
    let vendor = cdi.join("example.com-widget.json");
    std::fs::write(
        &vendor,
        "{\"cdiVersion\":\"0.5.0\",\"kind\":\"example.com/widget\",\"devices\":[]}",
    )
    .unwrap();

    let daemon = Daemon::start(&root.path(), &[]);
    assert!(lost.exists(), "the missing spec was not rewritten");
    assert!(!stale.exists(), "a spec of no allocation was kept");
    assert!(vendor.exists(), "a file not Pluglet's was touched");
    release(&daemon, "pod-a", None);
    release(&daemon, "pod-b", None);
    assert_eq!(own_specs(&cdi), Vec::<PathBuf>::new());
    daemon.terminate();
    drop(plugin);

    // With --no-cdi: the plugin's own names only, and no file.
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &["--no-cdi"]);
    let _plugin = DevicePluginProcess::start(&root, Flow::Classic, WIDGET, &["--cdi-devices"]);
    wait_allocatable(&daemon, WIDGET, 4);
    let got = allocate(&daemon, "pod-a", "main", WIDGET, 1).unwrap();
    let id = ids(&got["device_ids"]).remove(0);
    assert_eq!(names(&got["cdi_names"]), [format!("{WIDGET}={id}")]);
    assert!(own_specs(&root.path().join("cdi")).is_empty());
    daemon.terminate();
}
