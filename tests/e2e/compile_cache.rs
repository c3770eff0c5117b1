//! Story: the compile cache across restarts. The first start compiles the built-in handlers and
//! writes them to `<state>/handler-cache`; a second start on the same root loads them from
//! there; an entry corrupted between starts is recompiled, rewritten and the daemon serves.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use crate::support::{CsiPlugin, Daemon, TestRoot};

/// The cache's entries, sorted.
fn entries(root: &Path) -> Vec<PathBuf> {
    let dir = root.join("state").join("handler-cache");
    let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
        .collect();
    entries.sort();
    entries
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

/// The log lines containing `needle`.
fn lines<'a>(log: &'a str, needle: &str) -> Vec<&'a str> {
    log.lines().filter(|l| l.contains(needle)).collect()
}

/// A CSI plugin registers through the built-in CSI handler (its hooks run).
fn csi_registers(root: &TestRoot, daemon: &Daemon, name: &str) {
    let reg = root.registry().join(format!("{name}-reg.sock"));
    let plugin = CsiPlugin::start(
        &root.side("."),
        &reg,
        &["--name", name, "--versions", "1.0.0", "--node-id", "node-1"],
    );
    plugin.wait_registered();
    let p = daemon.wait_plugin(name);
    assert_eq!(p["handler"], "builtin:csi", "{p}");
}

#[test]
fn a_restart_loads_handlers_from_the_cache_and_a_corrupt_entry_is_recompiled() {
    let root = TestRoot::new();
    let path = root.path();

    let first = Daemon::start_cold(&path, &[]);
    let log = first.log_text();
    assert!(first.terminate().success());
    let cold = lines(&log, "handler modules loaded");
    assert!(
        cold.len() == 1 && cold[0].contains("from_cache=0") && cold[0].contains("compiled=2"),
        "the first start compiles both built-ins: {cold:?}\n{log}"
    );
    assert!(
        lines(&log, "handler loaded from the compile cache").is_empty(),
        "{log}"
    );
    let written = entries(&path);
    assert_eq!(written.len(), 2, "one entry per built-in: {written:?}");
    assert_eq!(mode(&path.join("state/handler-cache")), 0o700);
    assert_eq!(mode(&path.join("state/handler-cache.key")), 0o600);
    for entry in &written {
        assert_eq!(mode(entry), 0o600, "{}", entry.display());
    }

    let second = Daemon::start(&path, &[]);
    let log = second.log_text();
    let warm = lines(&log, "handler modules loaded");
    assert!(
        warm.len() == 1 && warm[0].contains("from_cache=2") && warm[0].contains("compiled=0"),
        "the second start loads both built-ins from the cache: {warm:?}\n{log}"
    );
    for module in ["builtin:csi", "builtin:device-plugin"] {
        assert!(
            lines(&log, "handler loaded from the compile cache")
                .iter()
                .any(|l| l.contains(module)),
            "{module} from the cache:\n{log}"
        );
    }
    assert!(
        lines(&log, "handler in force")
            .iter()
            .all(|l| l.contains("from_cache=true")),
        "{log}"
    );
    csi_registers(&root, &second, "csi-warm.example.com");
    assert!(second.terminate().success());
    assert_eq!(entries(&path), written, "no entry added or renamed");

    // Corrupt the CSI handler's entry (and only it) in the middle of its machine code.
    let mut corrupted = None;
    for entry in &written {
        let mut bytes = std::fs::read(entry).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x5a;
        std::fs::write(entry, &bytes).unwrap();
        let third = Daemon::start(&path, &[]);
        let log = third.log_text();
        let untrusted = lines(&log, "compile cache entry not trusted");
        assert_eq!(untrusted.len(), 1, "{log}");
        assert!(
            lines(&log, "compile cache entry rewritten").len() == 1,
            "the entry is rewritten:\n{log}"
        );
        let loaded = lines(&log, "handler modules loaded");
        assert!(
            loaded.len() == 1
                && loaded[0].contains("from_cache=1")
                && loaded[0].contains("compiled=1")
                && loaded[0].contains("untrusted=1"),
            "{loaded:?}\n{log}"
        );
        assert_ne!(std::fs::read(entry).unwrap(), bytes, "rewritten");
        assert_eq!(mode(entry), 0o600);
        let csi = untrusted[0].contains("builtin:csi");
        if csi {
            csi_registers(&root, &third, "csi-recompiled.example.com");
            corrupted = Some(entry.clone());
        }
        assert!(third.terminate().success());
        if csi {
            break;
        }
    }
    assert!(
        corrupted.is_some(),
        "one of the entries is the CSI handler's"
    );

    // Both entries are trusted again.
    let fourth = Daemon::start(&path, &[]);
    let log = fourth.log_text();
    assert!(
        lines(&log, "handler modules loaded")
            .iter()
            .any(|l| l.contains("from_cache=2")),
        "{log}"
    );
    assert!(lines(&log, "not trusted").is_empty(), "{log}");
    assert!(fourth.terminate().success());
}

#[test]
fn a_cold_start_compiles_in_a_compiler_process_not_in_the_daemon() {
    let root = TestRoot::new();
    let daemon = Daemon::start_cold(&root.path(), &[]);
    let log = daemon.log_text();
    let compiled = lines(&log, "handler compiled by a compiler process");
    assert_eq!(compiled.len(), 2, "both built-ins, each in a child: {log}");
    assert!(lines(&log, "compiler process failed").is_empty(), "{log}");
    // What the children compiled serves: a CSI driver registers through the built-in handler.
    csi_registers(&root, &daemon, "csi.child.example.com");
    assert!(daemon.terminate().success());
}

/// Runs the hidden compiler command with `stdin`; its exit code, stdout and stderr.
fn compile_handler(stdin: &[u8]) -> (Option<i32>, Vec<u8>, String) {
    use std::io::Write as _;
    let mut child = std::process::Command::new(crate::support::daemon::pluglet())
        .arg("compile-handler")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start pluglet compile-handler");
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_compiler_process_answers_an_artifact_or_why_the_module_does_not_compile() {
    let (code, artifact, stderr) = compile_handler(pluglet_wasm_guests::CSI);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        artifact.starts_with(b"\x7fELF"),
        "wasmtime's artifact is an ELF image: {} bytes",
        artifact.len()
    );

    let mut broken = b"\0asm\x0d\0\x01\0".to_vec();
    broken.extend_from_slice(&[0xff; 64]);
    let (code, artifact, stderr) = compile_handler(&broken);
    assert_eq!(
        code,
        Some(65),
        "EX_DATAERR for a module that does not compile"
    );
    assert!(artifact.is_empty());
    assert!(!stderr.trim().is_empty(), "the reason is on stderr");
}
