//! [`Pipeline`]: the steps, their order, the lock per type and name, and the end of every
//! registration (see the crate doc for the picture).
//!
//! Promises:
//! - registrations of one type and name run one at a time, from validate to activation, so
//!   each validate hook sees the plugin the one before it registered (two arriving at once
//!   cannot both pass on a stale view); deregistrations take the same lock;
//! - a registration that activated ends exactly once, by [`Pipeline::deregister`] (its socket
//!   is gone, its grace period is over) or by a newer registration of the same type and name
//!   replacing it: its kind deactivates it, then its deregister hook runs with the handler that
//!   registered it;
//! - a registration refused at activation has its register hook undone by the deregister
//!   hook before the refusal is returned;
//! - a type and name is held only while a registration of it is in force or a call is using its
//!   lock: names that come and go do not accumulate.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::Poll;
use std::time::{Instant, SystemTime};

use pluglet_core::events::{EventKind, EventLog};
use pluglet_core::{Generation, PluginKey, PluginType, SocketPath};
use pluglet_handler_runtime::{
    CallContext, GuestLog, HandlerError, PluginInfo, Refusal, RegisteredPlugin, run_in_place,
};
use pluglet_handlers::{Handlers, Served};
use pluglet_uds::Channel;
use tokio::sync::broadcast;

use crate::kind::{Facts, KindError, NoNativeSteps, PluginKind};

/// How a plugin came in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Door {
    /// A registration socket the plugin watcher found in the registry directory.
    Registry {
        /// The socket.
        socket: SocketPath,
        /// Its incarnation.
        generation: Generation,
    },
    /// `Register` on `kubelet.sock` (device plugins).
    KubeletSock,
}

impl fmt::Display for Door {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Door::Registry { socket, .. } => write!(f, "registry socket {socket}"),
            Door::KubeletSock => f.write_str("kubelet.sock"),
        }
    }
}

/// A plugin asking to register.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// What it said about itself (GetInfo, or the device plugin's RegisterRequest).
    pub info: PluginInfo,
    /// How it came in.
    pub door: Door,
    /// The open registration connection, when it came through a registry socket (a CSI
    /// driver serving its Node service on the same socket is asked over it).
    pub connection: Option<Channel>,
}

/// A step of the pipeline, as errors and events name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Finding the handler module for the plugin type.
    Handler,
    /// The validate hook.
    Validate,
    /// The plugin type's native facts (CSI `NodeGetInfo`).
    Facts,
    /// The register hook.
    Register,
    /// The plugin type's activation (a device plugin's endpoint dialed).
    Activate,
}

impl Stage {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Handler => "handler",
            Stage::Validate => "validate",
            Stage::Facts => "facts",
            Stage::Register => "register",
            Stage::Activate => "activate",
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a registration was refused.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// No handler module is configured or built in for the plugin type (the kubelet's
    /// wording; `handlers.toml` can map a module to any type).
    #[error("no handler registered for plugin type {plugin_type}")]
    NoHandler {
        /// The type the plugin gave.
        plugin_type: PluginType,
    },
    /// A hook refused the plugin.
    #[error("{key} refused by {module} at {stage} ({}): {}", refusal.kind, refusal.message)]
    Refused {
        /// Validate or register.
        stage: Stage,
        /// The plugin.
        key: PluginKey,
        /// The handler module.
        module: String,
        /// Its refusal.
        refusal: Refusal,
    },
    /// A hook failed (trap, deadline, memory cap).
    #[error("{key}: the {stage} hook of {module} failed")]
    Hook {
        /// Validate or register.
        stage: Stage,
        /// The plugin.
        key: PluginKey,
        /// The handler module.
        module: String,
        /// What went wrong in the handler.
        #[source]
        source: Box<HandlerError>,
    },
    /// A native step of the plugin type failed.
    #[error("{key}: {stage} failed")]
    Native {
        /// Facts or activate.
        stage: Stage,
        /// The plugin.
        key: PluginKey,
        /// The plugin type's error.
        #[source]
        source: KindError,
    },
}

impl RegisterError {
    /// The step that refused.
    pub fn stage(&self) -> Stage {
        match self {
            RegisterError::NoHandler { .. } => Stage::Handler,
            RegisterError::Refused { stage, .. }
            | RegisterError::Hook { stage, .. }
            | RegisterError::Native { stage, .. } => *stage,
        }
    }

    /// The refusal, when a hook refused (not failed).
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            RegisterError::Refused { refusal, .. } => Some(refusal),
            _ => None,
        }
    }

    /// The native step's own error, when it is an `E`.
    pub fn native<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            RegisterError::Native { source, .. } => source.downcast_ref(),
            _ => None,
        }
    }
}

/// Why a registration ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EndReason {
    /// Its registration socket disappeared or was created again.
    SocketGone,
    /// Its endpoint went away and the grace period passed without a new registration.
    GracePeriodOver,
    /// A newer registration of the same type and name took its place.
    Replaced,
    /// Its activation failed (the register hook is undone).
    ActivationFailed,
}

impl EndReason {
    /// Lower-case words.
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::SocketGone => "socket gone",
            EndReason::GracePeriodOver => "grace period over",
            EndReason::Replaced => "replaced",
            EndReason::ActivationFailed => "activation failed",
        }
    }
}

impl fmt::Display for EndReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A registered plugin: what it said, which handler took it, what the host learned.
#[derive(Debug)]
pub struct Registration {
    /// Unique per registration in this process (across pipelines too).
    pub id: u64,
    /// Type and name.
    pub key: PluginKey,
    /// What it said about itself.
    pub info: PluginInfo,
    /// The version its validate hook chose.
    pub version: Option<String>,
    /// The handler that validated and registered it; its deregister hook runs on the same.
    pub handler: Arc<Served>,
    /// How it came in.
    pub door: Door,
    /// What the plugin type learned natively.
    pub facts: Facts,
    /// When it registered.
    pub registered_at: SystemTime,
    ended: AtomicBool,
}

impl Registration {
    /// The form a later validate hook is shown as `existing`.
    pub fn as_existing(&self) -> RegisteredPlugin {
        RegisteredPlugin {
            info: self.info.clone(),
            version: self.version.clone(),
        }
    }

    /// Whether it has ended (deactivated and deregistered).
    pub fn has_ended(&self) -> bool {
        self.ended.load(Ordering::SeqCst)
    }
}

/// What the pipeline did, for whoever watches (tests, metrics).
#[derive(Clone, Debug)]
pub enum PipelineEvent {
    /// A plugin registered.
    Registered {
        /// The plugin.
        key: PluginKey,
        /// Its registration.
        id: u64,
        /// How it came in.
        door: Door,
    },
    /// A registration was refused.
    Refused {
        /// The plugin.
        key: PluginKey,
        /// Where.
        stage: Stage,
    },
    /// A registration ended: deactivated, then its deregister hook ran.
    Deregistered {
        /// The plugin.
        key: PluginKey,
        /// Its registration.
        id: u64,
        /// Why.
        reason: EndReason,
        /// What the deregister hook logged.
        logs: Vec<GuestLog>,
        /// Why the deregister hook failed, if it did.
        hook_error: Option<String>,
    },
}

type Slot = Arc<tokio::sync::Mutex<Option<Arc<Registration>>>>;
type Slots = Mutex<HashMap<PluginKey, Slot>>;

/// A use of one type and name's slot: from asking for its lock to releasing it. The last use
/// of a slot with no registration in force removes it from the map. A use takes its clone from
/// the map under the map's lock and gives it back under that lock (after any clone of its own,
/// such as the one holding the lock), then looks: so the last use to go sees the map's clone
/// alone, a slot another call holds or waits for is never removed, and a call that finds no
/// slot creates a fresh one. Every call of one type and name uses the one slot in the map, so
/// they stay serialised.
struct SlotUse<'a> {
    slots: &'a Slots,
    key: PluginKey,
    slot: Option<Slot>,
}

impl<'a> SlotUse<'a> {
    fn new(slots: &'a Slots, key: &PluginKey) -> SlotUse<'a> {
        let slot = lock_slots(slots).entry(key.clone()).or_default().clone();
        SlotUse {
            slots,
            key: key.clone(),
            slot: Some(slot),
        }
    }

    /// The slot in use (until the use is dropped).
    fn slot(&self) -> &Slot {
        self.slot.as_ref().expect("a slot in use until dropped")
    }
}

impl Drop for SlotUse<'_> {
    fn drop(&mut self) {
        let mut slots = lock_slots(self.slots);
        drop(self.slot.take());
        let unused = slots.get(&self.key).is_some_and(|slot| {
            Arc::strong_count(slot) == 1 && slot.try_lock().is_ok_and(|current| current.is_none())
        });
        if unused {
            slots.remove(&self.key);
        }
    }
}

/// The lock of one type and name's slot, held; derefs to the registration in force.
struct SlotGuard<'a> {
    // Declared first so that it is released before `_use` looks at the slot.
    guard: tokio::sync::OwnedMutexGuard<Option<Arc<Registration>>>,
    _use: SlotUse<'a>,
}

impl std::ops::Deref for SlotGuard<'_> {
    type Target = Option<Arc<Registration>>;

    fn deref(&self) -> &Self::Target {
        &self.guard
    }
}

impl std::ops::DerefMut for SlotGuard<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.guard
    }
}

fn lock_slots(slots: &Slots) -> std::sync::MutexGuard<'_, HashMap<PluginKey, Slot>> {
    slots.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registration ids, unique in the process, so that a registration is never mistaken for
/// another even where two pipelines meet (tests, a reloaded handler set).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

struct Inner {
    handlers: Handlers,
    node_name: String,
    kinds: RwLock<HashMap<PluginType, Arc<dyn PluginKind>>>,
    /// Per type and name: the registration in force, behind the lock that serialises them.
    slots: Slots,
    events: broadcast::Sender<PipelineEvent>,
    metrics: crate::metrics::Metrics,
    /// The daemon's event log, once given.
    log: std::sync::OnceLock<EventLog>,
    /// Every registration in force, through either door, by id.
    in_force: Mutex<BTreeMap<u64, Arc<Registration>>>,
}

/// The registration pipeline: cheap to clone; every clone is the same pipeline.
#[derive(Clone)]
pub struct Pipeline {
    inner: Arc<Inner>,
}

impl fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pipeline")
            .field("node_name", &self.inner.node_name)
            .finish_non_exhaustive()
    }
}

impl Pipeline {
    /// A pipeline calling the hooks of `handlers` with `node_name`; every plugin type has no
    /// native steps until [`Pipeline::set_kind`] gives it some.
    pub fn new(handlers: Handlers, node_name: impl Into<String>) -> Pipeline {
        Pipeline {
            inner: Arc::new(Inner {
                handlers,
                node_name: node_name.into(),
                kinds: RwLock::new(HashMap::new()),
                slots: Mutex::new(HashMap::new()),
                events: broadcast::channel(1024).0,
                metrics: crate::metrics::Metrics::default(),
                log: std::sync::OnceLock::new(),
                in_force: Mutex::new(BTreeMap::new()),
            }),
        }
    }

    /// Records registrations, refusals and deregistrations in `log` from now on (the first log
    /// given is kept).
    pub fn with_events(self, log: EventLog) -> Pipeline {
        if self.inner.log.set(log).is_err() {
            tracing::warn!("the registration pipeline records in the event log it was given first");
        }
        self
    }

    fn record(&self, kind: EventKind, key: &PluginKey, message: impl FnOnce() -> String) {
        if let Some(log) = self.inner.log.get() {
            log.record(kind, key.to_string(), message());
        }
    }

    /// Gives `plugin_type` its native steps (replacing any before).
    pub fn set_kind(&self, plugin_type: PluginType, kind: Arc<dyn PluginKind>) {
        self.inner
            .kinds
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(plugin_type, kind);
    }

    /// The live handler set.
    pub fn handlers(&self) -> &Handlers {
        &self.inner.handlers
    }

    /// What the pipeline counts (for the daemon's metrics registry).
    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.inner.metrics
    }

    /// Events from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<PipelineEvent> {
        self.inner.events.subscribe()
    }

    /// The registration in force for `key`, if any (waits while one of that name is running).
    pub async fn current(&self, key: &PluginKey) -> Option<Arc<Registration>> {
        self.lock_slot(key).await.clone()
    }

    /// Every registration in force, through either door, oldest first.
    pub fn registrations(&self) -> Vec<Arc<Registration>> {
        self.lock_in_force().values().cloned().collect()
    }

    fn lock_in_force(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Registration>>> {
        self.inner
            .in_force
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Runs the steps for `candidate` (see the module doc). On success the registration is
    /// the one in force for its type and name; one it replaced has ended.
    pub async fn register(&self, candidate: Candidate) -> Result<Arc<Registration>, RegisterError> {
        let plugin_type = PluginType::parse(&candidate.info.plugin_type);
        let key = PluginKey::new(plugin_type.clone(), candidate.info.name.clone());
        let door = candidate.door.clone();
        let result = self
            .run_steps(plugin_type.clone(), key.clone(), candidate)
            .await;
        let outcome = match &result {
            Ok(_) => "registered",
            Err(err) if err.refusal().is_some() => "refused",
            Err(_) => "failed",
        };
        self.inner
            .metrics
            .registration(&plugin_type, &door, outcome);
        if let Err(err) = &result {
            self.record(EventKind::Refused, &key, || pluglet_core::error_chain(err));
            let _ = self.inner.events.send(PipelineEvent::Refused {
                key,
                stage: err.stage(),
            });
        }
        result
    }

    async fn run_steps(
        &self,
        plugin_type: PluginType,
        key: PluginKey,
        candidate: Candidate,
    ) -> Result<Arc<Registration>, RegisterError> {
        let Some(handler) = self
            .inner
            .handlers
            .for_plugin_type(&candidate.info.plugin_type)
        else {
            return Err(RegisterError::NoHandler { plugin_type });
        };
        let kind = self.kind(&plugin_type);
        let mut current = self.lock_slot(&key).await;
        let start = Instant::now();
        let cx = self.call_context();
        let module = handler.module().to_owned();

        let existing = current.as_ref().map(|r| r.as_existing());
        let (accepted, validated_at, facts) = {
            let mut facts = std::pin::pin!(kind.gather_facts(&candidate));
            // Polled once before the hook when the kind allows: its request to the plugin is
            // then on its way while the hook runs.
            let early = if kind.facts_alongside_validate() {
                std::future::poll_fn(|task| Poll::Ready(facts.as_mut().poll(task))).await
            } else {
                Poll::Pending
            };
            let validated =
                run_in_place(|| handler.validate(&cx, &candidate.info, existing.as_ref()));
            let accepted = hook_outcome(validated, Stage::Validate, &key, &module)?;
            let validated_at = start.elapsed();
            let facts = match early {
                Poll::Ready(facts) => facts,
                Poll::Pending => facts.await,
            }
            .map_err(|source| RegisterError::Native {
                stage: Stage::Facts,
                key: key.clone(),
                source,
            })?;
            (accepted, validated_at, facts)
        };
        let facts_at = start.elapsed();

        let registered = run_in_place(|| handler.register(&cx, &candidate.info, &facts.hook));
        hook_outcome(registered, Stage::Register, &key, &module)?;

        let registration = Arc::new(Registration {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            key: key.clone(),
            info: candidate.info,
            version: accepted.version,
            handler,
            door: candidate.door,
            facts,
            registered_at: SystemTime::now(),
            ended: AtomicBool::new(false),
        });
        let registered_at = start.elapsed();
        if let Err(source) = kind.activate(&registration).await {
            registration.ended.store(true, Ordering::SeqCst);
            self.run_deregister_hook(&registration, EndReason::ActivationFailed);
            return Err(RegisterError::Native {
                stage: Stage::Activate,
                key,
                source,
            });
        }
        self.lock_in_force()
            .insert(registration.id, registration.clone());
        let replaced = current.replace(registration.clone());
        if let Some(old) = replaced.filter(|old| old.id != registration.id) {
            self.end(kind.as_ref(), &old, EndReason::Replaced).await;
        }
        drop(current);

        self.inner.metrics.steps(&key.plugin_type, start.elapsed());
        let us = |d: std::time::Duration| d.as_micros() as u64;
        tracing::info!(
            plugin = %key,
            door = %registration.door,
            version = registration.version.as_deref().unwrap_or(""),
            handler = %module,
            "plugin registered"
        );
        tracing::debug!(
            plugin = %key,
            validate_us = us(validated_at),
            facts_us = us(facts_at - validated_at),
            register_us = us(registered_at - facts_at),
            activate_us = us(start.elapsed() - registered_at),
            "registration steps"
        );
        self.record(EventKind::Registered, &key, || {
            let version = registration
                .version
                .as_deref()
                .map(|v| format!(", version {v}"))
                .unwrap_or_default();
            format!(
                "registered through {} by {module}{version}",
                registration.door
            )
        });
        let _ = self.inner.events.send(PipelineEvent::Registered {
            key,
            id: registration.id,
            door: registration.door.clone(),
        });
        Ok(registration)
    }

    /// Ends `registration` for `reason`: its kind deactivates it, then its deregister hook
    /// runs. Does nothing if it has ended already (replaced, or deregistered before).
    pub async fn deregister(&self, registration: &Arc<Registration>, reason: EndReason) {
        let kind = self.kind(&registration.key.plugin_type);
        let mut current = self.lock_slot(&registration.key).await;
        if current.as_ref().is_some_and(|c| c.id == registration.id) {
            *current = None;
        }
        self.end(kind.as_ref(), registration, reason).await;
    }

    /// Deactivation and the deregister hook, once per registration; the caller holds the
    /// registration's type-and-name lock.
    async fn end(&self, kind: &dyn PluginKind, registration: &Registration, reason: EndReason) {
        if registration.ended.swap(true, Ordering::SeqCst) {
            return;
        }
        self.lock_in_force().remove(&registration.id);
        kind.deactivate(registration).await;
        self.run_deregister_hook(registration, reason);
    }

    fn run_deregister_hook(&self, registration: &Registration, reason: EndReason) {
        let cx = self.call_context();
        let call = run_in_place(|| registration.handler.deregister(&cx, &registration.info));
        let (logs, hook_error) = match call {
            Ok(call) => (call.logs, None),
            Err(err) => {
                let err = pluglet_core::error_chain(&err);
                tracing::warn!(plugin = %registration.key, error = %err, "deregister hook failed");
                (Vec::new(), Some(err))
            }
        };
        tracing::info!(
            plugin = %registration.key,
            door = %registration.door,
            %reason,
            "plugin deregistered"
        );
        self.inner
            .metrics
            .deregistration(&registration.key.plugin_type, reason);
        self.record(
            EventKind::Deregistered,
            &registration.key,
            || match &hook_error {
                None => format!("deregistered: {reason}"),
                Some(err) => format!("deregistered: {reason} (the deregister hook failed: {err})"),
            },
        );
        let _ = self.inner.events.send(PipelineEvent::Deregistered {
            key: registration.key.clone(),
            id: registration.id,
            reason,
            logs,
            hook_error,
        });
    }

    fn call_context(&self) -> CallContext {
        CallContext {
            node_name: self.inner.node_name.clone(),
        }
    }

    fn kind(&self, plugin_type: &PluginType) -> Arc<dyn PluginKind> {
        self.inner
            .kinds
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(plugin_type)
            .cloned()
            .unwrap_or_else(|| Arc::new(NoNativeSteps))
    }

    /// Waits for the lock of `key`'s slot (created if there is none; removed again once unused).
    async fn lock_slot(&self, key: &PluginKey) -> SlotGuard<'_> {
        let slot_use = SlotUse::new(&self.inner.slots, key);
        // Should this future be dropped while waiting, the clone waiting for the lock goes
        // before `slot_use`, which then finds the slot as it should.
        let guard = slot_use.slot().clone().lock_owned().await;
        SlotGuard {
            guard,
            _use: slot_use,
        }
    }

    /// Types and names with a slot now (in force, or in the middle of a call).
    #[cfg(test)]
    fn slots_held(&self) -> usize {
        lock_slots(&self.inner.slots).len()
    }
}

/// A hook's answer as the pipeline's result.
fn hook_outcome<T>(
    call: Result<pluglet_handler_runtime::Call<Result<T, Refusal>>, HandlerError>,
    stage: Stage,
    key: &PluginKey,
    module: &str,
) -> Result<T, RegisterError> {
    match call {
        Ok(call) => call.value.map_err(|refusal| RegisterError::Refused {
            stage,
            key: key.clone(),
            module: module.to_owned(),
            refusal,
        }),
        Err(source) => Err(RegisterError::Hook {
            stage,
            key: key.clone(),
            module: module.to_owned(),
            source: Box::new(source),
        }),
    }
}

#[cfg(test)]
mod tests {
    use pluglet_handler_runtime::{Runtime, RuntimeConfig};

    use super::*;

    fn pipeline() -> Pipeline {
        let runtime = Runtime::new(RuntimeConfig::default()).unwrap();
        Pipeline::new(Handlers::builtins_only(runtime).unwrap(), "node-1")
    }

    fn device_plugin(name: &str) -> Candidate {
        Candidate {
            info: PluginInfo {
                plugin_type: "DevicePlugin".into(),
                name: name.into(),
                endpoint: format!("/{name}.sock"),
                supported_versions: vec!["v1beta1".into()],
            },
            door: Door::KubeletSock,
            connection: None,
        }
    }

    #[tokio::test]
    async fn the_slots_shrink_back_once_distinct_names_deregister() {
        let pipeline = pipeline();
        let names: Vec<String> = (0..500).map(|i| format!("vendor{i}.com/gpu")).collect();
        let mut registered = Vec::new();
        for name in &names {
            registered.push(pipeline.register(device_plugin(name)).await.unwrap());
        }
        assert_eq!(pipeline.slots_held(), names.len());
        // A refused registration and a look at a name never registered leave nothing behind.
        assert!(pipeline.register(device_plugin("no-domain")).await.is_err());
        let unknown = PluginKey::new(PluginType::DevicePlugin, "other.com/gpu".to_string());
        assert!(pipeline.current(&unknown).await.is_none());
        assert_eq!(pipeline.slots_held(), names.len());

        for registration in &registered {
            pipeline
                .deregister(registration, EndReason::SocketGone)
                .await;
        }
        assert_eq!(pipeline.slots_held(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_name_registered_while_it_is_deregistered_keeps_its_slot() {
        let pipeline = pipeline();
        let name = "vendor.com/gpu";
        let key = PluginKey::new(PluginType::DevicePlugin, name.to_string());
        for _ in 0..50 {
            let first = pipeline.register(device_plugin(name)).await.unwrap();
            let (_, second) = tokio::join!(
                pipeline.deregister(&first, EndReason::SocketGone),
                pipeline.register(device_plugin(name))
            );
            let second = second.unwrap();
            // Whichever ran first, the second registration is the one in force, in the slot.
            assert_eq!(pipeline.current(&key).await.map(|r| r.id), Some(second.id));
            assert_eq!(pipeline.slots_held(), 1);
            pipeline.deregister(&second, EndReason::SocketGone).await;
            assert_eq!(pipeline.slots_held(), 0);
        }
    }
}
