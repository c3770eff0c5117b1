//! Conformance vectors with real modules: the example policy passes the vectors it ships, and
//! the live set refuses a module that fails a case beside it (at start and live), runs cases
//! with the entry's settings, and applies it once the cases pass.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use pluglet_handler_runtime::{CallContext, Limits, ModuleSource, Runtime, RuntimeConfig};
use pluglet_handlers::{
    Builtins, ChangeState, Handlers, Outcome, ReloadOutcome, SlotKey, StartError, Vectors, run_all,
};

const GPU: &str = "vendor.com/gpu";

fn runtime() -> Runtime {
    Runtime::new(RuntimeConfig {
        default_limits: Limits {
            deadline: Duration::from_secs(5),
            ..Limits::default()
        },
        ..RuntimeConfig::default()
    })
    .expect("runtime")
}

fn load(dir: &Path) -> Result<Handlers, StartError> {
    let runtime = runtime();
    let builtins = Builtins::embedded(&runtime).expect("built-ins");
    Handlers::load(
        runtime,
        dir,
        None,
        builtins,
        pluglet_handlers::Trust::default(),
    )
}

fn write_file(dir: &Path, name: &str, body: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, body).unwrap();
    std::fs::rename(tmp, dir.join(name)).unwrap();
}

fn install(dir: &Path, guest: &str, name: &str) {
    std::fs::copy(pluglet_wasm_guests::guest_path(guest), dir.join(name)).unwrap();
}

fn policy_toml(settings: &str) -> String {
    format!("[resources.\"{GPU}\"]\nmodule = \"policy.wasm\"\nsettings = {{ {settings} }}\n")
}

/// One allocate case: two of four devices (dev-0, dev-2 on node 0; dev-1, dev-3 on node 1).
fn allocate_case(name: &str, devices: &[&str]) -> String {
    format!(
        r#"{{"name": "{name}", "hook": "allocate",
            "event": {{"resource": "{GPU}", "count": 2, "available": [
                {{"id": "dev-0", "numa": [0]}}, {{"id": "dev-1", "numa": [1]}},
                {{"id": "dev-2", "numa": [0]}}, {{"id": "dev-3", "numa": [1]}}]}},
            "expect": {{"result": "allocated", "devices": {}}}}}"#,
        serde_json::to_string(devices).unwrap()
    )
}

#[test]
fn the_example_policy_passes_the_vectors_it_ships() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/spread-policy/spread-policy.vectors.json");
    let vectors = Vectors::read(&path).unwrap();
    assert!(vectors.cases.len() >= 5);
    let handler = runtime()
        .load(
            ModuleSource::File(pluglet_wasm_guests::guest_path("spread-policy")),
            Default::default(),
            None,
        )
        .unwrap();
    let cx = CallContext {
        node_name: "test-node".into(),
    };
    let results = run_all(&handler, &cx, &vectors);
    for r in &results {
        assert!(r.passed, "{r}");
        assert!(r.fuel_used.is_some_and(|f| f > 0), "{r}");
    }
    assert!(
        results
            .iter()
            .any(|r| matches!(r.got, Outcome::Refused { .. })),
        "the example has refusal cases"
    );
}

#[test]
fn a_module_failing_a_case_is_refused_at_start_naming_the_case() {
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "spread-policy", "policy.wasm");
    write_file(
        dir.path(),
        "policy.vectors.json",
        &format!(
            "[{}, {}]",
            allocate_case("spreads", &["dev-0", "dev-1"]),
            allocate_case("packs", &["dev-0", "dev-2"])
        ),
    );
    write_file(dir.path(), "handlers.toml", &policy_toml(""));
    let err = load(dir.path()).unwrap_err().to_string();
    assert!(err.contains("entry resources.\"vendor.com/gpu\""), "{err}");
    assert!(err.contains("policy.vectors.json"), "{err}");
    assert!(
        err.contains(
            "case \"packs\" (allocate) expected allocated [dev-0, dev-2], got allocated [dev-0, dev-1]"
        ),
        "{err}"
    );
    assert!(!err.contains("\"spreads\""), "{err}");
}

#[test]
fn live_a_failing_module_is_refused_and_a_passing_one_applied() {
    let dir = tempfile::tempdir().unwrap();
    // misbehave answers first fit, with its `allocate` setting choosing how to misbehave.
    install(dir.path(), "misbehave", "policy.wasm");
    write_file(
        dir.path(),
        "policy.vectors.json",
        &format!("[{}]", allocate_case("first fit", &["dev-0", "dev-1"])),
    );
    write_file(dir.path(), "handlers.toml", &policy_toml(""));
    let handlers = load(dir.path()).unwrap();
    let before = handlers.for_resource(GPU);
    assert!(before.module().ends_with("policy.wasm"));

    // The cases run with the entry's settings: one id short fails the case.
    write_file(
        dir.path(),
        "handlers.toml",
        &policy_toml("allocate = \"too-few\""),
    );
    let ReloadOutcome::Refused(reason) = handlers.reload() else {
        panic!("a module failing its vectors must be refused")
    };
    assert!(
        reason.contains(
            "case \"first fit\" (allocate) expected allocated [dev-0, dev-1], got allocated [dev-0]"
        ),
        "{reason}"
    );
    assert!(Arc::ptr_eq(&handlers.for_resource(GPU), &before));
    let slot = handlers
        .status()
        .slots
        .into_iter()
        .find(|s| s.slot == SlotKey::Resource(GPU.into()))
        .unwrap();
    let change = slot.last_change.unwrap();
    assert_eq!(change.state, ChangeState::Refused);
    assert!(change.reason.contains("first fit"), "{}", change.reason);

    // A trap is an `error` outcome.
    write_file(
        dir.path(),
        "handlers.toml",
        &policy_toml("allocate = \"panic\""),
    );
    let ReloadOutcome::Refused(reason) = handlers.reload() else {
        panic!("a module trapping in its vectors must be refused")
    };
    assert!(reason.contains("got error: trapped"), "{reason}");

    // A bad vectors file refuses the module, naming the file and the case.
    write_file(
        dir.path(),
        "policy.vectors.json",
        "[{\"name\": \"x\", \"hook\": \"allot\"}]",
    );
    let ReloadOutcome::Refused(reason) = handlers.reload() else {
        panic!("a bad vectors file must refuse the module")
    };
    assert!(
        reason.contains("policy.vectors.json: case \"x\": unknown hook \"allot\""),
        "{reason}"
    );

    // Cases the module passes: applied.
    write_file(
        dir.path(),
        "policy.vectors.json",
        &format!(
            "[{}, {}]",
            allocate_case("first fit", &["dev-0", "dev-1"]),
            r#"{"name": "accepts", "hook": "validate",
                "event": {"name": "x", "type": "CSIPlugin", "versions": ["1.0.0"]},
                "expect": {"result": "accepted"}}"#
        ),
    );
    write_file(dir.path(), "handlers.toml", &policy_toml("mode = \"ok\""));
    assert_eq!(
        handlers.reload(),
        ReloadOutcome::Applied(vec![SlotKey::Resource(GPU.into())])
    );
    assert!(!Arc::ptr_eq(&handlers.for_resource(GPU), &before));
}
