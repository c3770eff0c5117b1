//! The live handler set with real modules: loading, transactions, refusals, probation,
//! rollback (automatic, by hand, across a restart) and swaps under concurrent calls.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use pluglet_core::events::{EventKind, EventLog};
use pluglet_handler_runtime::{
    AllocationRequest, CallContext, CandidateDevice, Limits, PluginInfo, Runtime, RuntimeConfig,
};
use pluglet_handlers::{
    Builtins, ChangeState, Handlers, HandlersEvent, Origin, ReloadOutcome, SlotEntry, SlotKey,
    StartError, Trust,
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

fn load(dir: &Path, state: Option<&Path>) -> Result<Handlers, StartError> {
    let runtime = runtime();
    let builtins = Builtins::embedded(&runtime).expect("built-ins");
    Handlers::load(runtime, dir, state, builtins, Trust::default())
}

fn cx() -> CallContext {
    CallContext {
        node_name: "node-1".into(),
    }
}

/// Eight devices, 0–3 on NUMA node 0 and 4–7 on node 1.
fn request(count: u32) -> AllocationRequest {
    AllocationRequest {
        resource: GPU.into(),
        available: (0..8)
            .map(|i| CandidateDevice {
                id: format!("dev-{i}"),
                numa_nodes: vec![i64::from(i / 4)],
            })
            .collect(),
        must_include: Vec::new(),
        count,
        preferred: None,
    }
}

fn allocate(handlers: &Handlers) -> Result<Vec<String>, String> {
    let policy = handlers.for_resource(GPU);
    match policy.allocate(&cx(), &request(2)) {
        Ok(call) => call.value.map_err(|r| r.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

fn guest(name: &str) -> std::path::PathBuf {
    pluglet_wasm_guests::guest_path(name)
}

fn write_toml(dir: &Path, body: &str) {
    let tmp = dir.join(".handlers.toml.tmp");
    std::fs::write(&tmp, body).unwrap();
    std::fs::rename(tmp, dir.join("handlers.toml")).unwrap();
}

/// Puts `guest` at `dir/name` by rename, as a vendor's installer does.
fn install(dir: &Path, guest_name: &str, name: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::copy(guest(guest_name), &tmp).unwrap();
    std::fs::rename(tmp, dir.join(name)).unwrap();
}

fn policy_entry(settings: &str, extra: &str) -> String {
    format!(
        "[resources.\"{GPU}\"]\nmodule = \"policy.wasm\"\nsettings = {{ {settings} }}\n{extra}\n"
    )
}

/// A handlers directory whose resource entry names the first-fit test policy (no settings),
/// and the set loaded from it.
fn first_fit_policy() -> (tempfile::TempDir, Handlers) {
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "misbehave", "policy.wasm");
    write_toml(dir.path(), &policy_entry("", ""));
    let handlers = load(dir.path(), None).unwrap();
    (dir, handlers)
}

fn slot_state(handlers: &Handlers) -> pluglet_handlers::SlotStatus {
    handlers
        .status()
        .slots
        .into_iter()
        .find(|s| s.slot == SlotKey::Resource(GPU.into()))
        .expect("the resource slot")
}

#[test]
fn without_a_file_the_builtins_serve() {
    let dir = tempfile::tempdir().unwrap();
    let handlers = load(dir.path(), None).unwrap();
    let csi = handlers.for_plugin_type("CSIPlugin").unwrap();
    assert_eq!(csi.module(), "builtin:csi");
    assert_eq!(*csi.origin(), Origin::Builtin);
    assert_eq!(
        handlers.for_plugin_type("DevicePlugin").unwrap().module(),
        "builtin:device-plugin"
    );
    assert!(handlers.for_plugin_type("DRAPlugin").is_none());
    assert_eq!(handlers.for_resource(GPU).module(), "builtin:device-plugin");
    // CSIPlugin, DevicePlugin and the default policy.
    assert_eq!(handlers.status().slots.len(), 3);
}

#[test]
fn entries_replace_builtins_with_their_settings_and_limits() {
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "misbehave", "strict.wasm");
    write_toml(
        dir.path(),
        "[plugin_types.CSIPlugin]\nmodule = \"strict.wasm\"\ndeadline_ms = 40\nmemory_mib = 8\n\
         fuel = 1000000\nsettings = { mode = \"ok\", version = \"7.0\", retries = 3 }\n",
    );
    let handlers = load(dir.path(), None).unwrap();
    let h = handlers.for_plugin_type("CSIPlugin").unwrap();
    assert_eq!(
        h.module(),
        dir.path().join("strict.wasm").display().to_string()
    );
    assert_eq!(
        *h.handler().limits(),
        Limits {
            deadline: Duration::from_millis(40),
            memory_mib: 8,
            fuel: Some(1_000_000),
            reuse_instances: false,
        }
    );
    let plugin = PluginInfo {
        plugin_type: "CSIPlugin".into(),
        name: "x.example.com".into(),
        endpoint: "/p/csi.sock".into(),
        supported_versions: vec![],
    };
    let call = h.validate(&cx(), &plugin, None).unwrap();
    assert_eq!(call.value.unwrap().version.as_deref(), Some("7.0"));
    assert_eq!(h.stats().snapshot().calls, 1);
    assert!(h.on_probation());
}

#[test]
fn an_entry_with_reuse_instances_runs_its_calls_in_one_instance_and_others_each_in_a_fresh_one() {
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "misbehave", "counting.wasm");
    write_toml(
        dir.path(),
        "[plugin_types.CSIPlugin]\nmodule = \"counting.wasm\"\nreuse_instances = true\n\
         settings = { mode = \"count\" }\n\
         [resources.\"vendor.com/gpu\"]\nmodule = \"counting.wasm\"\n\
         settings = { allocate = \"count\" }\n",
    );
    let handlers = load(dir.path(), None).unwrap();
    let plugin = PluginInfo {
        plugin_type: "CSIPlugin".into(),
        name: "x.example.com".into(),
        endpoint: "/p/csi.sock".into(),
        supported_versions: vec![],
    };
    let csi = handlers.for_plugin_type("CSIPlugin").unwrap();
    assert!(csi.handler().limits().reuse_instances);
    let gpu = handlers.for_resource(GPU);
    assert!(!gpu.handler().limits().reuse_instances, "fresh by default");
    for n in 1..=3 {
        let call = csi.validate(&cx(), &plugin, None).unwrap();
        assert_eq!(call.logs[0].message, format!("call {n} of this instance"));
        let call = gpu.allocate(&cx(), &request(1)).unwrap();
        assert_eq!(call.logs[0].message, "call 1 of this instance");
    }
    // The built-ins always reuse.
    let builtin = handlers.for_plugin_type("DevicePlugin").unwrap();
    assert!(builtin.handler().limits().reuse_instances);
}

#[test]
fn at_start_a_bad_entry_fails_naming_the_file_the_entry_and_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    write_toml(dir.path(), "[plugin_types.CSIPlugin]\nmodul = 1\n");
    let err = load(dir.path(), None).unwrap_err().to_string();
    assert!(err.contains("is not a valid handlers file"), "{err}");

    write_toml(
        dir.path(),
        "[plugin_types.CSIPlugin]\nmodule = \"gone.wasm\"\n",
    );
    let err = load(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("handlers.toml: entry plugin_types.CSIPlugin"),
        "{err}"
    );
    assert!(
        err.contains("gone.wasm") && err.contains("missing"),
        "{err}"
    );

    install(dir.path(), "csi", "csi.wasm");
    write_toml(
        dir.path(),
        &format!("[resources.\"{GPU}\"]\nmodule = \"csi.wasm\"\n"),
    );
    let err = load(dir.path(), None).unwrap_err().to_string();
    assert!(err.contains("allocation-policy family"), "{err}");
}

#[test]
fn a_refused_change_keeps_the_set_in_force_and_says_why() {
    let (dir, handlers) = first_fit_policy();
    let before = handlers.for_resource(GPU);

    // Not a component, a TOML error, an unknown key, a missing module: nothing changes.
    std::fs::write(dir.path().join("policy.wasm"), b"\0asm garbage").unwrap();
    let ReloadOutcome::Refused(reason) = handlers.reload() else {
        panic!("a broken module must be refused")
    };
    assert!(reason.contains("policy.wasm"), "{reason}");
    let state = slot_state(&handlers);
    assert!(Arc::ptr_eq(&state.current, &before));
    let change = state.last_change.unwrap();
    assert_eq!(change.state, ChangeState::Refused);
    assert!(change.sha256.is_some());
    assert_eq!(allocate(&handlers).unwrap().len(), 2);

    install(dir.path(), "misbehave", "policy.wasm");
    write_toml(dir.path(), "[resources.\"x\"\n");
    assert!(matches!(handlers.reload(), ReloadOutcome::Refused(_)));
    let file = handlers.status().last_change.unwrap();
    assert_eq!(file.state, ChangeState::Refused);
    assert!(
        file.reason.contains("not a valid handlers file"),
        "{}",
        file.reason
    );
    assert!(Arc::ptr_eq(&handlers.for_resource(GPU), &before));

    write_toml(dir.path(), &policy_entry("", "colour = 1"));
    assert!(matches!(handlers.reload(), ReloadOutcome::Refused(r) if r.contains("colour")));

    write_toml(dir.path(), &policy_entry("", ""));
    std::fs::remove_file(dir.path().join("policy.wasm")).unwrap();
    let ReloadOutcome::Refused(reason) = handlers.reload() else {
        panic!("a missing module must be refused")
    };
    assert!(reason.contains("missing"), "{reason}");
    assert!(
        handlers.status().last_change.is_none(),
        "the file parses again"
    );
    assert!(Arc::ptr_eq(&handlers.for_resource(GPU), &before));

    // Putting the module back is a successful change (the same version: nothing to swap),
    // and it ends the refusals.
    install(dir.path(), "misbehave", "policy.wasm");
    assert_eq!(handlers.reload(), ReloadOutcome::Unchanged);
    assert!(slot_state(&handlers).last_change.is_none());
}

#[test]
fn a_new_version_keeps_the_old_one_warm_and_removing_the_entry_returns_the_builtin() {
    let (dir, handlers) = first_fit_policy();
    let mut events = handlers.subscribe();
    let first = handlers.for_resource(GPU);
    assert_eq!(allocate(&handlers).unwrap(), ["dev-0", "dev-1"]);

    install(dir.path(), "spread-policy", "policy.wasm");
    assert_eq!(
        handlers.reload(),
        ReloadOutcome::Applied(vec![SlotKey::Resource(GPU.into())])
    );
    assert!(matches!(
        events.try_recv(),
        Ok(HandlersEvent::Applied { .. })
    ));
    let state = slot_state(&handlers);
    assert_ne!(state.current.sha256(), first.sha256());
    assert!(Arc::ptr_eq(state.previous.as_ref().unwrap(), &first));
    let spread = allocate(&handlers).unwrap();
    assert_ne!(spread, ["dev-0", "dev-1"], "spread takes one per NUMA node");
    // An allocation already decided is not the set's business: the old handle still answers.
    assert_eq!(
        first.allocate(&cx(), &request(2)).unwrap().value.unwrap(),
        ["dev-0", "dev-1"]
    );

    // Caught empty right after it had text, the file is taken as half-written; once its
    // writer is done, empty is no entries.
    write_toml(dir.path(), "");
    let spread = slot_state(&handlers).current.sha256().to_owned();
    assert!(matches!(handlers.reload(), ReloadOutcome::Waiting(_)));
    assert_eq!(slot_state(&handlers).current.sha256(), spread);
    handlers.reload_written();
    let state = slot_state(&handlers);
    assert_eq!(state.current.module(), "builtin:device-plugin");
    assert_eq!(state.last_change.unwrap().state, ChangeState::Applied);
}

#[test]
fn a_failing_new_module_is_rolled_back_and_not_applied_again_and_the_decision_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = tempfile::tempdir().unwrap();
    install(dir.path(), "misbehave", "policy.wasm");
    write_toml(dir.path(), &policy_entry("", ""));
    let handlers = load(dir.path(), Some(state_dir.path())).unwrap();
    let good = handlers.for_resource(GPU);

    install(dir.path(), "misbehave", "bad.wasm");
    write_toml(
        dir.path(),
        &policy_entry("allocate = \"panic\"", "rollback_after = 2")
            .replace("policy.wasm", "bad.wasm"),
    );
    assert!(matches!(handlers.reload(), ReloadOutcome::Applied(_)));
    assert!(allocate(&handlers).unwrap_err().contains("trapped"));
    assert!(allocate(&handlers).unwrap_err().contains("trapped"));
    // The second failure rolled back at once: the next call runs on the previous version.
    assert_eq!(allocate(&handlers).unwrap(), ["dev-0", "dev-1"]);
    let state = slot_state(&handlers);
    assert_eq!(state.current.sha256(), good.sha256());
    let change = state.last_change.unwrap();
    assert_eq!(change.state, ChangeState::RolledBack);
    assert!(
        change.reason.contains("2 failed calls"),
        "{}",
        change.reason
    );

    // Another change in the directory does not bring the bad module back.
    std::fs::write(dir.path().join("notes.txt"), "unrelated").unwrap();
    assert_eq!(handlers.reload(), ReloadOutcome::Unchanged);
    assert_eq!(handlers.for_resource(GPU).sha256(), good.sha256());
    drop(handlers);

    // Restarted with handlers.toml still naming it: the previous version serves, and says why.
    std::fs::remove_file(dir.path().join("policy.wasm")).unwrap();
    let handlers = load(dir.path(), Some(state_dir.path())).unwrap();
    assert_eq!(handlers.for_resource(GPU).sha256(), good.sha256());
    let change = slot_state(&handlers).last_change.unwrap();
    assert_eq!(change.state, ChangeState::RolledBack);
    assert!(
        change.reason.contains("rolled back at"),
        "{}",
        change.reason
    );
    assert_eq!(allocate(&handlers).unwrap(), ["dev-0", "dev-1"]);

    // A changed entry is a new version: applied again.
    write_toml(
        dir.path(),
        &policy_entry("allocate = \"ok\"", "").replace("policy.wasm", "bad.wasm"),
    );
    assert!(matches!(handlers.reload(), ReloadOutcome::Applied(_)));
    let state = slot_state(&handlers);
    assert_eq!(state.current.entry().unwrap().settings["allocate"], "ok");
    // The bytes were compiled already: only the settings were bound anew.
    assert_eq!(state.current.handler().compile_time(), Duration::ZERO);
}

#[test]
fn a_refused_entry_at_start_keeps_the_version_a_rollback_restored() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = tempfile::tempdir().unwrap();
    install(dir.path(), "misbehave", "policy.wasm");
    write_toml(dir.path(), &policy_entry("", ""));
    let handlers = load(dir.path(), Some(state_dir.path())).unwrap();
    let good = handlers.for_resource(GPU).sha256().to_owned();
    install(dir.path(), "misbehave", "bad.wasm");
    write_toml(
        dir.path(),
        &policy_entry("allocate = \"panic\"", "rollback_after = 1")
            .replace("policy.wasm", "bad.wasm"),
    );
    assert!(matches!(handlers.reload(), ReloadOutcome::Applied(_)));
    assert!(allocate(&handlers).is_err());
    assert_eq!(handlers.for_resource(GPU).sha256(), good);
    drop(handlers);

    // While the daemon is down the entry is edited to a pin no module has: refused at start,
    // as it would be live, and the version the rollback restored keeps serving.
    write_toml(
        dir.path(),
        &policy_entry("", &format!("sha256 = \"{}\"", "0".repeat(64))),
    );
    let handlers = load(dir.path(), Some(state_dir.path())).unwrap();
    assert_eq!(handlers.for_resource(GPU).sha256(), good);
    let change = slot_state(&handlers).last_change.unwrap();
    assert_eq!(change.state, ChangeState::Refused);
    assert!(
        change.reason.contains("does not match the pin"),
        "{}",
        change.reason
    );
    assert_eq!(allocate(&handlers).unwrap(), ["dev-0", "dev-1"]);
}

#[test]
fn with_on_failure_builtin_a_failed_call_is_decided_by_the_builtin_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "misbehave", "policy.wasm");
    write_toml(
        dir.path(),
        &policy_entry(
            "allocate = \"panic\"",
            "on_failure = \"builtin\"\nrollback_after = 0",
        ),
    );
    let handlers = load(dir.path(), None).unwrap();
    for _ in 0..3 {
        assert_eq!(allocate(&handlers).unwrap().len(), 2);
    }
    let state = slot_state(&handlers);
    assert!(state.current.module().ends_with("policy.wasm"));
    let stats = state.current.stats().snapshot();
    assert_eq!(stats.failures.trap, 3);
    assert!(
        stats
            .last_failure
            .unwrap()
            .message
            .contains("asked to panic")
    );
}

#[test]
fn rollback_by_hand_puts_the_previous_version_back() {
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "misbehave", "policy.wasm");
    write_toml(dir.path(), &policy_entry("", ""));
    let log = EventLog::default();
    let handlers = load(dir.path(), None).unwrap().with_events(log.clone());
    let first = handlers.for_resource(GPU).sha256().to_owned();
    install(dir.path(), "spread-policy", "policy.wasm");
    handlers.reload();
    let slot = SlotKey::Resource(GPU.into());
    let restored = handlers.roll_back(&slot).unwrap();
    assert_eq!(restored.sha256(), first);
    assert_eq!(handlers.for_resource(GPU).sha256(), first);
    // Then only the built-in is left to go back to; after it, nothing.
    assert_eq!(
        handlers.roll_back(&slot).unwrap().module(),
        "builtin:device-plugin"
    );
    let err = handlers.roll_back(&slot).unwrap_err().to_string();
    assert!(err.contains("already served by its built-in"), "{err}");
    assert!(
        handlers
            .roll_back(&SlotKey::Resource("x.com/none".into()))
            .is_err()
    );

    // The swap and both rollbacks are in the event log; what was not done is not.
    let events: Vec<(EventKind, String)> = log
        .recent()
        .into_iter()
        .map(|e| (e.kind, e.subject))
        .collect();
    let subject = format!("resource/{GPU}");
    assert_eq!(
        events,
        [
            (EventKind::HandlerApplied, subject.clone()),
            (EventKind::HandlerRolledBack, subject.clone()),
            (EventKind::HandlerRolledBack, subject),
        ]
    );
    let messages: Vec<String> = log.recent().into_iter().map(|e| e.message).collect();
    assert!(
        messages[2].contains("rolled back to builtin:device-plugin (sha256 ")
            && messages[2].ends_with(": rolled back by hand (pluglet ctl handlers rollback)"),
        "{messages:?}"
    );
}

/// Swaps the resource's module 100 times (first fit and spread in turn) while `threads`
/// threads run `each` over and over; returns how many times it ran.
fn during_a_hundred_swaps(
    dir: &Path,
    handlers: &Handlers,
    threads: usize,
    each: impl Fn(&Handlers) + Clone + Send + 'static,
) -> u64 {
    let stop = Arc::new(AtomicBool::new(false));
    let runs = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let (handlers, stop, runs, each) =
                (handlers.clone(), stop.clone(), runs.clone(), each.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    each(&handlers);
                    runs.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for i in 0..100 {
        let guest_name = if i % 2 == 0 {
            "misbehave"
        } else {
            "spread-policy"
        };
        install(dir, guest_name, "policy.wasm");
        assert!(matches!(handlers.reload(), ReloadOutcome::Applied(_)));
    }
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.join().unwrap();
    }
    runs.load(Ordering::Relaxed)
}

#[test]
fn calls_during_a_hundred_swaps_never_fail_and_each_is_answered_by_one_whole_version() {
    let (dir, handlers) = first_fit_policy();
    let first_fit: Vec<String> = vec!["dev-0".into(), "dev-1".into()];
    install(dir.path(), "spread-policy", "policy.wasm");
    handlers.reload();
    let spread = allocate(&handlers).unwrap();

    let calls = during_a_hundred_swaps(dir.path(), &handlers, 2, move |handlers| {
        let answer = allocate(handlers).expect("no call fails during a swap");
        assert!(answer == first_fit || answer == spread, "{answer:?}");
    });
    assert!(calls > 0);
    assert!(handlers.status().generation >= 100);
}

#[test]
fn a_status_read_during_swaps_shows_each_set_with_its_own_change() {
    let (dir, handlers) = first_fit_policy();
    install(dir.path(), "spread-policy", "policy.wasm");
    assert!(matches!(handlers.reload(), ReloadOutcome::Applied(_)));

    let reads = during_a_hundred_swaps(dir.path(), &handlers, 2, |handlers| {
        let state = slot_state(handlers);
        let change = state.last_change.expect("a change is recorded");
        assert_eq!(change.state, ChangeState::Applied);
        assert_eq!(
            change.sha256.as_deref(),
            Some(state.current.sha256()),
            "the change shown is the one that put the module in force"
        );
    });
    assert!(reads > 0);
}

/// Waits for the next change to be applied (a refusal of a file caught half-written may come
/// first: the watch tries again when the file is finished).
async fn next_applied(events: &mut tokio::sync::broadcast::Receiver<HandlersEvent>) {
    let wait = async {
        loop {
            match events.recv().await.unwrap() {
                HandlersEvent::Applied { .. } => return,
                other => eprintln!("before the change applied: {other:?}"),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait)
        .await
        .expect("the change is applied within 30 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_applies_a_module_renamed_into_place() {
    let (dir, handlers) = first_fit_policy();
    let mut events = handlers.subscribe();
    let cancel = tokio_util::sync::CancellationToken::new();
    let watch = tokio::spawn(handlers.watch(cancel.clone()).unwrap());

    install(dir.path(), "spread-policy", "policy.wasm");
    next_applied(&mut events).await;
    assert_eq!(
        handlers.for_resource(GPU).sha256(),
        handlers.current().for_resource(GPU).sha256()
    );
    assert_ne!(allocate(&handlers).unwrap(), ["dev-0", "dev-1"]);

    // Written in place (truncate + write), as `cp` does.
    std::fs::copy(guest("misbehave"), dir.path().join("policy.wasm")).unwrap();
    next_applied(&mut events).await;
    assert_eq!(allocate(&handlers).unwrap(), ["dev-0", "dev-1"]);

    cancel.cancel();
    watch.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_editor_saving_handlers_toml_by_rename_never_leaves_the_slot_to_the_builtin() {
    let (dir, handlers) = first_fit_policy();
    let mut events = handlers.subscribe();
    let cancel = tokio_util::sync::CancellationToken::new();
    let watch = tokio::spawn(handlers.watch(cancel.clone()).unwrap());

    // As vim does: the old file renamed to a backup, then a new file written and closed. The
    // editor's pause between the two is part of the scenario.
    let path = dir.path().join("handlers.toml");
    std::fs::rename(&path, dir.path().join("handlers.toml~")).unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    std::fs::write(&path, policy_entry("allocate = \"ok\"", "")).unwrap();
    next_applied(&mut events).await;
    let served = handlers.for_resource(GPU);
    assert_eq!(
        served.entry().expect("still configured").settings["allocate"],
        "ok",
        "the first change applied is the saved file, not an empty one"
    );
    let previous = slot_state(&handlers).previous.unwrap();
    assert!(
        previous.entry().is_some(),
        "never went through the built-in"
    );

    cancel.cancel();
    watch.await.unwrap();
}

/// The entry a rollout named `rollout` puts on the resource's slot: `guest_name`, built.
fn rollout_entry(rollout: &str, guest_name: &str, settings: &[(&str, &str)]) -> SlotEntry {
    let mut entry = SlotEntry::new(guest(guest_name).to_str().unwrap()).unwrap();
    entry.rollout = Some(rollout.into());
    entry.rollback_after = 2;
    entry.settings = settings
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    entry
}

fn gpu_rollout(entry: SlotEntry) -> BTreeMap<SlotKey, SlotEntry> {
    BTreeMap::from([(SlotKey::Resource(GPU.into()), entry)])
}

#[test]
fn a_rollout_entry_wins_over_handlers_toml_survives_a_restart_and_its_removal_returns_the_file_entry()
 {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = tempfile::tempdir().unwrap();
    install(dir.path(), "misbehave", "policy.wasm");
    write_toml(dir.path(), &policy_entry("", ""));
    let handlers = load(dir.path(), Some(state_dir.path())).unwrap();
    assert_eq!(allocate(&handlers).unwrap(), ["dev-0", "dev-1"]);

    let outcome = handlers.set_rollout_entries(gpu_rollout(rollout_entry(
        "spread-v2",
        "spread-policy",
        &[],
    )));
    assert_eq!(
        outcome,
        ReloadOutcome::Applied(vec![SlotKey::Resource(GPU.into())])
    );
    let spread = allocate(&handlers).unwrap();
    assert_ne!(spread, ["dev-0", "dev-1"], "spread takes one per NUMA node");
    let state = slot_state(&handlers);
    assert_eq!(
        state.current.entry().unwrap().rollout.as_deref(),
        Some("spread-v2")
    );
    assert_eq!(
        state.previous.as_ref().unwrap().entry().unwrap().rollout,
        None,
        "the file's version is kept warm"
    );

    // A change of the file's entry for the slot does not displace the rollout's.
    write_toml(dir.path(), &policy_entry("allocate = \"ok\"", ""));
    assert_eq!(handlers.reload(), ReloadOutcome::Unchanged);
    assert_eq!(allocate(&handlers).unwrap(), spread);
    drop(handlers);

    // Restarted: the rollout's entry is still in force.
    let handlers = load(dir.path(), Some(state_dir.path())).unwrap();
    assert_eq!(
        handlers.rollout_entries().keys().collect::<Vec<_>>(),
        [&SlotKey::Resource(GPU.into())]
    );
    assert_eq!(allocate(&handlers).unwrap(), spread);
    assert_eq!(
        slot_state(&handlers)
            .current
            .entry()
            .unwrap()
            .rollout
            .as_deref(),
        Some("spread-v2")
    );

    // Without the rollout the slot returns to the file's entry, and stays there after a
    // restart.
    assert!(matches!(
        handlers.set_rollout_entries(BTreeMap::new()),
        ReloadOutcome::Applied(_)
    ));
    assert_eq!(allocate(&handlers).unwrap(), ["dev-0", "dev-1"]);
    assert_eq!(
        slot_state(&handlers).current.entry().unwrap().settings["allocate"],
        "ok"
    );
    drop(handlers);
    let handlers = load(dir.path(), Some(state_dir.path())).unwrap();
    assert!(handlers.rollout_entries().is_empty());
    assert_eq!(slot_state(&handlers).current.entry().unwrap().rollout, None);
}

#[test]
fn a_refused_rollout_entry_leaves_the_entries_before_it_and_never_blocks_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = tempfile::tempdir().unwrap();
    install(dir.path(), "misbehave", "policy.wasm");
    write_toml(dir.path(), &policy_entry("", ""));
    let handlers = load(dir.path(), Some(state_dir.path())).unwrap();

    let mut missing = rollout_entry("broken", "spread-policy", &[]);
    missing.module = dir.path().join("no-such-module.wasm");
    let outcome = handlers.set_rollout_entries(gpu_rollout(missing));
    assert!(
        matches!(&outcome, ReloadOutcome::Refused(why) if why.contains("no-such-module.wasm")),
        "{outcome:?}"
    );
    assert!(handlers.rollout_entries().is_empty());
    assert_eq!(slot_state(&handlers).current.entry().unwrap().rollout, None);

    // The file changes as if no rollout had been tried.
    write_toml(dir.path(), &policy_entry("allocate = \"ok\"", ""));
    assert!(matches!(handlers.reload(), ReloadOutcome::Applied(_)));
    drop(handlers);
    let handlers = load(dir.path(), Some(state_dir.path())).unwrap();
    assert!(handlers.rollout_entries().is_empty());
}

#[test]
fn a_failing_rollout_entry_is_rolled_back_and_stays_so_while_the_rollout_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = tempfile::tempdir().unwrap();
    install(dir.path(), "misbehave", "policy.wasm");
    write_toml(dir.path(), &policy_entry("", ""));
    let handlers = load(dir.path(), Some(state_dir.path())).unwrap();
    let good = handlers.for_resource(GPU);

    let bad = rollout_entry("trap", "misbehave", &[("allocate", "panic")]);
    assert!(matches!(
        handlers.set_rollout_entries(gpu_rollout(bad.clone())),
        ReloadOutcome::Applied(_)
    ));
    assert!(allocate(&handlers).unwrap_err().contains("trapped"));
    assert!(allocate(&handlers).unwrap_err().contains("trapped"));
    assert_eq!(allocate(&handlers).unwrap(), ["dev-0", "dev-1"]);
    assert_eq!(handlers.for_resource(GPU).sha256(), good.sha256());
    let decisions = handlers.rollbacks();
    assert_eq!(decisions.len(), 1);
    assert_eq!(decisions[0].rejected.entry.rollout.as_deref(), Some("trap"));

    // Named again (the watch saw the rollout again), it is not applied again.
    assert_eq!(
        handlers.set_rollout_entries(gpu_rollout(bad)),
        ReloadOutcome::Unchanged
    );
    assert_eq!(handlers.for_resource(GPU).sha256(), good.sha256());

    // The rollout gone, its decision is void and the file's entry serves.
    handlers.set_rollout_entries(BTreeMap::new());
    assert!(handlers.rollbacks().is_empty());
    assert_eq!(allocate(&handlers).unwrap(), ["dev-0", "dev-1"]);
}
