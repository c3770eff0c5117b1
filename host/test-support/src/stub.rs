//! An in-process device plugin for tests and benchmarks (the kubelet's `plugin/v1beta1/stub.go`).
//!
//! [`Stub::start`] serves `v1beta1.DevicePlugin` on a socket; [`Stub::set_devices`] sends a new
//! full list on every open ListAndWatch stream; [`Stub::register`] calls Register on a
//! `kubelet.sock`. Allocate answers env `STUB_DEVICES=<ids joined by ,>`. The end-to-end tests
//! use the real `example-device-plugin` binary instead. [`next_event`] waits for an event of the
//! device manager or the registration pipeline.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pluglet_proto::v1beta1;
use pluglet_proto::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use tokio::sync::{Notify, Semaphore, broadcast, watch};
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;

/// What the stub answers and records.
#[derive(Debug, Default)]
pub struct StubState {
    /// Options returned by GetDevicePluginOptions.
    pub options: Mutex<v1beta1::DevicePluginOptions>,
    /// GetPreferredAllocation answers these ids when set.
    pub preferred: Mutex<Option<Vec<String>>>,
    /// Allocate fails when set.
    pub fail_allocate: AtomicBool,
    /// Allocate calls seen.
    pub allocate_calls: AtomicUsize,
    /// PreStartContainer calls seen.
    pub pre_start_calls: AtomicUsize,
    /// GetPreferredAllocation calls seen.
    pub preferred_calls: AtomicUsize,
    /// When set, Allocate waits for a permit of this semaphore before answering (the call is
    /// counted and announced on [`StubState::allocating`] first).
    pub allocate_gate: Mutex<Option<Arc<Semaphore>>>,
    /// Notified when an Allocate call arrives.
    pub allocating: Notify,
    /// When set, Allocate answers this for every container instead of the stub's own answer.
    pub allocate_answer: Mutex<Option<v1beta1::ContainerAllocateResponse>>,
    /// The containers each Allocate call asked for, in the order of the calls.
    pub allocate_sizes: Mutex<Vec<usize>>,
    /// When set, Allocate answers only the first container of a call (a plugin that does not
    /// loop over `container_requests`).
    pub answer_first_only: AtomicBool,
    /// When set, an Allocate call that asks for this device fails whole.
    pub refuse_device: Mutex<Option<String>>,
}

/// A running stub plugin; stops (and ends its streams) when dropped or [`Stub::stop`]ped.
#[derive(Debug)]
pub struct Stub {
    /// Its socket.
    pub socket: PathBuf,
    /// What it answers and records.
    pub state: Arc<StubState>,
    devices: watch::Sender<Vec<v1beta1::Device>>,
    cancel: CancellationToken,
}

/// `n` healthy devices `d0`… spread round-robin over `numa_nodes` nodes (0: no topology).
pub fn devices(n: usize, numa_nodes: i64) -> Vec<v1beta1::Device> {
    (0..n)
        .map(|i| v1beta1::Device {
            id: format!("d{i}"),
            health: pluglet_proto::constants::HEALTHY.into(),
            topology: (numa_nodes > 0).then(|| v1beta1::TopologyInfo {
                nodes: vec![v1beta1::NumaNode {
                    id: i as i64 % numa_nodes,
                }],
            }),
        })
        .collect()
}

impl Stub {
    /// Serves on `socket` with `devices`.
    pub fn start(
        socket: &Path,
        devices: Vec<v1beta1::Device>,
        options: v1beta1::DevicePluginOptions,
    ) -> Stub {
        let listener = pluglet_uds::bind(socket, None).expect("bind the stub plugin socket");
        let state = Arc::new(StubState {
            options: Mutex::new(options),
            ..Default::default()
        });
        let (tx, _) = watch::channel(devices);
        let cancel = CancellationToken::new();
        let service = DevicePluginServer::new(StubService {
            state: state.clone(),
            devices: tx.clone(),
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
        Stub {
            socket: socket.to_path_buf(),
            state,
            devices: tx,
            cancel,
        }
    }

    /// Sends `devices` as the new full list.
    pub fn set_devices(&self, devices: Vec<v1beta1::Device>) {
        self.devices.send_replace(devices);
    }

    /// Calls Register for `resource` on `kubelet_socket`, with this stub's socket file name as
    /// the endpoint.
    pub async fn register(
        &self,
        kubelet_socket: &Path,
        resource: &str,
    ) -> Result<(), tonic::Status> {
        let channel = pluglet_uds::connect(kubelet_socket, Duration::from_secs(10))
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let mut client = v1beta1::registration_client::RegistrationClient::new(channel);
        client
            .register(v1beta1::RegisterRequest {
                version: pluglet_proto::constants::DEVICE_PLUGIN_VERSION.into(),
                endpoint: self
                    .socket
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                resource_name: resource.into(),
                options: None,
            })
            .await
            .map(|_| ())
    }

    /// Stops serving and ends every ListAndWatch stream.
    pub fn stop(&self) {
        self.cancel.cancel();
    }
}

impl Drop for Stub {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

struct StubService {
    state: Arc<StubState>,
    devices: watch::Sender<Vec<v1beta1::Device>>,
    cancel: CancellationToken,
}

type DeviceStream =
    Pin<Box<dyn Stream<Item = Result<v1beta1::ListAndWatchResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for StubService {
    async fn get_device_plugin_options(
        &self,
        _request: tonic::Request<v1beta1::Empty>,
    ) -> Result<tonic::Response<v1beta1::DevicePluginOptions>, tonic::Status> {
        let options = *self.state.options.lock().unwrap_or_else(|e| e.into_inner());
        Ok(tonic::Response::new(options))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _request: tonic::Request<v1beta1::Empty>,
    ) -> Result<tonic::Response<Self::ListAndWatchStream>, tonic::Status> {
        let cancel = self.cancel.clone();
        let mut updates = self.devices.subscribe();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            loop {
                let devices = updates.borrow_and_update().clone();
                if tx
                    .send(Ok(v1beta1::ListAndWatchResponse { devices }))
                    .await
                    .is_err()
                {
                    return;
                }
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    changed = updates.changed() => if changed.is_err() { return },
                }
            }
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        Ok(tonic::Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: tonic::Request<v1beta1::PreferredAllocationRequest>,
    ) -> Result<tonic::Response<v1beta1::PreferredAllocationResponse>, tonic::Status> {
        self.state.preferred_calls.fetch_add(1, Ordering::SeqCst);
        let preferred = self
            .state
            .preferred
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|_| v1beta1::ContainerPreferredAllocationResponse {
                device_i_ds: preferred.clone().unwrap_or_default(),
            })
            .collect();
        Ok(tonic::Response::new(v1beta1::PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: tonic::Request<v1beta1::AllocateRequest>,
    ) -> Result<tonic::Response<v1beta1::AllocateResponse>, tonic::Status> {
        self.state.allocate_calls.fetch_add(1, Ordering::SeqCst);
        self.state
            .allocate_sizes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(request.get_ref().container_requests.len());
        self.state.allocating.notify_one();
        let gate = current(&self.state.allocate_gate);
        if let Some(gate) = gate {
            gate.acquire()
                .await
                .map_err(|_| tonic::Status::unavailable("stub: stopped"))?
                .forget();
        }
        if self.state.fail_allocate.load(Ordering::SeqCst) {
            return Err(tonic::Status::internal("stub: Allocate fails on purpose"));
        }
        let refused = current(&self.state.refuse_device);
        if let Some(refused) = refused {
            let asked = request.get_ref().container_requests.iter();
            if asked.flat_map(|r| &r.devices_ids).any(|id| *id == refused) {
                return Err(tonic::Status::invalid_argument(format!(
                    "stub: device {refused} is refused on purpose"
                )));
            }
        }
        let first_only = self.state.answer_first_only.load(Ordering::SeqCst);
        let fixed = current(&self.state.allocate_answer);
        let container_responses = request
            .into_inner()
            .container_requests
            .into_iter()
            .take(if first_only { 1 } else { usize::MAX })
            .map(|r| {
                fixed
                    .clone()
                    .unwrap_or_else(|| v1beta1::ContainerAllocateResponse {
                        envs: [("STUB_DEVICES".to_string(), r.devices_ids.join(","))].into(),
                        ..Default::default()
                    })
            })
            .collect();
        Ok(tonic::Response::new(v1beta1::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _request: tonic::Request<v1beta1::PreStartContainerRequest>,
    ) -> Result<tonic::Response<v1beta1::PreStartContainerResponse>, tonic::Status> {
        self.state.pre_start_calls.fetch_add(1, Ordering::SeqCst);
        Ok(tonic::Response::new(v1beta1::PreStartContainerResponse {}))
    }
}

/// Waits (10 s at most) for the first event `pick` accepts.
pub async fn next_event<E: Clone, T>(
    events: &mut broadcast::Receiver<E>,
    what: &str,
    mut pick: impl FnMut(E) -> Option<T>,
) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Ok(event)) => {
                if let Some(found) = pick(event) {
                    return found;
                }
            }
            Ok(Err(err)) => panic!("event stream broke waiting for {what}: {err}"),
            Err(_) => panic!("timed out waiting for {what}"),
        }
    }
}

/// A copy of what `value` holds now (a poisoned lock still holds it).
fn current<T: Clone>(value: &Mutex<T>) -> T {
    value.lock().unwrap_or_else(|e| e.into_inner()).clone()
}
