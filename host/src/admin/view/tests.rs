//! The views' JSON contract across families: keys scripts read, envelopes, round trips, and
//! the tables showing the JSON rows.

use super::*;
use pluglet_proto::EncodedAnswer;
use pluglet_proto::admin::v1 as pb;
use pluglet_proto::v1beta1;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

fn csi_plugin() -> pb::Plugin {
    pb::Plugin {
        name: "hostpath.csi.k8s.io".into(),
        r#type: "CSIPlugin".into(),
        endpoint: "/r/csi.sock".into(),
        versions: vec!["1.0.0".into()],
        version: "1.0.0".into(),
        handler: "builtin:csi".into(),
        registered_at: "2026-11-29T16:00:00.000Z".into(),
        socket_path: "/r/plugins_registry/reg.sock".into(),
        door: "registry".into(),
        csi: Some(pb::CsiNodeInfo {
            node_id: "node-1".into(),
            max_volumes_per_node: 16,
            topology: [("topology.kubernetes.io/zone".to_owned(), "z1".to_owned())].into(),
        }),
    }
}

fn plugins() -> Vec<PluginView> {
    let mut dp = csi_plugin();
    dp.name = "vendor.com/gpu".into();
    dp.r#type = "DevicePlugin".into();
    dp.csi = None;
    dp.version = String::new();
    vec![(&csi_plugin()).into(), (&dp).into()]
}

fn sockets() -> Vec<SocketView> {
    let registered = pb::SocketStatus {
        path: "/r/plugins_registry/a.sock".into(),
        state: "registered".into(),
        attempts: 1,
        last_error: String::new(),
        plugin_type: "CSIPlugin".into(),
        plugin_name: "a".into(),
        next_retry_ms: 0,
    };
    let retrying = pb::SocketStatus {
        path: "/r/plugins_registry/b.sock".into(),
        state: "retrying".into(),
        attempts: 3,
        last_error: "GetInfo failed: connection refused".into(),
        next_retry_ms: 400,
        ..Default::default()
    };
    vec![(&registered).into(), (&retrying).into()]
}

fn handlers() -> Vec<HandlerView> {
    let csi = pb::HandlerInfo {
        plugin_type: "CSIPlugin".into(),
        resource: String::new(),
        module: "builtin:csi".into(),
        sha256: "ab".repeat(32),
        contract_version: "1.2.0".into(),
        families: vec!["registration".into()],
        applied_at: "2026-12-01T00:00:00.000Z".into(),
        calls: 12,
        has_timing: true,
        mean_us: 40.5,
        p99_us: 90,
        ..Default::default()
    };
    let policy = pb::HandlerInfo {
        plugin_type: String::new(),
        resource: "vendor.com/gpu".into(),
        module: "/h/spread.wasm".into(),
        sha256: "cd".repeat(32),
        contract_version: "1.1.0".into(),
        families: vec!["allocation-policy".into()],
        applied_at: "2026-12-01T00:00:00.000Z".into(),
        previous_module: "/h/old.wasm".into(),
        previous_sha256: "ef".repeat(32),
        calls: 3,
        failures: Some(pb::HandlerFailures {
            trap: 1,
            ..Default::default()
        }),
        last_failure: Some(pb::HandlerFailure {
            at: "2026-12-01T00:00:01.000Z".into(),
            kind: "trap".into(),
            message: "trapped".into(),
        }),
        last_change: Some(pb::HandlerChange {
            state: "refused".into(),
            at: "2026-12-01T00:00:02.000Z".into(),
            reason: "the module file is missing".into(),
            module: "/h/spread.wasm".into(),
            sha256: String::new(),
            ..Default::default()
        }),
        rollback_after: 3,
        on_failure: "fail".into(),
        on_probation: true,
        running_calls: 1,
        max_concurrent_calls: 2,
        ..Default::default()
    };
    let default = pb::HandlerInfo {
        resource: String::new(),
        module: "builtin:device-plugin".into(),
        ..policy.clone()
    };
    vec![(&csi).into(), (&policy).into(), (&default).into()]
}

fn resources() -> Vec<ResourceView> {
    let connected = pb::Resource {
        resource: "vendor.com/gpu".into(),
        capacity: 2,
        allocatable: 1,
        devices: vec![
            pb::DeviceInfo {
                id: "d0".into(),
                health: "Healthy".into(),
                numa: vec![0],
            },
            pb::DeviceInfo {
                id: "d1".into(),
                health: "Unhealthy".into(),
                numa: vec![],
            },
        ],
        policy: "builtin:device-plugin".into(),
        endpoint: "/r/device-plugins/gpu.sock".into(),
        connected: true,
        last_error: String::new(),
    };
    let gone = pb::Resource {
        resource: "vendor.com/nic".into(),
        endpoint: String::new(),
        connected: false,
        last_error: "disconnected: ListAndWatch stream ended".into(),
        ..connected.clone()
    };
    vec![(&connected).into(), (&gone).into()]
}

fn allocations() -> Vec<AllocationView> {
    [
        ("pod-1", "a", &["d0", "d2"][..]),
        ("pod-2", "b", &["d1"][..]),
    ]
    .into_iter()
    .map(|(pod, container, ids)| {
        (&pb::Allocation {
            pod_uid: pod.into(),
            container: container.into(),
            resource: "vendor.com/gpu".into(),
            device_ids: ids.iter().map(|s| s.to_string()).collect(),
            cdi_names: vec![format!("vendor.com/gpu=pluglet-{pod}_{container}")],
            pod_name: pod.into(),
            pod_namespace: "default".into(),
        })
            .into()
    })
    .collect()
}

fn allocate_answer() -> pb::AllocateResponse {
    pb::AllocateResponse {
        device_ids: vec!["d0".into()],
        response: Some(EncodedAnswer::encode(&v1beta1::ContainerAllocateResponse {
            envs: [("A".to_string(), "1".to_string())].into(),
            mounts: vec![v1beta1::Mount {
                container_path: "/c".into(),
                host_path: "/h".into(),
                read_only: true,
            }],
            devices: vec![v1beta1::DeviceSpec {
                container_path: "/dev/x".into(),
                host_path: "/dev/null".into(),
                permissions: "rw".into(),
            }],
            annotations: [("k".to_string(), "v".to_string())].into(),
            cdi_devices: vec![v1beta1::CdiDevice {
                name: "vendor.com/gpu=d0".into(),
            }],
        })),
        cdi_names: vec![
            "vendor.com/gpu=d0".into(),
            "vendor.com/gpu=pluglet-p_c".into(),
        ],
    }
}

fn sync_pods(dry_run: bool) -> SyncPodsView {
    let freed = allocations()
        .iter()
        .map(|a| pb::Allocation {
            pod_uid: a.pod_uid.clone(),
            container: a.container.clone(),
            resource: a.resource.clone(),
            device_ids: a.device_ids.clone(),
            cdi_names: a.cdi_names.clone(),
            pod_name: a.pod_name.clone(),
            pod_namespace: a.pod_namespace.clone(),
        })
        .collect();
    (&pb::SyncPodsResponse { freed, dry_run }).into()
}

/// What a reader of the writer's JSON gets back.
fn round_trip<T: Serialize + DeserializeOwned>(value: &T) -> T {
    let text = json(value);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// Every list view: JSON parses back to the same views, and the table rendered from what
/// the JSON says is the table rendered from the views, one row per item.
fn check_list<T>(items: Vec<T>)
where
    T: Serialize + DeserializeOwned + Table + PartialEq + std::fmt::Debug,
{
    let back: Vec<T> = round_trip(&items);
    assert_eq!(back, items);
    let text = table(&items);
    assert_eq!(table(&back), text);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), items.len() + 1, "{text}");
    assert!(lines[0].starts_with(T::HEADER[0]), "{text}");
    for (line, item) in lines[1..].iter().zip(&items) {
        let row = item.row();
        let cells: Vec<&str> = line.split("  ").filter(|c| !c.is_empty()).collect();
        let cells: Vec<&str> = cells.iter().map(|c| c.trim()).collect();
        assert_eq!(cells, row, "{text}");
    }
}

#[test]
fn list_views_round_trip_and_tables_show_the_json_rows() {
    check_list(plugins());
    check_list(sockets());
    check_list(handlers());
    check_list(resources());
    check_list(allocations());
    let devices = resources().remove(0).devices;
    assert_eq!(round_trip(&devices), devices);
}

#[test]
fn result_views_round_trip_and_tables_show_the_json_rows() {
    let allocated = AllocateResultView::try_from(&allocate_answer()).unwrap();
    let back = round_trip(&allocated);
    assert_eq!(back, allocated);
    assert_eq!(back.table(), allocated.table());
    assert_eq!(
        allocated.table(),
        "WHAT        VALUE\n\
         devices     d0\n\
         env         A=1\n\
         mount       /h -> /c (ro)\n\
         device      /dev/null -> /dev/x (rw)\n\
         annotation  k=v\n\
         cdi         vendor.com/gpu=d0\n\
         cdi         vendor.com/gpu=pluglet-p_c\n"
    );

    let released = ReleaseResultView {
        released: 2,
        freed: Vec::new(),
    };
    assert_eq!(round_trip(&released), released);
    assert_eq!(released.text("p", None), "released 2 entries of pod p\n");
    let nothing = ReleaseResultView {
        released: 0,
        freed: Vec::new(),
    };
    assert_eq!(
        nothing.text("p", None),
        "nothing released: pod p holds no devices\n"
    );
    assert_eq!(
        nothing.text("p", Some("c")),
        "nothing released: container c of pod p holds no devices\n"
    );

    for dry_run in [false, true] {
        let synced = sync_pods(dry_run);
        let back = round_trip(&synced);
        assert_eq!(back, synced);
        assert_eq!(back.table(), synced.table());
        let text = synced.table();
        let rows: Vec<&str> = text.lines().collect();
        assert_eq!(rows.len(), synced.freed.len() + 2, "{text}");
        assert_eq!(&text[..table(&synced.freed).len()], table(&synced.freed));
    }
}

#[test]
fn sync_pods_table_says_what_happened() {
    let freed = sync_pods(false).table();
    assert!(freed.ends_with("\nfreed 2 entries of 2 pods\n"), "{freed}");
    assert!(
        freed.contains(
            "pod-1  a          vendor.com/gpu  d0,d2    vendor.com/gpu=pluglet-pod-1_a\n"
        ),
        "{freed}"
    );
    let dry = sync_pods(true).table();
    assert!(
        dry.ends_with("\ndry run: would free 2 entries of 2 pods; nothing was freed\n"),
        "{dry}"
    );
    let nothing = SyncPodsView {
        dry_run: false,
        freed: Vec::new(),
    };
    assert_eq!(
        nothing.table(),
        "POD  CONTAINER  RESOURCE  DEVICES  CDI\nnothing to free\n"
    );
    assert_eq!(
        serde_json::to_value(&nothing).unwrap(),
        json!({"dry_run": false, "freed": []})
    );
}

#[test]
fn plugin_json_has_flat_csi_keys_and_wire_strings() {
    let v = serde_json::to_value(PluginView::from(&csi_plugin())).unwrap();
    assert_eq!(v["type"], "CSIPlugin");
    assert_eq!(v["node_id"], "node-1");
    assert_eq!(v["max_volumes_per_node"], 16);
    assert_eq!(v["topology"]["topology.kubernetes.io/zone"], "z1");
    assert_eq!(v["versions"], json!(["1.0.0"]));
    let mut dp = csi_plugin();
    dp.csi = None;
    dp.version = String::new();
    let v = serde_json::to_value(PluginView::from(&dp)).unwrap();
    assert!(v.get("node_id").is_none());
    assert_eq!(v["version"], Value::Null);
}

#[test]
fn allocate_json_has_the_documented_keys() {
    assert_eq!(
        serde_json::to_value(AllocateResultView::try_from(&allocate_answer()).unwrap()).unwrap(),
        json!({
            "device_ids": ["d0"],
            "envs": {"A": "1"},
            "mounts": [{"container_path": "/c", "host_path": "/h", "read_only": true}],
            "device_specs": [{"container_path": "/dev/x", "host_path": "/dev/null", "permissions": "rw"}],
            "annotations": {"k": "v"},
            "cdi_devices": ["vendor.com/gpu=d0"],
            "cdi_names": ["vendor.com/gpu=d0", "vendor.com/gpu=pluglet-p_c"],
        })
    );
}

/// The keys scripts read: exactly the ones `pluglet ctl -o json` has always printed.
#[test]
fn json_keys_are_the_ones_scripts_read() {
    fn keys<T: Serialize>(value: &T) -> Vec<String> {
        match serde_json::to_value(value).unwrap() {
            Value::Object(map) => {
                let mut keys: Vec<String> = map.keys().cloned().collect();
                keys.sort();
                keys
            }
            other => panic!("not an object: {other}"),
        }
    }
    assert_eq!(
        keys(&plugins()[0]),
        [
            "door",
            "endpoint",
            "handler",
            "max_volumes_per_node",
            "name",
            "node_id",
            "registered_at",
            "socket_path",
            "topology",
            "type",
            "version",
            "versions"
        ]
    );
    assert_eq!(
        keys(&sockets()[1]),
        [
            "attempts",
            "last_error",
            "next_retry_ms",
            "path",
            "plugin_name",
            "plugin_type",
            "state"
        ]
    );
    assert_eq!(
        serde_json::to_value(&sockets()[1]).unwrap()["plugin_type"],
        Value::Null
    );
    assert_eq!(
        keys(&handlers()[0]),
        [
            "applied_at",
            "calls",
            "contract_version",
            "failures",
            "families",
            "last_change",
            "last_failure",
            "mean_us",
            "module",
            "on_failure",
            "on_probation",
            "p99_us",
            "plugin_type",
            "previous",
            "refusals",
            "resource",
            "rollback_after",
            "sha256",
            "signature",
            "slot"
        ]
    );
    assert_eq!(
        serde_json::to_value(&handlers()[0]).unwrap()["max_concurrent_calls"],
        Value::Null,
        "a built-in is not limited"
    );
    let text = table(&handlers());
    let cells = |line: usize| -> Vec<String> {
        let line = text.lines().nth(line).unwrap();
        line.split("  ")
            .filter(|c| !c.is_empty())
            .map(|c| c.trim().to_owned())
            .collect()
    };
    assert_eq!(cells(2)[4], "1/2", "running / max_concurrent_calls: {text}");
    assert_eq!(cells(1)[4], "-", "a built-in: {text}");
    assert_eq!(
        keys(&resources()[1]),
        [
            "allocatable",
            "capacity",
            "connected",
            "devices",
            "endpoint",
            "last_error",
            "policy",
            "resource"
        ]
    );
    assert_eq!(
        serde_json::to_value(&resources()[1]).unwrap()["endpoint"],
        Value::Null
    );
    assert_eq!(keys(&resources()[0].devices[0]), ["health", "id", "numa"]);
    assert_eq!(
        keys(&allocations()[0]),
        [
            "cdi_names",
            "container",
            "device_ids",
            "pod_name",
            "pod_namespace",
            "pod_uid",
            "resource"
        ]
    );
    assert_eq!(
        keys(&ReleaseResultView {
            released: 1,
            freed: Vec::new()
        }),
        ["freed", "released"]
    );
}

#[test]
fn table_aligns_columns() {
    let t = columns(&["A", "LONG"], vec![vec!["xyz".into(), "1".into()]]);
    assert_eq!(t, "A    LONG\nxyz  1\n");
}

#[test]
fn handler_table_names_what_each_module_is_for() {
    let text = table(&handlers());
    let first: Vec<&str> = text
        .lines()
        .skip(1)
        .map(|l| l.split("  ").next().unwrap())
        .collect();
    assert_eq!(
        first,
        [
            "plugin_type/CSIPlugin",
            "resource/vendor.com/gpu",
            "default_policy"
        ]
    );
}

#[test]
fn an_oci_slot_shows_its_reference_and_short_digest_as_its_module() {
    let pulled = pb::HandlerInfo {
        resource: "vendor.com/gpu".into(),
        module: "/state/handlers/oci/1234/module.wasm".into(),
        sha256: "cd".repeat(32),
        source: "oci://registry.example:5000/vendor/gpu-policy:v2".into(),
        digest: format!("sha256:{}", "12".repeat(32)),
        previous_module: "/state/handlers/oci/5678/module.wasm".into(),
        previous_sha256: "ef".repeat(32),
        previous_source: "oci://registry.example:5000/vendor/gpu-policy@sha256:5678".into(),
        previous_digest: "sha256:5678".into(),
        ..Default::default()
    };
    let view = HandlerView::from(&pulled);
    let row = view.row();
    assert_eq!(
        row[1],
        "oci://registry.example:5000/vendor/gpu-policy:v2@sha256:121212121212"
    );
    assert_eq!(
        row[7],
        "oci://registry.example:5000/vendor/gpu-policy@sha256:5678 (efefefefefef)"
    );
    check_list(vec![view]);
    // A file keeps its path.
    assert_eq!(handlers()[1].row()[1], "/h/spread.wasm");
}

#[test]
fn a_verified_signature_shows_its_key_id_and_trusted_comment() {
    let signed = pb::HandlerInfo {
        resource: "vendor.com/gpu".into(),
        module: "/h/spread.wasm".into(),
        sha256: "cd".repeat(32),
        signature: Some(pb::HandlerSignature {
            key_id: "745C5BF2302F34A".into(),
            trusted_comment: "spread-policy 1.2.0".into(),
        }),
        ..Default::default()
    };
    let view = HandlerView::from(&signed);
    assert_eq!(
        serde_json::to_value(&view).unwrap()["signature"],
        serde_json::json!({"key_id": "745C5BF2302F34A", "trusted_comment": "spread-policy 1.2.0"})
    );
    assert!(
        table(&[view]).contains("cdcdcdcdcdcd signed:745C5BF2302F34A"),
        "{}",
        table(&[HandlerView::from(&signed)])
    );
    assert_eq!(
        serde_json::to_value(&handlers()[0]).unwrap()["signature"],
        Value::Null
    );
}

fn event(seq: u64, kind: &str, subject: &str) -> pb::Event {
    pb::Event {
        seq,
        at: format!("2026-12-01T00:00:0{seq}.000Z"),
        kind: kind.into(),
        subject: subject.into(),
        message: format!("{kind} {subject}"),
        missed: 0,
    }
}

#[test]
fn every_json_output_carries_the_version_and_its_kind() {
    let list: Value = serde_json::from_str(&json_list(plugins())).unwrap();
    assert_eq!(list["api_version"], "pluglet/v1");
    assert_eq!(list["kind"], "PluginList");
    assert_eq!(list["items"].as_array().unwrap().len(), 2);
    assert_eq!(list["items"][0]["name"], "hostpath.csi.k8s.io");
    let kinds = [
        serde_json::from_str::<Value>(&json_list(sockets())).unwrap()["kind"].clone(),
        serde_json::from_str::<Value>(&json_list(resources())).unwrap()["kind"].clone(),
        serde_json::from_str::<Value>(&json_list(allocations())).unwrap()["kind"].clone(),
        serde_json::from_str::<Value>(&json_list(Vec::<EventView>::new())).unwrap()["kind"].clone(),
    ];
    assert_eq!(
        kinds,
        ["SocketList", "ResourceList", "AllocationList", "EventList"]
    );

    let released: Value = serde_json::from_str(&json_of(&ReleaseResultView {
        released: 2,
        freed: Vec::new(),
    }))
    .unwrap();
    assert_eq!(
        released,
        json!({"api_version": "pluglet/v1", "kind": "ReleaseResult", "released": 2, "freed": []})
    );
    let handlers = HandlersView {
        items: handlers(),
        last_change: None,
    };
    let back: Envelope<HandlersView> = serde_json::from_str(&json_of(&handlers)).unwrap();
    assert_eq!(back, Envelope::new(handlers));
    assert_eq!(back.kind, "HandlerList");
}

#[test]
fn a_json_line_is_one_enveloped_object_on_one_line() {
    let view = EventView::from(&event(1, "allocated", "vendor.com/gpu"));
    let line = json_line_of(&view);
    assert!(
        line.ends_with('\n') && line.trim_end().lines().count() == 1,
        "{line}"
    );
    assert_eq!(
        serde_json::from_str::<Value>(&line).unwrap(),
        json!({
            "api_version": "pluglet/v1",
            "kind": "Event",
            "seq": 1,
            "at": "2026-12-01T00:00:01.000Z",
            "type": "allocated",
            "subject": "vendor.com/gpu",
            "message": "allocated vendor.com/gpu",
        })
    );
    let missed = EventView::from(&pb::Event {
        kind: "missed".into(),
        missed: 7,
        ..event(0, "missed", "")
    });
    assert_eq!(serde_json::to_value(&missed).unwrap()["missed"], 7);
}

#[test]
fn events_list_newest_last_as_a_table() {
    let events: Vec<EventView> = [
        event(1, "registered", "DevicePlugin gpu"),
        event(2, "allocated", "vendor.com/gpu"),
    ]
    .iter()
    .map(EventView::from)
    .collect();
    check_list(events.clone());
    let text = table(&events);
    assert!(text.starts_with("TIME"), "{text}");
    assert!(text.lines().nth(2).unwrap().contains("allocated"), "{text}");
}

fn status() -> pb::GetStatusResponse {
    pb::GetStatusResponse {
        version: "0.1.0".into(),
        started_at: "2026-12-01T00:00:00.000Z".into(),
        uptime_ms: 3_723_000,
        live: true,
        ready: false,
        waiting_for: vec!["registry-scanned".into()],
        stages: vec![pb::StageStatus {
            name: "watcher".into(),
            ended: String::new(),
        }],
        plugins: vec![
            pb::PluginCount {
                r#type: "CSIPlugin".into(),
                state: "registered".into(),
                count: 2,
            },
            pb::PluginCount {
                r#type: "CSIPlugin".into(),
                state: "failing".into(),
                count: 1,
            },
            pb::PluginCount {
                r#type: "DevicePlugin".into(),
                state: "waiting".into(),
                count: 1,
            },
        ],
        resources: vec![pb::ResourceSummary {
            resource: "vendor.com/gpu".into(),
            capacity: 4,
            allocatable: 3,
            allocated: 2,
            connected: true,
            last_error: String::new(),
        }],
        handlers: vec![pb::HandlerSummary {
            slot: "CSIPlugin".into(),
            module: "builtin:csi".into(),
            sha256: "ab".repeat(32),
        }],
        last_errors: vec![event(3, "refused", "CSIPlugin bad")],
        devices: true,
        publishing: Some(pb::Publishing {
            node: "node-a".into(),
            server: "https://10.0.0.1:6443/".into(),
            state: "failing".into(),
            last_sync: "2026-12-01T00:00:01.000Z".into(),
            last_error: "patch Node status node-a: 403".into(),
            pending_changes: 2,
            rounds: 9,
            failures: 3,
            writes: 6,
            conflicts: 1,
            warnings: vec!["Node label zone is \"a\"".into()],
            resources: 1,
            csi_drivers: 1,
        }),
        rollouts: Vec::new(),
    }
}

#[test]
fn status_counts_plugins_per_type_and_shows_every_part() {
    let view = StatusView::from(&status());
    assert_eq!(round_trip(&view), view);
    let v: Value = serde_json::from_str(&json_of(&view)).unwrap();
    assert_eq!(v["kind"], "Status");
    assert_eq!(v["api_version"], "pluglet/v1");
    assert_eq!(
        v["plugins"],
        json!([
            {"type": "CSIPlugin", "registered": 2, "failing": 1, "waiting": 0},
            {"type": "DevicePlugin", "registered": 0, "failing": 0, "waiting": 1},
        ])
    );
    assert_eq!(v["resources"][0]["allocated"], 2);
    assert_eq!(v["last_errors"][0]["type"], "refused");
    let text = view.text();
    assert!(
        text.starts_with("pluglet 0.1.0, up 1h 2m 3s (since 2026-12-01T00:00:00.000Z)\n"),
        "{text}"
    );
    assert!(
        text.contains("not ready: waiting for registry-scanned\n"),
        "{text}"
    );
    assert!(
        text.contains("\nCSIPlugin     2           1        0\n"),
        "{text}"
    );
    assert!(
        text.contains("vendor.com/gpu  4         3            2"),
        "{text}"
    );
    assert!(text.contains("builtin:csi  abababababab\n"), "{text}");
    assert!(text.contains("refused  CSIPlugin bad"), "{text}");
    assert_eq!(v["publishing"]["state"], "failing");
    assert_eq!(v["publishing"]["pending_changes"], 2);
    assert!(
        text.contains(
            "PUBLISHING\nnode node-a to https://10.0.0.1:6443/: failing, last sync \
             2026-12-01T00:00:01.000Z; 1 resources, 1 CSI drivers; 2 pending changes, 6 \
             writes, 1 conflicts, 3 of 9 rounds failed\nerror: patch Node status node-a: \
             403\nwarning: Node label zone is \"a\"\n"
        ),
        "{text}"
    );

    let bare = StatusView::from(&pb::GetStatusResponse {
        devices: false,
        resources: Vec::new(),
        publishing: None,
        ..status()
    });
    assert!(!bare.text().contains("PUBLISHING"));
    assert_eq!(
        serde_json::to_value(&bare).unwrap()["resources"],
        Value::Null
    );
    assert!(bare.text().contains("RESOURCES\nno device manager\n"));
}

#[test]
fn a_slot_put_in_force_by_a_rollout_says_so() {
    let rolled = pb::HandlerInfo {
        resource: "vendor.com/gpu".into(),
        module: "/state/handlers/oci/1234/module.wasm".into(),
        sha256: "cd".repeat(32),
        rollout: "rollout/gpu-v2".into(),
        ..Default::default()
    };
    let view = HandlerView::from(&rolled);
    assert_eq!(
        serde_json::to_value(&view).unwrap()["rollout"],
        "rollout/gpu-v2"
    );
    assert!(
        view.row()[2].ends_with(" source:rollout/gpu-v2"),
        "{:?}",
        view.row()
    );
    let plain = HandlerView::from(&pb::HandlerInfo::default());
    assert!(
        serde_json::to_value(&plain)
            .unwrap()
            .get("rollout")
            .is_none()
    );
}

#[test]
fn status_shows_the_rollouts_the_node_takes_part_in() {
    let view = StatusView::from(&pb::GetStatusResponse {
        rollouts: vec![
            pb::RolloutPart {
                name: "gpu-v2".into(),
                state: "Healthy".into(),
                digest: "sha256:12".into(),
                reason: String::new(),
            },
            pb::RolloutPart {
                name: "gpu-trap".into(),
                state: "RolledBack".into(),
                digest: String::new(),
                reason: "1 failed calls".into(),
            },
        ],
        ..status()
    });
    assert_eq!(round_trip(&view), view);
    let v = serde_json::to_value(&view).unwrap();
    assert_eq!(v["rollouts"][0]["state"], "Healthy");
    assert!(v["rollouts"][1].get("digest").is_none());
    let text = view.text();
    assert!(
        text.contains(
            "ROLLOUTS\ngpu-v2: Healthy (sha256:12)\ngpu-trap: RolledBack: 1 failed calls\n"
        ),
        "{text}"
    );
    let none = serde_json::to_value(StatusView::from(&status())).unwrap();
    assert!(none.get("rollouts").is_none());
}
