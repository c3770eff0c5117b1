//! The documentation runs: every `sh` block of a page in `docs/` (and of the README), in order,
//! as one bash script per page from the repository root, with this build's binaries (`pluglet`,
//! `example-csi-plugin`, `example-device-plugin`) on `PATH`. A command on a page that stops
//! working fails its page's test, so the pages cannot rot.
//!
//! The convention a page follows:
//! - a ` ```sh ` block runs;
//! - a block that cannot run here (systemctl on a real node, an image build that pulls a base
//!   image from a registry, a command that needs an API server) is fenced ` ```sh not-run `
//!   (it still renders as shell) and the prose between the block before it and itself says why,
//!   with the words "not run here";
//! - any other shell-like fence (`bash`, `shell`, `console`, `sh` with another word) is refused,
//!   so no command hides from the test;
//! - a page that starts the daemon runs it on a temporary root in the background, waits for it
//!   with `pluglet ctl`, and stops it in its last block.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The fence of a block that runs.
const RUN: &str = "sh";
/// The fence of a block that cannot run here; the prose before it says why.
const NOT_RUN: &str = "sh not-run";
/// What the prose before a `sh not-run` block must say.
const REASON: &str = "not run here";
/// Fence languages that hold commands: a block in one of them must be `sh` or `sh not-run`.
const SHELL_LANGUAGES: &[&str] = &["sh", "bash", "shell", "console", "zsh", "shell-session"];

/// Every page whose commands run, relative to the repository root; each has a test below.
const RUN_PAGES: &[&str] = &[
    "README.md",
    "docs/architecture.md",
    "docs/cdi.md",
    "docs/cli.md",
    "docs/fleet.md",
    "docs/handlers.md",
    "docs/operating.md",
];

/// A page's command blocks.
#[derive(Debug, Default)]
struct Blocks {
    /// The `sh` blocks, in order.
    run: Vec<String>,
    /// How many `sh not-run` blocks the page has.
    not_run: usize,
}

/// Reads a Markdown page's command blocks, or says which block breaks the convention.
fn command_blocks(page: &str) -> Result<Blocks, String> {
    let mut blocks = Blocks::default();
    // The fence of the block being read (`None`: prose) and its text.
    let mut open: Option<(String, String)> = None;
    let mut prose = String::new();
    for (number, line) in page.lines().enumerate() {
        let trimmed = line.trim();
        match &mut open {
            None => {
                let Some(info) = trimmed.strip_prefix("```") else {
                    prose.push_str(trimmed);
                    prose.push('\n');
                    continue;
                };
                let info = info.trim().to_owned();
                let language = info.split_whitespace().next().unwrap_or("");
                if info == NOT_RUN && !prose.to_lowercase().contains(REASON) {
                    return Err(format!(
                        "line {}: a `{NOT_RUN}` block without the reason before it (the prose \
                         since the block before must say \"{REASON}: <why>\")",
                        number + 1
                    ));
                }
                if SHELL_LANGUAGES.contains(&language) && info != RUN && info != NOT_RUN {
                    return Err(format!(
                        "line {}: a ```{info} block: commands go in ```{RUN} (run by the test) or \
                         ```{NOT_RUN} (with the reason before it)",
                        number + 1
                    ));
                }
                open = Some((info, String::new()));
            }
            Some((info, text)) => {
                if trimmed == "```" {
                    match info.as_str() {
                        RUN => blocks.run.push(std::mem::take(text)),
                        NOT_RUN => blocks.not_run += 1,
                        _ => {}
                    }
                    open = None;
                    prose.clear();
                } else {
                    text.push_str(line);
                    text.push('\n');
                }
            }
        }
    }
    match open {
        Some((info, _)) => Err(format!("a ```{info} block is not closed")),
        None => Ok(blocks),
    }
}

/// The repository root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs a page's `sh` blocks as one script; returns its standard output. Fails when the script
/// fails, when the page breaks the convention, or when it has fewer than `min_blocks` blocks
/// that run.
fn run_page(page: &str, min_blocks: usize) -> String {
    let repo = repo();
    let text = std::fs::read_to_string(repo.join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
    let blocks = command_blocks(&text).unwrap_or_else(|e| panic!("{page}: {e}"));
    assert!(
        blocks.run.len() >= min_blocks,
        "{page}: {} blocks run, expected at least {min_blocks}: {blocks:?}",
        blocks.run.len()
    );
    for program in ["minisign", "curl", "docker-registry"] {
        assert!(
            Command::new(program).arg("--version").output().is_ok(),
            "the pages need the `{program}` program (Debian package `{program}`); run the tests \
             with `bash scripts/test.sh`, which installs it"
        );
    }

    let bin = PathBuf::from(env!("CARGO_BIN_EXE_pluglet"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // The pages' cargo commands build into their own target directory, so they never wait on
    // the lock of the build running these tests.
    let target = repo.join("target").join("docs");
    let script = format!("set -euo pipefail\n{}", blocks.run.join("\n"));
    let out = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(&repo)
        .env("PATH", path)
        .env("CARGO_TARGET_DIR", &target)
        .env_remove("RUST_LOG")
        .output()
        .expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{page} failed ({})\nscript:\n{script}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Asserts that a page's output says each of `expected`.
fn says(page: &str, stdout: &str, expected: &[&str]) {
    for text in expected {
        assert!(
            stdout.contains(text),
            "{page}: the output lacks {text:?}:\n{stdout}"
        );
    }
}

#[test]
fn every_page_follows_the_convention_and_its_commands_run() {
    let mut pages = vec!["README.md".to_owned()];
    for entry in std::fs::read_dir(repo().join("docs")).expect("docs/") {
        let name = entry.expect("a docs/ entry").file_name();
        let name = name.to_string_lossy();
        if name.ends_with(".md") {
            pages.push(format!("docs/{name}"));
        }
    }
    for page in pages {
        let text = std::fs::read_to_string(repo().join(&page)).expect("a page");
        let blocks = command_blocks(&text).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(
            blocks.run.is_empty() || RUN_PAGES.contains(&page.as_str()),
            "{page} has commands that no test runs: add it to RUN_PAGES with a test"
        );
    }
}

#[test]
fn a_block_that_does_not_run_must_say_why() {
    let with_reason = "Not run here: it needs systemd.\n\n```sh not-run\nsystemctl start x\n```\n";
    let blocks = command_blocks(with_reason).unwrap();
    assert_eq!((blocks.run.len(), blocks.not_run), (0, 1));

    let without = "Start it.\n\n```sh not-run\nsystemctl start x\n```\n";
    let err = command_blocks(without).unwrap_err();
    assert!(err.contains("line 3") && err.contains(REASON), "{err}");
    // The reason of one block does not cover the next.
    let err = command_blocks(&format!("{with_reason}{without}")).unwrap_err();
    assert!(err.contains("line 8"), "{err}");

    let hidden = "```bash\nrm -rf /\n```\n";
    assert!(command_blocks(hidden).unwrap_err().contains("```bash"));
    let blocks = command_blocks("```toml\na = 1\n```\n```sh\necho hi\n```\n").unwrap();
    assert_eq!(blocks.run, ["echo hi\n"]);
}

#[test]
fn the_readme_tour_runs() {
    let out = run_page("README.md", 4);
    says(
        "README.md",
        &out,
        &["vendor.com/gpu", "AllocateResult", "spread-policy.wasm"],
    );
}

#[test]
fn docs_operating_runs() {
    let out = run_page("docs/operating.md", 5);
    says(
        "docs/operating.md",
        &out,
        &["registry_dir", "ok", "pluglet_ready 1", "\"level\""],
    );
}

#[test]
fn docs_cli_runs() {
    let out = run_page("docs/cli.md", 10);
    says(
        "docs/cli.md",
        &out,
        &[
            "\"kind\": \"PluginList\"",
            "released",
            "nothing released",
            "\"kind\": \"SyncPodsResult\"",
            "allocation-policy",
        ],
    );
}

#[test]
fn docs_cdi_runs() {
    let out = run_page("docs/cdi.md", 3);
    says(
        "docs/cdi.md",
        &out,
        &["vendor.com/gpu=pluglet-1234_main", "cdiVersion"],
    );
}

#[test]
fn docs_fleet_runs() {
    run_page("docs/fleet.md", 0);
}

#[test]
fn docs_handlers_runs() {
    let out = run_page("docs/handlers.md", 8);
    says(
        "docs/handlers.md",
        &out,
        &["allocation-policy", "passed, 0 failed", "rolled back"],
    );
}

#[test]
fn docs_architecture_runs() {
    let out = run_page("docs/architecture.md", 2);
    says("docs/architecture.md", &out, &["device-manager", "ok"]);
}
