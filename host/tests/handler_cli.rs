//! `pluglet handler check` and `pluglet handler test`, run as the real binary on the real guests
//! and the sample events in `examples/events/`, including how their errors name what is wrong.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn pluglet(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pluglet"))
        .args(args)
        .env("RUST_LOG", "off")
        .output()
        .expect("run pluglet")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
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

/// The command failed and its stderr says `expected`.
fn assert_fails_with(out: &Output, expected: &str) {
    assert!(!out.status.success(), "succeeded: {}", stdout(out));
    assert!(stderr(out).contains(expected), "{}", stderr(out));
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", stdout(o), stderr(o)))
}

#[test]
fn check_reports_contract_families_and_digest() {
    let path = guest("device-plugin");
    let out = pluglet(&["handler", "check", &path]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("contract:  pluglet:handler@1.2.0"), "{text}");
    assert!(
        text.contains("families:  registration, allocation-policy"),
        "{text}"
    );
    assert!(text.contains("sha256:    "), "{text}");
    assert!(text.contains("compiled:  "), "{text}");

    let out = pluglet(&["handler", "check", &guest("contract-v1-0"), "-o", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["contract_version"], "1.0.0");
    assert_eq!(v["families"], serde_json::json!(["registration"]));
    assert_eq!(v["sha256"].as_str().unwrap().len(), 64);
}

#[test]
fn check_refuses_forbidden_imports_non_components_and_missing_files() {
    let out = pluglet(&["handler", "check", &guest("uses-fs")]);
    assert_fails_with(&out, "`wasi:filesystem/");

    let dir = tempfile::tempdir().unwrap();
    let text_file: PathBuf = dir.path().join("readme.wasm");
    std::fs::write(&text_file, "not wasm").unwrap();
    let out = pluglet(&["handler", "check", &text_file.display().to_string()]);
    assert_fails_with(&out, "is not a WebAssembly component");

    let out = pluglet(&["handler", "check", "/nonexistent/x.wasm"]);
    assert_fails_with(&out, "/nonexistent/x.wasm");
}

#[test]
fn test_validate_accepts_with_the_chosen_version() {
    let out = pluglet(&[
        "handler",
        "test",
        "builtin:csi",
        "--hook",
        "validate",
        "--event",
        &event("csi-valid.json"),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("outcome:   accepted (version 1.5.0)"),
        "{text}"
    );
    assert!(text.contains("compiled:  "), "{text}");
    assert!(text.contains("call:      "), "{text}");
}

#[test]
fn test_validate_refuses_a_same_name_driver_with_a_lower_version() {
    let out = pluglet(&[
        "handler",
        "test",
        "builtin:csi",
        "--hook",
        "validate",
        "--event",
        &event("csi-old-version.json"),
        "-o",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["hook"], "validate");
    assert_eq!(v["outcome"]["result"], "refused");
    assert_eq!(v["outcome"]["kind"], "already-registered");
    assert!(v["compile_ms"].as_f64().unwrap() > 0.0);
    assert!(v["call_ms"].as_f64().unwrap() > 0.0);
}

#[test]
fn test_register_and_device_plugin_and_allocate() {
    let out = pluglet(&[
        "handler",
        "test",
        "builtin:csi",
        "--hook",
        "register",
        "--event",
        &event("csi-valid.json"),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("outcome:   ok"), "{}", stdout(&out));

    let out = pluglet(&[
        "handler",
        "test",
        "builtin:device-plugin",
        "--hook",
        "validate",
        "--event",
        &event("device-plugin.json"),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("accepted (version v1beta1)"),
        "{}",
        stdout(&out)
    );

    let out = pluglet(&[
        "handler",
        "test",
        &guest("device-plugin"),
        "--hook",
        "allocate",
        "--event",
        &event("allocate.json"),
        "-o",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["outcome"]["result"], "allocated");
    assert_eq!(
        v["outcome"]["devices"],
        serde_json::json!(["gpu-1", "gpu-2"])
    );
}

#[test]
fn test_prints_guest_logs_and_passes_settings_and_node_name() {
    let out = pluglet(&[
        "handler",
        "test",
        &guest("misbehave"),
        "--hook",
        "validate",
        "--event",
        &event("csi-valid.json"),
        "--setting",
        "mode=ok",
        "--setting",
        "version=3.1",
        "--node-name",
        "worker-9",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("accepted (version 3.1)"), "{text}");
    assert!(text.contains("info  ok on node worker-9"), "{text}");
}

#[test]
fn test_reports_a_trap_as_an_error() {
    let out = pluglet(&[
        "handler",
        "test",
        &guest("misbehave"),
        "--hook",
        "validate",
        "--event",
        &event("csi-valid.json"),
        "--setting",
        "mode=loop",
        "--deadline-ms",
        "30",
        "--fuel",
        "100000000000",
    ]);
    assert_fails_with(&out, "hook validate: deadline of 30 ms exceeded");
}

#[test]
fn test_allocate_on_a_registration_only_module_says_so() {
    let out = pluglet(&[
        "handler",
        "test",
        "builtin:csi",
        "--hook",
        "allocate",
        "--event",
        &event("allocate.json"),
    ]);
    assert_fails_with(&out, "does not export the allocation-policy family");
}

// A bad event file and a failing handler are separate errors: the event file's errors name the
// file; a trap, the memory cap or a module refused at load name the module (and the hook),
// never the event file.

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

// `handler test --vectors`: every case of a vectors file, a line each, then the totals; exit 1
// when a case fails.

fn spread_vectors() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/spread-policy/spread-policy.vectors.json")
        .display()
        .to_string()
}

#[test]
fn vectors_that_pass_print_each_case_and_the_totals() {
    let out = pluglet(&[
        "handler",
        "test",
        &guest("spread-policy"),
        "--vectors",
        &spread_vectors(),
    ]);
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("pass two devices spread over both NUMA nodes (allocate): "),
        "{text}"
    );
    assert!(
        text.contains("got:      allocated [dev-0, dev-1]"),
        "{text}"
    );
    assert!(text.contains(", fuel "), "{text}");
    assert!(text.contains("7 passed, 0 failed"), "{text}");

    let out = pluglet(&[
        "handler",
        "test",
        &guest("spread-policy"),
        "--vectors",
        &spread_vectors(),
        "-o",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["passed"], 7);
    assert_eq!(v["failed"], 0);
    let case = &v["cases"][5];
    assert_eq!(case["passed"], true);
    assert_eq!(case["hook"], "allocate");
    assert_eq!(
        case["expected"],
        serde_json::json!({"result": "refused", "kind": "unsatisfiable"})
    );
    assert_eq!(case["got"]["result"], "refused");
    assert!(case["got"]["message"].as_str().is_some(), "{case}");
    assert!(case["fuel_used"].as_u64().unwrap() > 0, "{case}");
    assert!(case["call_ms"].as_f64().unwrap() > 0.0, "{case}");
}

#[test]
fn vectors_that_fail_say_what_was_expected_and_what_came_and_exit_1() {
    // misbehave is first fit: the spread cases fail, the refusals pass.
    let out = pluglet(&[
        "handler",
        "test",
        &guest("misbehave"),
        "--vectors",
        &spread_vectors(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("FAIL a must-include device counts toward its node (allocate)"),
        "{text}"
    );
    assert!(
        text.contains("expected: allocated [dev-2, dev-1]"),
        "{text}"
    );
    assert!(
        text.contains("got:      allocated [dev-2, dev-0]"),
        "{text}"
    );
    assert!(text.contains("passed, "), "{text}");
    assert!(stderr(&out).contains("cases of"), "{}", stderr(&out));

    // Settings apply to every case; a trap is an `error` outcome with no fuel figure.
    let dir = tempfile::tempdir().unwrap();
    let vectors = dir.path().join("m.vectors.json");
    std::fs::write(
        &vectors,
        r#"[{"name": "accepts with the version", "hook": "validate",
             "event": {"name": "csi.example.com", "type": "CSIPlugin", "versions": ["1.0.0"]},
             "expect": {"result": "accepted", "version": "3.1"}},
            {"name": "registers", "hook": "register",
             "event": {"name": "csi.example.com", "type": "CSIPlugin"},
             "expect": {"result": "ok"}}]"#,
    )
    .unwrap();
    let vectors = vectors.display().to_string();
    let module = guest("misbehave");
    let run = |settings: &[&str]| {
        let mut args = vec![
            "handler",
            "test",
            &module,
            "--vectors",
            &vectors,
            "-o",
            "json",
        ];
        args.extend(settings);
        pluglet(&args)
    };
    let out = run(&["--setting", "version=3.1"]);
    assert!(out.status.success(), "{}", stdout(&out));
    assert_eq!(json(&out)["passed"], 2);

    let out = run(&["--setting", "version=2"]);
    assert_eq!(out.status.code(), Some(1));
    let v = json(&out);
    assert_eq!(v["failed"], 1);
    assert_eq!(v["cases"][0]["got"]["version"], "2");

    let out = run(&["--setting", "mode=panic"]);
    assert_eq!(out.status.code(), Some(1));
    let v = json(&out);
    assert_eq!(v["cases"][0]["got"]["result"], "error");
    assert!(
        v["cases"][0]["got"]["message"]
            .as_str()
            .unwrap()
            .contains("trapped"),
        "{v}"
    );
    assert!(v["cases"][0]["fuel_used"].is_null(), "{v}");
}

#[test]
fn a_bad_vectors_file_is_its_own_error_naming_the_case() {
    let dir = tempfile::tempdir().unwrap();
    let module = guest("misbehave");
    let write = |text: &str| {
        let path = dir.path().join("bad.vectors.json");
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let run = |path: &str| {
        let out = pluglet(&["handler", "test", &module, "--vectors", path]);
        assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
        assert!(out.stdout.is_empty(), "no report for a bad file");
        stderr(&out)
    };
    let path = write("[{");
    let err = run(&path);
    assert!(
        err.starts_with(&format!("error: vectors file {path} is not valid JSON")),
        "{err}"
    );
    let path =
        write(r#"[{"name": "c1", "hook": "reboot", "event": {}, "expect": {"result": "ok"}}]"#);
    let err = run(&path);
    assert!(
        err.contains("case \"c1\": unknown hook \"reboot\""),
        "{err}"
    );
    let path = write(
        r#"[{"name": "c2", "hook": "allocate", "event": {"name": "x", "type": "CSIPlugin"},
             "expect": {"result": "refused"}}]"#,
    );
    let err = run(&path);
    assert!(
        err.contains("case \"c2\": event is not what hook allocate takes"),
        "{err}"
    );
    assert!(err.contains("missing field `resource`"), "{err}");

    let out = pluglet(&["handler", "test", &module, "--hook", "validate"]);
    assert!(!out.status.success());
    let out = pluglet(&[
        "handler",
        "test",
        &module,
        "--vectors",
        &path,
        "--hook",
        "validate",
    ]);
    assert!(
        stderr(&out).contains("cannot be used with"),
        "{}",
        stderr(&out)
    );
}
