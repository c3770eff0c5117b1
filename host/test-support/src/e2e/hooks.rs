//! The daemon's test hooks, compiled in by `pluglet`'s `test-hooks` feature: the variables that
//! steer it, and a check that the binary under test has them.

use std::process::Command;

use super::daemon::pluglet;

/// The path of a FIFO the daemon reads to its end before the registry's start-up scan.
pub const HOLD_SCAN: &str = "PLUGLET_TEST_HOLD_SCAN";

/// The name of a stage that ends with an error as soon as the daemon is ready.
pub const FAIL_STAGE: &str = "PLUGLET_TEST_FAIL_STAGE";

/// Fails the test, saying how to build one that has them, unless the `pluglet` binary the tests
/// start has the test hooks compiled in (its `--version` then ends in `+test-hooks`).
pub fn require() {
    let binary = pluglet();
    let out = Command::new(&binary)
        .arg("--version")
        .output()
        .expect("run pluglet --version");
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && version.trim_end().ends_with("+test-hooks"),
        "{} has no test hooks (`pluglet --version`: {:?}), and this test steers the daemon \
         through them: build it with `cargo build --workspace --bins --features \
         pluglet/test-hooks` and run the tests with `--features pluglet/test-hooks` \
         (scripts/test.sh does both)",
        binary.display(),
        version.trim_end()
    );
}
