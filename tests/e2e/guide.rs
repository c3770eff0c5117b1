//! The vendor's guide (`docs/handlers.md`) runs: every `sh` block of the page, in order, as one
//! bash script from the repository root with this build's `pluglet` on `PATH`. A command on the
//! page that stops working fails this test, so the page cannot rot.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The `sh` blocks of a Markdown page, in order.
fn sh_blocks(page: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in page.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```sh") => current = Some(String::new()),
            (Some(block), "```") => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            (Some(block), text) => {
                block.push_str(text);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

#[test]
fn the_vendor_guide_runs() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let page = std::fs::read_to_string(repo.join("docs/handlers.md")).expect("docs/handlers.md");
    let blocks = sh_blocks(&page);
    assert!(blocks.len() >= 8, "the guide's sh blocks: {blocks:?}");
    assert!(
        Command::new("minisign").arg("-v").output().is_ok(),
        "the guide needs the `minisign` program (Debian package `minisign`); run the tests with \
         `bash scripts/test.sh`, which installs it"
    );

    let bin = PathBuf::from(env!("CARGO_BIN_EXE_pluglet"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // The guide's cargo commands build into their own target directory, so they never wait on
    // the lock of the build running these tests.
    let target = repo.join("target").join("guide");
    let script = format!("set -euo pipefail\n{}", blocks.join("\n"));
    let out = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(&repo)
        .env("PATH", path)
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the guide failed ({})\nscript:\n{script}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // What the reader is told to expect.
    assert!(stdout.contains("allocation-policy"), "{stdout}");
    assert!(stdout.contains("passed, 0 failed"), "{stdout}");
    assert!(stdout.contains("rolled back"), "{stdout}");
}
