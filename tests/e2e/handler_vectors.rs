//! Conformance vectors in the daemon: a module with `NAME.vectors.json` beside it is applied only
//! when it passes every case. The example spread policy passes the vectors it ships (applied at
//! start); misbehave (first fit) renamed over it fails one of them and is refused, naming the
//! case and what was expected and what came, while the spread policy keeps serving; once the
//! vectors say what first fit answers, the same module is applied.

use crate::handler_swap::{
    FIRST_FIT, GPU, POLICY_TOML, SPREAD, allocate_ok, gpu_row, rename_guest, rename_into_place,
    sha256, start, wait_gpu_row, wait_gpu_sha,
};
use crate::support::TestRoot;

/// The vectors the example policy ships.
fn spread_vectors() -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/spread-policy/spread-policy.vectors.json");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Vectors first fit passes: two of four devices, and a refusal of too many.
const FIRST_FIT_VECTORS: &str = r#"[
  {"name": "first fit takes the first two", "hook": "allocate",
   "event": {"resource": "vendor.com/gpu", "count": 2, "available": [
     {"id": "dev-0", "numa": [0]}, {"id": "dev-1", "numa": [1]},
     {"id": "dev-2", "numa": [0]}, {"id": "dev-3", "numa": [1]}]},
   "expect": {"result": "allocated", "devices": ["dev-0", "dev-1"]}},
  {"name": "too many is refused", "hook": "allocate",
   "event": {"resource": "vendor.com/gpu", "count": 5, "available": [
     {"id": "dev-0", "numa": [0]}]},
   "expect": {"result": "refused"}}
]"#;

#[test]
fn a_module_failing_its_vectors_is_refused_and_one_passing_them_applied() {
    let root = TestRoot::new();
    std::fs::create_dir_all(root.handlers()).unwrap();
    std::fs::write(
        root.handlers().join("policy.vectors.json"),
        spread_vectors(),
    )
    .unwrap();
    let (daemon, _plugin) = start(&root, &[("spread-policy", "policy.wasm")], POLICY_TOML);
    let spread = sha256(&crate::handler_swap::guest("spread-policy"));
    let first_fit = sha256(&crate::handler_swap::guest("misbehave"));
    wait_gpu_sha(&daemon, &spread);
    assert_eq!(allocate_ok(&daemon, "pod-0"), SPREAD);

    // First fit fails the example's third case (the first two it answers alike).
    rename_guest(&root, "misbehave", "policy.wasm");
    let row = wait_gpu_row(&daemon, "refusing the module failing its vectors", |r| {
        r["last_change"]["state"] == "refused" && r["last_change"]["sha256"] == first_fit.as_str()
    });
    let reason = row["last_change"]["reason"].as_str().unwrap();
    assert!(reason.contains("policy.vectors.json"), "{reason}");
    assert!(
        reason.contains(
            "case \"a must-include device counts toward its node\" (allocate) expected \
             allocated [dev-2, dev-1], got allocated [dev-2, dev-0]"
        ),
        "{reason}"
    );
    assert_eq!(row["sha256"], spread.as_str(), "{row}");
    assert_eq!(allocate_ok(&daemon, "pod-1"), SPREAD);
    let log = daemon.log_text();
    assert!(
        log.contains("handler change refused") && log.contains("a must-include device"),
        "{log}"
    );

    // Vectors first fit passes: the module is tried again on that change, and applied.
    rename_into_place(&root, "policy.vectors.json", FIRST_FIT_VECTORS.as_bytes());
    let row = wait_gpu_sha(&daemon, &first_fit);
    assert_eq!(row["last_change"]["state"], "applied", "{row}");
    assert_eq!(row["previous"]["sha256"], spread.as_str(), "{row}");
    assert_eq!(allocate_ok(&daemon, "pod-2"), FIRST_FIT);
    assert_eq!(gpu_row(&daemon).unwrap()["resource"], GPU);
}
