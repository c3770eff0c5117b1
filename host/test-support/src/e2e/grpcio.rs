//! A stock gRPC client where a Rust one would not do: Debian's `python3-grpcio` (installed by
//! `scripts/test.sh`), run as a short script against a unix socket, as the test's user or
//! another.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

/// What every script starts with: `grpc` imported and `channel` open on the socket, with
/// grpcio's default channel settings (its `:authority` is the socket path, percent-encoded).
const PREAMBLE: &str = r#"
import sys, grpc
channel = grpc.insecure_channel("unix://" + sys.argv[1])
"#;

/// Runs `script` (Python, after [`PREAMBLE`]) with `/usr/bin/python3` against `socket`, as
/// `user` (`(uid, gid)`, with no supplementary groups) when given, and returns what it printed,
/// trimmed. Fails the test when grpcio is not installed or the script fails.
pub fn run(socket: &Path, user: Option<(u32, u32)>, script: &str) -> String {
    let mut command = Command::new("/usr/bin/python3");
    command
        .arg("-c")
        .arg(format!("{PREAMBLE}{script}"))
        .arg(socket)
        .current_dir("/");
    if let Some((uid, gid)) = user {
        command.uid(uid).gid(gid);
    }
    let out = command.output().expect("run /usr/bin/python3");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'grpc'"),
        "this test needs grpcio: install the Debian package python3-grpcio (scripts/test.sh \
         does, as root)"
    );
    assert!(out.status.success(), "the grpcio client failed: {stderr}");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}
