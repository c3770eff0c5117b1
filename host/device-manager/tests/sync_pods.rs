//! `DeviceManager::sync_pods`: the devices of pods no longer active are freed in one state
//! change and one journal record, in-flight allocations of those pods included; a dry run
//! changes nothing.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use pluglet_core::PodUid;
use pluglet_device_manager::stub::{Stub, devices};
use pluglet_device_manager::{AllocateError, AllocationInfo, Config, DeviceManager, Durability};
use pluglet_handler_runtime::{HandlerSet, ModuleSource, Runtime, RuntimeConfig};
use pluglet_proto::v1beta1;
use pluglet_proto::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use pluglet_registration::Pipeline;
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;

const GPU: &str = "vendor.com/gpu";

fn handlers() -> Arc<HandlerSet> {
    let builtin = || ModuleSource::Builtin {
        name: "device-plugin".into(),
        bytes: pluglet_wasm_guests::DEVICE_PLUGIN,
    };
    let runtime = Runtime::new(RuntimeConfig::default()).unwrap();
    Arc::new(
        HandlerSet::load(
            &runtime,
            Path::new("/nonexistent"),
            vec![("DevicePlugin".into(), builtin())],
            builtin(),
        )
        .unwrap(),
    )
}

struct Node {
    root: tempfile::TempDir,
    manager: DeviceManager,
}

impl Node {
    async fn start() -> Node {
        let root = tempfile::tempdir().unwrap();
        let mut config = Config::new(
            root.path().join("device-plugins"),
            root.path().join("state"),
            "node-1".into(),
        );
        config.durability = Durability::NoFsync;
        let pipeline = Pipeline::new(handlers(), "node-1");
        let manager = DeviceManager::start(config, pipeline, CancellationToken::new())
            .await
            .unwrap();
        Node { root, manager }
    }

    fn dp_dir(&self) -> PathBuf {
        self.root.path().join("device-plugins")
    }

    fn kubelet_socket(&self) -> PathBuf {
        self.dp_dir().join("kubelet.sock")
    }

    /// Waits (10 s at most) until `GPU` has `n` allocatable devices.
    async fn wait_allocatable(&self, n: usize) {
        let mut changes = self.manager.changes();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while self.manager.counts(GPU).is_none_or(|(_, a)| a != n) {
            tokio::time::timeout_at(deadline, changes.changed())
                .await
                .unwrap_or_else(|_| panic!("{GPU} never had {n} allocatable devices"))
                .unwrap();
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
}

fn keep(uids: &[&str]) -> BTreeSet<PodUid> {
    uids.iter().map(|s| PodUid::from(*s)).collect()
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
    let plugin = Stub::start(
        &node.dp_dir().join("gpu.sock"),
        devices(6, 2),
        v1beta1::DevicePluginOptions::default(),
    );
    plugin.register(&node.kubelet_socket(), GPU).await.unwrap();
    node.wait_allocatable(6).await;
    let kept = node.manager.allocate("pod-a", "ctr", GPU, 2).await.unwrap();
    node.manager.allocate("pod-b", "one", GPU, 1).await.unwrap();
    node.manager.allocate("pod-b", "two", GPU, 1).await.unwrap();
    node.manager.allocate("pod-c", "ctr", GPU, 2).await.unwrap();
    let held = node.manager.allocations();

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
    let plugin = GatedPlugin::start(&node.dp_dir().join("gated.sock"));
    plugin.register(&node.kubelet_socket()).await;
    node.wait_allocatable(2).await;

    let manager = node.manager.clone();
    let in_flight = tokio::spawn(async move { manager.allocate("pod-gone", "ctr", GPU, 2).await });
    // The plugin's Allocate has been called: the devices are reserved.
    plugin.allocating.lock().await.recv().await.unwrap();
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

    plugin.gate.add_permits(1);
    let err = in_flight.await.unwrap().unwrap_err();
    assert!(matches!(err, AllocateError::Released { .. }), "{err}");
    assert!(node.manager.allocations().is_empty(), "nothing held");
    plugin.gate.add_permits(1);
    let again = node.manager.allocate("pod-new", "ctr", GPU, 2).await;
    assert_eq!(again.unwrap().device_ids.len(), 2, "both devices free");
}

/// A device plugin with two devices whose Allocate waits for a permit of `gate` and reports on
/// `allocating` when it is called.
struct GatedPlugin {
    socket: PathBuf,
    gate: Arc<Semaphore>,
    allocating: tokio::sync::Mutex<mpsc::UnboundedReceiver<()>>,
    cancel: CancellationToken,
}

impl GatedPlugin {
    fn start(socket: &Path) -> GatedPlugin {
        let listener = pluglet_uds::bind(socket, None).unwrap();
        let gate = Arc::new(Semaphore::new(0));
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let service = DevicePluginServer::new(GatedService {
            gate: gate.clone(),
            allocating: tx,
            cancel: cancel.clone(),
        });
        let stop = cancel.clone();
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(
                    pluglet_uds::incoming(listener),
                    stop.cancelled_owned(),
                )
                .await;
        });
        GatedPlugin {
            socket: socket.to_owned(),
            gate,
            allocating: tokio::sync::Mutex::new(rx),
            cancel,
        }
    }

    async fn register(&self, kubelet_socket: &Path) {
        let channel = pluglet_uds::connect(kubelet_socket, Duration::from_secs(10))
            .await
            .unwrap();
        v1beta1::registration_client::RegistrationClient::new(channel)
            .register(v1beta1::RegisterRequest {
                version: pluglet_proto::constants::DEVICE_PLUGIN_VERSION.into(),
                endpoint: self.socket.file_name().unwrap().to_string_lossy().into(),
                resource_name: GPU.into(),
                options: None,
            })
            .await
            .unwrap();
    }
}

impl Drop for GatedPlugin {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

struct GatedService {
    gate: Arc<Semaphore>,
    allocating: mpsc::UnboundedSender<()>,
    cancel: CancellationToken,
}

type DeviceStream =
    Pin<Box<dyn Stream<Item = Result<v1beta1::ListAndWatchResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for GatedService {
    async fn get_device_plugin_options(
        &self,
        _: tonic::Request<v1beta1::Empty>,
    ) -> Result<tonic::Response<v1beta1::DevicePluginOptions>, tonic::Status> {
        Ok(tonic::Response::new(Default::default()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: tonic::Request<v1beta1::Empty>,
    ) -> Result<tonic::Response<Self::ListAndWatchStream>, tonic::Status> {
        let first = Ok(v1beta1::ListAndWatchResponse {
            devices: devices(2, 0),
        });
        let cancel = self.cancel.clone();
        let stream = tokio_stream::StreamExt::chain(
            tokio_stream::once(first),
            // Open until the plugin stops.
            tokio_stream::wrappers::ReceiverStream::new({
                let (tx, rx) = mpsc::channel(1);
                tokio::spawn(async move {
                    cancel.cancelled().await;
                    drop(tx);
                });
                rx
            }),
        );
        Ok(tonic::Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        _: tonic::Request<v1beta1::PreferredAllocationRequest>,
    ) -> Result<tonic::Response<v1beta1::PreferredAllocationResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not offered"))
    }

    async fn allocate(
        &self,
        request: tonic::Request<v1beta1::AllocateRequest>,
    ) -> Result<tonic::Response<v1beta1::AllocateResponse>, tonic::Status> {
        let _ = self.allocating.send(());
        self.gate
            .acquire()
            .await
            .map_err(|_| tonic::Status::unavailable("closed"))?
            .forget();
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|_| v1beta1::ContainerAllocateResponse::default())
            .collect();
        Ok(tonic::Response::new(v1beta1::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: tonic::Request<v1beta1::PreStartContainerRequest>,
    ) -> Result<tonic::Response<v1beta1::PreStartContainerResponse>, tonic::Status> {
        Ok(tonic::Response::new(Default::default()))
    }
}
