//! [`Registry`]: the device plugin resources, each with its devices and the endpoint of the
//! plugin serving it (the kubelet's endpoint map, `allDevices` and health tracking).
//!
//! Who changes what: registrations connect endpoints ([`Registry::connect`], the device
//! plugin type's activation step); each endpoint's own task applies its ListAndWatch updates
//! ([`Registry::apply_devices`]) and reports its stream's end ([`Registry::disconnect`]);
//! grace timers remove resources whose plugin did not come back. Every change is made under
//! one short `std` mutex that is never held across an `.await` nor together with another
//! part's lock; after it, the registry asks for a checkpoint write and wakes the waiters on
//! [`Registry::changes`].
//!
//! A resource whose grace period ends hands its registration to the device manager's loop
//! (the `ended` channel), which ends it in the registration pipeline: that runs the deregister
//! hook, once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use pluglet_core::events::{EventKind, EventLog};
use pluglet_core::{Generation, ResourceName};
use pluglet_handlers::Handlers;
use pluglet_registration::Registration;
use pluglet_uds::Channel;
use tokio::sync::{broadcast, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::device_list::DeviceUpdate;
use crate::devices::{Device, DeviceSet, ListedDevice};
use crate::endpoint::{self, AllocateCalls, Endpoint, Flow};
use crate::error::{AllocateError, ConnectError};
use crate::persistence::WriteRequests;

/// The generation of resources restored from the checkpoint, before any plugin connected.
const RESTORED: Generation = Generation(0);

/// When a grace period of `grace` starting now ends (RFC 3339, UTC, to the second).
fn grace_end(grace: Duration) -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now() + grace).to_string()
}

/// One resource.
#[derive(Debug, Default)]
struct Resource {
    devices: DeviceSet,
    /// The connected plugin; `None` while stopped.
    endpoint: Option<Arc<Endpoint>>,
    /// Set while no plugin is connected: the generation of the endpoint that stopped. The
    /// grace timer removes the resource only if this is still the latest stop.
    stopped: Option<Generation>,
    /// The registration that connected the endpoint (kept while stopped, so that the end of
    /// the grace period can end it).
    registration: Option<Arc<Registration>>,
    /// What is wrong with what the plugin sent or why it is disconnected, for the admin API.
    last_error: Option<String>,
}

/// A resource as the admin API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceInfo {
    /// Extended resource name.
    pub resource: ResourceName,
    /// Every device.
    pub capacity: usize,
    /// Healthy devices.
    pub allocatable: usize,
    /// The devices in plugin order.
    pub devices: Vec<ListedDevice>,
    /// Module id of the allocation policy in force.
    pub policy: String,
    /// The plugin's endpoint while connected.
    pub endpoint: Option<PathBuf>,
    /// Whether a plugin's ListAndWatch stream is live.
    pub connected: bool,
    /// What was wrong with the plugin's last device list (empty or duplicated ids), or why it
    /// disconnected; `None` while all is well.
    pub last_error: Option<String>,
}

/// What happened to a resource, for whoever watches (tests, metrics).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistryEvent {
    /// A plugin's endpoint became the resource's endpoint.
    Connected {
        /// The resource.
        resource: ResourceName,
    },
    /// The resource's endpoint went away; its grace period started.
    Disconnected {
        /// The resource.
        resource: ResourceName,
        /// Why.
        reason: String,
    },
    /// A grace period ended: the resource was removed, or kept because its plugin came back
    /// (or stopped again later, starting a new grace period).
    GraceEnded {
        /// The resource.
        resource: ResourceName,
        /// Whether it was removed.
        removed: bool,
    },
}

/// What an allocation may choose from, and whom to ask.
#[derive(Clone, Debug)]
pub(crate) struct Offer {
    /// The resource's devices now (shared, not copied).
    pub devices: DeviceSet,
    /// The plugin's connection.
    pub channel: Channel,
    /// The plugin's Allocate calls.
    pub calls: Arc<AllocateCalls>,
    /// Whether the plugin answers GetPreferredAllocation.
    pub preferred_available: bool,
    /// Whether the plugin wants PreStartContainer.
    pub pre_start_required: bool,
}

/// Timings and limits of the registry's endpoints.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings {
    /// How long a disconnected resource stays.
    pub grace_period: Duration,
    /// Time allowed to dial a plugin and for GetDevicePluginOptions.
    pub dial_timeout: Duration,
    /// The most containers one Allocate call asks for (see [`AllocateCalls`]).
    pub allocate_batch: usize,
}

struct Inner {
    resources: Mutex<BTreeMap<ResourceName, Resource>>,
    next_generation: AtomicU64,
    changed: watch::Sender<u64>,
    events: broadcast::Sender<RegistryEvent>,
    log: EventLog,
    writes: WriteRequests,
    settings: Settings,
    cancel: CancellationToken,
    tasks: TaskTracker,
    ended: mpsc::UnboundedSender<Arc<Registration>>,
}

/// The resources and their endpoints: the narrow handle endpoint tasks, timers, the allocator
/// and the device plugin type hold. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Registry {
    inner: Arc<Inner>,
}

impl Registry {
    /// A registry holding the `restored` resources (disconnected, their grace period running).
    /// Endpoint tasks and timers run on `tasks` and stop when `cancel` fires; registrations
    /// whose grace period ended are sent to `ended`. Connections, disconnections and removals
    /// are recorded in `log`.
    pub fn new(
        restored: BTreeMap<ResourceName, DeviceSet>,
        settings: Settings,
        writes: WriteRequests,
        cancel: CancellationToken,
        tasks: TaskTracker,
        ended: mpsc::UnboundedSender<Arc<Registration>>,
        log: EventLog,
    ) -> Registry {
        let names: Vec<ResourceName> = restored.keys().cloned().collect();
        let why = format!(
            "restored from the checkpoint; the plugin has not registered since the daemon \
             started; its devices stay allocated, and capacity is kept until the grace period \
             ends at {}",
            grace_end(settings.grace_period)
        );
        let resources = restored
            .into_iter()
            .map(|(name, devices)| {
                let resource = Resource {
                    devices,
                    stopped: Some(RESTORED),
                    last_error: Some(why.clone()),
                    ..Resource::default()
                };
                (name, resource)
            })
            .collect();
        let registry = Registry {
            inner: Arc::new(Inner {
                resources: Mutex::new(resources),
                next_generation: AtomicU64::new(RESTORED.0 + 1),
                changed: watch::Sender::new(0),
                events: broadcast::channel(256).0,
                log,
                writes,
                settings,
                cancel,
                tasks,
                ended,
            }),
        };
        for name in names {
            registry.start_grace_timer(name, RESTORED);
        }
        registry
    }

    /// Dials the plugin at `path` and makes it the resource's endpoint, replacing any
    /// connected one; its task applies the plugin's device lists from now on.
    pub async fn connect(
        &self,
        resource: ResourceName,
        path: PathBuf,
        flow: Flow,
        registration: Arc<Registration>,
    ) -> Result<(), ConnectError> {
        if self.inner.cancel.is_cancelled() {
            return Err(ConnectError::Stopped { resource });
        }
        let generation = Generation(self.inner.next_generation.fetch_add(1, Ordering::SeqCst));
        let cancel = self.inner.cancel.child_token();
        let (endpoint, opened) = Endpoint::connect(
            &resource,
            path,
            flow,
            generation,
            self.inner.settings.dial_timeout,
            self.inner.settings.allocate_batch,
            cancel.clone(),
        )
        .await?;
        let options = endpoint.options;
        let endpoint = Arc::new(endpoint);
        {
            let mut resources = self.lock();
            let entry = resources.entry(resource.clone()).or_default();
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
            entry.last_error = None;
        }
        self.inner.tasks.spawn(endpoint::run(
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
            %generation,
            pre_start_required = options.pre_start_required,
            get_preferred_allocation_available = options.get_preferred_allocation_available,
            "device plugin connected"
        );
        self.inner.log.record(
            EventKind::Connected,
            resource.as_str(),
            format!("endpoint {} connected", endpoint.path.display()),
        );
        let _ = self
            .inner
            .events
            .send(RegistryEvent::Connected { resource });
        self.changed();
        Ok(())
    }

    /// Applies one ListAndWatch update if `generation` is still the resource's endpoint:
    /// visible at once, the checkpoint follows. Returns `false` only when a
    /// [`DeviceUpdate::Changed`] does not fit the devices held (the positions it names are not
    /// the stream's last list); nothing is changed then.
    pub(crate) fn apply_devices(
        &self,
        resource: &ResourceName,
        generation: Generation,
        update: DeviceUpdate,
    ) -> bool {
        let changed = {
            let mut resources = self.lock();
            match resources.get_mut(resource) {
                Some(entry)
                    if entry
                        .endpoint
                        .as_ref()
                        .is_some_and(|e| e.generation == generation) =>
                {
                    match update {
                        DeviceUpdate::List {
                            devices,
                            refused: replaced,
                        } => {
                            let changed = entry.devices.adopt(devices);
                            entry.last_error = replaced.refused_any().then(|| {
                                format!(
                                    "the last device list had {} device(s) with an empty id \
                                     (not served) and {} with an id listed before{} (only the \
                                     last one listed is served): fix the plugin",
                                    replaced.empty_ids,
                                    replaced.duplicates,
                                    if replaced.duplicate_ids.is_empty() {
                                        String::new()
                                    } else {
                                        format!(" ({})", replaced.duplicate_ids.join(", "))
                                    }
                                )
                            });
                            if replaced.refused_any() {
                                tracing::warn!(
                                    %resource,
                                    empty_ids = replaced.empty_ids,
                                    duplicates = replaced.duplicates,
                                    duplicated = ?replaced.duplicate_ids,
                                    "the device plugin listed devices with empty or duplicated \
                                     ids: a device without an id is not served, and of devices \
                                     sharing an id only the last one listed is; fix the plugin"
                                );
                            }
                            changed
                        }
                        DeviceUpdate::Changed { len, changes } => {
                            match entry.devices.apply_changes(len, &changes) {
                                Some(changed) => changed,
                                None => return false,
                            }
                        }
                    }
                }
                _ => false,
            }
        };
        if changed {
            self.changed();
            self.inner.writes.devices_changed();
        }
        true
    }

    /// Marks `resource` disconnected if `generation` is still its endpoint: its devices turn
    /// unhealthy at once and its grace period starts.
    pub fn disconnect(&self, resource: &ResourceName, generation: Generation, reason: &str) {
        {
            let mut resources = self.lock();
            let Some(entry) = resources.get_mut(resource) else {
                return;
            };
            match &entry.endpoint {
                Some(endpoint) if endpoint.generation == generation => {
                    endpoint.cancel.cancel();
                }
                _ => {
                    tracing::debug!(
                        %resource,
                        %generation,
                        reason,
                        "ignoring the end of a replaced endpoint"
                    );
                    return;
                }
            }
            entry.endpoint = None;
            entry.devices.mark_all_unhealthy();
            entry.stopped = Some(generation);
            entry.last_error = Some(format!(
                "disconnected: {reason}; its devices are unhealthy until the plugin registers \
                 again, and capacity is kept until the grace period ends at {}",
                grace_end(self.inner.settings.grace_period)
            ));
        }
        tracing::warn!(
            %resource,
            reason,
            grace_period = ?self.inner.settings.grace_period,
            "device plugin disconnected: its devices are unhealthy until it registers again"
        );
        self.start_grace_timer(resource.clone(), generation);
        self.inner.log.record(
            EventKind::Disconnected,
            resource.as_str(),
            format!(
                "{reason}; devices unhealthy for the grace period ({:?})",
                self.inner.settings.grace_period
            ),
        );
        let _ = self.inner.events.send(RegistryEvent::Disconnected {
            resource: resource.clone(),
            reason: reason.to_owned(),
        });
        self.changed();
        self.inner.writes.devices_changed();
    }

    /// Disconnects the endpoint that registration `id` connected, if it is still connected
    /// (a newer registration's endpoint is left alone).
    pub fn disconnect_registration(&self, id: u64, reason: &str) {
        let found = self.find(|r| r.registration.as_ref().is_some_and(|reg| reg.id == id));
        for (resource, generation) in found {
            self.disconnect(&resource, generation, reason);
        }
    }

    /// Disconnects every `kubelet.sock` endpoint whose socket was `path` (it was removed).
    pub fn socket_removed(&self, path: &Path) {
        let found = self.find(|r| {
            r.endpoint
                .as_ref()
                .is_some_and(|e| e.flow == Flow::Classic && e.path == path)
        });
        for (resource, generation) in found {
            self.disconnect(&resource, generation, "its socket was removed");
        }
    }

    /// Connected resources matching `pred`, with their endpoints' generations.
    fn find(&self, pred: impl Fn(&Resource) -> bool) -> Vec<(ResourceName, Generation)> {
        self.lock()
            .iter()
            .filter(|(_, r)| pred(r))
            .filter_map(|(name, r)| r.endpoint.as_ref().map(|e| (name.clone(), e.generation)))
            .collect()
    }

    fn start_grace_timer(&self, resource: ResourceName, generation: Generation) {
        let registry = self.clone();
        let grace = self.inner.settings.grace_period;
        let cancel = self.inner.cancel.clone();
        self.inner.tasks.spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = tokio::time::sleep(grace) => registry.expire(&resource, generation),
            }
        });
    }

    /// The grace period of the stop at `generation` is over: removes the resource unless its
    /// plugin came back (or stopped again later), and hands its registration on to be ended.
    fn expire(&self, resource: &ResourceName, generation: Generation) {
        let removed = {
            let mut resources = self.lock();
            let expired = resources
                .get(resource)
                .is_some_and(|r| r.endpoint.is_none() && r.stopped == Some(generation));
            if expired {
                resources.remove(resource)
            } else {
                None
            }
        };
        let _ = self.inner.events.send(RegistryEvent::GraceEnded {
            resource: resource.clone(),
            removed: removed.is_some(),
        });
        let Some(removed) = removed else {
            return;
        };
        self.inner.log.record(
            EventKind::GraceEnded,
            resource.as_str(),
            "the device plugin did not come back within the grace period: resource removed",
        );
        tracing::info!(
            %resource,
            "device plugin did not come back within the grace period: resource removed"
        );
        if let Some(registration) = removed.registration {
            let _ = self.inner.ended.send(registration);
        }
        self.changed();
        self.inner.writes.devices_changed();
    }

    /// What an allocation of `resource` may choose from now.
    pub fn offer(&self, resource: &ResourceName) -> Result<Offer, AllocateError> {
        let resources = self.lock();
        let Some(entry) = resources.get(resource) else {
            return Err(AllocateError::UnknownResource {
                resource: resource.clone(),
            });
        };
        let Some(endpoint) = &entry.endpoint else {
            return Err(AllocateError::NotConnected {
                resource: resource.clone(),
            });
        };
        Ok(Offer {
            devices: entry.devices.clone(),
            channel: endpoint.channel.clone(),
            calls: endpoint.calls.clone(),
            preferred_available: endpoint.options.get_preferred_allocation_available,
            pre_start_required: endpoint.options.pre_start_required,
        })
    }

    /// Every resource's devices (shared, not copied), for the checkpoint.
    pub fn device_sets(&self) -> Vec<(ResourceName, DeviceSet)> {
        self.lock()
            .iter()
            .map(|(name, r)| (name.clone(), r.devices.clone()))
            .collect()
    }

    /// Every resource as the admin API shows it, sorted by name.
    pub fn views(&self, handlers: &Handlers) -> Vec<ResourceInfo> {
        self.lock()
            .iter()
            .map(|(name, r)| ResourceInfo {
                resource: name.clone(),
                capacity: r.devices.capacity(),
                allocatable: r.devices.allocatable(),
                devices: r.devices.devices().map(Device::to_listed).collect(),
                policy: handlers.for_resource(name.as_str()).module().to_owned(),
                endpoint: r.endpoint.as_ref().map(|e| e.path.clone()),
                connected: r.endpoint.is_some(),
                last_error: r.last_error.clone(),
            })
            .collect()
    }

    /// Every resource's capacity and allocatable, sorted by name (no device is copied).
    pub fn all_counts(&self) -> Vec<(ResourceName, usize, usize)> {
        self.lock()
            .iter()
            .map(|(name, r)| (name.clone(), r.devices.capacity(), r.devices.allocatable()))
            .collect()
    }

    /// Capacity and allocatable of `resource`, if known.
    pub fn counts(&self, resource: &str) -> Option<(usize, usize)> {
        self.lock()
            .get(resource)
            .map(|r| (r.devices.capacity(), r.devices.allocatable()))
    }

    /// A receiver that changes after every change of devices or plugin connections.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.inner.changed.subscribe()
    }

    /// The event log connections, allocations and releases are recorded in.
    pub(crate) fn events(&self) -> &EventLog {
        &self.inner.log
    }

    /// Events from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<RegistryEvent> {
        self.inner.events.subscribe()
    }

    fn changed(&self) {
        self.inner.changed.send_modify(|n| *n += 1);
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<ResourceName, Resource>> {
        self.inner
            .resources
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use pluglet_proto::v1beta1::DevicePluginOptions;

    use super::*;
    use pluglet_test_support::pipeline::registration;
    use pluglet_test_support::stub::{Stub, devices, next_event};

    const GPU: &str = "vendor.com/gpu";

    fn registry(grace_period: Duration) -> (Registry, mpsc::UnboundedReceiver<Arc<Registration>>) {
        let (ended_tx, ended_rx) = mpsc::unbounded_channel();
        let registry = Registry::new(
            BTreeMap::new(),
            Settings {
                grace_period,
                dial_timeout: Duration::from_secs(5),
                allocate_batch: crate::DEFAULT_ALLOCATE_BATCH,
            },
            WriteRequests::new(),
            CancellationToken::new(),
            TaskTracker::new(),
            ended_tx,
            EventLog::default(),
        );
        (registry, ended_rx)
    }

    #[tokio::test]
    async fn alone_it_connects_applies_updates_and_hands_on_what_its_grace_period_ended() {
        let dir = tempfile::tempdir().unwrap();
        let stub = Stub::start(
            &dir.path().join("gpu.sock"),
            devices(3, 1),
            DevicePluginOptions::default(),
        );
        let (registry, mut ended) = registry(Duration::from_millis(50));
        let mut events = registry.subscribe();
        let mut changes = registry.changes();
        let gpu = ResourceName::from(GPU);
        let registration = registration(GPU).await;
        registry
            .connect(
                gpu.clone(),
                stub.socket.clone(),
                Flow::Classic,
                registration.clone(),
            )
            .await
            .unwrap();
        while registry.counts(GPU) != Some((3, 3)) {
            changes.changed().await.unwrap();
        }

        // News from an endpoint that is not (or no longer) the resource's is ignored.
        registry.apply_devices(
            &gpu,
            Generation(999),
            DeviceUpdate::List {
                devices: DeviceSet::default(),
                refused: Default::default(),
            },
        );
        registry.disconnect(&gpu, Generation(999), "an old stream ended");
        assert_eq!(registry.counts(GPU), Some((3, 3)));
        let offer = registry.offer(&gpu).unwrap();
        assert_eq!(offer.devices.capacity(), 3);

        stub.stop();
        let reason = next_event(&mut events, "the disconnection", |e| match e {
            RegistryEvent::Disconnected { reason, .. } => Some(reason),
            _ => None,
        })
        .await;
        assert!(reason.contains("ListAndWatch"), "{reason}");
        assert_eq!(
            registry.counts(GPU),
            Some((3, 0)),
            "unhealthy, still listed"
        );
        assert!(matches!(
            registry.offer(&gpu),
            Err(AllocateError::NotConnected { .. })
        ));

        let removed = next_event(&mut events, "the end of the grace period", |e| match e {
            RegistryEvent::GraceEnded { removed, .. } => Some(removed),
            _ => None,
        })
        .await;
        assert!(removed);
        assert_eq!(registry.counts(GPU), None);
        let handed_on = ended.recv().await.unwrap();
        assert_eq!(
            handed_on.id, registration.id,
            "its registration is ended by the pipeline"
        );
    }

    #[tokio::test]
    async fn disconnecting_a_registration_leaves_a_newer_one_alone() {
        let dir = tempfile::tempdir().unwrap();
        let old = Stub::start(
            &dir.path().join("old.sock"),
            devices(1, 1),
            DevicePluginOptions::default(),
        );
        let new = Stub::start(
            &dir.path().join("new.sock"),
            devices(2, 1),
            DevicePluginOptions::default(),
        );
        let (registry, _ended) = registry(Duration::from_secs(300));
        let mut changes = registry.changes();
        let gpu = ResourceName::from(GPU);
        let (first, second) = (registration(GPU).await, registration(GPU).await);
        registry
            .connect(
                gpu.clone(),
                old.socket.clone(),
                Flow::Watcher,
                first.clone(),
            )
            .await
            .unwrap();
        registry
            .connect(gpu.clone(), new.socket.clone(), Flow::Watcher, second)
            .await
            .unwrap();
        while registry.counts(GPU) != Some((2, 2)) {
            changes.changed().await.unwrap();
        }
        registry.disconnect_registration(first.id, "its socket was removed");
        registry.socket_removed(&new.socket);
        assert_eq!(
            registry.counts(GPU),
            Some((2, 2)),
            "neither an older registration nor a kubelet.sock rule touches it"
        );
    }
}
