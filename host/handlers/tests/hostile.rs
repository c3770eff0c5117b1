//! Handlers that misbehave: the robustness suite, every case in one place.
//!
//! One live handler set serves a hostile module (`hostile.wasm`, the test guest `misbehave`) in a
//! plugin type's slot and in a resource's slot, each choosing its misbehaviour from the call
//! (the plugin's name; the request's first preferred id), and a good module (`good.wasm`, the
//! same guest answering well) in two other slots. Each case checks that the error names the
//! handler, the hook and the limit it hit, that a good call to the other handler still works,
//! and that a good call to the same slot afterwards works too.
//!
//! | case | here | also covered by |
//! |---|---|---|
//! | 1. infinite loop | [`case_1_an_infinite_loop_hits_the_deadline`] | handler-runtime `tests/runtime.rs` (`deadline_violated`, `fuel_violated`, the wall-time cap) |
//! | 2. memory bomb | [`case_2_a_memory_bomb_hits_the_memory_cap`] | `memory_violated` there |
//! | 3. deep recursion | [`case_3_a_deep_recursion_is_reported_as_a_stack_overflow`] | |
//! | 4. huge answer | [`case_4_huge_answers_are_refused_at_a_named_bound`] | the bounds' unit tests in handler-runtime `src/answer.rs` |
//! | 5. an id that is not available | [`case_5_an_id_that_is_not_available_is_refused`] | e2e `devices::a_bad_policy_answer_is_refused_naming_the_policy` (the daemon end to end) |
//! | 6. forbidden import | [`case_6_a_module_importing_something_forbidden_is_refused`] | `a_guest_using_std_fs_is_refused_naming_the_import`, `..._tcp_...` there |
//! | 7. not a component | [`case_7_a_core_module_is_refused_as_not_a_component`] | `a_core_module_is_not_a_component` there |
//! | concurrent hostile calls | [`hostile_calls_running_concurrently_leave_good_calls_served`] | the latency under attack: `benches/hostile.rs` |
//! | a slot at its limit | [`a_call_finding_its_slot_at_the_limit_is_refused_naming_the_limit`] | |
//!
//! A guest panic is covered by handler-runtime's `panic_text_surfaces` and e2e
//! `refusal::trapping_handler_refuses_its_plugin_and_the_next_plugin_still_registers`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pluglet_handler_runtime::{
    AllocationRequest, CallContext, CandidateDevice, CompileCache, HandlerError, PluginInfo,
    Runtime, RuntimeConfig,
};
use pluglet_handlers::{Builtins, Handlers, ReloadOutcome, SlotKey, Trust};

const HOSTILE_TYPE: &str = "HostilePlugin";
const GOOD_TYPE: &str = "GoodPlugin";
const HOSTILE_RESOURCE: &str = "vendor.com/hostile";
const GOOD_RESOURCE: &str = "vendor.com/good";
/// A slot whose calls sleep (no CPU), to hold its only call permit.
const SLOW_TYPE: &str = "SlowPlugin";

/// The deadline and memory cap of the hostile slots: room for a 100 MiB string, and a deadline
/// the memory bomb does not reach first, even on a loaded machine (filling 128 MiB once took
/// more than 200 ms of CPU there: the page faults count as the call's CPU time).
const DEADLINE_MS: u64 = 500;
const MEMORY_MIB: u32 = 128;

fn handlers_toml() -> String {
    let hostile = format!(
        "module = \"hostile.wasm\"\ndeadline_ms = {DEADLINE_MS}\nmemory_mib = {MEMORY_MIB}\n\
         fuel = 1000000000000\nmax_concurrent_calls = 1\nrollback_after = 0\n"
    );
    format!(
        "[plugin_types.{HOSTILE_TYPE}]\n{hostile}settings = {{ mode = \"by-name\" }}\n\n\
         [resources.\"{HOSTILE_RESOURCE}\"]\n{hostile}settings = {{ allocate = \"by-request\" }}\n\n\
         [plugin_types.{GOOD_TYPE}]\nmodule = \"good.wasm\"\n\n\
         [resources.\"{GOOD_RESOURCE}\"]\nmodule = \"good.wasm\"\n\n\
         [plugin_types.{SLOW_TYPE}]\nmodule = \"hostile.wasm\"\ndeadline_ms = 200\n\
         max_concurrent_calls = 1\nrollback_after = 0\n\
         settings = {{ mode = \"by-name\", ms = \"2500\" }}\n"
    )
}

/// The handlers directory and the live set.
struct Suite {
    dir: tempfile::TempDir,
    handlers: Handlers,
}

fn suite() -> Suite {
    let dir = tempfile::tempdir().unwrap();
    let misbehave = pluglet_wasm_guests::guest_path("misbehave");
    for name in ["hostile.wasm", "good.wasm"] {
        std::fs::copy(&misbehave, dir.path().join(name)).unwrap();
    }
    std::fs::write(dir.path().join("handlers.toml"), handlers_toml()).unwrap();
    // One compile cache for every test of the suite: each module is compiled once.
    static STATE: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    let state = STATE.get_or_init(|| tempfile::tempdir().unwrap());
    let cache = CompileCache::open(state.path()).expect("compile cache");
    let runtime = Runtime::with_cache(RuntimeConfig::default(), cache).expect("runtime");
    let builtins = Builtins::embedded(&runtime).expect("built-ins");
    let handlers = Handlers::load(runtime, dir.path(), None, builtins, Trust::default())
        .expect("the suite's handlers.toml loads");
    Suite { dir, handlers }
}

fn cx() -> CallContext {
    CallContext {
        node_name: "node-1".into(),
    }
}

fn plugin(plugin_type: &str, name: &str) -> PluginInfo {
    PluginInfo {
        plugin_type: plugin_type.into(),
        name: name.into(),
        endpoint: "/tmp/hostile.sock".into(),
        supported_versions: vec!["1.0.0".into()],
    }
}

/// Four devices; `mode` travels as the first preferred id (the hostile policy's switch).
fn request(resource: &str, mode: &str) -> AllocationRequest {
    AllocationRequest {
        resource: resource.into(),
        available: (0..4)
            .map(|i| CandidateDevice {
                id: format!("dev-{i}"),
                numa_nodes: vec![0],
            })
            .collect(),
        must_include: Vec::new(),
        count: 2,
        preferred: Some(vec![mode.into()]),
    }
}

impl Suite {
    /// `validate` on a plugin type's slot, the plugin's name choosing the hostile mode.
    fn validate(&self, plugin_type: &str, mode: &str) -> Result<(), HandlerError> {
        let served = self
            .handlers
            .for_plugin_type(plugin_type)
            .expect("the slot");
        let call = served.validate(&cx(), &plugin(plugin_type, mode), None)?;
        call.value.expect("accepted");
        Ok(())
    }

    /// `allocate` on a resource's slot.
    fn allocate(&self, resource: &str, mode: &str) -> Result<Vec<String>, HandlerError> {
        let served = self.handlers.for_resource(resource);
        let call = served.allocate(&cx(), &request(resource, mode))?;
        Ok(call.value.expect("not refused"))
    }

    /// A good call to the other handler works, and so does one to the hostile slots.
    fn still_serving(&self) {
        self.validate(GOOD_TYPE, "ok")
            .expect("the good handler still validates");
        assert_eq!(
            self.allocate(GOOD_RESOURCE, "ok")
                .expect("the good handler still allocates"),
            ["dev-0", "dev-1"]
        );
        self.validate(HOSTILE_TYPE, "ok")
            .expect("the same slot validates a good call afterwards");
        assert_eq!(
            self.allocate(HOSTILE_RESOURCE, "ok")
                .expect("the same slot allocates a good call afterwards"),
            ["dev-0", "dev-1"]
        );
    }
}

/// Asserts that `err` names the hostile handler, `hook` and every one of `limit`.
fn assert_names(err: &HandlerError, hook: &str, limit: &[&str]) {
    let text = err.to_string();
    assert!(text.contains("hostile.wasm"), "names the handler: {text}");
    assert!(
        text.contains(&format!("hook {hook}")),
        "names the hook: {text}"
    );
    for part in limit {
        assert!(text.contains(part), "names the limit ({part}): {text}");
    }
    assert!(text.len() < 1024, "a short message: {} bytes", text.len());
}

#[test]
fn case_1_an_infinite_loop_hits_the_deadline() {
    let s = suite();
    let err = s.validate(HOSTILE_TYPE, "loop").unwrap_err();
    assert_names(
        &err,
        "validate",
        &[
            &format!("deadline of {DEADLINE_MS} ms exceeded"),
            "deadline_ms",
        ],
    );
    let err = s.allocate(HOSTILE_RESOURCE, "loop").unwrap_err();
    assert_names(&err, "allocate", &["deadline of", "exceeded"]);
    s.still_serving();
}

#[test]
fn case_2_a_memory_bomb_hits_the_memory_cap() {
    let s = suite();
    let err = s.validate(HOSTILE_TYPE, "alloc").unwrap_err();
    assert_names(
        &err,
        "validate",
        &[
            &format!("memory cap {MEMORY_MIB} MiB exceeded"),
            "memory_mib",
        ],
    );
    s.still_serving();
}

#[test]
fn case_3_a_deep_recursion_is_reported_as_a_stack_overflow() {
    let s = suite();
    let err = s.validate(HOSTILE_TYPE, "recurse").unwrap_err();
    assert_names(&err, "validate", &["stack overflow", "recursion too deep"]);
    assert!(
        !err.to_string().contains("trapped"),
        "not a generic trap: {err}"
    );
    s.still_serving();
}

#[test]
fn case_4_huge_answers_are_refused_at_a_named_bound() {
    let s = suite();
    // Millions of ids: more than the host copies out of a guest at once.
    let err = s.allocate(HOSTILE_RESOURCE, "huge-ids").unwrap_err();
    assert_names(
        &err,
        "allocate",
        &["answer too large", "MAX_TRANSFER_BYTES", "4 MiB"],
    );
    // Fewer, small enough to copy, but more ids than a policy may answer.
    let err = s.allocate(HOSTILE_RESOURCE, "huge-ids:65537").unwrap_err();
    assert_names(&err, "allocate", &["65537 ids", "MAX_ANSWER_IDS"]);
    // A 100 MiB string, wherever the guest puts it.
    for (mode, hook) in [
        ("huge-message", "validate"),
        ("huge-version", "validate"),
        ("huge-log", "validate"),
    ] {
        let err = s.validate(HOSTILE_TYPE, mode).unwrap_err();
        assert_names(&err, hook, &["answer too large", "MAX_TRANSFER_BYTES"]);
    }
    // A 1 MiB string is copied, then refused as longer than a string may be.
    let err = s.validate(HOSTILE_TYPE, "huge-message:1").unwrap_err();
    assert_names(
        &err,
        "validate",
        &[
            "refusal's message is 1048576 bytes",
            "MAX_ANSWER_STRING_BYTES",
        ],
    );
    let err = s.validate(HOSTILE_TYPE, "huge-version:1").unwrap_err();
    assert_names(&err, "validate", &["accepted version", "64 KiB"]);
    // A 1 MiB log line is no error: it is cut (handler-runtime `a_log_flood_is_capped`).
    s.validate(HOSTILE_TYPE, "huge-log:1")
        .expect("a long log line is cut, not refused");
    s.still_serving();
}

#[test]
fn case_5_an_id_that_is_not_available_is_refused() {
    let s = suite();
    // The runtime hands the answer over as it is; the device manager checks it against what
    // is available before anything is reserved.
    let answer = s.allocate(HOSTILE_RESOURCE, "unknown-id").unwrap();
    assert_eq!(answer, ["dev-0", "no-such-device"]);
    let request = request(HOSTILE_RESOURCE, "unknown-id");
    let available: std::collections::HashSet<&str> = request.available.ids().collect();
    let problem = pluglet_device_manager::check_answer(
        &answer,
        request.count,
        |id| available.contains(id),
        &[],
    )
    .expect_err("an id that is not available is refused");
    let served = s.handlers.for_resource(HOSTILE_RESOURCE);
    let err = pluglet_device_manager::error::AllocateError::BadPolicyAnswer {
        resource: HOSTILE_RESOURCE.into(),
        module: served.module().to_owned(),
        answer,
        count: request.count,
        problem,
    }
    .to_string();
    assert!(
        err.contains("allocation policy") && err.contains("hostile.wasm"),
        "{err}"
    );
    assert!(
        err.contains("no-such-device is not an available device"),
        "{err}"
    );
    s.still_serving();
}

/// Points the hostile plugin type's slot at `module` and checks the change is refused with
/// every part of `reason`, the slot still serving its module.
fn refused_change(s: &Suite, module: &str, reason: &[&str]) {
    let toml = handlers_toml().replacen(
        "module = \"hostile.wasm\"",
        &format!("module = \"{module}\""),
        1,
    );
    std::fs::write(s.dir.path().join("handlers.toml"), toml).unwrap();
    let outcome = s.handlers.reload();
    let ReloadOutcome::Refused(refusals) = outcome else {
        panic!("the change is refused: {outcome:?}");
    };
    let text = format!("{refusals:?}");
    assert!(text.contains(module), "names the module: {text}");
    for part in reason {
        assert!(text.contains(part), "names {part}: {text}");
    }
    let slot = SlotKey::PluginType(HOSTILE_TYPE.into());
    let current = s.handlers.current();
    let served = &current.slot(&slot).expect("the slot").current;
    assert!(
        served.module().ends_with("hostile.wasm"),
        "{}",
        served.module()
    );
    s.still_serving();
}

#[test]
fn case_6_a_module_importing_something_forbidden_is_refused() {
    let s = suite();
    std::fs::copy(
        pluglet_wasm_guests::guest_path("uses-fs"),
        s.dir.path().join("uses-fs.wasm"),
    )
    .unwrap();
    refused_change(
        &s,
        "uses-fs.wasm",
        &["wasi:filesystem", "which handlers may not use"],
    );
}

#[test]
fn case_7_a_core_module_is_refused_as_not_a_component() {
    let s = suite();
    std::fs::write(s.dir.path().join("core.wasm"), b"\0asm\x01\0\0\0").unwrap();
    refused_change(
        &s,
        "core.wasm",
        &["is not a WebAssembly component", "core WebAssembly module"],
    );
}

/// Polls `done` every 10 ms until it holds, for at most 30 s.
fn wait_for(what: &str, done: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn hostile_calls_running_concurrently_leave_good_calls_served() {
    let s = Arc::new(suite());
    let stop = Arc::new(AtomicBool::new(false));
    // Loops and memory bombs on both hostile slots, two threads each, until the good calls
    // are done.
    let attackers: Vec<_> = [
        (true, "loop"),
        (true, "alloc"),
        (false, "loop"),
        (false, "alloc"),
    ]
    .into_iter()
    .map(|(registration, mode)| {
        let (s, stop) = (s.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut errors = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let err = if registration {
                    s.validate(HOSTILE_TYPE, mode).unwrap_err()
                } else {
                    s.allocate(HOSTILE_RESOURCE, mode).unwrap_err()
                };
                errors.push(err.to_string());
            }
            errors
        })
    })
    .collect();
    let hostile = s.handlers.for_plugin_type(HOSTILE_TYPE).unwrap();
    wait_for("a hostile call to run", || {
        hostile.running_calls() == Some(1)
    });

    for _ in 0..50 {
        s.validate(GOOD_TYPE, "ok")
            .expect("a good call during the attack");
        s.allocate(GOOD_RESOURCE, "ok")
            .expect("a good call during the attack");
    }
    stop.store(true, Ordering::Relaxed);

    for attacker in attackers {
        for err in attacker.join().unwrap() {
            assert!(err.contains("hostile.wasm"), "{err}");
            assert!(
                err.contains("deadline of")
                    || err.contains("memory cap")
                    || err.contains("max_concurrent_calls = 1"),
                "each hostile call hits its deadline, its memory cap or its slot's limit: {err}"
            );
        }
    }
    s.still_serving();
}

#[test]
fn a_call_finding_its_slot_at_the_limit_is_refused_naming_the_limit() {
    let s = Arc::new(suite());
    // One call holds the slot's only permit, sleeping 2.5 s (its deadline counts CPU time,
    // and its wall-time cap is 4 s); the next call waits its deadline, at least 1 s.
    let holder = {
        let s = s.clone();
        std::thread::spawn(move || s.validate(SLOW_TYPE, "sleep"))
    };
    let slow = s.handlers.for_plugin_type(SLOW_TYPE).unwrap();
    assert_eq!(slow.max_concurrent_calls(), Some(1));
    wait_for("the sleeping call to hold the slot", || {
        slow.running_calls() == Some(1)
    });

    // The next call waits for its deadline, at least 1 s, then gives up.
    let err = s.validate(SLOW_TYPE, "ok").unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("hook validate") && text.contains("hostile.wasm"),
        "{text}"
    );
    assert!(
        text.contains("busy") && text.contains("max_concurrent_calls = 1"),
        "{text}"
    );
    // Other slots are not held up.
    s.validate(HOSTILE_TYPE, "ok").unwrap();
    s.validate(GOOD_TYPE, "ok").unwrap();

    holder.join().unwrap().expect("the sleeping call ends well");
    s.validate(SLOW_TYPE, "ok")
        .expect("the slot serves once its call ended");
}

#[test]
fn the_default_limit_leaves_a_core_free() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let limit = pluglet_handlers::default_max_concurrent_calls() as usize;
    assert!(
        limit >= 1 && (cores == 1 || limit < cores),
        "{limit} of {cores} cores"
    );
}
