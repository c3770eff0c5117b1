//! [`DeviceManager`]: the cheap handle the daemon, the admin API and tests use, and the wiring
//! of the parts behind it. Each part owns its state and is reached through a narrow handle:
//!
//! - [`Registry`] owns the resources, their devices and endpoints; endpoint tasks and grace
//!   timers hold a registry handle, nothing more;
//! - [`Allocator`] owns who holds which devices and serialises decisions per resource;
//! - [`Persistence`] owns the files and says when a change is durable; the others only ask it
//!   for writes;
//! - the `kubelet.sock` door and the plugin watcher both register through the daemon's
//!   [`Pipeline`]; the device plugin type's steps in it ([`DevicePluginKind`]) connect and
//!   disconnect endpoints in the registry.
//!
//! Every task (endpoint streams, grace timers, the checkpoint writer, the `kubelet.sock`
//! server, the loop below) runs on one [`TaskTracker`] and stops when the cancel token given
//! to [`DeviceManager::start`] fires; [`DeviceManager::shutdown`] waits for all of them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use pluglet_checkpoint::{CheckpointError, Durability};
use pluglet_core::events::{EventKind, EventLog};
use pluglet_core::{ContainerName, PluginType, PodUid, ResourceName, error_chain};
use pluglet_handlers::Handlers;
use pluglet_proto::constants::KUBELET_SOCKET;
use pluglet_registration::{EndReason, Pipeline, Registration};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::allocator::{Allocation, AllocationInfo, Allocator};
use crate::cdi::{Handoff, Reconciled};
use crate::devices::DeviceSet;
use crate::error::{AllocateError, ReleaseError, StartError};
use crate::keep_list::KeepList;
use crate::kind::DevicePluginKind;
use crate::persistence::files::{KubeletCheckpoint, SideResource, SideState};
use crate::persistence::restore::RestoreReport;
use crate::persistence::{
    JOURNAL_FILE_NAME, Paths, Persistence, SIDE_FILE_NAME, SideSource, Snapshot,
};
use crate::pod_devices::{HolderKey, PodDevices, PodName};
use crate::registry::{Registry, ResourceInfo, Settings};

/// How long a resource whose plugin disconnected stays (with its devices unhealthy) before it
/// is removed, unless the plugin registers again: the kubelet's `endpointStopGracePeriod`.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(5 * 60);

/// Time allowed to dial a plugin and for GetDevicePluginOptions to answer (the kubelet dials
/// with a 10 s blocking timeout).
pub const DEFAULT_DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// The most containers one Allocate call asks a plugin for (16). A plugin has one Allocate
/// call at a time, as from the kubelet; the allocations that reach it while a call runs are
/// asked for together in the next (see `endpoint::allocate_calls`). 1 asks for one container
/// per call, as the kubelet does.
pub const DEFAULT_ALLOCATE_BATCH: usize = 16;

/// Settings of one device manager.
#[derive(Clone, Debug)]
pub struct Config {
    /// The device plugins directory: `kubelet.sock`, plugin sockets and the checkpoint.
    pub device_plugins_dir: PathBuf,
    /// Pluglet's state directory: the side file and the journal.
    pub state_dir: PathBuf,
    /// The node's name, passed to allocation policies.
    pub node_name: String,
    /// See [`DEFAULT_GRACE_PERIOD`].
    pub grace_period: Duration,
    /// See [`DEFAULT_DIAL_TIMEOUT`].
    pub dial_timeout: Duration,
    /// See [`DEFAULT_ALLOCATE_BATCH`].
    pub allocate_batch: usize,
    /// Whether checkpoint writes fsync ([`Durability::NoFsync`] only for benchmarks).
    pub durability: Durability,
    /// Where the device manager counts (register [`crate::Metrics`] to export them).
    pub metrics: crate::Metrics,
    /// Where connections, allocations and releases are recorded (a log of its own unless the
    /// daemon's is given).
    pub events: EventLog,
    /// Where each allocation is written as a CDI spec for container runtimes (see
    /// [`crate::cdi`]); `None` (the library's default) writes none.
    pub cdi_spec_dir: Option<PathBuf>,
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
            allocate_batch: DEFAULT_ALLOCATE_BATCH,
            durability: Durability::Fsync,
            metrics: crate::Metrics::default(),
            events: EventLog::default(),
            cdi_spec_dir: None,
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

    fn paths(&self) -> Paths {
        Paths {
            checkpoint: self.checkpoint_path(),
            side: self.side_path(),
            journal: self.journal_path(),
        }
    }
}

struct Inner {
    config: Config,
    handlers: Handlers,
    registry: Registry,
    allocator: Allocator,
    persistence: Persistence,
    cancel: CancellationToken,
    tasks: TaskTracker,
    report: RestoreReport,
    stopped: watch::Receiver<Option<String>>,
}

/// The device manager: cheap to clone; every clone is the same manager.
#[derive(Clone)]
pub struct DeviceManager {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for DeviceManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceManager")
            .field("device_plugins_dir", &self.inner.config.device_plugins_dir)
            .finish_non_exhaustive()
    }
}

impl DeviceManager {
    /// Starts the device manager, as the kubelet's device manager starts (see
    /// `docs/kubelet-compatibility.md`, "Device plugins directory at start-up"):
    ///
    /// 1. if `kubelet.sock` answers a connect, another kubelet-like process owns the directory:
    ///    fail with [`StartError::DirectoryInUse`] having touched nothing;
    /// 2. create the directory and remove every stale socket in it (never other files, so
    ///    neither the checkpoint nor a set-aside file): that is how plugins learn to register
    ///    again;
    /// 3. restore allocations and devices from the checkpoint, side file and journal (a
    ///    corrupt file is set aside: see [`DeviceManager::restore_report`]);
    /// 4. give `pipeline` the device plugin type's steps, serve `v1beta1.Registration` on
    ///    `kubelet.sock` through it, watch the directory for removed plugin sockets, and run
    ///    the checkpoint writer until `cancel` fires.
    pub async fn start(
        config: Config,
        pipeline: Pipeline,
        cancel: CancellationToken,
    ) -> Result<DeviceManager, StartError> {
        let kubelet_socket = config.kubelet_socket();
        crate::registration_server::check_not_in_use(&kubelet_socket)?;
        crate::registration_server::prepare_directory(&config.device_plugins_dir)?;
        // A few small files, read once before anything is served.
        let (persistence, restored) =
            Persistence::open(config.paths(), config.durability, config.metrics.clone())
                .map_err(StartError::Restore)?;
        log_restore(&restored.report, &config.events);

        let tasks = TaskTracker::new();
        let (ended_tx, ended_rx) = mpsc::unbounded_channel();
        let registry = Registry::new(
            restored.resources,
            Settings {
                grace_period: config.grace_period,
                dial_timeout: config.dial_timeout,
                allocate_batch: config.allocate_batch,
            },
            persistence.requests(),
            cancel.clone(),
            tasks.clone(),
            ended_tx,
            config.events.clone(),
        );
        let handlers = pipeline.handlers().clone();
        let cdi = config.cdi_spec_dir.clone().map(Handoff::new);
        if let Some(cdi) = &cdi {
            log_cdi(cdi, &cdi.reconcile(&restored.pods));
        }
        let allocator = Allocator::new(
            restored.pods,
            registry.clone(),
            persistence.clone(),
            handlers.clone(),
            config.node_name.clone(),
            config.metrics.clone(),
            cdi,
            cancel.clone(),
        );
        pipeline.set_kind(
            PluginType::DevicePlugin,
            Arc::new(DevicePluginKind {
                registry: registry.clone(),
                device_plugins_dir: config.device_plugins_dir.clone(),
            }),
        );

        let listener = pluglet_uds::bind(&kubelet_socket, Some(0o600)).map_err(StartError::Bind)?;
        let (removed_tx, removed_rx) = mpsc::channel(1024);
        let watcher =
            crate::registration_server::watch_directory(&config.device_plugins_dir, removed_tx)?;
        let (stopped_tx, stopped) = watch::channel(None);
        let stages = Stages {
            tasks: tasks.clone(),
            cancel: cancel.clone(),
            stopped: Arc::new(stopped_tx),
        };
        let writer = persistence
            .spawn_writer(
                snapshot_source(&registry, &allocator, &handlers),
                cancel.clone(),
            )
            .map_err(StartError::Writer)?;
        stages.spawn("checkpoint writer", writer);
        stages.spawn(
            "device manager loop",
            run_loop(
                registry.clone(),
                pipeline.clone(),
                removed_rx,
                ended_rx,
                watcher,
                cancel.clone(),
                tasks.clone(),
            ),
        );
        stages.spawn(
            "kubelet.sock server",
            crate::registration_server::serve(
                pipeline,
                listener,
                kubelet_socket,
                config.metrics.clone(),
                cancel.clone(),
            ),
        );
        // The first write of this start, made to survive a power cut at once.
        if let Err(err) = persistence.write_now().await {
            tracing::error!(error = %error_chain(&*err), "cannot write the device manager checkpoint");
        }
        tracing::info!(
            dir = %config.device_plugins_dir.display(),
            "device manager serving kubelet.sock"
        );
        Ok(DeviceManager {
            inner: Arc::new(Inner {
                config,
                handlers,
                registry,
                allocator,
                persistence,
                cancel,
                tasks,
                report: restored.report,
                stopped,
            }),
        })
    }

    /// Resolves when one of the device manager's own tasks (the loop, the `kubelet.sock`
    /// server, the checkpoint writer) ended before the cancel token fired, with what ended and
    /// why; pending otherwise.
    pub async fn stopped(&self) -> String {
        let mut stopped = self.inner.stopped.clone();
        let cause = match stopped.wait_for(Option::is_some).await {
            Ok(cause) => cause.clone(),
            Err(_) => None,
        };
        match cause {
            Some(cause) => cause,
            None => std::future::pending().await,
        }
    }

    /// What the start restored, and which corrupt files it set aside.
    pub fn restore_report(&self) -> &RestoreReport {
        &self.inner.report
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The device plugins directory.
    pub fn device_plugins_dir(&self) -> &Path {
        &self.inner.config.device_plugins_dir
    }

    /// A receiver that changes after every change of devices or plugin connections.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.inner.registry.changes()
    }

    /// What happens to resources from now on (connections, disconnections, grace periods).
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<crate::registry::RegistryEvent> {
        self.inner.registry.subscribe()
    }

    /// Stops serving (cancels the token given to [`DeviceManager::start`]) and waits for every
    /// task, the last checkpoint write included. `kubelet.sock` is removed.
    pub async fn shutdown(&self) {
        self.inner.cancel.cancel();
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
    }

    /// Writes both files now and waits until they are on disk.
    pub async fn flush_checkpoint(&self) -> Result<(), Arc<CheckpointError>> {
        let requests = self.inner.persistence.requests();
        let seq = requests.devices_changed();
        requests.flush(seq).await
    }

    /// Waits until every write requested so far (after every change so far) has finished,
    /// without asking for a new one.
    pub async fn wait_checkpoint(&self) -> Result<(), Arc<CheckpointError>> {
        let requests = self.inner.persistence.requests();
        requests.flush(requests.requested()).await
    }

    /// Every resource, sorted by name.
    pub fn resources(&self) -> Vec<ResourceInfo> {
        self.inner.registry.views(&self.inner.handlers)
    }

    /// Every resource's capacity and allocatable, sorted by name: what the node offers (a
    /// resource whose plugin is gone counts its devices as unhealthy until its grace period
    /// ends, then is absent).
    pub fn all_counts(&self) -> Vec<(ResourceName, usize, usize)> {
        self.inner.registry.all_counts()
    }

    /// Capacity and allocatable of `resource`, if known (cheaper than [`DeviceManager::resources`]).
    pub fn counts(&self, resource: &str) -> Option<(usize, usize)> {
        self.inner.registry.counts(resource)
    }

    /// Who holds what, sorted by pod, container and resource.
    pub fn allocations(&self) -> Vec<AllocationInfo> {
        self.inner.allocator.allocations()
    }

    /// The allocations as of the newest change made durable: a shared, immutable copy, read
    /// without the allocator's lock (the pod-resources API answers from it).
    pub fn acknowledged(&self) -> Arc<PodDevices> {
        self.inner.persistence.acknowledged()
    }

    /// Every resource's devices (shared, not copied).
    pub fn device_sets(&self) -> Vec<(ResourceName, DeviceSet)> {
        self.inner.registry.device_sets()
    }

    /// Allocates `count` devices of `resource` to one container: the same ones again if it
    /// holds them already; answered once the allocation is durable (see [`crate::allocator`]).
    pub async fn allocate(
        &self,
        pod_uid: impl Into<PodUid>,
        container: impl Into<ContainerName>,
        resource: impl Into<ResourceName>,
        count: u32,
    ) -> Result<Allocation, AllocateError> {
        self.allocate_named(pod_uid, container, resource, count, None)
            .await
    }

    /// [`DeviceManager::allocate`] for a pod with a name and namespace (`None`: the ones
    /// recorded with the pod's other allocations, else its UID and `default`), as the
    /// pod-resources API shows it.
    pub async fn allocate_named(
        &self,
        pod_uid: impl Into<PodUid>,
        container: impl Into<ContainerName>,
        resource: impl Into<ResourceName>,
        count: u32,
        pod: Option<PodName>,
    ) -> Result<Allocation, AllocateError> {
        self.inner
            .allocator
            .allocate(HolderKey::new(pod_uid, container, resource), count, pod)
            .await
    }

    /// Releases what `pod_uid` holds (only `container`'s when given); returns the number of
    /// (container, resource) entries released, once that is durable. A release that cannot be
    /// recorded on disk is refused ([`ReleaseError`]): nothing is released.
    pub async fn release(
        &self,
        pod_uid: &str,
        container: Option<&str>,
    ) -> Result<usize, ReleaseError> {
        self.release_entries(pod_uid, container)
            .await
            .map(|released| released.len())
    }

    /// Like [`DeviceManager::release`], returning the entries released.
    pub async fn release_entries(
        &self,
        pod_uid: &str,
        container: Option<&str>,
    ) -> Result<Vec<AllocationInfo>, ReleaseError> {
        match self.inner.allocator.release(pod_uid, container).await {
            Ok(released) => Ok(released),
            Err(err) => {
                tracing::error!(error = %error_chain(&err), "release refused: cannot record it on disk");
                Err(err)
            }
        }
    }

    /// Releases, in one durable step, every allocation of a pod not in `keep` (the kubelet
    /// frees the devices of pods that are no longer active the same way); returns what was
    /// freed. With `dry_run`, frees nothing and returns what would be freed.
    pub async fn sync_pods(
        &self,
        keep: &KeepList,
        dry_run: bool,
    ) -> Result<Vec<AllocationInfo>, ReleaseError> {
        self.inner.allocator.sync_pods(keep, dry_run).await
    }
}

/// Logs what the start restored, and for each corrupt file kept aside also records a
/// `state_set_aside` event: what was wrong, where the copy is, what was recovered and lost.
fn log_cdi(cdi: &Handoff, report: &Reconciled) {
    let dir = cdi.dir().display();
    for error in &report.errors {
        tracing::error!(%dir, error = %error, "CDI spec directory not converged");
    }
    tracing::info!(
        %dir,
        written = report.written,
        removed = report.removed,
        kept = report.kept,
        "CDI specs of the restored allocations in place"
    );
}

fn log_restore(report: &RestoreReport, events: &EventLog) {
    if report.from_journal && report.recovery.is_none() {
        tracing::info!(
            "allocations restored from the journal: Pluglet stopped before the checkpoint caught up"
        );
    }
    for aside in &report.set_aside {
        let checkpoint = aside.path.file_name()
            == Some(std::ffi::OsStr::new(
                pluglet_checkpoint::CHECKPOINT_FILE_NAME,
            ));
        let outcome = match &report.recovery {
            Some(recovery) if checkpoint => recovery.summary(),
            _ if checkpoint => "starting without its allocations".to_owned(),
            _ if aside.path.extension() == Some(std::ffi::OsStr::new("journal"))
                && report.journal_salvaged =>
            {
                "its newest intact record was kept and the new journal starts from it".to_owned()
            }
            _ if aside.path.extension() == Some(std::ffi::OsStr::new("journal")) => {
                "allocations come from the checkpoint alone".to_owned()
            }
            _ => "devices come from the checkpoint alone, without NUMA nodes".to_owned(),
        };
        tracing::warn!(
            path = %aside.path.display(),
            moved_to = %aside.moved_to.display(),
            reason = %aside.reason,
            outcome = %outcome,
            "corrupt device manager state set aside"
        );
        events.record(
            EventKind::StateSetAside,
            aside.path.display().to_string(),
            format!(
                "{}; kept as {}; {outcome}",
                aside.reason,
                aside.moved_to.display()
            ),
        );
    }
    if report.allocations > 0 || !report.resources.is_empty() {
        tracing::info!(
            allocations = report.allocations,
            resources = ?report.resources,
            "device manager state restored; resources wait for their plugins"
        );
    }
}

/// What the checkpoint writer writes: the registry's devices and the allocator's records,
/// each copied under its own lock (shared device sets, so the copy is cheap), encoded after.
fn snapshot_source(
    registry: &Registry,
    allocator: &Allocator,
    handlers: &Handlers,
) -> impl Fn(bool) -> Snapshot + Send + 'static {
    let (registry, allocator, handlers) = (registry.clone(), allocator.clone(), handlers.clone());
    move |with_side| {
        let resources = registry.device_sets();
        let pods = allocator.snapshot();
        let data = KubeletCheckpoint::of(resources.iter().map(|(k, d)| (k, d)), pods);
        let side = with_side.then(|| {
            let policies: Vec<(String, String)> = resources
                .iter()
                .map(|(name, _)| {
                    let policy = handlers.for_resource(name.as_str());
                    (policy.module().to_owned(), policy.sha256().to_owned())
                })
                .collect();
            Box::new(move || SideState {
                resources: resources
                    .iter()
                    .zip(policies)
                    .map(|((name, devices), (module, sha256))| {
                        (name.clone(), SideResource::of(devices, &module, &sha256))
                    })
                    .collect(),
            }) as SideSource
        });
        (data, side)
    }
}

/// Spawns the device manager's long-running tasks on its tracker and records the first that
/// ends before cancellation.
struct Stages {
    tasks: TaskTracker,
    cancel: CancellationToken,
    stopped: Arc<watch::Sender<Option<String>>>,
}

/// What a task's end can say.
trait StageResult {
    fn cause(self) -> Option<String>;
}

impl StageResult for () {
    fn cause(self) -> Option<String> {
        None
    }
}

impl<E: std::error::Error + 'static> StageResult for Result<(), E> {
    fn cause(self) -> Option<String> {
        self.err().map(|err| error_chain(&err))
    }
}

impl Stages {
    fn spawn<F>(&self, name: &'static str, task: F)
    where
        F: std::future::Future + Send + 'static,
        F::Output: StageResult + Send,
    {
        let cancel = self.cancel.clone();
        let stopped = self.stopped.clone();
        let task = tokio::spawn(task);
        self.tasks.spawn(async move {
            let cause = match task.await {
                Ok(output) => output.cause(),
                Err(err) => Some(err.to_string()),
            };
            if !cancel.is_cancelled() {
                let why = match cause {
                    Some(cause) => format!("{name} ended: {cause}"),
                    None => format!("{name} ended"),
                };
                tracing::error!(stage = name, cause = %why, "device manager task ended");
                stopped.send_if_modified(|s| {
                    s.is_none() && {
                        *s = Some(why);
                        true
                    }
                });
            }
        });
    }
}

/// The manager loop: disconnects `kubelet.sock` plugins whose socket was removed, and ends in
/// the pipeline the registrations whose grace period is over.
async fn run_loop(
    registry: Registry,
    pipeline: Pipeline,
    mut removed: mpsc::Receiver<PathBuf>,
    mut ended: mpsc::UnboundedReceiver<Arc<Registration>>,
    _watcher: crate::registration_server::RemovalWatch,
    cancel: CancellationToken,
    tasks: TaskTracker,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            Some(path) = removed.recv() => registry.socket_removed(&path),
            Some(registration) = ended.recv() => {
                // Its own task: the pipeline may be busy with a registration of the same name.
                let pipeline = pipeline.clone();
                tasks.spawn(async move {
                    pipeline.deregister(&registration, EndReason::GracePeriodOver).await;
                });
            }
            else => break,
        }
    }
}
