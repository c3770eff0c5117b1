//! Shared harness for the end-to-end stories: a temporary root, the real `pluglet` daemon, the
//! example plugins as separate processes (each under a [`process::ChildGuard`]), `pluglet ctl`,
//! and condition waits with deadlines.
//!
//! The binaries are the ones cargo built beside the test or bench executable
//! (`target/<profile>`): `scripts/test.sh` builds them with `--features pluglet/test-hooks`, the
//! features `cargo test` uses too, so `target/debug/pluglet` has the daemon's [`hooks`].

mod compiled;
pub mod daemon;
pub mod devices;
pub mod grpcio;
pub mod hooks;
pub mod kube;
pub mod oci_registry;
pub mod plugins;
pub mod process;

use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use daemon::Daemon;
pub use oci_registry::{OciRegistry, RegistryConfig};
pub use plugins::{CsiPlugin, DevicePlugin};

/// How long a condition may take before a test fails. Generous: the machine is shared.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// The directory cargo built the running test's binaries in: the one above the test or bench
/// executable (`target/<profile>/deps/<name>-<hash>`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the path of the running test executable");
    let dir = exe
        .parent()
        .expect("the test executable sits in a directory");
    let dir = if dir.ends_with("deps") {
        dir.parent().expect("deps sits in the profile directory")
    } else {
        dir
    };
    dir.to_owned()
}

/// Path of a binary built beside the test (`pluglet`, the example plugins). Fails with a clear
/// message when it was not built.
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.exists(),
        "binary {name} not found at {}: build it first with `cargo build --workspace --bins \
         --features pluglet/test-hooks` (the README's test command, scripts/test.sh, does)",
        path.display()
    );
    path
}

/// Polls `probe` until it returns `Some`, failing after `timeout` with `what`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut probe: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        if let Some(v) = probe() {
            return v;
        }
        if start.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// A temporary root directory for one daemon.
pub struct TestRoot {
    dir: tempfile::TempDir,
}

impl Default for TestRoot {
    fn default() -> TestRoot {
        TestRoot::new()
    }
}

impl TestRoot {
    /// A fresh, empty root (short path: unix socket paths are limited to 107 bytes).
    pub fn new() -> TestRoot {
        let dir = tempfile::Builder::new()
            .prefix("pe2e")
            .tempdir_in("/tmp")
            .expect("create temporary root");
        TestRoot { dir }
    }

    /// The root.
    pub fn path(&self) -> PathBuf {
        self.dir.path().to_owned()
    }

    /// `<root>/plugins_registry`.
    pub fn registry(&self) -> PathBuf {
        self.dir.path().join("plugins_registry")
    }

    /// `<root>/handlers`.
    pub fn handlers(&self) -> PathBuf {
        self.dir.path().join("handlers")
    }

    /// `<root>/pluglet.sock`.
    pub fn admin_socket(&self) -> PathBuf {
        self.dir.path().join("pluglet.sock")
    }

    /// A path for a plugin's side files (status file, CSI socket) outside the registry.
    pub fn side(&self, name: &str) -> PathBuf {
        let d = self.dir.path().join("plugins");
        std::fs::create_dir_all(&d).expect("create plugins dir");
        d.join(name)
    }
}
