//! A start with a per-user inotify limit used up: the daemon stops, naming the sysctl and the
//! command that raises it.
//!
//! A test binary of its own: it lowers a sysctl that holds for every process of the user, and
//! cargo runs test binaries one after another, so no other test's daemon starts while it is
//! lowered.

use std::path::PathBuf;
use std::time::Instant;

use pluglet_test_support::e2e::{DEADLINE, Daemon, TestRoot, hooks, wait_for};

/// A sysctl lowered for a short window; its old value is written back on drop, also when the
/// test fails.
struct SysctlGuard {
    path: PathBuf,
    old: String,
}

impl SysctlGuard {
    fn set(name: &str, value: &str) -> SysctlGuard {
        let path = PathBuf::from("/proc/sys").join(name.replace('.', "/"));
        let old = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        std::fs::write(&path, value).unwrap_or_else(|e| {
            panic!(
                "cannot lower {name} ({e}): this test needs root and a writable /proc/sys \
                 (a privileged container)"
            )
        });
        SysctlGuard { path, old }
    }
}

impl Drop for SysctlGuard {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(&self.path, self.old.trim()) {
            eprintln!("could not restore {}: {e}", self.path.display());
        }
    }
}

#[test]
fn inotify_limits_reached_stop_the_start_with_the_sysctl_named() {
    hooks::require();
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test lowers fs.inotify sysctls and must run as root (scripts/test.sh in CI does)"
    );
    for sysctl in [
        "fs.inotify.max_user_instances",
        "fs.inotify.max_user_watches",
    ] {
        let root = TestRoot::new();
        let fifo = root.path().join("hold-scan");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // The daemon stops just before it creates its inotify instance and watches the registry:
        // the sysctl is lowered only around that step, since it holds for every process of the
        // user (other tests start daemons at the same time).
        let daemon =
            Daemon::spawn_with_env(&root.path(), &[], &[(hooks::HOLD_SCAN, fifo.as_os_str())]);
        wait_for("the daemon to hold before watching", DEADLINE, || {
            daemon
                .log_text()
                .contains("holding the start-up scan")
                .then_some(())
        });
        let window = Instant::now();
        {
            let _lowered = SysctlGuard::set(sysctl, "0");
            drop(std::fs::OpenOptions::new().write(true).open(&fifo).unwrap());
            wait_for("the daemon to give up watching", DEADLINE, || {
                daemon.log_text().contains(sysctl).then_some(())
            });
        }
        println!("{sysctl} was lowered for {:?}", window.elapsed());
        let (status, log) = daemon.wait_exit();
        assert!(!status.success(), "{sysctl}: {status}\n{log}");
        assert!(log.contains(&format!("sysctl -w {sysctl}=")), "{log}");
        assert!(log.contains("Pluglet does not start"), "{log}");
    }
}
