//! `pluglet handler test`, run as the real binary: a bad event file and a failing handler are
//! separate errors. The event file's errors name the file; a trap, the memory cap or a module
//! refused at load name the module (and the hook), never the event file.

use std::path::Path;
use std::process::{Command, Output};

fn pluglet(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pluglet"))
        .args(args)
        .env("RUST_LOG", "off")
        .output()
        .expect("run pluglet")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn event(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/events")
        .join(name)
        .display()
        .to_string()
}

fn guest(name: &str) -> String {
    pluglet_wasm_guests::guest_path(name).display().to_string()
}

/// Runs `handler test MODULE --hook validate --event EVENT <extra>`, expects a failure (exit 1)
/// and returns its stderr.
fn fails(module: &str, event: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "handler", "test", module, "--hook", "validate", "--event", event,
    ];
    args.extend(extra);
    let out = pluglet(&args);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
    assert!(out.stdout.is_empty(), "no report on failure");
    stderr(&out)
}

#[test]
fn a_trap_names_the_module_and_the_hook_not_the_event_file() {
    let module = guest("misbehave");
    let err = fails(
        &module,
        &event("csi-valid.json"),
        &["--setting", "mode=panic"],
    );
    assert!(
        err.starts_with(&format!("error: handler {module} hook validate: trapped")),
        "{err}"
    );
    assert!(err.contains("misbehave: asked to panic"), "{err}");
    assert!(!err.contains("event file"), "{err}");
    assert!(!err.contains("csi-valid.json"), "{err}");
}

#[test]
fn the_memory_cap_names_the_module_not_the_event_file() {
    let module = guest("misbehave");
    let err = fails(
        &module,
        &event("csi-valid.json"),
        &[
            "--setting",
            "mode=alloc",
            "--memory-mib",
            "16",
            "--deadline-ms",
            "5000",
            "--fuel",
            "100000000000",
        ],
    );
    assert!(
        err.contains(&format!(
            "handler {module} hook validate: memory cap 16 MiB exceeded"
        )),
        "{err}"
    );
    assert!(!err.contains("event file"), "{err}");
}

#[test]
fn a_module_refused_at_load_names_the_module_not_the_event_file() {
    let module = guest("uses-fs");
    let err = fails(&module, &event("csi-valid.json"), &[]);
    assert!(err.contains(&format!("handler {module} imports")), "{err}");
    assert!(!err.contains("event file"), "{err}");
}

#[test]
fn event_file_errors_name_the_file_and_what_is_wrong_not_the_handler() {
    let dir = tempfile::tempdir().unwrap();
    // A module that would trap: the event file is read first, and its error is the one told.
    let module = guest("misbehave");
    let trap = ["--setting", "mode=panic"];

    let missing = dir.path().join("missing.json");
    let missing = missing.to_str().unwrap();
    let err = fails(&module, missing, &trap);
    assert!(
        err.starts_with(&format!("error: cannot read the event file {missing}")),
        "{err}"
    );
    assert!(!err.contains("trapped"), "{err}");

    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"name\": \"x\",").unwrap();
    let bad = bad.to_str().unwrap();
    let err = fails(&module, bad, &trap);
    assert!(
        err.starts_with(&format!("error: event file {bad} is not valid JSON")),
        "{err}"
    );
    assert!(err.contains("line 1"), "{err}");
    assert!(!err.contains("trapped") && !err.contains(&module), "{err}");

    // An allocation request given to a registration hook.
    let err = fails(&module, &event("allocate.json"), &trap);
    assert!(
        err.contains("is not what hook validate takes; expected a plugin record"),
        "{err}"
    );
    assert!(err.contains("missing field `name`"), "{err}");
    assert!(!err.contains("trapped") && !err.contains(&module), "{err}");
}
