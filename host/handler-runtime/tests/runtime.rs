//! The handler runtime driving the real guests built from source by `pluglet-wasm-guests`:
//! the built-in handlers' accepted and refused cases, the allocation policy, bad guests (deadline,
//! fuel, memory, panic, forbidden imports) followed by a good call, the 1.0.0 contract guest,
//! the call gate and `handlers.toml`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pluglet_handler_runtime::{
    AllocationRequest, CallContext, CandidateDevice, Family, Handler, HandlerFault, Limits,
    LoadError, LogLevel, ModuleSource, PluginInfo, RefusalKind, RegisteredPlugin,
    RegistrationFacts, Runtime, RuntimeConfig,
};

/// Deadline for calls that must succeed: generous, because the test machine is shared.
const GENEROUS: Duration = Duration::from_secs(5);

fn runtime() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        Runtime::new(RuntimeConfig {
            default_limits: Limits {
                deadline: GENEROUS,
                ..Limits::default()
            },
            ..RuntimeConfig::default()
        })
        .expect("runtime")
    })
}

fn builtin(name: &str, bytes: &'static [u8]) -> ModuleSource {
    ModuleSource::Builtin {
        name: name.into(),
        bytes,
    }
}

fn csi() -> Arc<Handler> {
    static CSI: OnceLock<Arc<Handler>> = OnceLock::new();
    CSI.get_or_init(|| {
        runtime()
            .load(
                builtin("csi", pluglet_wasm_guests::CSI),
                BTreeMap::new(),
                None,
            )
            .expect("builtin csi loads")
    })
    .clone()
}

fn device_plugin() -> Arc<Handler> {
    static DP: OnceLock<Arc<Handler>> = OnceLock::new();
    DP.get_or_init(|| {
        runtime()
            .load(
                builtin("device-plugin", pluglet_wasm_guests::DEVICE_PLUGIN),
                BTreeMap::new(),
                None,
            )
            .expect("builtin device-plugin loads")
    })
    .clone()
}

fn guest(name: &str) -> ModuleSource {
    ModuleSource::File(pluglet_wasm_guests::guest_path(name))
}

fn misbehave(settings: &[(&str, &str)], limits: Limits) -> Arc<Handler> {
    let settings = settings
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    runtime()
        .load(guest("misbehave"), settings, Some(limits))
        .expect("misbehave loads")
}

fn cx() -> CallContext {
    CallContext {
        node_name: "node-7".into(),
    }
}

fn plugin(plugin_type: &str, name: &str, versions: &[&str]) -> PluginInfo {
    PluginInfo {
        plugin_type: plugin_type.into(),
        name: name.into(),
        endpoint: format!("/var/lib/kubelet/plugins/{name}/csi.sock"),
        supported_versions: versions.iter().map(|v| v.to_string()).collect(),
    }
}

/// A call on a good handler in the same runtime succeeds (run after every bad-guest case).
fn good_call_succeeds() {
    let call = csi()
        .validate(
            &cx(),
            &plugin("CSIPlugin", "csi.example.com", &["1.0.0"]),
            None,
        )
        .expect("good handler still works");
    assert_eq!(call.value.unwrap().version.as_deref(), Some("1.0.0"));
}

mod builtin_csi {
    use super::*;

    #[test]
    fn families_and_contract_are_read_from_the_component() {
        let h = csi();
        assert_eq!(h.module(), "builtin:csi");
        assert_eq!(h.contract_version(), "1.2.0");
        assert_eq!(h.families(), &[Family::Registration]);
        assert_eq!(h.sha256().len(), 64);
    }

    #[test]
    fn accepts_and_chooses_the_highest_1x_version() {
        let call = csi()
            .validate(
                &cx(),
                &plugin(
                    "CSIPlugin",
                    "csi.example.com",
                    &["0.3.0", "1.2.0", "1.10.0", "2.0.0"],
                ),
                None,
            )
            .unwrap();
        assert_eq!(call.value.unwrap().version.as_deref(), Some("1.10.0"));
        assert!(call.elapsed > Duration::ZERO);
    }

    #[test]
    fn refuses_an_empty_version_list() {
        let refusal = csi()
            .validate(&cx(), &plugin("CSIPlugin", "csi.example.com", &[]), None)
            .unwrap()
            .value
            .unwrap_err();
        assert_eq!(refusal.kind, RefusalKind::UnsupportedVersion);
        assert!(refusal.message.contains("empty list"), "{refusal}");
    }

    #[test]
    fn refuses_0x_only_drivers() {
        let refusal = csi()
            .validate(
                &cx(),
                &plugin("CSIPlugin", "csi.example.com", &["0.3.0"]),
                None,
            )
            .unwrap()
            .value
            .unwrap_err();
        assert_eq!(refusal.kind, RefusalKind::UnsupportedVersion);
        assert!(refusal.message.contains("must be v1.x"), "{refusal}");
    }

    #[test]
    fn refuses_a_name_that_is_not_a_dns_subdomain() {
        let refusal = csi()
            .validate(&cx(), &plugin("CSIPlugin", "My_Driver", &["1.0.0"]), None)
            .unwrap()
            .value
            .unwrap_err();
        assert_eq!(refusal.kind, RefusalKind::InvalidName);
        assert!(
            refusal.message.contains("API server would refuse"),
            "{refusal}"
        );
        assert_eq!(refusal.kind.to_string(), "invalid-name");
    }

    #[test]
    fn same_name_needs_a_strictly_higher_version() {
        let existing = RegisteredPlugin {
            info: plugin("CSIPlugin", "csi.example.com", &["1.2.0"]),
            version: Some("1.2.0".into()),
        };
        for (versions, accepted) in [(&["1.2.0"], false), (&["1.1.0"], false), (&["1.3.0"], true)] {
            let out = csi()
                .validate(
                    &cx(),
                    &plugin("CSIPlugin", "csi.example.com", versions),
                    Some(&existing),
                )
                .unwrap()
                .value;
            match out {
                Ok(a) => {
                    assert!(accepted, "{versions:?} should be refused");
                    assert_eq!(a.version.as_deref(), Some(versions[0]));
                }
                Err(refusal) => {
                    assert!(!accepted, "{versions:?} should be accepted");
                    assert_eq!(refusal.kind, RefusalKind::AlreadyRegistered);
                    assert!(refusal.message.contains("strictly higher"), "{refusal}");
                }
            }
        }
    }

    #[test]
    fn register_refuses_an_empty_node_id_and_accepts_a_real_one() {
        let p = plugin("CSIPlugin", "csi.example.com", &["1.0.0"]);
        let facts = RegistrationFacts {
            node_id: Some(String::new()),
            max_volumes_per_node: Some(0),
            topology: BTreeMap::new(),
        };
        let refusal = csi()
            .register(&cx(), &p, &facts)
            .unwrap()
            .value
            .unwrap_err();
        assert_eq!(refusal.kind, RefusalKind::InvalidFacts);
        assert!(refusal.message.contains("empty node id"), "{refusal}");

        let facts = RegistrationFacts {
            node_id: Some("node-7".into()),
            max_volumes_per_node: Some(-1),
            topology: BTreeMap::from([("topology.example.com/zone".into(), "a".into())]),
        };
        let call = csi().register(&cx(), &p, &facts).unwrap();
        assert_eq!(call.value, Ok(()));
        assert!(
            call.logs
                .iter()
                .any(|l| l.level == LogLevel::Warn && l.message.contains("negative")),
            "{:?}",
            call.logs
        );
    }

    #[test]
    fn deregister_runs() {
        let p = plugin("CSIPlugin", "csi.example.com", &["1.0.0"]);
        csi().deregister(&cx(), &p).unwrap();
    }

    #[test]
    fn allocate_on_a_registration_only_handler_names_the_missing_family() {
        let err = csi()
            .allocate(&cx(), &request(vec![], &[], 0, None))
            .unwrap_err();
        assert!(
            matches!(
                err.fault,
                HandlerFault::MissingFamily {
                    family: Family::AllocationPolicy
                }
            ),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "handler builtin:csi hook allocate: does not export the allocation-policy family"
        );
    }
}

fn dev(id: &str, numa: &[i64]) -> CandidateDevice {
    CandidateDevice {
        id: id.into(),
        numa_nodes: numa.to_vec(),
    }
}

fn request(
    available: Vec<CandidateDevice>,
    must: &[&str],
    count: u32,
    preferred: Option<&[&str]>,
) -> AllocationRequest {
    AllocationRequest {
        resource: "vendor.com/gpu".into(),
        available: available.into(),
        must_include: must.iter().map(|s| s.to_string()).collect(),
        count,
        preferred: preferred.map(|p| p.iter().map(|s| s.to_string()).collect()),
    }
}

mod builtin_device_plugin {
    use super::*;

    #[test]
    fn exports_both_families() {
        let h = device_plugin();
        assert_eq!(
            h.families(),
            &[Family::Registration, Family::AllocationPolicy]
        );
        assert_eq!(h.contract_version(), "1.2.0");
    }

    #[test]
    fn accepts_v1beta1_with_an_extended_resource_name() {
        let call = device_plugin()
            .validate(
                &cx(),
                &plugin("DevicePlugin", "vendor.com/gpu", &["v1beta1"]),
                None,
            )
            .unwrap();
        assert_eq!(call.value.unwrap().version.as_deref(), Some("v1beta1"));
    }

    #[test]
    fn refuses_other_versions() {
        let refusal = device_plugin()
            .validate(
                &cx(),
                &plugin("DevicePlugin", "vendor.com/gpu", &["v1alpha"]),
                None,
            )
            .unwrap()
            .value
            .unwrap_err();
        assert_eq!(refusal.kind, RefusalKind::UnsupportedVersion);
        assert!(
            refusal.message.contains("not supported by kubelet"),
            "{refusal}"
        );
    }

    #[test]
    fn refuses_names_that_are_not_extended_resources() {
        for name in ["gpu", "kubernetes.io/gpu", "Vendor.com/gpu"] {
            let refusal = device_plugin()
                .validate(&cx(), &plugin("DevicePlugin", name, &["v1beta1"]), None)
                .unwrap()
                .value
                .unwrap_err();
            assert_eq!(refusal.kind, RefusalKind::InvalidName, "{name}");
            assert!(refusal.message.contains("is invalid"), "{refusal}");
        }
    }

    #[test]
    fn same_name_replaces_the_registered_plugin() {
        let existing = RegisteredPlugin {
            info: plugin("DevicePlugin", "vendor.com/gpu", &["v1beta1"]),
            version: Some("v1beta1".into()),
        };
        let call = device_plugin()
            .validate(
                &cx(),
                &plugin("DevicePlugin", "vendor.com/gpu", &["v1beta1"]),
                Some(&existing),
            )
            .unwrap();
        assert!(call.value.is_ok());
        assert!(
            call.logs.iter().any(|l| l.message.contains("replaces")),
            "{:?}",
            call.logs
        );
    }

    #[test]
    fn allocation_packs_onto_the_fullest_numa_node() {
        let r = request(
            vec![
                dev("a0", &[0]),
                dev("b0", &[1]),
                dev("b1", &[1]),
                dev("x", &[]),
            ],
            &[],
            2,
            None,
        );
        let chosen = device_plugin().allocate(&cx(), &r).unwrap().value.unwrap();
        assert_eq!(chosen, vec!["b0", "b1"]);
    }

    #[test]
    fn allocation_puts_must_include_first_then_the_preference() {
        let r = request(
            vec![dev("a0", &[0]), dev("a1", &[0]), dev("b0", &[1])],
            &["a1"],
            2,
            Some(&["b0", "gone"]),
        );
        let chosen = device_plugin().allocate(&cx(), &r).unwrap().value.unwrap();
        assert_eq!(chosen, vec!["a1", "b0"]);
    }

    #[test]
    fn allocation_refuses_when_too_few_devices() {
        let r = request(vec![dev("a0", &[0])], &[], 3, None);
        let refusal = device_plugin()
            .allocate(&cx(), &r)
            .unwrap()
            .value
            .unwrap_err();
        assert_eq!(refusal.kind, RefusalKind::Unsatisfiable);
        assert!(
            refusal.message.contains("only 1 are available"),
            "{refusal}"
        );
    }

    /// The policy itself stays within the base fuel budget among 100,000 devices (the
    /// per-device allowance is spare), and answers distinct available ids.
    #[test]
    fn allocation_among_a_hundred_thousand_devices_fits_the_base_fuel() {
        let base = Limits::default().fuel.unwrap();
        let available: Vec<CandidateDevice> = (0..100_000)
            .map(|i| dev(&format!("dev-{i}"), &[i % 2]))
            .collect();
        for (count, must, preferred) in [
            (1, &[][..], None),
            (1_000, &[][..], None),
            (
                1_000,
                &["dev-99999"][..],
                Some(&["dev-5", "dev-7", "gone"][..]),
            ),
        ] {
            let r = request(available.clone(), must, count, preferred);
            let call = device_plugin().allocate(&cx(), &r).unwrap();
            let chosen = call.value.unwrap();
            println!(
                "{count} of 100000 (must {must:?}, preferred {preferred:?}): fuel {}, {:?}",
                call.fuel_used, call.elapsed
            );
            assert!(call.fuel_used < base, "{} fuel", call.fuel_used);
            assert_eq!(chosen.len(), count as usize);
            let distinct: std::collections::HashSet<&String> = chosen.iter().collect();
            assert_eq!(distinct.len(), chosen.len());
            assert!(chosen.iter().all(|id| id.starts_with("dev-")), "{chosen:?}");
            assert!(must.iter().all(|m| chosen.contains(&m.to_string())));
        }
    }
}

mod limits {
    use super::*;

    fn limits(deadline_ms: u64, memory_mib: u32, fuel: Option<u64>) -> Limits {
        Limits {
            deadline: Duration::from_millis(deadline_ms),
            memory_mib,
            fuel,
            reuse_instances: false,
        }
    }

    fn validate(h: &Handler) -> Result<(), pluglet_handler_runtime::HandlerError> {
        h.validate(
            &cx(),
            &plugin("CSIPlugin", "x.example.com", &["1.0.0"]),
            None,
        )
        .map(|call| assert!(call.value.is_ok()))
    }

    #[test]
    fn deadline_obeyed() {
        let h = misbehave(&[("mode", "spin"), ("ms", "5")], limits(2000, 16, None));
        validate(&h).expect("5 ms of work fits a 2 s deadline");
    }

    /// Whether `err` is the deadline fault for `deadline`.
    fn is_deadline(err: &pluglet_handler_runtime::HandlerError, deadline: Duration) -> bool {
        matches!(err.fault, HandlerFault::Deadline { deadline: d } if d == deadline)
    }

    #[test]
    fn deadline_violated() {
        // The loop never ends on its own: only the deadline's interrupt ends the call.
        let h = misbehave(&[("mode", "loop")], limits(50, 16, None));
        let err = validate(&h).unwrap_err();
        assert!(is_deadline(&err, Duration::from_millis(50)), "{err:?}");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!(
                "handler {} hook validate: deadline of 50 ms exceeded",
                h.module()
            )),
            "{text}"
        );
        good_call_succeeds();
        // The same handler works again: every call has a fresh instance.
        let h = misbehave(&[("mode", "ok")], limits(2000, 16, None));
        validate(&h).unwrap();
    }

    #[test]
    fn deadline_counts_cpu_time_not_wall_time() {
        // 200 ms asleep uses almost no CPU: a 50 ms CPU deadline is not exceeded.
        let h = misbehave(&[("mode", "sleep"), ("ms", "200")], limits(50, 16, None));
        validate(&h).expect("sleeping is not spending the CPU budget");
    }

    /// Runs a guest in `settings` with a 10 ms deadline on another thread and returns its
    /// error, failing if the call has not ended within `within`; a good call succeeds after it.
    fn ends_at_the_wall_time_cap(settings: &[(&str, &str)], within: Duration) {
        let h = misbehave(settings, limits(10, 16, None));
        let (done, ended) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = done.send(validate(&h));
        });
        let err = ended
            .recv_timeout(within)
            .unwrap_or_else(|_| panic!("the call did not end within {within:?}"))
            .unwrap_err();
        assert!(is_deadline(&err, Duration::from_millis(10)), "{err:?}");
        good_call_succeeds();
    }

    #[test]
    fn wall_time_is_capped_too() {
        // However little CPU it uses, a call ends after max(20 × deadline, 1 s) of wall time.
        // 30 s of 1 ms naps would finish and accept without the cap; ending with the deadline
        // fault is the proof, so the wait is only the harness's generous bound.
        ends_at_the_wall_time_cap(
            &[("mode", "naps"), ("ms", "30000")],
            Duration::from_secs(120),
        );
    }

    #[test]
    fn one_long_sleep_ends_at_the_wall_time_cap() {
        // A single hour-long sleep is waited for in host code, out of the epoch deadline's reach:
        // the timer itself must end when the call's wall time does. Without that the call would
        // still end with the deadline fault, an hour later, so here only the time tells: the
        // call must end long before the hour (the cap is 1 s).
        ends_at_the_wall_time_cap(
            &[("mode", "sleep"), ("ms", "3600000")],
            Duration::from_secs(60),
        );
    }

    #[test]
    fn fuel_obeyed() {
        let h = misbehave(
            &[("mode", "burn"), ("iterations", "1000")],
            limits(5000, 16, Some(10_000_000)),
        );
        validate(&h).expect("1000 iterations fit 10M fuel");
    }

    #[test]
    fn allocate_gets_fuel_per_device_offered() {
        let h = misbehave(&[("allocate", "loop")], limits(10_000, 16, Some(1_000_000)));
        let r = request(
            (0..10).map(|i| dev(&format!("d{i}"), &[])).collect(),
            &[],
            1,
            None,
        );
        let err = h.allocate(&cx(), &r).unwrap_err();
        let budget = 1_000_000 + 10 * pluglet_handler_runtime::FUEL_PER_DEVICE;
        assert!(
            matches!(err.fault, HandlerFault::Fuel { fuel } if fuel == budget),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains(&format!("fuel budget of {budget} exhausted")),
            "{err}"
        );
    }

    #[test]
    fn fuel_violated() {
        let h = misbehave(&[("mode", "loop")], limits(10_000, 16, Some(1_000_000)));
        let err = validate(&h).unwrap_err();
        assert!(
            matches!(err.fault, HandlerFault::Fuel { fuel: 1_000_000 }),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("fuel budget of 1000000 exhausted"),
            "{err}"
        );
        good_call_succeeds();
    }

    #[test]
    fn memory_obeyed() {
        let h = misbehave(
            &[("mode", "alloc-some"), ("mib", "4")],
            limits(5000, 16, None),
        );
        validate(&h).expect("4 MiB fit a 16 MiB cap");
    }

    #[test]
    fn memory_violated() {
        let h = misbehave(&[("mode", "alloc")], limits(5000, 16, None));
        let err = validate(&h).unwrap_err();
        assert!(
            matches!(err.fault, HandlerFault::MemoryCap { mib: 16 }),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("memory cap 16 MiB exceeded"),
            "{err}"
        );
        good_call_succeeds();
    }

    #[test]
    fn panic_text_surfaces() {
        let h = misbehave(&[("mode", "panic")], limits(5000, 16, None));
        let err = validate(&h).unwrap_err();
        let HandlerFault::Trapped { message } = &err.fault else {
            panic!("expected a trap, got {err}");
        };
        assert!(message.contains("misbehave: asked to panic"), "{message}");
        assert!(
            err.to_string().contains("hook validate: trapped: "),
            "{err}"
        );
        good_call_succeeds();
    }

    #[test]
    fn invalid_limits_are_refused_at_load() {
        let err = runtime()
            .load(
                guest("misbehave"),
                BTreeMap::new(),
                Some(limits(50, 100_000, None)),
            )
            .unwrap_err();
        assert!(matches!(err, LoadError::InvalidLimits { .. }), "{err}");
        assert!(
            err.to_string().contains("memory_mib must be between 1 and"),
            "{err}"
        );
    }
}

mod admission {
    use super::*;

    #[test]
    fn a_component_that_does_not_compile_keeps_wasmtime_error_as_its_source() {
        // A component header followed by bytes that are no section at all.
        const BROKEN: &[u8] = &[0, b'a', b's', b'm', 0x0d, 0, 1, 0, 0xff, 0xff, 0xff];
        let err = runtime()
            .load(builtin("broken", BROKEN), BTreeMap::new(), None)
            .unwrap_err();
        assert!(matches!(err, LoadError::Compile { .. }), "{err:?}");
        assert_eq!(err.to_string(), "handler builtin:broken does not compile");
        let source = std::error::Error::source(&err).expect("wasmtime's error is the source");
        assert!(!source.to_string().is_empty());
    }

    #[test]
    fn a_guest_using_std_fs_is_refused_naming_the_import() {
        let err = runtime()
            .load(guest("uses-fs"), BTreeMap::new(), None)
            .unwrap_err();
        let LoadError::ForbiddenImport { imports, .. } = &err else {
            panic!("expected a forbidden import, got {err}");
        };
        let fs = imports
            .iter()
            .find(|i| i.starts_with("wasi:filesystem/"))
            .unwrap_or_else(|| panic!("{imports:?}"));
        assert!(err.to_string().contains(&format!("`{fs}`")), "{err}");
        good_call_succeeds();
    }

    #[test]
    fn a_guest_using_tcp_is_refused_naming_the_import() {
        let err = runtime()
            .load(guest("uses-tcp"), BTreeMap::new(), None)
            .unwrap_err();
        let LoadError::ForbiddenImport { imports, .. } = &err else {
            panic!("expected a forbidden import, got {err}");
        };
        let tcp = imports
            .iter()
            .find(|i| i.starts_with("wasi:sockets/"))
            .unwrap_or_else(|| panic!("{imports:?}"));
        assert!(err.to_string().contains(&format!("`{tcp}`")), "{err}");
        good_call_succeeds();
    }

    #[test]
    fn a_core_module_is_not_a_component() {
        static CORE: &[u8] = b"\0asm\x01\0\0\0";
        let err = runtime()
            .load(builtin("core", CORE), BTreeMap::new(), None)
            .unwrap_err();
        assert!(matches!(err, LoadError::NotAComponent { .. }), "{err}");
        assert!(err.to_string().contains("core WebAssembly module"), "{err}");
    }

    #[test]
    fn text_is_not_webassembly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notes.wasm");
        std::fs::write(&path, "hello").unwrap();
        let err = runtime()
            .load(ModuleSource::File(path), BTreeMap::new(), None)
            .unwrap_err();
        assert!(err.to_string().contains("not WebAssembly at all"), "{err}");
    }

    #[test]
    fn a_missing_file_names_the_path() {
        let err = runtime()
            .load(
                ModuleSource::File(PathBuf::from("/nonexistent/handler.wasm")),
                BTreeMap::new(),
                None,
            )
            .unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/handler.wasm"),
            "{err}"
        );
    }

    #[test]
    fn an_empty_component_is_of_another_contract() {
        static EMPTY: &[u8] = b"\0asm\x0d\0\x01\0";
        let err = runtime()
            .load(builtin("empty", EMPTY), BTreeMap::new(), None)
            .unwrap_err();
        assert!(matches!(err, LoadError::OtherContract { .. }), "{err}");
        assert!(err.to_string().contains("exports nothing"), "{err}");
    }

    #[test]
    fn a_1_1_0_policy_without_allocate_packed_is_called_with_records() {
        let h = runtime()
            .load(guest("contract-v1-1"), BTreeMap::new(), None)
            .expect("the 1.1.0 guest loads");
        assert_eq!(h.contract_version(), "1.1.0");
        assert_eq!(h.families(), &[Family::AllocationPolicy]);
        let request = AllocationRequest {
            resource: "vendor.com/gpu".into(),
            available: vec![
                CandidateDevice {
                    id: "a".into(),
                    numa_nodes: vec![0],
                },
                CandidateDevice {
                    id: "b".into(),
                    numa_nodes: vec![],
                },
                CandidateDevice {
                    id: "c".into(),
                    numa_nodes: vec![0, 1],
                },
            ]
            .into(),
            must_include: vec![],
            count: 2,
            preferred: None,
        };
        let chosen = h.allocate(&cx(), &request).unwrap().value.unwrap();
        assert_eq!(chosen, ["c@[0, 1]", "b@[]"]);
    }

    #[test]
    fn the_packed_request_reaches_a_1_2_0_policy_intact() {
        // The built-in exports allocate-packed: ids of several lengths, NUMA lists of 0–2 nodes,
        // preference and must-include all survive the trip through the columns.
        let h = runtime()
            .load(
                builtin("device-plugin", pluglet_wasm_guests::DEVICE_PLUGIN),
                BTreeMap::new(),
                None,
            )
            .unwrap();
        let device = |id: &str, numa: &[i64]| CandidateDevice {
            id: id.into(),
            numa_nodes: numa.to_vec(),
        };
        let request = AllocationRequest {
            resource: "vendor.com/gpu".into(),
            available: vec![
                device("gpu-0", &[0]),
                device("g1", &[1]),
                device("long-device-name-2", &[1]),
                device("x", &[]),
                device("both", &[0, 1]),
            ]
            .into(),
            must_include: vec!["x".into()],
            count: 3,
            preferred: Some(vec!["long-device-name-2".into(), "missing".into()]),
        };
        let chosen = h.allocate(&cx(), &request).unwrap().value.unwrap();
        assert_eq!(chosen, ["x", "long-device-name-2", "g1"]);
    }

    #[test]
    fn a_1_0_0_component_loads_and_validates_in_the_1_1_0_host() {
        let h = runtime()
            .load(guest("contract-v1-0"), BTreeMap::new(), None)
            .expect("the 1.0.0 guest loads");
        assert_eq!(h.contract_version(), "1.0.0");
        assert_eq!(h.families(), &[Family::Registration]);
        let call = h
            .validate(
                &cx(),
                &plugin("CSIPlugin", "old.example.com", &["1.0.0"]),
                None,
            )
            .unwrap();
        assert_eq!(
            call.value.unwrap().version.as_deref(),
            Some("chosen-by-1.0.0")
        );
        assert_eq!(call.logs.len(), 1);
        assert!(
            call.logs[0]
                .message
                .contains("1.0.0 guest validating old.example.com")
        );
        let refusal = h
            .validate(&cx(), &plugin("CSIPlugin", "old.example.com", &[]), None)
            .unwrap()
            .value
            .unwrap_err();
        assert_eq!(refusal.kind, RefusalKind::UnsupportedVersion);
        let p = plugin("CSIPlugin", "old.example.com", &["1.0.0"]);
        h.register(&cx(), &p, &RegistrationFacts::default())
            .unwrap();
        h.deregister(&cx(), &p).unwrap();
    }
}

mod host_imports {
    use super::*;

    #[test]
    fn settings_and_node_name_reach_the_guest() {
        let h = misbehave(&[("mode", "ok"), ("version", "9.9")], Limits::default());
        assert_eq!(h.settings().get("version").map(String::as_str), Some("9.9"));
        let call = h
            .validate(&cx(), &plugin("CSIPlugin", "x.example.com", &[]), None)
            .unwrap();
        assert_eq!(call.value.unwrap().version.as_deref(), Some("9.9"));
        assert_eq!(call.logs.len(), 1);
        assert_eq!(call.logs[0].level, LogLevel::Info);
        assert_eq!(call.logs[0].message, "ok on node node-7");
    }

    #[test]
    fn a_log_flood_is_capped() {
        let h = misbehave(&[("mode", "log"), ("lines", "500")], Limits::default());
        let call = h
            .validate(&cx(), &plugin("CSIPlugin", "x.example.com", &[]), None)
            .unwrap();
        assert_eq!(call.logs.len(), 65);
        assert!(call.logs[64].message.contains("436 more log lines dropped"));
    }
}

mod gate {
    use super::*;

    #[test]
    fn a_burst_larger_than_the_pool_waits_rather_than_fails() {
        let rt = Runtime::new(RuntimeConfig {
            pool_size: 2,
            default_limits: Limits {
                deadline: GENEROUS,
                ..Limits::default()
            },
            ..RuntimeConfig::default()
        })
        .unwrap();
        let h = rt
            .load(
                builtin("csi", pluglet_wasm_guests::CSI),
                BTreeMap::new(),
                None,
            )
            .unwrap();
        let threads: Vec<_> = (0..12)
            .map(|_| {
                let h = h.clone();
                std::thread::spawn(move || {
                    for _ in 0..5 {
                        let call = h
                            .validate(
                                &cx(),
                                &plugin("CSIPlugin", "csi.example.com", &["1.0.0"]),
                                None,
                            )
                            .expect("no pool exhaustion");
                        assert!(call.value.is_ok());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn runaway_calls_past_the_long_call_cpu_take_turns_and_keep_their_budget() {
        let rt = Runtime::new(RuntimeConfig {
            long_calls: 1,
            ..RuntimeConfig::default()
        })
        .unwrap();
        let deadline = Duration::from_millis(100);
        let h = rt
            .load(
                guest("misbehave"),
                [("mode".to_owned(), "loop".to_owned())].into(),
                Some(Limits {
                    deadline,
                    fuel: None,
                    ..Limits::default()
                }),
            )
            .unwrap();
        let done = std::sync::atomic::AtomicBool::new(false);
        let peak = std::sync::atomic::AtomicU32::new(0);
        let results: Vec<_> = std::thread::scope(|s| {
            s.spawn(|| {
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    peak.fetch_max(rt.long_calls_running(), std::sync::atomic::Ordering::SeqCst);
                    std::thread::yield_now();
                }
            });
            let calls: Vec<_> = (0..3)
                .map(|_| {
                    s.spawn(|| {
                        h.validate(
                            &cx(),
                            &plugin("CSIPlugin", "csi.example.com", &["1.0.0"]),
                            None,
                        )
                    })
                })
                .collect();
            let results = calls.into_iter().map(|c| c.join().unwrap()).collect();
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            results
        });
        for result in results {
            let err = result.expect_err("a loop ends only by its deadline");
            // Waiting for its turn did not use up the call's CPU budget.
            assert!(
                matches!(err.fault, HandlerFault::Deadline { deadline: d } if d == deadline),
                "{err}"
            );
        }
        // Long calls went through the gate, and never more than one at a time.
        assert_eq!(peak.into_inner(), 1, "long calls running at once, at most");
        assert_eq!(rt.long_calls_running(), 0, "every permit given back");
    }
}

mod deferred_release {
    use super::*;

    /// A runtime of one pool slot (a call whose instance is still kept holds the only slot)
    /// with `source` loaded under `settings`.
    fn one_slot_with(source: ModuleSource, settings: &[(&str, &str)]) -> (Runtime, Arc<Handler>) {
        let rt = Runtime::new(RuntimeConfig {
            pool_size: 1,
            default_limits: Limits {
                deadline: GENEROUS,
                ..Limits::default()
            },
            ..RuntimeConfig::default()
        })
        .expect("runtime");
        let settings = settings
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let handler = rt.load(source, settings, None).expect("the module loads");
        (rt, handler)
    }

    /// [`one_slot_with`] the built-in device-plugin handler.
    fn one_slot() -> (Runtime, Arc<Handler>) {
        one_slot_with(
            builtin("device-plugin", pluglet_wasm_guests::DEVICE_PLUGIN),
            &[],
        )
    }

    #[test]
    fn calls_inside_defer_release_leave_their_instances_until_it_is_dropped() {
        let (_rt, handler) = one_slot();
        let req = request(vec![dev("a", &[0]), dev("b", &[0])], &[], 1, None);
        let plain = handler.allocate(&cx(), &req).unwrap().value;

        let (kept, deferred) =
            pluglet_handler_runtime::defer_release(|| handler.allocate(&cx(), &req));
        assert_eq!(kept.unwrap().value, plain, "the same answer");
        assert_eq!(deferred.len(), 1);
        // The one slot is free again once the instance is dropped: this call would wait for
        // it forever otherwise.
        drop(deferred);
        let (again, deferred) = pluglet_handler_runtime::defer_release(|| {
            (
                handler.allocate(&cx(), &req).map(|c| c.value),
                pluglet_handler_runtime::defer_release(|| ()).1.len(),
            )
        });
        assert_eq!(again.0.unwrap(), plain);
        assert_eq!(again.1, 0, "a nested keeper keeps only its own calls");
        assert_eq!(deferred.len(), 1);
        drop(deferred);

        // Outside a keeper, every call frees its instance before it returns.
        for _ in 0..3 {
            handler.allocate(&cx(), &req).unwrap();
        }
    }

    fn logged(
        call: &pluglet_handler_runtime::Call<Result<Vec<String>, pluglet_handler_runtime::Refusal>>,
    ) -> Vec<String> {
        call.logs.iter().map(|l| l.message.clone()).collect()
    }

    #[test]
    fn dropping_what_was_kept_makes_a_fresh_instance_that_the_next_call_runs_in() {
        let (rt, handler) = one_slot_with(guest("misbehave"), &[("allocate", "count")]);
        let req = request(vec![dev("a", &[0]), dev("b", &[0])], &[], 1, None);
        let fresh = vec!["call 1 of this instance".to_string()];

        let (first, deferred) =
            pluglet_handler_runtime::defer_release(|| handler.allocate(&cx(), &req));
        assert_eq!(logged(&first.unwrap()), fresh);
        assert_eq!(
            rt.spares(),
            0,
            "nothing is made ahead while the instance is kept"
        );
        drop(deferred);
        assert_eq!(
            rt.spares(),
            1,
            "the next instance is made when the kept one is freed"
        );

        // The next call runs in the instance made ahead: a fresh one, never the one before.
        let (second, deferred) =
            pluglet_handler_runtime::defer_release(|| handler.allocate(&cx(), &req));
        assert_eq!(logged(&second.unwrap()), fresh);
        assert_eq!(rt.spares(), 0, "the call took it");
        drop(deferred);
        assert_eq!(rt.spares(), 1);

        // A call for another node does not take the spare (it is dropped) and gets a fresh
        // instance; the spare's pool slot was never one of the calls' slots.
        let other = CallContext {
            node_name: "node-8".into(),
        };
        let third = handler.allocate(&other, &req).unwrap();
        assert_eq!(logged(&third), vec!["call 1 of this instance".to_string()]);
        assert_eq!(
            rt.spares(),
            0,
            "a spare made for another node is dropped, not kept"
        );
        // Calls outside a keeper neither make nor leave spares.
        handler.allocate(&cx(), &req).unwrap();
        assert_eq!(rt.spares(), 0);
    }

    #[test]
    fn a_failed_call_leaves_no_instance_made_ahead() {
        let (rt, handler) = one_slot_with(guest("misbehave"), &[("allocate", "panic")]);
        let req = request(vec![dev("a", &[0])], &[], 1, None);
        let (call, deferred) =
            pluglet_handler_runtime::defer_release(|| handler.allocate(&cx(), &req));
        call.expect_err("the guest panics");
        assert_eq!(deferred.len(), 1, "the failed call's instance is kept too");
        drop(deferred);
        assert_eq!(rt.spares(), 0);
    }

    #[test]
    fn a_runtime_keeps_at_most_max_spares_made_ahead() {
        let (rt, handler) = one_slot();
        let req = request(vec![dev("a", &[0])], &[], 1, None);
        let max = RuntimeConfig {
            pool_size: 1,
            ..RuntimeConfig::default()
        }
        .spare_slots();
        assert_eq!(max, 6, "two per call slot and four more");
        let handlers: Vec<_> = (0..max + 2)
            .map(|i| {
                handler
                    .reconfigured(format!("copy-{i}"), BTreeMap::new(), None)
                    .expect("reconfigured")
            })
            .collect();
        for h in &handlers {
            let (call, deferred) =
                pluglet_handler_runtime::defer_release(|| h.allocate(&cx(), &req));
            call.unwrap();
            drop(deferred);
        }
        assert_eq!(rt.spares(), max);
        // Every handler still answers, with or without a spare, in the one call slot.
        for h in &handlers {
            h.allocate(&cx(), &req).unwrap();
        }
        assert_eq!(rt.spares(), 0, "each spare was taken by its handler's call");
        // A handler dropped with its spare gives its count back.
        let (call, deferred) =
            pluglet_handler_runtime::defer_release(|| handlers[0].allocate(&cx(), &req));
        call.unwrap();
        drop(deferred);
        assert_eq!(rt.spares(), 1);
        drop(handlers);
        assert_eq!(rt.spares(), 0);
    }

    #[test]
    fn a_panic_inside_defer_release_frees_what_was_kept() {
        let (_rt, handler) = one_slot();
        let req = request(vec![dev("a", &[0])], &[], 1, None);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pluglet_handler_runtime::defer_release(|| {
                handler.allocate(&cx(), &req).unwrap();
                panic!("on purpose");
            })
        }));
        assert!(caught.is_err());
        // The slot was given back, and no keeper is left running on this thread.
        handler.allocate(&cx(), &req).unwrap();
        handler.allocate(&cx(), &req).unwrap();
    }
}

/// A handler loaded with `reuse_instances` runs each call in the instance a call before it
/// succeeded in, up to a bound; any doubt about that instance gives the next call a fresh one.
mod reuse {
    use super::*;

    /// A 16 MiB cap: the `alloc-some` mode's 10 MiB pass it by half.
    fn reusing(settings: &[(&str, &str)]) -> (Runtime, Arc<Handler>) {
        let rt = Runtime::new(RuntimeConfig {
            pool_size: 1,
            ..RuntimeConfig::default()
        })
        .expect("runtime");
        let mut all = vec![("allocate", "by-request"), ("mib", "10")];
        all.extend_from_slice(settings);
        let settings = all
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let limits = Limits {
            deadline: GENEROUS,
            memory_mib: 16,
            reuse_instances: true,
            ..Limits::default()
        };
        let handler = rt
            .load(guest("misbehave"), settings, Some(limits))
            .expect("the module loads");
        (rt, handler)
    }

    /// One `allocate` call whose guest runs `mode` first: its log lines, or its fault's text.
    fn call(handler: &Handler, node: &str, mode: &str) -> Result<Vec<String>, String> {
        let req = request(vec![dev("a", &[0]), dev("b", &[0])], &[], 1, Some(&[mode]));
        let cx = CallContext {
            node_name: node.into(),
        };
        match handler.allocate(&cx, &req) {
            Ok(call) => {
                call.value.expect("an answer, not a refusal");
                Ok(call.logs.into_iter().map(|l| l.message).collect())
            }
            Err(err) => Err(err.fault.to_string()),
        }
    }

    fn nth(n: u32) -> Result<Vec<String>, String> {
        Ok(vec![format!("call {n} of this instance")])
    }

    #[test]
    fn calls_run_in_the_instance_of_the_call_before() {
        let (rt, handler) = reusing(&[]);
        for n in 1..=5 {
            assert_eq!(call(&handler, "node-7", "count"), nth(n));
        }
        assert_eq!(rt.spares(), 1, "the instance is kept between calls");
        // Inside a keeper nothing is left to free: the instance went back to the handler.
        let (logs, deferred) =
            pluglet_handler_runtime::defer_release(|| call(&handler, "node-7", "count"));
        assert_eq!(logs, nth(6));
        assert!(deferred.is_empty());
        drop(handler);
        assert_eq!(
            rt.spares(),
            0,
            "a handler dropped gives its kept instance back"
        );
    }

    #[test]
    fn a_failed_call_or_a_refused_answer_is_never_run_in_again() {
        let (_rt, handler) = reusing(&[]);
        assert!(call(&handler, "node-7", "count").is_ok());
        let fault = call(&handler, "node-7", "panic").unwrap_err();
        assert!(fault.contains("asked to panic"), "{fault}");
        assert_eq!(
            call(&handler, "node-7", "count"),
            nth(1),
            "a fresh instance after the trap"
        );
        assert_eq!(call(&handler, "node-7", "count"), nth(2));
        // The guest ran without fault, but the host refused its answer.
        let fault = call(&handler, "node-7", "huge-ids:70000").unwrap_err();
        assert!(fault.contains("answer too large"), "{fault}");
        assert_eq!(
            call(&handler, "node-7", "count"),
            nth(1),
            "a fresh instance after the refused answer"
        );
    }

    #[test]
    fn an_instance_grown_past_half_its_cap_is_not_kept() {
        let (_rt, handler) = reusing(&[]);
        assert!(call(&handler, "node-7", "count").is_ok());
        call(&handler, "node-7", "alloc-some").expect("10 MiB fit in the 16 MiB cap");
        assert_eq!(call(&handler, "node-7", "count"), nth(1));
    }

    #[test]
    fn the_builtin_policy_is_kept_after_choosing_among_1024_devices() {
        let rt = Runtime::new(RuntimeConfig {
            pool_size: 1,
            ..RuntimeConfig::default()
        })
        .expect("runtime");
        let limits = Limits {
            reuse_instances: true,
            ..Limits::default()
        };
        let handler = rt
            .load(
                builtin("device-plugin", pluglet_wasm_guests::DEVICE_PLUGIN),
                BTreeMap::new(),
                Some(limits),
            )
            .expect("the built-in loads");
        let devices = (0..1024)
            .map(|i| dev(&format!("dev-{i:04}"), &[0]))
            .collect();
        let req = request(devices, &[], 1024, None);
        for _ in 0..3 {
            assert_eq!(
                handler.allocate(&cx(), &req).unwrap().value.unwrap().len(),
                1024
            );
            assert_eq!(
                rt.spares(),
                1,
                "its memory stays within what the pool keeps resident, so it is kept"
            );
        }
    }

    #[test]
    fn an_instance_serves_at_most_max_calls_per_instance() {
        let (_rt, handler) = reusing(&[]);
        for n in 1..=pluglet_handler_runtime::MAX_CALLS_PER_INSTANCE {
            assert_eq!(call(&handler, "node-7", "count"), nth(n));
        }
        assert_eq!(call(&handler, "node-7", "count"), nth(1));
    }

    #[test]
    fn an_instance_serves_only_the_node_name_it_was_made_for() {
        let (_rt, handler) = reusing(&[]);
        assert!(call(&handler, "node-7", "count").is_ok());
        assert_eq!(call(&handler, "node-8", "count"), nth(1));
        assert_eq!(call(&handler, "node-8", "count"), nth(2));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_handed_off_the_worker_is_not_run_again_in_the_instance_it_left() {
        let (_rt, handler) = reusing(&[]);
        let on_worker = |mode: &'static str| {
            let handler = handler.clone();
            tokio::spawn(async move {
                pluglet_handler_runtime::run_in_place(|| call(&handler, "node-7", mode))
            })
        };
        assert_eq!(on_worker("count").await.unwrap(), nth(1));
        assert_eq!(on_worker("count").await.unwrap(), nth(2));
        // The panic's text goes to stderr: the call stops there and runs again off the worker.
        let fault = on_worker("panic").await.unwrap().unwrap_err();
        assert!(fault.contains("asked to panic"), "{fault}");
        assert_eq!(on_worker("count").await.unwrap(), nth(1));
    }

    #[test]
    fn without_reuse_every_call_gets_a_fresh_instance() {
        let (_rt, handler) = reusing(&[]);
        let fresh = handler
            .reconfigured(
                "fresh".into(),
                [("allocate".to_string(), "by-request".to_string())].into(),
                None,
            )
            .expect("reconfigured");
        for _ in 0..3 {
            assert_eq!(call(&fresh, "node-7", "count"), nth(1));
        }
    }
}

/// Hook calls from async code run on the tokio worker as they are; one that would block it
/// (a timer, its stdio, a long run) stops and runs again off the worker, with the same outcome
/// as a call made outside any runtime.
mod in_place {
    use super::*;
    use pluglet_handler_runtime::{HANDED_OFF_CALLS, HandlerError, run_in_place};

    type Validated = Result<(), HandlerError>;

    /// `validate` of a plugin named `name` through `run_in_place`: each attempt's outcome
    /// ("handed off", "answered" or the fault) and the result.
    fn attempts(h: &Handler, name: &str) -> (Vec<String>, Validated) {
        let mut seen = Vec::new();
        let result = run_in_place(|| {
            let result = h
                .validate(&cx(), &plugin("CSIPlugin", name, &["1.0.0"]), None)
                .map(|call| assert!(call.value.is_ok(), "{:?}", call.value));
            seen.push(match &result {
                Ok(()) => "answered".to_string(),
                Err(err) if matches!(err.fault, HandlerFault::HandedOff) => {
                    "handed off".to_string()
                }
                Err(err) => err.fault.to_string(),
            });
            result
        });
        (seen, result)
    }

    /// [`attempts`] in a task of the runtime's workers, as the daemon makes its calls.
    async fn on_worker(h: &Arc<Handler>, name: &str) -> (Vec<String>, Validated) {
        let (h, name) = (h.clone(), name.to_owned());
        tokio::spawn(async move { attempts(&h, &name) })
            .await
            .expect("the task ran")
    }

    fn limits(deadline_ms: u64) -> Limits {
        Limits {
            deadline: Duration::from_millis(deadline_ms),
            memory_mib: 16,
            fuel: None,
            reuse_instances: false,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_quick_call_runs_once_on_the_worker() {
        let h = misbehave(&[("mode", "log"), ("lines", "3")], limits(2000));
        let (seen, result) = on_worker(&h, "x.example.com").await;
        result.unwrap();
        assert_eq!(seen, ["answered"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_guest_reaching_for_its_stdio_runs_again_off_the_worker() {
        // The panic message goes to stderr: WASI's stream would wait on a runtime of its own.
        let h = misbehave(&[("mode", "panic")], limits(2000));
        let (seen, result) = on_worker(&h, "x.example.com").await;
        let err = result.unwrap_err();
        assert_eq!(seen[0], "handed off");
        assert_eq!(seen.len(), 2, "{seen:?}");
        let HandlerFault::Trapped { message } = &err.fault else {
            panic!("expected a trap, got {err}");
        };
        assert!(message.contains("misbehave: asked to panic"), "{message}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_guest_sleeping_runs_again_off_the_worker() {
        let h = misbehave(&[("mode", "sleep"), ("ms", "20")], limits(2000));
        let (seen, result) = on_worker(&h, "x.example.com").await;
        result.unwrap();
        assert_eq!(seen, ["handed off", "answered"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_runaway_call_hands_off_then_meets_its_deadline() {
        let h = misbehave(&[("mode", "loop")], limits(50));
        let (seen, result) = on_worker(&h, "x.example.com").await;
        let err = result.unwrap_err();
        assert!(
            matches!(err.fault, HandlerFault::Deadline { deadline } if deadline == Duration::from_millis(50)),
            "{err:?}"
        );
        assert_eq!(seen[0], "handed off");
        assert_eq!(seen.len(), 2, "{seen:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn after_a_long_call_the_handler_s_next_calls_go_straight_off_the_worker() {
        // In `by-name` mode the plugin's name is the behaviour: "burn" runs 20 million loop
        // iterations, past the long-call mark in CPU time however busy the machine is (a spin
        // for a wall-clock time may get less than that mark of CPU on a loaded machine); "ok"
        // answers at once.
        let h = misbehave(
            &[("mode", "by-name"), ("iterations", "20000000")],
            limits(2000),
        );
        let (seen, result) = on_worker(&h, "burn").await;
        result.unwrap();
        assert_eq!(seen, ["handed off", "answered"]);
        for _ in 0..HANDED_OFF_CALLS {
            let (seen, result) = on_worker(&h, "ok").await;
            result.unwrap();
            assert_eq!(
                seen,
                ["handed off", "answered"],
                "sent straight off the worker"
            );
        }
        let (seen, result) = on_worker(&h, "ok").await;
        result.unwrap();
        assert_eq!(seen, ["answered"], "in place again");
    }
}
