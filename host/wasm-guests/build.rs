//! Builds every guest component of the workspace with an inner
//! `$CARGO build --release --target wasm32-wasip2` into `<outer target dir>/wasm-guests`.
//!
//! The inner build has its own target directory (sharing the outer one would deadlock on its
//! lock) and a cleaned environment (no wrappers such as clippy-driver, no outer RUSTFLAGS or
//! target). The test guests are built only with the `test-guests` feature; an example whose
//! crate is still a placeholder (no export macro in `src/lib.rs`) is skipped rather than failing
//! the build.

use std::path::{Path, PathBuf};
use std::process::Command;

/// What a guest is for, which decides when it is built.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// A built-in handler, embedded in the daemon: always built.
    BuiltIn,
    /// An example handler: always built, once its `src/lib.rs` exports something (a
    /// placeholder crate is skipped rather than failing the build).
    Example,
    /// A guest only tests load: built with the `test-guests` feature, which the test build
    /// turns on (a build of the daemon alone skips them).
    Test,
}

/// A guest crate: short name, package name, directory relative to the workspace root, kind.
const GUESTS: &[(&str, &str, &str, Kind)] = &[
    ("csi", "pluglet-handler-csi", "handlers/csi", Kind::BuiltIn),
    (
        "device-plugin",
        "pluglet-handler-device-plugin",
        "handlers/device-plugin",
        Kind::BuiltIn,
    ),
    (
        "misbehave",
        "test-guest-misbehave",
        "tests/guests/misbehave",
        Kind::Test,
    ),
    (
        "uses-fs",
        "test-guest-uses-fs",
        "tests/guests/uses-fs",
        Kind::Test,
    ),
    (
        "uses-tcp",
        "test-guest-uses-tcp",
        "tests/guests/uses-tcp",
        Kind::Test,
    ),
    (
        "contract-v1-0",
        "test-guest-contract-v1-0",
        "tests/guests/contract-v1-0",
        Kind::Test,
    ),
    (
        "contract-v1-1",
        "test-guest-contract-v1-1",
        "tests/guests/contract-v1-1",
        Kind::Test,
    ),
    (
        "spread-policy",
        "example-spread-policy",
        "examples/spread-policy",
        Kind::Example,
    ),
];

const TARGET: &str = "wasm32-wasip2";

/// A 64 KiB shadow stack instead of Rust's 1 MiB default: handlers are shallow, and a small
/// stack keeps the pages a call touches few and together, which makes resetting a pooled memory
/// slot cheap. (The stack sits first in memory, so an overflow traps instead of corrupting data.)
const GUEST_RUSTFLAGS: &str = "-C link-arg=-zstack-size=65536";

fn main() {
    let manifest_dir = PathBuf::from(env("CARGO_MANIFEST_DIR"));
    let root = manifest_dir
        .parent()
        .and_then(Path::parent)
        .expect("host/wasm-guests sits two levels below the workspace root")
        .to_path_buf();
    // OUT_DIR = <target>[/<triple>]/<profile>/build/<pkg>-<hash>/out
    let out_dir = PathBuf::from(env("OUT_DIR"));
    let outer_target = out_dir
        .ancestors()
        .nth(4)
        .expect("OUT_DIR is inside the target directory")
        .to_path_buf();
    let target_dir = outer_target.join("wasm-guests");
    let artifacts = target_dir.join(TARGET).join("release");

    for dir in [
        "guest-sdk/src",
        "guest-sdk/wit",
        "guest-sdk/wit-history",
        "guest-sdk/Cargo.toml",
        "guest-sdk/build.rs",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(dir).display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        root.join("Cargo.lock").display()
    );

    check_target_installed();

    let mut packages = Vec::new();
    let mut built = Vec::new();
    let with_tests = std::env::var_os("CARGO_FEATURE_TEST_GUESTS").is_some();
    for (name, package, dir, kind) in GUESTS {
        if *kind == Kind::Test && !with_tests {
            continue;
        }
        let dir = root.join(dir);
        println!("cargo:rerun-if-changed={}", dir.join("src").display());
        println!(
            "cargo:rerun-if-changed={}",
            dir.join("Cargo.toml").display()
        );
        if *kind == Kind::Example {
            let lib = std::fs::read_to_string(dir.join("src/lib.rs")).unwrap_or_default();
            if !lib.contains("export_handler!") && !lib.contains("export!(") {
                println!(
                    "cargo:warning=guest {name} ({package}) is not a handler yet (no export macro \
                     in src/lib.rs); skipped"
                );
                continue;
            }
        }
        packages.push(*package);
        built.push(*name);
    }

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&root)
        .args(["build", "--release", "--target", TARGET, "--target-dir"])
        .arg(&target_dir);
    for package in &packages {
        cmd.args(["-p", package]);
    }
    for var in [
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTC_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_BUILD_RUSTC_WRAPPER",
        "CARGO_BUILD_RUSTC_WORKSPACE_WRAPPER",
        "CARGO_BUILD_TARGET_DIR",
        "CARGO_LLVM_COV",
        "LLVM_PROFILE_FILE",
    ] {
        cmd.env_remove(var);
    }
    // Small components: no DWARF (the name section stays, for wasm backtraces).
    cmd.env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_PROFILE_RELEASE_STRIP", "debuginfo")
        .env("CARGO_TARGET_WASM32_WASIP2_RUSTFLAGS", GUEST_RUSTFLAGS);
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run cargo for the wasm guests: {e}"));
    if !output.status.success() {
        panic!(
            "building the wasm guests failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }

    for (name, package, _, _) in GUESTS {
        let file = artifacts.join(format!("{}.wasm", package.replace('-', "_")));
        if built.contains(name) && !file.exists() {
            panic!("the wasm guest build did not produce {}", file.display());
        }
    }
    println!(
        "cargo:rustc-env=PLUGLET_WASM_GUESTS_DIR={}",
        artifacts.display()
    );
    println!(
        "cargo:rustc-env=PLUGLET_WASM_GUESTS_BUILT={}",
        built.join(",")
    );
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("cargo sets {name} for build scripts"))
}

/// Fails with a clear message when the standard library for wasm32-wasip2 is missing.
fn check_target_installed() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let sysroot = Command::new(&rustc)
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    if let Some(sysroot) = sysroot
        && !sysroot.join("lib/rustlib").join(TARGET).exists()
    {
        panic!(
            "the Rust target {TARGET} is not installed (no {}); run `rustup target add {TARGET}` \
             and build again",
            sysroot.join("lib/rustlib").join(TARGET).display()
        );
    }
}
