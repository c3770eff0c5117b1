//! [`DeviceManager`]: the handle the daemon, the admin API and the plugin manager use, and the
//! state behind it.
//!
//! Who writes what:
//! - the state (`State`: devices per resource, what each container holds) sits behind one
//!   short `std` mutex, never held across an `.await`;
//! - endpoint tasks ([`crate::endpoint`]) only send [`Event`]s; the manager loop applies them;
//! - registrations ([`DeviceManager::connect`]) install endpoints, allocations
//!   ([`crate::allocator`]) reserve and commit pod devices;
//! - the checkpoint writer ([`crate::checkpoint`]) snapshots the state after every change.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use pluglet_checkpoint::Durability;
use pluglet_handler_runtime::{HandlerSet, PluginInfo, RegisteredPlugin};
use pluglet_proto::constants::{DEVICE_PLUGIN, DEVICE_PLUGIN_VERSION, KUBELET_SOCKET};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::{
    self, Checkpointer, Disk, JOURNAL_FILE_NAME, RestoreReport, SIDE_FILE_NAME, SideState,
};
use crate::devices::{Device, DeviceSet};
use crate::endpoint::{self, Endpoint, Event, Flow};
use crate::error::{RegisterError, StartError};
use crate::pod_devices::{Entry, EntryState, HolderKey, PodDevices};

/// How long a resource whose plugin disconnected stays (with its devices unhealthy) before it
/// is removed, unless the plugin registers again: the kubelet's `endpointStopGracePeriod`.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(5 * 60);

/// Time allowed to dial a plugin and for GetDevicePluginOptions to answer (the kubelet dials
/// with a 10 s blocking timeout).
pub const DEFAULT_DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// Settings of one device manager.
#[derive(Clone, Debug)]
pub struct Config {
    /// The device plugins directory: `kubelet.sock`, plugin sockets and the checkpoint.
    pub device_plugins_dir: PathBuf,
    /// Pluglet's state directory: the side file.
    pub state_dir: PathBuf,
    /// The node's name, passed to handlers.
    pub node_name: String,
    /// See [`DEFAULT_GRACE_PERIOD`].
    pub grace_period: Duration,
    /// See [`DEFAULT_DIAL_TIMEOUT`].
    pub dial_timeout: Duration,
    /// Whether checkpoint writes fsync ([`Durability::NoFsync`] only for benchmarks).
    pub durability: Durability,
}

impl Config {
    /// Kubelet defaults for everything but the two directories and the node name.
    pub fn new(device_plugins_dir: PathBuf, state_dir: PathBuf, node_name: String) -> Config {
        Config {
            device_plugins_dir,
            state_dir,
            node_name,
            grace_period: DEFAULT_GRACE_PERIOD,
            dial_timeout: DEFAULT_DIAL_TIMEOUT,
            durability: Durability::Fsync,
        }
    }

    /// `<device plugins dir>/kubelet.sock`.
    pub fn kubelet_socket(&self) -> PathBuf {
        self.device_plugins_dir.join(KUBELET_SOCKET)
    }

    /// `<device plugins dir>/kubelet_internal_checkpoint`.
    pub fn checkpoint_path(&self) -> PathBuf {
        pluglet_checkpoint::checkpoint_path(&self.device_plugins_dir)
    }

    /// `<state dir>/device-manager.json`.
    pub fn side_path(&self) -> PathBuf {
        self.state_dir.join(SIDE_FILE_NAME)
    }

    /// `<state dir>/device-manager.journal`.
    pub fn journal_path(&self) -> PathBuf {
        self.state_dir.join(JOURNAL_FILE_NAME)
    }
}

/// A resource whose plugin is gone: its devices are unhealthy until the plugin comes back or
/// the grace period ends.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stopped {
    /// Generation of the endpoint that stopped (0: restored from the checkpoint); the grace
    /// timer removes the resource only if this is still the latest stop.
    pub generation: u64,
}

/// One resource.
#[derive(Debug, Default)]
pub(crate) struct Resource {
    pub devices: DeviceSet,
    /// The connected plugin; `None` while stopped.
    pub endpoint: Option<Arc<Endpoint>>,
    /// Set while no plugin is connected.
    pub stopped: Option<Stopped>,
    /// What the plugin registered as (the `existing` of the next validate hook).
    pub registration: Option<RegisteredPlugin>,
}

/// Everything behind the state lock.
#[derive(Debug, Default)]
pub(crate) struct State {
    pub resources: BTreeMap<String, Resource>,
    pub pods: PodDevices,
}

/// A resource as the admin API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceInfo {
    /// Extended resource name.
    pub resource: String,
    /// Every device.
    pub capacity: usize,
    /// Healthy devices.
    pub allocatable: usize,
    /// The devices in plugin order.
    pub devices: Vec<Device>,
    /// Module id of the allocation policy in force.
    pub policy: String,
    /// The plugin's endpoint while connected.
    pub endpoint: Option<PathBuf>,
    /// Whether a plugin's ListAndWatch stream is live.
    pub connected: bool,
}

/// What one container holds of one resource, as the admin API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocationInfo {
    /// The pod.
    pub pod_uid: String,
    /// The container.
    pub container: String,
    /// The resource.
    pub resource: String,
    /// The devices.
    pub device_ids: Vec<String>,
    /// False while the plugin's Allocate is still running.
    pub allocated: bool,
}

impl AllocationInfo {
    /// The admin view of one pod devices entry.
    pub(crate) fn of(key: &HolderKey, entry: &Entry) -> AllocationInfo {
        AllocationInfo {
            pod_uid: key.pod_uid.clone(),
            container: key.container.clone(),
            resource: key.resource.clone(),
            device_ids: entry.devices.clone(),
            allocated: matches!(entry.state, EntryState::Allocated { .. }),
        }
    }
}

pub(crate) struct Inner {
    pub config: Config,
    pub handlers: Arc<HandlerSet>,
    state: Mutex<State>,
    pub events: mpsc::Sender<Event>,
    pub checkpoint: Checkpointer,
    /// The journal and what the checkpoint writer has put on disk (see [`Disk`]).
    pub disk: tokio::sync::Mutex<Disk>,
    /// Per resource: held while choosing devices, so two requests never choose the same ones.
    pub decisions: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    next_generation: AtomicU64,
    pub next_token: AtomicU64,
    /// Bumped after every change of devices or connections (for waiters).
    changed: watch::Sender<u64>,
    pub cancel: CancellationToken,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    report: RestoreReport,
}

/// The device manager: cheap to clone; every clone is the same manager.
#[derive(Clone)]
pub struct DeviceManager {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for DeviceManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceManager")
            .field("device_plugins_dir", &self.inner.config.device_plugins_dir)
            .finish_non_exhaustive()
    }
}

impl DeviceManager {
    /// Starts the device manager, as the kubelet's device manager starts (facts §7.1):
    ///
    /// 1. if `kubelet.sock` answers a connect, another kubelet-like process owns the directory:
    ///    fail with [`StartError::DirectoryInUse`] having touched nothing;
    /// 2. create the directory and remove every stale socket in it (never other files, so
    ///    neither the checkpoint nor a set-aside file): that is how plugins learn to register
    ///    again;
    /// 3. restore allocations and devices from the checkpoint and side file (a corrupt file is
    ///    set aside and the state starts empty: see [`DeviceManager::restore_report`]);
    /// 4. serve `v1beta1.Registration` on `kubelet.sock` (accepting Go plugins' path-like
    ///    `:authority`), watch the directory for removed plugin sockets, and run the manager
    ///    loop and the checkpoint writer until `cancel` fires.
    pub async fn start(
        config: Config,
        handlers: Arc<HandlerSet>,
        cancel: CancellationToken,
    ) -> Result<DeviceManager, StartError> {
        let kubelet_socket = config.kubelet_socket();
        crate::registration_server::check_not_in_use(&kubelet_socket)?;
        crate::registration_server::prepare_directory(&config.device_plugins_dir)?;
        let checkpoint_path = config.checkpoint_path();
        let side_path = config.side_path();
        let journal_path = config.journal_path();
        // A few small files, read once before anything is served.
        let opened = pluglet_checkpoint::Journal::open(&journal_path, config.durability)
            .map_err(StartError::Restore)?;
        let mut restored =
            checkpoint::restore(&checkpoint_path, &side_path, opened.record.as_ref())
                .map_err(StartError::Restore)?;
        if let Some(moved_to) = opened.set_aside {
            restored.report.set_aside.push(checkpoint::SetAside {
                path: journal_path,
                moved_to,
                reason: "not a Pluglet journal, or both of its slots are damaged".into(),
            });
        }
        if restored.report.from_journal {
            tracing::info!(
                "allocations restored from the journal: Pluglet stopped before the checkpoint caught up"
            );
        }
        for aside in &restored.report.set_aside {
            tracing::warn!(
                path = %aside.path.display(),
                moved_to = %aside.moved_to.display(),
                reason = %aside.reason,
                "corrupt device manager state set aside; starting empty"
            );
        }
        if restored.report.allocations > 0 || !restored.report.resources.is_empty() {
            tracing::info!(
                allocations = restored.report.allocations,
                resources = ?restored.report.resources,
                "device manager state restored; resources wait for their plugins"
            );
        }

        let mut state = State {
            resources: BTreeMap::new(),
            pods: restored.pods,
        };
        for (name, devices) in restored.resources {
            state.resources.insert(
                name,
                Resource {
                    devices,
                    endpoint: None,
                    stopped: Some(Stopped { generation: 0 }),
                    registration: None,
                },
            );
        }
        let restored_names: Vec<String> = state.resources.keys().cloned().collect();

        let (events, events_rx) = mpsc::channel(1024);
        let inner = Arc::new(Inner {
            config,
            handlers,
            state: Mutex::new(state),
            events,
            checkpoint: Checkpointer::default(),
            disk: tokio::sync::Mutex::new(Disk {
                journal: opened.journal,
                on_disk: Vec::new(),
                journaled: 0,
                unsynced: 0,
            }),
            decisions: Mutex::new(HashMap::new()),
            next_generation: AtomicU64::new(1),
            next_token: AtomicU64::new(1),
            changed: watch::Sender::new(0),
            cancel,
            tasks: Mutex::new(Vec::new()),
            report: restored.report,
        });
        let manager = DeviceManager { inner };

        let listener = pluglet_uds::bind(&kubelet_socket, Some(0o600)).map_err(StartError::Bind)?;
        let watcher = crate::registration_server::watch_directory(
            &manager.inner.config.device_plugins_dir,
            manager.inner.events.clone(),
        )?;
        let tasks = vec![
            tokio::spawn(manager.clone().run_loop(events_rx, watcher)),
            tokio::spawn(manager.clone().run_writer()),
            tokio::spawn(crate::registration_server::serve(
                manager.clone(),
                listener,
                kubelet_socket,
            )),
        ];
        for name in restored_names {
            manager.start_grace_timer(name, 0);
        }
        *manager.lock_tasks() = tasks;
        // The first write of this start, made to survive a power cut at once.
        let seq = manager.inner.checkpoint.request_devices();
        let written = match manager.inner.checkpoint.flush(seq).await {
            Ok(()) => manager.sync_dirs().await.map_err(Arc::new),
            Err(err) => Err(err),
        };
        if let Err(err) = written {
            tracing::error!(error = %crate::error::error_chain(&*err), "cannot write the device manager checkpoint");
        }
        tracing::info!(
            dir = %manager.inner.config.device_plugins_dir.display(),
            "device manager serving kubelet.sock"
        );
        Ok(manager)
    }

    /// What the start restored, and which corrupt files it set aside.
    pub fn restore_report(&self) -> &RestoreReport {
        &self.inner.report
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// A receiver that changes after every change of devices or plugin connections.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.inner.changed.subscribe()
    }

    /// Stops serving (cancels the token given to [`DeviceManager::start`]) and waits for the
    /// tasks, the last checkpoint write included. `kubelet.sock` is removed.
    pub async fn shutdown(&self) {
        self.inner.cancel.cancel();
        let tasks = std::mem::take(&mut *self.lock_tasks());
        for task in tasks {
            let _ = task.await;
        }
    }

    /// Writes both files now and waits until they are on disk.
    pub async fn flush_checkpoint(&self) -> Result<(), Arc<pluglet_checkpoint::CheckpointError>> {
        let seq = self.inner.checkpoint.request_devices();
        self.inner.checkpoint.flush(seq).await
    }

    /// Waits until every write requested so far (after every change so far) has finished,
    /// without asking for a new one.
    pub async fn wait_checkpoint(&self) -> Result<(), Arc<pluglet_checkpoint::CheckpointError>> {
        let seq = self.inner.checkpoint.requested();
        self.inner.checkpoint.flush(seq).await
    }

    /// Every resource, sorted by name.
    pub fn resources(&self) -> Vec<ResourceInfo> {
        let state = self.lock();
        state
            .resources
            .iter()
            .map(|(name, r)| ResourceInfo {
                resource: name.clone(),
                capacity: r.devices.capacity(),
                allocatable: r.devices.allocatable(),
                devices: r.devices.iter().cloned().collect(),
                policy: self.inner.handlers.for_resource(name).module().to_owned(),
                endpoint: r.endpoint.as_ref().map(|e| e.path.clone()),
                connected: r.endpoint.is_some(),
            })
            .collect()
    }

    /// Who holds what, sorted by pod, container and resource.
    pub fn allocations(&self) -> Vec<AllocationInfo> {
        let state = self.lock();
        state
            .pods
            .iter()
            .map(|(key, entry)| AllocationInfo::of(key, entry))
            .collect()
    }

    /// Connects a plugin found by the plugin watcher (its DevicePlugin handler has already
    /// accepted it): dial `endpoint` as-is, GetDevicePluginOptions, start ListAndWatch. A
    /// connected plugin for the same resource is replaced.
    pub async fn connect_watcher(
        &self,
        resource: String,
        endpoint: PathBuf,
    ) -> Result<(), RegisterError> {
        let info = PluginInfo {
            plugin_type: DEVICE_PLUGIN.to_owned(),
            name: resource.clone(),
            endpoint: endpoint.display().to_string(),
            supported_versions: vec![DEVICE_PLUGIN_VERSION.to_owned()],
        };
        let registration = RegisteredPlugin {
            info,
            version: Some(DEVICE_PLUGIN_VERSION.to_owned()),
        };
        self.connect(resource, endpoint, Flow::Watcher, registration)
            .await
    }

    /// Disconnects the watcher-registered plugin of `resource` at `endpoint` (its registration
    /// socket is gone): its devices turn unhealthy at once and the grace period starts. Does
    /// nothing if the resource is now served by another registration.
    pub async fn disconnect_watcher(&self, resource: String, endpoint: PathBuf) {
        let generation = {
            let state = self.lock();
            state
                .resources
                .get(&resource)
                .and_then(|r| r.endpoint.as_ref())
                .filter(|e| e.flow == Flow::Watcher && e.path == endpoint)
                .map(|e| e.generation)
        };
        if let Some(generation) = generation {
            self.disconnect(&resource, generation, "its registration socket was removed");
        }
    }

    /// Dials the plugin and installs it as the resource's endpoint (both flows).
    pub(crate) async fn connect(
        &self,
        resource: String,
        path: PathBuf,
        flow: Flow,
        registration: RegisteredPlugin,
    ) -> Result<(), RegisterError> {
        if self.inner.cancel.is_cancelled() {
            return Err(RegisterError::Stopped { resource });
        }
        let generation = self.inner.next_generation.fetch_add(1, Ordering::SeqCst);
        let cancel = self.inner.cancel.child_token();
        let endpoint = Endpoint::connect(
            &resource,
            path,
            flow,
            generation,
            self.inner.config.dial_timeout,
            cancel.clone(),
        )
        .await?;
        let (endpoint, opened) = endpoint;
        let options = endpoint.options;
        let endpoint = Arc::new(endpoint);
        {
            let mut state = self.lock();
            let entry = state.resources.entry(resource.clone()).or_default();
            if let Some(old) = entry.endpoint.replace(endpoint.clone()) {
                tracing::info!(
                    %resource,
                    old = %old.path.display(),
                    new = %endpoint.path.display(),
                    "device plugin registered again: the new endpoint replaces the old one"
                );
                old.cancel.cancel();
            }
            entry.stopped = None;
            entry.registration = Some(registration);
        }
        tokio::spawn(endpoint::run(
            self.clone(),
            resource.clone(),
            generation,
            opened,
            cancel,
        ));
        tracing::info!(
            %resource,
            endpoint = %endpoint.path.display(),
            ?flow,
            generation,
            pre_start_required = options.pre_start_required,
            get_preferred_allocation_available = options.get_preferred_allocation_available,
            "device plugin connected"
        );
        self.changed();
        Ok(())
    }

    /// Applies one ListAndWatch update (the full new list) if `generation` is still the
    /// resource's endpoint: visible at once, the checkpoint follows.
    pub(crate) fn apply_devices(&self, resource: &str, generation: u64, devices: Vec<Device>) {
        let changed = {
            let mut state = self.lock();
            match state.resources.get_mut(resource) {
                Some(entry)
                    if entry
                        .endpoint
                        .as_ref()
                        .is_some_and(|e| e.generation == generation) =>
                {
                    entry.devices.replace(devices)
                }
                _ => false,
            }
        };
        if changed {
            self.changed();
            self.inner.checkpoint.request_devices();
        }
    }

    /// Marks `resource` disconnected if `generation` is still its endpoint.
    fn disconnect(&self, resource: &str, generation: u64, reason: &str) {
        {
            let mut state = self.lock();
            let Some(entry) = state.resources.get_mut(resource) else {
                return;
            };
            match &entry.endpoint {
                Some(endpoint) if endpoint.generation == generation => {
                    endpoint.cancel.cancel();
                }
                _ => {
                    tracing::debug!(
                        resource,
                        generation,
                        reason,
                        "ignoring the end of a replaced endpoint"
                    );
                    return;
                }
            }
            entry.endpoint = None;
            entry.devices.mark_all_unhealthy();
            entry.stopped = Some(Stopped { generation });
        }
        tracing::warn!(
            resource,
            reason,
            grace_period = ?self.inner.config.grace_period,
            "device plugin disconnected: its devices are unhealthy until it registers again"
        );
        self.start_grace_timer(resource.to_owned(), generation);
        self.changed();
        self.inner.checkpoint.request_devices();
    }

    fn start_grace_timer(&self, resource: String, generation: u64) {
        let grace = self.inner.config.grace_period;
        let events = self.inner.events.clone();
        let cancel = self.inner.cancel.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = tokio::time::sleep(grace) => {
                    let _ = events.send(Event::GraceExpired { resource, generation }).await;
                }
            }
        });
    }

    /// The manager loop: applies endpoint events until cancelled.
    async fn run_loop(
        self,
        mut events: mpsc::Receiver<Event>,
        _watcher: notify::RecommendedWatcher,
    ) {
        loop {
            let event = tokio::select! {
                _ = self.inner.cancel.cancelled() => break,
                event = events.recv() => match event {
                    Some(event) => event,
                    None => break,
                },
            };
            match event {
                Event::StreamEnded {
                    resource,
                    generation,
                    reason,
                } => self.disconnect(&resource, generation, &reason),
                Event::SocketRemoved(path) => {
                    let gone: Vec<(String, u64)> = {
                        let state = self.lock();
                        state
                            .resources
                            .iter()
                            .filter_map(|(name, r)| {
                                r.endpoint
                                    .as_ref()
                                    .filter(|e| e.flow == Flow::Classic && e.path == path)
                                    .map(|e| (name.clone(), e.generation))
                            })
                            .collect()
                    };
                    for (resource, generation) in gone {
                        self.disconnect(&resource, generation, "its socket was removed");
                    }
                }
                Event::GraceExpired {
                    resource,
                    generation,
                } => {
                    let removed = {
                        let mut state = self.lock();
                        let expired = state.resources.get(&resource).is_some_and(|r| {
                            r.endpoint.is_none()
                                && r.stopped.is_some_and(|s| s.generation == generation)
                        });
                        if expired {
                            state.resources.remove(&resource);
                        }
                        expired
                    };
                    if removed {
                        tracing::info!(
                            %resource,
                            "device plugin did not come back within the grace period: resource removed"
                        );
                        self.changed();
                        self.inner.checkpoint.request_devices();
                    }
                }
            }
        }
    }

    /// The checkpoint writer: one write per batch of requests, and a last one at shutdown.
    async fn run_writer(self) {
        loop {
            let target = tokio::select! {
                target = self.inner.checkpoint.next_request() => target,
                _ = self.inner.cancel.cancelled() => {
                    if !self.inner.checkpoint.pending() {
                        break;
                    }
                    self.inner.checkpoint.next_request().await
                }
            };
            let write_side = self.inner.checkpoint.take_devices_changed();
            let (bytes, checksum, side) = {
                // Under the disk lock, so a journal record made after this snapshot names it.
                let mut disk = self.inner.disk.lock().await;
                let (data, side) = self.snapshot(write_side);
                let (bytes, checksum) = data.encode_with_checksum();
                disk.writing(checksum);
                (bytes, checksum, side)
            };
            let config = &self.inner.config;
            let result = pluglet_handler_runtime::run_in_place(|| {
                checkpoint::write_files(
                    &config.checkpoint_path(),
                    &config.side_path(),
                    &bytes,
                    side.as_ref(),
                    config.durability,
                )
            });
            let result = match result {
                Ok(()) => {
                    let sync = {
                        let mut disk = self.inner.disk.lock().await;
                        disk.written(checksum);
                        disk.needs_dir_sync()
                    };
                    if sync { self.sync_dirs().await } else { Ok(()) }
                }
                Err(err) => Err(err),
            };
            if let Err(err) = &result {
                tracing::error!(error = %crate::error::error_chain(err), "cannot write the device manager checkpoint");
            }
            self.inner.checkpoint.done(target, result.err());
        }
        if self.inner.disk.lock().await.unsynced > 0
            && let Err(err) = self.sync_dirs().await
        {
            tracing::error!(error = %crate::error::error_chain(&err), "cannot sync the device manager checkpoint");
        }
    }

    /// Fsyncs the directories of the checkpoint and the side file, so that the renames so far
    /// survive a power cut.
    async fn sync_dirs(&self) -> Result<(), pluglet_checkpoint::CheckpointError> {
        let config = &self.inner.config;
        if config.durability == Durability::Fsync {
            pluglet_handler_runtime::run_in_place(|| {
                pluglet_checkpoint::sync_parent(&config.checkpoint_path())?;
                pluglet_checkpoint::sync_parent(&config.side_path())
            })?;
        }
        self.inner.disk.lock().await.unsynced = 0;
        Ok(())
    }

    /// Makes the allocations as they are now durable (a journal record) before returning, and
    /// asks for a checkpoint write to follow. Concurrent callers share records: a record taken
    /// after a caller's change covers it.
    pub(crate) async fn persist_allocations(
        &self,
    ) -> Result<(), Arc<pluglet_checkpoint::CheckpointError>> {
        let result = {
            let mut disk = self.inner.disk.lock().await;
            let (version, payload) = {
                let state = self.lock();
                let version = state.pods.version();
                if version <= disk.journaled {
                    return Ok(());
                }
                (
                    version,
                    checkpoint::encode_journal(&disk.on_disk, &state.pods),
                )
            };
            let result = pluglet_handler_runtime::run_in_place(|| disk.journal.append(&payload));
            if result.is_ok() {
                disk.journaled = version;
            }
            result
        };
        self.inner.checkpoint.request();
        result.map_err(|err| {
            tracing::error!(error = %crate::error::error_chain(&err), "cannot write the allocation journal");
            Arc::new(err)
        })
    }

    /// The kubelet checkpoint, and the side file when `with_side`.
    fn snapshot(&self, with_side: bool) -> (pluglet_checkpoint::CheckpointData, Option<SideState>) {
        // Under the state lock only the (shared, copy-on-write) device sets and the allocations
        // are copied; sorting and encoding happen after it is released.
        let (resources, pods) = {
            let state = self.lock();
            let resources: Vec<(String, DeviceSet)> = state
                .resources
                .iter()
                .map(|(name, r)| (name.clone(), r.devices.clone()))
                .collect();
            (resources, state.pods.clone())
        };
        let data = checkpoint::kubelet_data(resources.iter().map(|(k, d)| (k, d)), &pods);
        let side = with_side.then(|| SideState {
            resources: resources
                .iter()
                .map(|(name, devices)| {
                    let policy = self.inner.handlers.for_resource(name);
                    (
                        name.clone(),
                        checkpoint::side_resource(devices, policy.module(), policy.sha256()),
                    )
                })
                .collect(),
        });
        (data, side)
    }

    /// Capacity and allocatable of `resource`, if known (cheaper than [`DeviceManager::resources`]).
    pub fn counts(&self, resource: &str) -> Option<(usize, usize)> {
        self.lock()
            .resources
            .get(resource)
            .map(|r| (r.devices.capacity(), r.devices.allocatable()))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_tasks(&self) -> MutexGuard<'_, Vec<JoinHandle<()>>> {
        self.inner.tasks.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn changed(&self) {
        self.inner.changed.send_modify(|n| *n += 1);
    }

    /// The device plugins directory.
    pub fn device_plugins_dir(&self) -> &Path {
        &self.inner.config.device_plugins_dir
    }
}
