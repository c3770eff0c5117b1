//! The device manager over real unix sockets, with in-process stub plugins and the real
//! built-in WASM handler (`handlers/device-plugin`).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pluglet_core::{Generation, PluginKey, PluginType, SocketPath};
use pluglet_device_manager::{
    AllocateError, AllocationInfo, Config, DeviceManager, Durability, Health, KeepList,
    RegistryEvent, ResourceInfo, StartError,
};
use pluglet_handler_runtime::{PluginInfo, Runtime, RuntimeConfig};
use pluglet_handlers::{Builtins, Handlers, Trust};
use pluglet_proto::v1beta1;
use pluglet_registration::{Candidate, Door, EndReason, Pipeline, PipelineEvent};
use pluglet_test_support::stub::{Stub, devices, next_event};
use tokio_util::sync::CancellationToken;

const GPU: &str = "vendor.com/gpu";

fn load_handlers(dir: &Path) -> Handlers {
    let runtime = Runtime::new(RuntimeConfig::default()).unwrap();
    let builtins = Builtins::embedded(&runtime).unwrap();
    Handlers::load(runtime, dir, None, builtins, Trust::default()).unwrap()
}

/// Built-ins only; compiled once for the whole test binary.
fn handlers() -> Handlers {
    static SET: OnceLock<Handlers> = OnceLock::new();
    SET.get_or_init(|| load_handlers(Path::new("/nonexistent")))
        .clone()
}

struct Node {
    root: tempfile::TempDir,
    pipeline: Pipeline,
    manager: DeviceManager,
}

impl Node {
    fn dp_dir(&self) -> PathBuf {
        self.root.path().join("device-plugins")
    }

    fn config(root: &Path) -> Config {
        let mut config = Config::new(
            root.join("device-plugins"),
            root.join("state"),
            "node-1".into(),
        );
        config.durability = Durability::NoFsync;
        config
    }

    async fn start() -> Node {
        Node::start_with(|_| {}).await
    }

    async fn start_with(tune: impl FnOnce(&mut Config)) -> Node {
        let root = tempfile::tempdir().unwrap();
        let mut config = Node::config(root.path());
        tune(&mut config);
        let pipeline = Pipeline::new(handlers(), "node-1");
        let manager = DeviceManager::start(config, pipeline.clone(), CancellationToken::new())
            .await
            .unwrap();
        Node {
            root,
            pipeline,
            manager,
        }
    }

    async fn restart(self) -> Node {
        self.manager.shutdown().await;
        let pipeline = Pipeline::new(handlers(), "node-1");
        let manager = DeviceManager::start(
            Node::config(self.root.path()),
            pipeline.clone(),
            CancellationToken::new(),
        )
        .await
        .unwrap();
        Node {
            root: self.root,
            pipeline,
            manager,
        }
    }

    fn plugin(&self, name: &str, n: usize, options: v1beta1::DevicePluginOptions) -> Stub {
        Stub::start(&self.dp_dir().join(name), devices(n, 2), options)
    }

    fn kubelet_socket(&self) -> PathBuf {
        self.dp_dir().join("kubelet.sock")
    }

    fn resource(&self, name: &str) -> Option<ResourceInfo> {
        self.manager
            .resources()
            .into_iter()
            .find(|r| r.resource == name)
    }

    /// Waits (10 s at most) until `check` holds for the resource list.
    async fn wait(&self, what: &str, check: impl Fn(&Node) -> bool) {
        let mut changes = self.manager.changes();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !check(self) {
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                panic!(
                    "timed out waiting for {what}: {:#?}",
                    self.manager.resources()
                );
            }
        }
    }

    /// The sequence number of the newest allocation journal record.
    fn journal_seq(&self) -> u64 {
        let opened = pluglet_checkpoint::Journal::open(
            &self.manager.config().journal_path(),
            Durability::NoFsync,
        )
        .unwrap();
        opened.record.map_or(0, |r| r.seq)
    }

    /// Pods holding devices, in order.
    fn pods(&self) -> Vec<String> {
        let mut pods: Vec<String> = self
            .manager
            .allocations()
            .into_iter()
            .map(|a| a.pod_uid.into_string())
            .collect();
        pods.dedup();
        pods
    }

    async fn wait_allocatable(&self, name: &str, n: usize) {
        self.wait(&format!("{name} allocatable {n}"), |node| {
            node.resource(name).is_some_and(|r| r.allocatable == n)
        })
        .await;
    }
}

/// A device plugin found by the plugin watcher at `socket`.
fn watcher_candidate(resource: &str, socket: &Path, generation: u64) -> Candidate {
    Candidate {
        info: PluginInfo {
            plugin_type: "DevicePlugin".into(),
            name: resource.into(),
            endpoint: socket.display().to_string(),
            supported_versions: vec!["v1beta1".into()],
        },
        door: Door::Registry {
            socket: SocketPath::new(socket),
            generation: Generation(generation),
        },
        connection: None,
    }
}

fn options(preferred: bool, pre_start: bool) -> v1beta1::DevicePluginOptions {
    v1beta1::DevicePluginOptions {
        pre_start_required: pre_start,
        get_preferred_allocation_available: preferred,
    }
}

#[tokio::test]
async fn register_lists_devices_and_applies_health_updates() {
    let node = Node::start().await;
    let plugin = node.plugin("gpu.sock", 4, options(false, false));
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 4).await;
    let r = node.resource(GPU).unwrap();
    assert_eq!(r.capacity, 4);
    assert!(r.connected);
    assert_eq!(r.policy, "builtin:device-plugin");
    assert_eq!(r.devices[1].numa, [1]);

    let mut list = devices(4, 2);
    list[2].health = "Unhealthy".into();
    plugin.set_devices(list);
    node.wait_allocatable(GPU, 3).await;
    let r = node.resource(GPU).unwrap();
    assert_eq!(r.capacity, 4);
    assert_eq!(r.devices[2].health, Health::Unhealthy);

    // Full-list replacement: devices absent from an update disappear.
    plugin.set_devices(devices(2, 2));
    node.wait("capacity 2", |n| n.resource(GPU).unwrap().capacity == 2)
        .await;
    node.manager.flush_checkpoint().await.unwrap();
    let text = std::fs::read_to_string(node.dp_dir().join("kubelet_internal_checkpoint")).unwrap();
    assert!(
        text.contains(r#""RegisteredDevices":{"vendor.com/gpu":["d0","d1"]}"#),
        "{text}"
    );
}

#[tokio::test]
async fn register_refusals_are_clear_grpc_errors() {
    let node = Node::start().await;
    let plugin = node.plugin("gpu.sock", 1, options(false, false));

    let err = plugin
        .register(&node.kubelet_socket(), "gpu")
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("builtin:device-plugin"), "{err:?}");
    assert!(err.message().contains("gpu"), "{err:?}");

    let mut client = v1beta1::registration_client::RegistrationClient::new(
        pluglet_uds::connect(&node.kubelet_socket(), Duration::from_secs(5))
            .await
            .unwrap(),
    );
    let err = client
        .register(v1beta1::RegisterRequest {
            version: "v1alpha2".into(),
            endpoint: "gpu.sock".into(),
            resource_name: GPU.into(),
            options: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("v1alpha2"), "{err:?}");

    let err = client
        .register(v1beta1::RegisterRequest {
            version: "v1beta1".into(),
            endpoint: "nobody-serves-this.sock".into(),
            resource_name: GPU.into(),
            options: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert!(err.message().contains("nobody-serves-this.sock"), "{err:?}");
    assert!(node.resource(GPU).is_none(), "nothing registered");
}

#[tokio::test]
async fn allocation_is_idempotent_refuses_a_changed_count_and_release_returns_devices() {
    let node = Node::start().await;
    let plugin = node.plugin("gpu.sock", 4, options(false, true));
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 4).await;

    let first = node.manager.allocate("pod-1", "ctr", GPU, 2).await.unwrap();
    assert_eq!(first.device_ids.len(), 2);
    assert!(!first.reused);
    assert_eq!(
        first.answer.response().envs["STUB_DEVICES"],
        first.device_ids.join(",")
    );
    // The built-in policy packs onto one NUMA node (d0, d2 on node 0).
    assert_eq!(first.device_ids, ["d0", "d2"]);
    assert_eq!(plugin.state.pre_start_calls.load(Ordering::SeqCst), 1);

    let again = node.manager.allocate("pod-1", "ctr", GPU, 2).await.unwrap();
    assert!(again.reused);
    assert_eq!(again.device_ids, first.device_ids);
    assert_eq!(
        plugin.state.allocate_calls.load(Ordering::SeqCst),
        1,
        "no new RPC"
    );

    let err = node
        .manager
        .allocate("pod-1", "ctr", GPU, 3)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            AllocateError::ChangedRequest {
                held: 2,
                requested: 3,
                ..
            }
        ),
        "{err}"
    );

    let err = node
        .manager
        .allocate("pod-2", "ctr", GPU, 3)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            AllocateError::Unavailable {
                requested: 3,
                available: 2,
                ..
            }
        ),
        "{err}"
    );

    // The allocation is durable in the journal; the kubelet checkpoint follows.
    node.manager.wait_checkpoint().await.unwrap();
    let text = std::fs::read_to_string(node.dp_dir().join("kubelet_internal_checkpoint")).unwrap();
    assert!(text.contains(r#""PodUID":"pod-1""#), "{text}");

    assert_eq!(node.manager.release("pod-1", None).await.unwrap(), 1);
    assert!(node.manager.allocations().is_empty());
    let all = node.manager.allocate("pod-2", "ctr", GPU, 4).await.unwrap();
    assert_eq!(all.device_ids.len(), 4);
}

#[tokio::test]
async fn the_plugin_preference_reaches_the_policy() {
    let node = Node::start().await;
    let plugin = node.plugin("gpu.sock", 4, options(true, false));
    *plugin.state.preferred.lock().unwrap() = Some(vec!["d3".into(), "d0".into()]);
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 4).await;
    let got = node.manager.allocate("pod", "ctr", GPU, 2).await.unwrap();
    assert_eq!(got.device_ids, ["d3", "d0"]);
    assert_eq!(plugin.state.preferred_calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn failures_leave_nothing_held() {
    let node = Node::start().await;
    let plugin = node.plugin("gpu.sock", 2, options(false, false));
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 2).await;
    plugin.state.fail_allocate.store(true, Ordering::SeqCst);
    let err = node
        .manager
        .allocate("pod", "ctr", GPU, 1)
        .await
        .unwrap_err();
    assert!(matches!(err, AllocateError::Allocate { .. }), "{err}");
    assert!(pluglet_core::error_chain(&err).contains("fails on purpose"));
    assert!(node.manager.allocations().is_empty());

    let err = node
        .manager
        .allocate("pod", "ctr", "vendor.com/nic", 1)
        .await
        .unwrap_err();
    assert!(
        matches!(err, AllocateError::UnknownResource { .. }),
        "{err}"
    );
    let err = node
        .manager
        .allocate("pod", "ctr", GPU, 0)
        .await
        .unwrap_err();
    assert!(matches!(err, AllocateError::ZeroCount { .. }), "{err}");

    plugin.state.fail_allocate.store(false, Ordering::SeqCst);
    let got = node.manager.allocate("pod", "ctr", GPU, 2).await.unwrap();
    assert_eq!(got.device_ids.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cdi_spec_that_cannot_be_written_undoes_the_allocation() {
    let spec_root = tempfile::tempdir().unwrap();
    let cdi = spec_root.path().join("cdi");
    let node = Node::start_with(|config| config.cdi_spec_dir = Some(cdi.clone())).await;
    let plugin = node.plugin("gpu.sock", 2, options(false, false));
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 2).await;
    let before = node.journal_seq();

    // The spec directory becomes a regular file: no spec can be written in it.
    std::fs::remove_dir_all(&cdi).unwrap();
    std::fs::write(&cdi, b"not a directory").unwrap();
    let err = node
        .manager
        .allocate("pod", "ctr", GPU, 1)
        .await
        .unwrap_err();
    assert!(matches!(err, AllocateError::Cdi { .. }), "{err}");
    assert!(
        pluglet_core::error_chain(&err).contains("cannot write the CDI spec"),
        "{}",
        pluglet_core::error_chain(&err)
    );
    assert!(node.manager.allocations().is_empty());
    // Written beside the spec, the allocation's record was then taken back by a second one.
    assert_eq!(node.journal_seq(), before + 2);
    assert_eq!(node.resource(GPU).unwrap().allocatable, 2);

    // With the directory back the next one works, and only it comes back after a restart.
    std::fs::remove_file(&cdi).unwrap();
    let held = node.manager.allocate("pod-2", "ctr", GPU, 2).await.unwrap();
    assert_eq!(held.cdi_names.len(), 1);
    let specs: Vec<String> = std::fs::read_dir(&cdi)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        // The directory of temporary spec files is not a spec.
        .filter(|name| !name.starts_with('.'))
        .collect();
    assert_eq!(specs.len(), 1, "{specs:?}");
    assert!(specs[0].starts_with("pluglet-") && specs[0].ends_with(".json"));
    drop(plugin);
    let node = node.restart().await;
    assert_eq!(node.pods(), ["pod-2"]);
}

#[tokio::test]
async fn concurrent_requests_never_share_a_device() {
    let node = Node::start().await;
    let plugin = node.plugin("gpu.sock", 8, options(false, false));
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 8).await;
    let mut tasks = Vec::new();
    for i in 0..10 {
        let manager = node.manager.clone();
        tasks.push(tokio::spawn(async move {
            manager.allocate(&format!("pod-{i}"), "ctr", GPU, 1).await
        }));
    }
    let mut got = Vec::new();
    let mut refused = 0;
    for task in tasks {
        match task.await.unwrap() {
            Ok(a) => got.extend(a.device_ids),
            Err(AllocateError::Unavailable { .. }) => refused += 1,
            Err(e) => panic!("{e}"),
        }
    }
    got.sort();
    got.dedup();
    assert_eq!(got.len(), 8);
    assert_eq!(refused, 2);
}

#[tokio::test]
async fn an_old_stream_ending_does_not_disconnect_the_new_registration() {
    let node = Node::start().await;
    let old = node.plugin("old.sock", 2, options(false, false));
    old.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 2).await;
    let new = node.plugin("new.sock", 3, options(false, false));
    new.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 3).await;
    old.stop();
    drop(old);
    // Give a wrong disconnect every chance to happen, then check it did not.
    let got = node.manager.allocate("pod", "ctr", GPU, 1).await.unwrap();
    assert_eq!(got.answer.response().envs.len(), 1);
    let r = node.resource(GPU).unwrap();
    assert!(r.connected);
    assert_eq!(r.allocatable, 3);
    assert_eq!(r.endpoint.unwrap(), node.dp_dir().join("new.sock"));
}

#[tokio::test]
async fn a_device_list_over_the_message_limit_disconnects_the_plugin_saying_why() {
    let node = Node::start().await;
    let plugin = node.plugin("gpu.sock", 4, options(false, false));
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 4).await;
    // 60,000 devices with 64-byte ids: about 4.7 MiB on the wire, over the 4 MiB limit.
    let oversized = (0..60_000)
        .map(|i| v1beta1::Device {
            id: format!("{i:064}"),
            health: pluglet_proto::constants::HEALTHY.into(),
            topology: None,
        })
        .collect();
    plugin.set_devices(oversized);
    node.wait("gpu disconnected", |n| {
        n.resource(GPU).is_some_and(|r| !r.connected)
    })
    .await;
    let r = node.resource(GPU).unwrap();
    assert_eq!(
        (r.capacity, r.allocatable),
        (4, 0),
        "the devices known before, unhealthy; nothing of the oversized list"
    );
    let why = r.last_error.unwrap();
    assert!(
        why.contains("4 MiB") && why.contains("more resources"),
        "the reason names the limit and what to do: {why}"
    );
}

#[tokio::test]
async fn stream_end_and_socket_removal_turn_devices_unhealthy_then_the_resource_goes() {
    let node = Node::start_with(|c| c.grace_period = Duration::from_millis(300)).await;
    let plugin = node.plugin("gpu.sock", 2, options(false, false));
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 2).await;
    plugin.stop();
    node.wait("gpu disconnected", |n| {
        n.resource(GPU)
            .is_some_and(|r| !r.connected && r.allocatable == 0 && r.capacity == 2)
    })
    .await;
    let err = node
        .manager
        .allocate("pod", "ctr", GPU, 1)
        .await
        .unwrap_err();
    assert!(matches!(err, AllocateError::NotConnected { .. }), "{err}");
    node.wait("gpu removed", |n| n.resource(GPU).is_none())
        .await;

    let nic = "vendor.com/nic";
    let plugin = node.plugin("nic.sock", 2, options(false, false));
    plugin.register(&node.kubelet_socket(), nic).await.unwrap();
    node.wait_allocatable(nic, 2).await;
    std::fs::remove_file(&plugin.socket).unwrap();
    node.wait("nic disconnected", |n| {
        n.resource(nic)
            .is_some_and(|r| !r.connected && r.allocatable == 0)
    })
    .await;
    node.wait("nic removed", |n| n.resource(nic).is_none())
        .await;
}

#[tokio::test]
async fn a_plugin_back_within_the_grace_period_keeps_its_resource() {
    let node = Node::start_with(|c| c.grace_period = Duration::from_millis(300)).await;
    let mut events = node.manager.subscribe();
    let plugin = node.plugin("gpu.sock", 2, options(false, false));
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 2).await;
    plugin.stop();
    drop(plugin);
    node.wait("disconnected", |n| {
        n.resource(GPU).is_some_and(|r| !r.connected)
    })
    .await;
    let plugin = node.plugin("gpu2.sock", 2, options(false, false));
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 2).await;
    let removed = next_event(
        &mut events,
        "the first stop's grace period to end",
        |e| match e {
            RegistryEvent::GraceEnded { resource, removed } if resource == GPU => Some(removed),
            _ => None,
        },
    )
    .await;
    assert!(!removed, "the resource whose plugin came back is kept");
    assert!(
        node.resource(GPU)
            .is_some_and(|r| r.connected && r.allocatable == 2),
        "kept after the grace period"
    );
}

#[tokio::test]
async fn the_deregister_hook_runs_once_when_a_kubelet_sock_plugin_is_gone_for_good() {
    let node = Node::start_with(|c| c.grace_period = Duration::from_millis(200)).await;
    let mut events = node.pipeline.subscribe();
    let deregistered = |e: PipelineEvent| match e {
        PipelineEvent::Deregistered {
            key, reason, logs, ..
        } if key.name == GPU => Some((reason, logs)),
        _ => None,
    };

    // Replaced by a newer registration: the older one ends at once.
    let first = node.plugin("gpu-1.sock", 2, options(false, false));
    first.register(&node.kubelet_socket(), GPU).await.unwrap();
    let second = node.plugin("gpu-2.sock", 2, options(false, false));
    second.register(&node.kubelet_socket(), GPU).await.unwrap();
    let (reason, logs) =
        next_event(&mut events, "the first registration to end", deregistered).await;
    assert_eq!(reason, EndReason::Replaced);
    assert!(
        logs.iter()
            .any(|l| l.message == "device plugin vendor.com/gpu deregistered"),
        "the handler's deregister hook ran: {logs:?}"
    );
    first.stop();

    // Stream ended and the grace period passed with no new registration: the second ends.
    second.stop();
    let (reason, _) = next_event(&mut events, "the second registration to end", deregistered).await;
    assert_eq!(reason, EndReason::GracePeriodOver);
    node.wait("gpu removed", |n| n.resource(GPU).is_none())
        .await;

    // Once each: nothing more for this name, up to a later registration's own events.
    let third = node.plugin("gpu-3.sock", 1, options(false, false));
    third.register(&node.kubelet_socket(), GPU).await.unwrap();
    let next = next_event(&mut events, "the next event of the name", |e| match e {
        PipelineEvent::Registered { key, .. } if key.name == GPU => Some("registered"),
        PipelineEvent::Deregistered { key, .. } if key.name == GPU => Some("deregistered"),
        _ => None,
    })
    .await;
    assert_eq!(
        next, "registered",
        "no second deregistration of an ended registration"
    );
    let key = PluginKey::new(PluginType::DevicePlugin, GPU);
    assert!(node.pipeline.current(&key).await.is_some());
}

#[tokio::test]
async fn two_kubelet_sock_registrations_of_one_resource_at_once_are_serialised() {
    let node = Node::start().await;
    let mut events = node.pipeline.subscribe();
    let a = node.plugin("a.sock", 2, options(false, false));
    let b = node.plugin("b.sock", 3, options(false, false));
    let kubelet_socket = node.kubelet_socket();
    let (ra, rb) = tokio::join!(
        a.register(&kubelet_socket, GPU),
        b.register(&kubelet_socket, GPU)
    );
    ra.unwrap();
    rb.unwrap();
    // One after the other: the later replaced the earlier, which ended once; the resource is
    // served by whichever registered last.
    let (ended, _) = next_event(
        &mut events,
        "the earlier registration to end",
        |e| match e {
            PipelineEvent::Deregistered { id, reason, .. } => Some((id, reason)),
            _ => None,
        },
    )
    .await;
    let key = PluginKey::new(PluginType::DevicePlugin, GPU);
    let current = node.pipeline.current(&key).await.unwrap();
    assert_ne!(current.id, ended);
    let endpoint = node.resource(GPU).unwrap().endpoint.unwrap();
    assert_eq!(
        endpoint,
        node.dp_dir().join(&current.info.endpoint),
        "the registry serves the registration in force"
    );
}

#[tokio::test]
async fn watcher_flow_connects_and_disconnects() {
    let node = Node::start().await;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("gpu.sock");
    let _plugin = Stub::start(&socket, devices(3, 1), options(false, false));
    let registration = node
        .pipeline
        .register(watcher_candidate(GPU, &socket, 1))
        .await
        .unwrap();
    node.wait_allocatable(GPU, 3).await;

    // A registration replaced by a newer one: its socket going away later changes nothing.
    let other = dir.path().join("other.sock");
    let _other = Stub::start(&other, devices(3, 1), options(false, false));
    let newer = node
        .pipeline
        .register(watcher_candidate(GPU, &other, 2))
        .await
        .unwrap();
    assert!(registration.has_ended(), "replaced");
    node.pipeline
        .deregister(&registration, EndReason::SocketGone)
        .await;
    let r = node.resource(GPU).unwrap();
    assert!(r.connected);
    assert_eq!(r.endpoint.unwrap(), other);

    node.pipeline
        .deregister(&newer, EndReason::SocketGone)
        .await;
    node.wait("disconnected", |n| {
        n.resource(GPU)
            .is_some_and(|r| !r.connected && r.allocatable == 0)
    })
    .await;
    let err = node
        .pipeline
        .register(watcher_candidate(
            "vendor.com/nic",
            &dir.path().join("missing.sock"),
            3,
        ))
        .await
        .unwrap_err();
    assert!(
        pluglet_core::error_chain(&err).contains("missing.sock"),
        "{}",
        pluglet_core::error_chain(&err)
    );
}

#[tokio::test]
async fn allocations_survive_a_restart_and_held_devices_are_not_offered_again() {
    let node = Node::start().await;
    let plugin = node.plugin("gpu.sock", 2, options(false, false));
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 2).await;
    let held = node.manager.allocate("pod", "ctr", GPU, 1).await.unwrap();
    drop(plugin);

    let node = node.restart().await;
    assert_eq!(node.manager.restore_report().allocations, 1);
    let allocations = node.manager.allocations();
    assert_eq!(allocations.len(), 1);
    assert_eq!(allocations[0].device_ids, held.device_ids);
    let r = node.resource(GPU).unwrap();
    assert!(!r.connected);
    assert_eq!((r.capacity, r.allocatable), (2, 0));
    assert!(
        !node.dp_dir().join("gpu.sock").exists(),
        "stale socket removed"
    );

    // Same answer for the same container, no plugin needed.
    let again = node.manager.allocate("pod", "ctr", GPU, 1).await.unwrap();
    assert_eq!(again.answer, held.answer);

    let plugin = node.plugin("gpu.sock", 2, options(false, false));
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 2).await;
    let err = node
        .manager
        .allocate("pod-2", "ctr", GPU, 2)
        .await
        .unwrap_err();
    assert!(
        matches!(err, AllocateError::Unavailable { available: 1, .. }),
        "{err}"
    );
    let other = node.manager.allocate("pod-2", "ctr", GPU, 1).await.unwrap();
    assert_ne!(other.device_ids, held.device_ids);
}

#[tokio::test]
async fn a_corrupt_checkpoint_is_set_aside() {
    let root = tempfile::tempdir().unwrap();
    let dp = root.path().join("device-plugins");
    std::fs::create_dir_all(&dp).unwrap();
    std::fs::write(dp.join("kubelet_internal_checkpoint"), "{not json").unwrap();
    let manager = DeviceManager::start(
        Node::config(root.path()),
        Pipeline::new(handlers(), "node-1"),
        CancellationToken::new(),
    )
    .await
    .unwrap();
    let report = manager.restore_report();
    assert_eq!(report.set_aside.len(), 1);
    assert!(report.set_aside[0].moved_to.exists());
    assert_eq!(
        std::fs::read_to_string(&report.set_aside[0].moved_to).unwrap(),
        "{not json"
    );
    assert!(manager.allocations().is_empty());
    // A fresh, valid checkpoint replaced it.
    let text = std::fs::read_to_string(dp.join("kubelet_internal_checkpoint")).unwrap();
    assert!(text.starts_with(r#"{"Data":"#), "{text}");
    manager.shutdown().await;
}

#[tokio::test]
async fn a_live_kubelet_socket_refuses_the_start_and_touches_nothing() {
    let root = tempfile::tempdir().unwrap();
    let dp = root.path().join("device-plugins");
    std::fs::create_dir_all(&dp).unwrap();
    let _live = std::os::unix::net::UnixListener::bind(dp.join("kubelet.sock")).unwrap();
    let _other = std::os::unix::net::UnixListener::bind(dp.join("plugin.sock")).unwrap();
    std::fs::write(dp.join("kubelet_internal_checkpoint"), "{not json").unwrap();
    let err = DeviceManager::start(
        Node::config(root.path()),
        Pipeline::new(handlers(), "node-1"),
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, StartError::DirectoryInUse { .. }), "{err}");
    assert!(dp.join("plugin.sock").exists());
    assert_eq!(
        std::fs::read_to_string(dp.join("kubelet_internal_checkpoint")).unwrap(),
        "{not json"
    );
}

fn keep(uids: &[&str]) -> KeepList {
    uids.iter().copied().collect()
}

fn entries(freed: &[AllocationInfo]) -> Vec<(&str, &str, usize)> {
    freed
        .iter()
        .map(|a| (a.pod_uid.as_str(), a.container.as_str(), a.device_ids.len()))
        .collect()
}

#[tokio::test]
async fn sync_pods_frees_every_pod_not_kept_in_one_journal_record() {
    let node = Node::start().await;
    let plugin = node.plugin("gpu.sock", 6, options(false, false));
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 6).await;
    let kept = node.manager.allocate("pod-a", "ctr", GPU, 2).await.unwrap();
    node.manager.allocate("pod-b", "one", GPU, 1).await.unwrap();
    node.manager.allocate("pod-b", "two", GPU, 1).await.unwrap();
    node.manager.allocate("pod-c", "ctr", GPU, 2).await.unwrap();
    let held = node.manager.allocations();
    // The checkpoint write the allocations asked for is done: one still running when the
    // sync's record lands adds a record naming its checkpoint (`Persistence::name` in
    // `src/persistence/writer.rs`), which this test does not count.
    node.manager.wait_checkpoint().await.unwrap();

    let seq = node.journal_seq();
    let would = node
        .manager
        .sync_pods(&keep(&["pod-a"]), true)
        .await
        .unwrap();
    assert_eq!(
        entries(&would),
        [
            ("pod-b", "one", 1),
            ("pod-b", "two", 1),
            ("pod-c", "ctr", 2)
        ]
    );
    assert_eq!(node.manager.allocations(), held, "a dry run frees nothing");
    assert_eq!(node.journal_seq(), seq, "a dry run writes nothing");
    let err = node
        .manager
        .allocate("pod-d", "ctr", GPU, 4)
        .await
        .unwrap_err();
    assert!(
        matches!(err, AllocateError::Unavailable { available: 0, .. }),
        "{err}"
    );

    let freed = node
        .manager
        .sync_pods(&keep(&["pod-a", "pod-not-on-this-node"]), false)
        .await
        .unwrap();
    assert_eq!(freed, would, "what the dry run said");
    assert_eq!(node.journal_seq(), seq + 1, "one journal record");
    assert_eq!(node.pods(), ["pod-a"]);
    assert_eq!(node.manager.allocations()[0].device_ids, kept.device_ids);
    node.manager.wait_checkpoint().await.unwrap();
    let text = std::fs::read_to_string(node.manager.config().checkpoint_path()).unwrap();
    assert!(text.contains(r#""PodUID":"pod-a""#), "{text}");
    assert!(!text.contains("pod-b") && !text.contains("pod-c"), "{text}");

    // The freed devices are free again; the kept ones are not.
    let got = node.manager.allocate("pod-d", "ctr", GPU, 4).await.unwrap();
    for id in &got.device_ids {
        assert!(!kept.device_ids.contains(id), "{id} given twice");
    }

    // Nothing left to free: no record.
    let seq = node.journal_seq();
    assert!(
        node.manager
            .sync_pods(&keep(&["pod-a", "pod-d"]), false)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(node.journal_seq(), seq);

    // An empty keep list frees everything.
    let freed = node.manager.sync_pods(&keep(&[]), false).await.unwrap();
    assert_eq!(freed.len(), 2);
    assert!(node.manager.allocations().is_empty());
}

#[tokio::test]
async fn an_allocation_in_flight_for_a_pod_not_kept_is_freed_and_fails_as_released() {
    let node = Node::start().await;
    let plugin = node.plugin("gated.sock", 2, options(false, false));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    *plugin.state.allocate_gate.lock().unwrap() = Some(gate.clone());
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(GPU, 2).await;

    let manager = node.manager.clone();
    let in_flight = tokio::spawn(async move { manager.allocate("pod-gone", "ctr", GPU, 2).await });
    // The plugin's Allocate has been called: the devices are reserved.
    plugin.state.allocating.notified().await;
    let listed = node.manager.allocations();
    assert_eq!(listed.len(), 1);
    assert!(!listed[0].allocated, "still being allocated");

    let freed = node
        .manager
        .sync_pods(&keep(&["other"]), false)
        .await
        .unwrap();
    assert_eq!(entries(&freed), [("pod-gone", "ctr", 2)]);
    assert!(!freed[0].allocated);
    assert!(node.manager.allocations().is_empty());

    gate.add_permits(1);
    let err = in_flight.await.unwrap().unwrap_err();
    assert!(matches!(err, AllocateError::Released { .. }), "{err}");
    assert!(node.manager.allocations().is_empty(), "nothing held");
    gate.add_permits(1);
    let again = node.manager.allocate("pod-new", "ctr", GPU, 2).await;
    assert_eq!(again.unwrap().device_ids.len(), 2, "both devices free");
}
