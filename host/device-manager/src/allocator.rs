//! [`Allocator`]: who holds which devices, and every change to that: allocation (candidates →
//! plugin preference → WASM policy → host check → reserve → Allocate → PreStartContainer →
//! record, with the CDI spec written beside the record), release, and the sync with the pods
//! still active. The kubelet behaviour it follows
//! is in `docs/kubelet-compatibility.md` ("Allocation").
//!
//! It owns the pod-device records ([`PodDevices`]) behind one short `std` mutex, never held
//! across an `.await` nor together with the registry's lock: it reads the resource's devices
//! from the [`Registry`] first (a shared copy), then decides under its own lock.
//!
//! Each step of an allocation and a release is timed into
//! `pluglet_device_stage_duration_seconds` ([`crate::metrics::Stage`]), so where an
//! allocation's time goes can be read from `/metrics` on any node.
//!
//! Promises:
//! - a container that already holds devices of a resource gets the same ones again with no
//!   RPC; a different count is a "changed request" error, as in the kubelet;
//! - the policy's answer must be exactly `count` distinct available ids including every
//!   must-include id, else the request is refused naming the policy module;
//! - devices are chosen under a per-resource decision lock and reserved in the state before
//!   the first RPC to the plugin, so concurrent requests never get the same device;
//! - any failure leaves nothing held; success returns only once it is durable (journal
//!   first, the kubelet checkpoint follows: see [`crate::persistence`]);
//! - a release takes effect only once it is durable: one that cannot be recorded is refused
//!   and the devices stay held.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use pluglet_core::events::EventKind;
use pluglet_core::{ContainerName, PodUid, ResourceName};
use pluglet_handler_runtime::{AllocationRequest, CallContext, Candidates};
use pluglet_handlers::Handlers;
use pluglet_proto::v1beta1;
use pluglet_proto::v1beta1::device_plugin_client::DevicePluginClient;
use pluglet_uds::{Channel, RpcError};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::answer::{AllocateIds, AnswerView, PluginAnswer, ReadAnswer};
use crate::cdi::{Handoff, PendingSpec};
use crate::device_id::DeviceId;
use crate::devices::{DeviceSet, Health, IdHasher, NameHasher, Positions};
use crate::endpoint::AllocateCalls;
use crate::error::{AllocateError, AnswerError, ReleaseError};
use crate::keep_list::KeepList;
use crate::metrics::{Metrics, Operation, Outcome, ResourceSeries, Stage, StageClock};
use crate::persistence::Persistence;
use crate::pod_devices::{
    Change, HeldIds, HolderKey, Holding, HoldingState, PodDevices, PodName, group_by_numa,
};
use crate::registry::Registry;

/// The kubelet's `KubeletPreStartContainerRPCTimeoutInSecs`.
pub const PRE_START_TIMEOUT: Duration = Duration::from_secs(30);

/// Time allowed for the plugin's Allocate and GetPreferredAllocation (the kubelet sets none;
/// a plugin that never answers would otherwise hold its reservation forever).
pub const ALLOCATE_TIMEOUT: Duration = Duration::from_secs(30);

/// A successful allocation.
#[derive(Clone, Debug, PartialEq)]
pub struct Allocation {
    /// The devices the container holds, in the order chosen.
    pub device_ids: Vec<DeviceId>,
    /// The plugin's Allocate answer for the container, as its bytes
    /// ([`PluginAnswer::response`] decodes it).
    pub answer: PluginAnswer,
    /// True when the container already held these devices and no RPC was made.
    pub reused: bool,
    /// Every CDI device name to give a container runtime: the plugin's own `cdi_devices`, then
    /// the one of Pluglet's spec (see [`crate::cdi`]; none with CDI off).
    pub cdi_names: Vec<String>,
}

/// Checks a policy answer: exactly `count` distinct ids, each one `is_available` says is,
/// including every `must_include` id. Returns what is wrong. The answer is the policy's own
/// strings: they name devices only once this check has passed.
///
/// Only the answer's ids are looked up, so the check costs the same for 8 devices offered as
/// for 10,000.
pub fn check_answer(
    answer: &[String],
    count: u32,
    is_available: impl Fn(&str) -> bool,
    must_include: &[String],
) -> Result<(), AnswerError> {
    // An available id's place: the order it was first seen in.
    let mut first_seen: HashMap<&str, usize, IdHasher> =
        HashMap::with_capacity_and_hasher(answer.len(), IdHasher::default());
    let place = |id| {
        is_available(id).then(|| {
            let next = first_seen.len();
            *first_seen.entry(id).or_insert(next)
        })
    };
    check_places(answer, count, place, must_include).map(drop)
}

/// [`check_answer`] against `devices` (the snapshot the candidates came from) and what is
/// `held` now: available means healthy there and held by no one. Returns where the answer's
/// devices are in `devices`, in answer order, so that they are looked up there once.
pub fn check_answer_in(
    answer: &[String],
    count: u32,
    devices: &DeviceSet,
    held: HeldIds<'_>,
    must_include: &[String],
) -> Result<Positions, AnswerError> {
    let place = |id| {
        devices
            .position(id)
            .filter(|&at| devices.is_healthy_at(at) && !held.is_held(id))
    };
    let at = check_places(answer, count, place, must_include)?;
    Ok(Positions::new(devices, at))
}

/// The check of [`check_answer`], with `place` saying where an available id's device is
/// (distinct devices at distinct places, below 4 billion) and `None` for an id that is not
/// available. Returns the answer's places, in answer order.
fn check_places<'a>(
    answer: &'a [String],
    count: u32,
    mut place: impl FnMut(&'a str) -> Option<usize>,
    must_include: &'a [String],
) -> Result<Vec<u32>, AnswerError> {
    if answer.len() != count as usize {
        return Err(AnswerError::Count {
            answered: answer.len(),
            count,
        });
    }
    // A bit per place: a word per 64 devices rather than a hash of every id.
    let mut seen: Vec<u64> = Vec::new();
    let is_seen =
        |seen: &[u64], at: usize| seen.get(at / 64).is_some_and(|w| w >> (at % 64) & 1 == 1);
    let mut places = Vec::with_capacity(answer.len());
    for id in answer {
        // Availability before repeats: whether an id is available does not depend on where
        // it stands, so either order names the same problem.
        let Some(at) = place(id) else {
            return Err(AnswerError::NotAvailable { id: id.clone() });
        };
        if is_seen(&seen, at) {
            return Err(AnswerError::Twice { id: id.clone() });
        }
        if seen.len() <= at / 64 {
            seen.resize(at / 64 + 1, 0);
        }
        seen[at / 64] |= 1 << (at % 64);
        places.push(u32::try_from(at).expect("a place is below 4 billion"));
    }
    if let Some(missing) = must_include
        .iter()
        .find(|id| !place(id).is_some_and(|at| is_seen(&seen, at)))
    {
        return Err(AnswerError::MustIncludeMissing {
            id: missing.clone(),
        });
    }
    Ok(places)
}

/// Checks the name `given` with a new entry of `key`'s pod against the one the pod's other
/// entries carry (`recorded`): refused when the pod's UID is recorded under another name (a
/// pod's name never changes; two names for one UID are a client's mistake). The name recorded
/// with the entry is the one given, else the one recorded.
fn check_pod_name(
    recorded: Option<&PodName>,
    key: &HolderKey,
    given: Option<&PodName>,
) -> Result<(), AllocateError> {
    match (given, recorded) {
        (Some(given), Some(recorded)) if given != recorded => Err(AllocateError::PodRenamed {
            pod_uid: key.pod_uid.clone(),
            recorded: format!("{}/{}", recorded.namespace, recorded.name),
            given: format!("{}/{}", given.namespace, given.name),
        }),
        _ => Ok(()),
    }
}

/// What one container holds of one resource, as the admin API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocationInfo {
    /// The pod.
    pub pod_uid: PodUid,
    /// The container.
    pub container: ContainerName,
    /// The resource.
    pub resource: ResourceName,
    /// The devices.
    pub device_ids: Vec<DeviceId>,
    /// False while the plugin's Allocate is still running.
    pub allocated: bool,
    /// The CDI device names of the allocation (see [`Allocation::cdi_names`]).
    pub cdi_names: Vec<String>,
    /// The pod's name and namespace (its UID and `default` when none was given).
    pub pod: PodName,
}

impl AllocationInfo {
    fn of(key: &HolderKey, entry: &Holding, cdi: Option<&Handoff>) -> AllocationInfo {
        let (allocated, cdi_names) = match &entry.state {
            HoldingState::Allocated { answer } => (true, crate::cdi::names(cdi, key, answer)),
            HoldingState::Reserved { .. } => (false, Vec::new()),
        };
        AllocationInfo {
            pod_uid: key.pod_uid.clone(),
            container: key.container.clone(),
            resource: key.resource.clone(),
            device_ids: entry.devices.to_vec(),
            allocated,
            cdi_names,
            pod: PodName::shown(entry.pod.as_ref(), key.pod_uid.as_str()),
        }
    }
}

struct Inner {
    pods: Arc<Mutex<PodDevices>>,
    /// What is kept per resource, looked up once per allocation or release.
    resources: Mutex<HashMap<ResourceName, Arc<PerResource>, NameHasher>>,
    next_token: AtomicU64,
    registry: Registry,
    persistence: Persistence,
    handlers: Handlers,
    /// What the policies are told about the node (its name).
    call_context: CallContext,
    metrics: Metrics,
    cdi: Option<Handoff>,
    cancel: CancellationToken,
}

/// What the allocator keeps per resource.
#[derive(Default)]
struct PerResource {
    /// Held while choosing devices, so two requests never choose the same ones.
    decision: tokio::sync::Mutex<()>,
    /// The resource's allocation metrics.
    series: ResourceSeries,
}

/// The allocations and the decisions about them. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Allocator {
    inner: Arc<Inner>,
}

impl Allocator {
    /// An allocator starting from `pods` (restored), choosing among the `registry`'s devices
    /// with the policies of `handlers`, committing through `persistence`, recording allocations,
    /// their failures and releases in the registry's event log, handing allocations to
    /// container runtimes as CDI specs through `cdi` when it is given.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        pods: PodDevices,
        registry: Registry,
        persistence: Persistence,
        handlers: Handlers,
        node_name: String,
        metrics: Metrics,
        cdi: Option<Handoff>,
        cancel: CancellationToken,
    ) -> Allocator {
        Allocator {
            inner: Arc::new(Inner {
                pods: Arc::new(Mutex::new(pods)),
                resources: Mutex::new(HashMap::default()),
                next_token: AtomicU64::new(1),
                registry,
                persistence,
                handlers,
                call_context: CallContext { node_name },
                metrics,
                cdi,
                cancel,
            }),
        }
    }

    /// Allocates `count` devices of `resource` to one container (see the module doc), in an
    /// `allocation` span with the pod, container and resource. `pod` is the pod's name and
    /// namespace when the client gave them: recorded with the allocation, and refused when the
    /// pod's UID is recorded under another name. A new allocation and a failed one are
    /// recorded in the event log.
    pub async fn allocate(
        &self,
        key: HolderKey,
        count: u32,
        pod: Option<PodName>,
    ) -> Result<Allocation, AllocateError> {
        let span = tracing::info_span!(
            "allocation",
            pod = %key.pod_uid,
            container = %key.container,
            resource = %key.resource,
        );
        self.allocate_in_span(key, count, pod)
            .instrument(span)
            .await
    }

    async fn allocate_in_span(
        &self,
        key: HolderKey,
        count: u32,
        pod: Option<PodName>,
    ) -> Result<Allocation, AllocateError> {
        let per_resource = self.per_resource(&key.resource);
        // Shared from here on by the reservation, the change made durable and this span.
        let key = Arc::new(key);
        let result = self
            .choose_and_commit(Arc::clone(&key), count, pod, &per_resource)
            .await;
        let outcome = match &result {
            Ok(allocation) if allocation.reused => Outcome::Reused,
            Ok(_) => Outcome::Allocated,
            Err(_) => Outcome::Failed,
        };
        per_resource
            .series
            .allocation(&self.inner.metrics, key.resource.as_str(), outcome);
        match &result {
            Ok(allocation) if !allocation.reused => self.inner.registry.events().record(
                EventKind::Allocated,
                key.resource.as_str(),
                holding_text(
                    &allocation.device_ids,
                    "to",
                    key.pod_uid.as_str(),
                    key.container.as_str(),
                    &[],
                ),
            ),
            Ok(_) => {}
            Err(err) => self.inner.registry.events().record(
                EventKind::AllocateFailed,
                key.resource.as_str(),
                format!(
                    "{count} requested for pod {} container {}: {}",
                    key.pod_uid,
                    key.container,
                    pluglet_core::error_chain(err)
                ),
            ),
        }
        result
    }

    /// What is kept for `resource` (made at its first allocation or release).
    fn per_resource(&self, resource: &ResourceName) -> Arc<PerResource> {
        let mut resources = self
            .inner
            .resources
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match resources.get(resource.as_str()) {
            Some(kept) => Arc::clone(kept),
            None => Arc::clone(resources.entry(resource.clone()).or_default()),
        }
    }

    async fn choose_and_commit(
        &self,
        key: Arc<HolderKey>,
        count: u32,
        pod: Option<PodName>,
        per_resource: &PerResource,
    ) -> Result<Allocation, AllocateError> {
        let resource = key.resource.clone();
        if count == 0 {
            return Err(AllocateError::ZeroCount { resource });
        }
        if self.inner.cancel.is_cancelled() {
            return Err(AllocateError::Stopped);
        }
        let mut clock = StageClock::start(&self.inner.metrics, Operation::Allocate);
        let decision = per_resource.decision.lock().await;
        clock.done(Stage::Queue);

        let (available, offered, preferred_available, channel, named) =
            match self.plan(&key, count, pod.as_ref())? {
                Plan::Reuse(allocation) => return Ok(allocation),
                Plan::Choose {
                    available,
                    offered,
                    preferred_available,
                    channel,
                    named,
                } => (available, offered, preferred_available, channel, named),
            };
        clock.done(Stage::Candidates);

        let preferred = if preferred_available {
            let request = v1beta1::PreferredAllocationRequest {
                container_requests: vec![v1beta1::ContainerPreferredAllocationRequest {
                    available_device_i_ds: available.ids().map(str::to_owned).collect(),
                    must_include_device_i_ds: Vec::new(),
                    allocation_size: i32::try_from(count).unwrap_or(i32::MAX),
                }],
            };
            let answer = pluglet_uds::with_deadline(
                ALLOCATE_TIMEOUT,
                DevicePluginClient::new(channel).get_preferred_allocation(request),
            )
            .await
            .map_err(|status| AllocateError::Preferred {
                resource: resource.clone(),
                status,
            })?;
            // Only the first container response counts, as in the kubelet.
            let preferred = answer
                .container_responses
                .into_iter()
                .next()
                .map(|r| r.device_i_ds)
                .unwrap_or_default();
            clock.done(Stage::Preferred);
            Some(preferred)
        } else {
            None
        };

        let policy = self.inner.handlers.for_resource(resource.as_str());
        let module = policy.module();
        let request = AllocationRequest {
            resource: resource.to_string(),
            available,
            must_include: Vec::new(),
            count,
            preferred,
        };
        let cx = &self.inner.call_context;
        // The call's instance is freed during the plugin's Allocate below, not before it.
        let (call, spent) = pluglet_handler_runtime::run_in_place(|| {
            pluglet_handler_runtime::defer_release(|| policy.allocate(cx, &request))
        });
        let call = call.map_err(|source| AllocateError::PolicyFailed {
            resource: resource.clone(),
            source,
        })?;
        let chosen = call.value.map_err(|refusal| AllocateError::PolicyRefused {
            resource: resource.clone(),
            module: module.to_owned(),
            refusal,
        })?;
        // Offered means healthy in the snapshot the candidates came from and free now (under
        // the decision lock nothing else of this resource is reserved; a release only frees).
        let checked = {
            let pods = self.lock();
            let held = pods.held_of(resource.as_str());
            check_answer_in(&chosen, count, &offered, held, &request.must_include)
        };
        let found = checked.map_err(|problem| AllocateError::BadPolicyAnswer {
            resource: resource.clone(),
            module: module.to_owned(),
            answer: chosen.clone(),
            count,
            problem,
        })?;
        clock.done(Stage::Policy);
        // Checked: the answer's strings name devices now (moved, not copied), shared by the
        // holding and the plugin's request.
        let chosen: Arc<[DeviceId]> = DeviceId::from_wire(chosen).into();
        tracing::debug!(%resource, %module, ?chosen, elapsed = ?call.elapsed, "allocation policy chose");

        let token = self.inner.next_token.fetch_add(1, Ordering::SeqCst);
        let plugin = self.reserve(&key, &chosen, &found, token, pod, named)?;
        drop(decision);
        clock.done(Stage::Reserve);

        let free_spent = async move {
            // Once the request is on its way (the connection's task runs first), not before. A
            // reused instance leaves nothing to free: no extra turn of the task then.
            if !spent.is_empty() {
                tokio::task::yield_now().await;
            }
            drop(spent);
        };
        let (answered, ()) = tokio::join!(
            call_plugin(
                plugin,
                &key,
                &chosen,
                &self.inner.metrics,
                &per_resource.series
            ),
            free_spent
        );
        clock.done(Stage::Plugin);
        let handed_off = answered.and_then(|answer| {
            let view = read_answer(&answer, &key, &chosen)?;
            let (names, spec) = self.hand_off(&key, &view)?;
            Ok((answer.kept(&view), names, spec))
        });
        match handed_off {
            Ok((answer, cdi_names, spec)) => {
                clock.done(Stage::Cdi);
                let committed = self
                    .commit(key, token, chosen, answer, cdi_names, spec)
                    .await;
                clock.done(Stage::Commit);
                committed
            }
            Err(err) => {
                self.lock().cancel(&key, token);
                Err(err)
            }
        }
    }

    /// Checks and renders the CDI spec of the allocation (with CDI on); returns its CDI names
    /// and the spec file still to be written.
    fn hand_off(
        &self,
        key: &HolderKey,
        answer: &AnswerView<'_>,
    ) -> Result<(Vec<String>, Option<PendingSpec>), AllocateError> {
        let Some(cdi) = &self.inner.cdi else {
            return Ok((crate::cdi::passed_through(answer), None));
        };
        cdi.prepare(key, answer)
            .map_err(|source| AllocateError::Cdi {
                resource: key.resource.clone(),
                source,
            })
    }

    /// Removes the CDI specs of allocations that are gone (with CDI on). A spec that cannot be
    /// removed is logged; the next start removes it.
    fn unhand(&self, keys: impl IntoIterator<Item = HolderKey>) {
        let Some(cdi) = &self.inner.cdi else {
            return;
        };
        for key in keys {
            if let Err(err) = cdi.remove(&key) {
                tracing::warn!(
                    pod = %key.pod_uid,
                    container = %key.container,
                    resource = %key.resource,
                    dir = %cdi.dir().display(),
                    error = %err,
                    "cannot remove the CDI spec of a released allocation; it is removed at the next start"
                );
            }
        }
    }

    /// Releases what `pod_uid` holds (only `container`'s when given); returns the
    /// (container, resource) entries released, once that is durable. Runs in a `release` span
    /// with the pod and the container.
    pub async fn release(
        &self,
        pod_uid: &str,
        container: Option<&str>,
    ) -> Result<Vec<AllocationInfo>, ReleaseError> {
        let span = tracing::info_span!("release", pod = pod_uid, container);
        self.release_where(Select::Pod { pod_uid, container }, "")
            .instrument(span)
            .await
    }

    /// Releases, in one durable step, every allocation of a pod not in `keep` (the kubelet's
    /// sync with the active pods); with `dry_run`, only says what that would free.
    pub async fn sync_pods(
        &self,
        keep: &KeepList,
        dry_run: bool,
    ) -> Result<Vec<AllocationInfo>, ReleaseError> {
        let select = Select::NotKept(keep);
        if dry_run {
            return Ok(self.held(select));
        }
        self.release_where(select, " (sync of pods: the pod is no longer active)")
            .await
    }

    /// What `select` selects among the entries held now, found as a release finds them.
    fn held(&self, select: Select<'_>) -> Vec<AllocationInfo> {
        let pods = self.lock();
        select
            .keys(&pods)
            .iter()
            .filter_map(|key| {
                let entry = pods.get(key)?;
                Some(AllocationInfo::of(key, entry, self.inner.cdi.as_ref()))
            })
            .collect()
    }

    /// Removes the entries `select` selects in one change once that is durable (nothing is
    /// removed when it cannot be made durable); each entry released is recorded in the event
    /// log, its message ending with `why`.
    async fn release_where(
        &self,
        select: Select<'_>,
        why: &str,
    ) -> Result<Vec<AllocationInfo>, ReleaseError> {
        let mut clock = StageClock::start(&self.inner.metrics, Operation::Release);
        let released = self
            .inner
            .persistence
            .change_beside(&self.inner.pods, |state, waiting, pods| {
                let keys = select.keys_beside(state, waiting, pods);
                pods.release_keys(keys)
                    .iter()
                    .map(|(key, entry)| AllocationInfo::of(key, entry, self.inner.cdi.as_ref()))
                    .collect::<Vec<_>>()
            })
            .await;
        let released = match released {
            Ok(released) => released,
            Err(source) => {
                let err = ReleaseError {
                    held: self.held(select),
                    source,
                };
                for a in &err.held {
                    self.inner.registry.events().record(
                        EventKind::ReleaseFailed,
                        a.resource.as_str(),
                        holding_text(
                            &a.device_ids,
                            "of",
                            a.pod_uid.as_str(),
                            a.container.as_str(),
                            &[why, ": ", &pluglet_core::error_chain(&err)],
                        ),
                    );
                }
                return Err(err);
            }
        };
        if released.is_empty() {
            return Ok(released);
        }
        clock.done(Stage::Commit);
        self.unhand(
            released.iter().map(|a| {
                HolderKey::new(a.pod_uid.clone(), a.container.clone(), a.resource.clone())
            }),
        );
        if self.inner.cdi.is_some() {
            clock.done(Stage::CdiRemove);
        }
        tracing::info!(
            entries = released.len(),
            pods = ?released.iter().map(|a| a.pod_uid.as_str()).collect::<BTreeSet<_>>(),
            "devices released"
        );
        for a in &released {
            self.per_resource(&a.resource)
                .series
                .released(&self.inner.metrics, a.resource.as_str());
            self.inner.registry.events().record(
                EventKind::Released,
                a.resource.as_str(),
                holding_text(
                    &a.device_ids,
                    "of",
                    a.pod_uid.as_str(),
                    a.container.as_str(),
                    &[why],
                ),
            );
        }
        Ok(released)
    }

    /// Who holds what, sorted by pod, container and resource.
    pub fn allocations(&self) -> Vec<AllocationInfo> {
        self.lock()
            .iter()
            .map(|(key, entry)| AllocationInfo::of(key, entry, self.inner.cdi.as_ref()))
            .collect()
    }

    /// A copy of the records (entries only, shared: see [`PodDevices::without_index`]), for
    /// the checkpoint writer.
    pub fn snapshot(&self) -> PodDevices {
        self.lock().without_index()
    }

    /// Reuse, or the candidates: the registry's devices now, minus what someone holds.
    fn plan(
        &self,
        key: &HolderKey,
        count: u32,
        pod: Option<&PodName>,
    ) -> Result<Plan, AllocateError> {
        let named = match self.reuse(key, count, pod)? {
            Holds::Already(allocation) => return Ok(Plan::Reuse(allocation)),
            Holds::Nothing(named) => named,
        };
        let offer = self.inner.registry.offer(&key.resource)?;
        let available = {
            let mut pods = self.lock();
            let (free, runs) = pods.free_devices(&key.resource, &offer.devices);
            let mut available = Candidates::with_capacity(free, free * ID_BYTES_GUESS);
            for run in runs {
                available.extend_from_columns(run);
            }
            available
        };
        if available.len() < count as usize {
            return Err(AllocateError::Unavailable {
                resource: key.resource.clone(),
                requested: count,
                available: available.len(),
            });
        }
        Ok(Plan::Choose {
            available,
            offered: offer.devices,
            preferred_available: offer.preferred_available,
            channel: offer.channel,
            named,
        })
    }

    /// What the container holds already, if anything; else what the state said of the pod,
    /// for [`Allocator::reserve`].
    fn reuse(
        &self,
        key: &HolderKey,
        count: u32,
        pod: Option<&PodName>,
    ) -> Result<Holds, AllocateError> {
        let pods = self.lock();
        let (recorded, entry) = pods.pod_name_and_entry(key);
        check_pod_name(recorded, key, pod)?;
        let Some(entry) = entry else {
            return Ok(Holds::Nothing(Named {
                version: pods.version(),
                recorded: match (pod, recorded) {
                    (None, Some(recorded)) => Some(recorded.clone()),
                    _ => None,
                },
            }));
        };
        match &entry.state {
            HoldingState::Reserved { .. } => Err(AllocateError::InProgress {
                pod_uid: key.pod_uid.clone(),
                container: key.container.clone(),
                resource: key.resource.clone(),
            }),
            HoldingState::Allocated { answer } if entry.devices.len() == count as usize => {
                Ok(Holds::Already(Allocation {
                    device_ids: entry.devices.to_vec(),
                    answer: answer.clone(),
                    reused: true,
                    cdi_names: crate::cdi::names(self.inner.cdi.as_ref(), key, answer),
                }))
            }
            HoldingState::Allocated { .. } => Err(AllocateError::ChangedRequest {
                pod_uid: key.pod_uid.clone(),
                container: key.container.clone(),
                resource: key.resource.clone(),
                held: entry.devices.len(),
                requested: count,
            }),
        }
    }

    /// Checks the chosen devices are still healthy (in the registry now) and free (under the
    /// allocator's lock), and holds them for this request. `found` says where the answer's
    /// check found them; `named`, what [`Allocator::reuse`] found of the pod (used as it is
    /// while the state has not changed since). Returns the plugin's connection and whether
    /// PreStartContainer is due.
    fn reserve(
        &self,
        key: &Arc<HolderKey>,
        chosen: &Arc<[DeviceId]>,
        found: &Positions,
        token: u64,
        pod: Option<PodName>,
        named: Named,
    ) -> Result<PluginCall, AllocateError> {
        let offer = self.inner.registry.offer(&key.resource)?;
        let mut pods = self.lock();
        let pod = if pods.version() == named.version {
            pod.or(named.recorded)
        } else {
            let (recorded, entry) = pods.pod_name_and_entry(key);
            check_pod_name(recorded, key, pod.as_ref())?;
            if entry.is_some() {
                return Err(AllocateError::InProgress {
                    pod_uid: key.pod_uid.clone(),
                    container: key.container.clone(),
                    resource: key.resource.clone(),
                });
            }
            pod.or_else(|| recorded.cloned())
        };
        let held = pods.held_of(key.resource.as_str());
        let numa_of = reservable(&offer.devices, chosen, found, held).map_err(|device| {
            AllocateError::Raced {
                resource: key.resource.clone(),
                device: device.clone(),
            }
        })?;
        let numa = group_by_numa(chosen.iter().map(DeviceId::as_str).zip(numa_of));
        pods.insert_found(
            Arc::clone(key),
            Holding {
                devices: Arc::clone(chosen),
                numa: numa.into(),
                state: HoldingState::Reserved { token },
                pod,
            },
            found,
        );
        Ok(PluginCall {
            channel: offer.channel,
            calls: offer.calls,
            pre_start: offer.pre_start_required,
        })
    }

    /// Records the allocation once it is durable and its CDI spec (if any) is written; drops
    /// the reservation and the spec if it cannot be made durable, and undoes the allocation if
    /// the spec cannot be written (nothing held, the spec gone).
    ///
    /// The spec file is written on the hand-off's writer thread while the journal record is
    /// written here: the answer waits for both, neither needs the other, and the spec's file
    /// creation and rename cost about as much as the journal's `fdatasync`.
    async fn commit(
        &self,
        key: Arc<HolderKey>,
        token: u64,
        chosen: Arc<[DeviceId]>,
        answer: PluginAnswer,
        cdi_names: Vec<String>,
        spec: Option<PendingSpec>,
    ) -> Result<Allocation, AllocateError> {
        let writing = match (spec, &self.inner.cdi) {
            (Some(spec), Some(cdi)) => Some(cdi.write_later(spec)),
            _ => None,
        };
        // The state and the caller share the answer's bytes.
        let committed = self
            .inner
            .persistence
            .change(&self.inner.pods, |pods| {
                pods.commit(&key, token, answer.clone())
            })
            .await;
        let written = match writing {
            None => Ok(()),
            Some(write) => write.await,
        };
        match committed {
            Ok(true) => {
                if let Err(source) = written {
                    self.undo(&key).await;
                    return Err(AllocateError::Cdi {
                        resource: key.resource.clone(),
                        source,
                    });
                }
            }
            Ok(false) => {
                self.unhand([HolderKey::clone(&key)]);
                return Err(AllocateError::Released {
                    pod_uid: key.pod_uid.clone(),
                    container: key.container.clone(),
                    resource: key.resource.clone(),
                });
            }
            Err(source) => {
                self.lock().cancel(&key, token);
                self.unhand([HolderKey::clone(&key)]);
                return Err(AllocateError::Checkpoint {
                    resource: key.resource.clone(),
                    source,
                });
            }
        }
        // The pod, container and resource are the fields of the allocation span around this.
        tracing::info!(devices = ?chosen, "devices allocated");
        Ok(Allocation {
            device_ids: chosen.to_vec(),
            answer,
            reused: false,
            cdi_names,
        })
    }

    /// Takes back a durable allocation whose CDI spec could not be written, and removes what
    /// was written of the spec. If that cannot be recorded either, the devices stay held (as the
    /// journal says) until released, and the error log says so.
    async fn undo(&self, key: &HolderKey) {
        let undone = self
            .inner
            .persistence
            .change(&self.inner.pods, |pods| {
                pods.release_keys(vec![key.clone()]);
            })
            .await;
        self.unhand([key.clone()]);
        if let Err(err) = undone {
            tracing::error!(
                pod = %key.pod_uid,
                container = %key.container,
                resource = %key.resource,
                error = %pluglet_core::error_chain(&*err),
                "the allocation was refused (its CDI spec could not be written) but cannot be \
                 taken back on disk: its devices stay held until the pod is released"
            );
        }
    }

    fn lock(&self) -> MutexGuard<'_, PodDevices> {
        self.inner.pods.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The NUMA nodes of each of `chosen` if every one is healthy in `devices` (the resource's
/// devices now) and not `held`; else the first that is not. While `devices` is the set the
/// answer was checked against (the same generation), `found` says where each is; when it
/// changed meanwhile, each is looked up again by id.
fn reservable<'a, 'c>(
    devices: &'a DeviceSet,
    chosen: &'c [DeviceId],
    found: &Positions,
    held: HeldIds<'_>,
) -> Result<Vec<&'a [i64]>, &'c DeviceId> {
    let at = found.in_set(devices);
    let mut numa_of = Vec::with_capacity(chosen.len());
    for (i, id) in chosen.iter().enumerate() {
        let device = match at {
            Some(at) => devices.at(at[i] as usize),
            None => devices.get(id.as_str()),
        };
        match device {
            Some(device) if device.health == Health::Healthy && !held.is_held(id.as_str()) => {
                numa_of.push(device.numa);
            }
            _ => return Err(id),
        }
    }
    Ok(numa_of)
}

/// `1 device (d0) to pod <uid> container <name>` / `2 devices (d0,d1) of pod …` (`link` is
/// `to` or `of`), then `tail`: an event's text, written on every allocation and release, so
/// built in one string rather than by `format!` (several times the instructions).
fn holding_text(
    ids: &[DeviceId],
    link: &str,
    pod_uid: &str,
    container: &str,
    tail: &[&str],
) -> String {
    let count = ids.len().to_string();
    let noun = if ids.len() == 1 {
        " device ("
    } else {
        " devices ("
    };
    let holder = [") ", link, " pod ", pod_uid, " container ", container];
    let ids_len: usize = ids.iter().map(|id| id.as_str().len() + 1).sum();
    let rest_len: usize = holder.iter().chain(tail).map(|part| part.len()).sum();
    let mut text = String::with_capacity(count.len() + noun.len() + ids_len + rest_len);
    text.push_str(&count);
    text.push_str(noun);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            text.push(',');
        }
        text.push_str(id.as_str());
    }
    for part in holder.iter().chain(tail) {
        text.push_str(part);
    }
    text
}

/// Bytes per device id to make room for when collecting candidates (a guess: too small only
/// costs a few regrowths of one string).
const ID_BYTES_GUESS: usize = 16;

/// Which entries a release removes.
#[derive(Clone, Copy)]
enum Select<'a> {
    /// The entries of this pod (only this container's, when given).
    Pod {
        pod_uid: &'a str,
        container: Option<&'a str>,
    },
    /// Every entry of a pod not in this list.
    NotKept(&'a KeepList),
}

impl Select<'_> {
    /// The keys of the entries this selects in `pods`, sorted.
    fn keys(self, pods: &PodDevices) -> Vec<HolderKey> {
        self.keys_beside(pods, &[], pods)
    }

    /// The keys of the entries this selects in `next`, a copy made from `state` with the
    /// changes `waiting` made on it (see [`Persistence::change_beside`]), sorted.
    fn keys_beside(
        self,
        state: &PodDevices,
        waiting: &[Change],
        next: &PodDevices,
    ) -> Vec<HolderKey> {
        match self {
            Select::Pod { pod_uid, container } => {
                next.pod_keys_where(pod_uid, |key| container.is_none_or(|c| key.container == c))
            }
            Select::NotKept(keep) => next.not_kept_beside(state, waiting, keep),
        }
    }
}

/// What the records say before the policy runs.
enum Plan {
    /// The container already holds these devices.
    Reuse(Allocation),
    /// Choose among these.
    Choose {
        available: Candidates,
        /// The registry's devices the candidates were taken from.
        offered: DeviceSet,
        preferred_available: bool,
        /// The plugin's connection.
        channel: Channel,
        /// What the state said of the pod.
        named: Named,
    },
}

/// What [`Allocator::reuse`] found.
enum Holds {
    /// The container already holds these devices.
    Already(Allocation),
    /// It holds none of the resource yet.
    Nothing(Named),
}

/// What [`Allocator::reuse`] found of a pod that does not hold the resource yet: the state's
/// version then, and the name its other entries carry when the request gave none. While the
/// state is at that version, [`Allocator::reserve`] takes this instead of looking the pod's
/// entries up again (a range of the map: about 1,000 instructions on a node of 10,000
/// allocations).
struct Named {
    version: u64,
    recorded: Option<PodName>,
}

/// Whom an allocation asks: the plugin's connection and Allocate calls, and whether it wants
/// PreStartContainer.
struct PluginCall {
    channel: Channel,
    calls: Arc<AllocateCalls>,
    pre_start: bool,
}

/// Allocate (in the plugin's next call, see [`AllocateCalls`]), then PreStartContainer when the
/// plugin asked for it.
async fn call_plugin(
    plugin: PluginCall,
    key: &HolderKey,
    chosen: &Arc<[DeviceId]>,
    metrics: &Metrics,
    series: &ResourceSeries,
) -> Result<ReadAnswer, AllocateError> {
    let started = std::time::Instant::now();
    let called = plugin.calls.allocate(AllocateIds(Arc::clone(chosen))).await;
    let resource = key.resource.as_str();
    series.alloc_duration(metrics, resource, started.elapsed());
    series.allocate_calls(metrics, resource, called.calls);
    let answer = called.answer.map_err(|status| AllocateError::Allocate {
        resource: key.resource.clone(),
        devices: chosen.to_vec(),
        status,
    })?;
    let answer = answer.ok_or_else(|| AllocateError::EmptyAllocateResponse {
        resource: key.resource.clone(),
        devices: chosen.to_vec(),
    })?;
    if plugin.pre_start {
        // An answer that does not decode fails the allocation before PreStartContainer, as
        // the kubelet's client refuses it with the Allocate call.
        read_answer(&answer, key, chosen)?;
        let mut client = DevicePluginClient::new(plugin.channel);
        let request = v1beta1::PreStartContainerRequest {
            devices_ids: DeviceId::to_wire(chosen),
        };
        pluglet_uds::with_deadline(PRE_START_TIMEOUT, client.pre_start_container(request))
            .await
            .map_err(|status| AllocateError::PreStart {
                resource: key.resource.clone(),
                devices: chosen.to_vec(),
                status,
            })?;
    }
    Ok(answer)
}

/// The plugin's answer read in place; an answer that does not decode fails the Allocate call.
fn read_answer<'a>(
    answer: &'a ReadAnswer,
    key: &HolderKey,
    chosen: &[DeviceId],
) -> Result<AnswerView<'a>, AllocateError> {
    answer.view().map_err(|status| AllocateError::Allocate {
        resource: key.resource.clone(),
        devices: chosen.to_vec(),
        status: RpcError(status),
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn an_answer_that_does_not_decode_fails_the_allocate_call() {
        let key = HolderKey::new("p", "c", "vendor.com/gpu");
        let cut = ReadAnswer {
            encoded: bytes::Bytes::from_static(&[0x1a, 0x05, 0x0a]),
        };
        let chosen = [DeviceId::new("d0")];
        match read_answer(&cut, &key, &chosen) {
            Err(AllocateError::Allocate {
                devices, status, ..
            }) => {
                assert_eq!(devices, chosen);
                assert!(
                    status.0.message().contains("does not decode"),
                    "{}",
                    status.0
                );
            }
            other => panic!("{other:?}"),
        }
    }

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_good_answer_passes() {
        let available = HashSet::from(["a", "b", "c"]);
        assert_eq!(
            check_answer(
                &ids(&["c", "a"]),
                2,
                |id| available.contains(id),
                &ids(&["a"])
            ),
            Ok(())
        );
    }

    #[test]
    fn bad_answers_are_named() {
        let available = HashSet::from(["a", "b", "c"]);
        let cases: [(&[&str], &[&str], &str); 4] = [
            (&["a"], &[], "1 ids instead of exactly 2"),
            (&["a", "a"], &[], "a is chosen twice"),
            (&["a", "x"], &[], "x is not an available device"),
            (&["a", "b"], &["c"], "must-include device c is missing"),
        ];
        for (answer, must, expected) in cases {
            let err =
                check_answer(&ids(answer), 2, |id| available.contains(id), &ids(must)).unwrap_err();
            assert!(err.to_string().contains(expected), "{answer:?}: {err}");
        }
    }

    fn set(devices: &[(&str, Health, &[i64])]) -> DeviceSet {
        DeviceSet::new(
            devices
                .iter()
                .map(|&(id, health, numa)| crate::devices::ListedDevice {
                    id: id.into(),
                    health,
                    numa: numa.to_vec(),
                })
                .collect(),
        )
    }

    fn chosen(list: &[&str]) -> Vec<DeviceId> {
        list.iter().map(|&s| DeviceId::from(s)).collect()
    }

    #[test]
    fn the_check_against_a_set_finds_where_the_answer_s_devices_are() {
        use Health::{Healthy, Unhealthy};
        let devices = set(&[
            ("a", Healthy, &[0]),
            ("b", Healthy, &[1]),
            ("c", Healthy, &[0]),
            ("sick", Unhealthy, &[0]),
            ("taken", Healthy, &[1]),
        ]);
        let mut pods = PodDevices::default();
        pods.insert(
            HolderKey::new("p", "c", "r"),
            Holding {
                devices: chosen(&["taken"]).into(),
                numa: Default::default(),
                state: HoldingState::Reserved { token: 1 },
                pod: None,
            },
        );
        let held = pods.held_of("r");
        let found = check_answer_in(&ids(&["c", "a"]), 2, &devices, held, &ids(&["a"])).unwrap();
        assert_eq!(found, Positions::new(&devices, vec![2, 0]));

        let cases: [(&[&str], &[&str], &str); 6] = [
            (&["a"], &[], "1 ids instead of exactly 2"),
            (&["a", "a"], &[], "a is chosen twice"),
            (&["a", "x"], &[], "x is not an available device"),
            (&["a", "sick"], &[], "sick is not an available device"),
            (&["taken", "a"], &[], "taken is not an available device"),
            (&["a", "b"], &["c"], "must-include device c is missing"),
        ];
        let available = HashSet::from(["a", "b", "c"]);
        for (answer, must, expected) in cases {
            let err = check_answer_in(&ids(answer), 2, &devices, held, &ids(must)).unwrap_err();
            assert!(err.to_string().contains(expected), "{answer:?}: {err}");
            let by_id = check_answer(&ids(answer), 2, |id| available.contains(id), &ids(must));
            assert_eq!(by_id, Err(err), "both checks name the same problem");
        }
    }

    #[test]
    fn a_reservation_in_the_checked_set_takes_the_devices_where_the_check_found_them() {
        use Health::Healthy;
        let devices = set(&[("a", Healthy, &[0]), ("b", Healthy, &[1])]);
        let held = PodDevices::default();
        let picked = chosen(&["a", "b"]);
        let found =
            check_answer_in(&ids(&["a", "b"]), 2, &devices, held.held_of("r"), &[]).unwrap();
        // The registry's copy of the set the candidates came from.
        let now = devices.clone();
        let numa = reservable(&now, &picked, &found, held.held_of("r")).unwrap();
        assert_eq!(numa, [&[0][..], &[1][..]]);

        // Positions of the same generation are read as they are, the ids not looked up.
        let swapped = Positions::new(&devices, vec![1, 0]);
        let numa = reservable(&devices, &picked, &swapped, held.held_of("r")).unwrap();
        assert_eq!(numa, [&[1][..], &[0][..]]);
    }

    #[test]
    fn a_set_changed_since_the_check_is_read_by_id_and_still_refuses_what_is_gone() {
        use Health::{Healthy, Unhealthy};
        let checked = set(&[("a", Healthy, &[0]), ("b", Healthy, &[1])]);
        let held = PodDevices::default();
        let picked = chosen(&["a", "b"]);
        let found =
            check_answer_in(&ids(&["a", "b"]), 2, &checked, held.held_of("r"), &[]).unwrap();

        // The same devices listed anew, in another order: found by id where they are now.
        let reordered = set(&[
            ("b", Healthy, &[1]),
            ("x", Healthy, &[]),
            ("a", Healthy, &[0]),
        ]);
        let numa = reservable(&reordered, &picked, &found, held.held_of("r")).unwrap();
        assert_eq!(numa, [&[0][..], &[1][..]]);

        let mut unhealthy = checked.clone();
        let b = crate::devices::ListedDevice {
            id: "b".into(),
            health: Unhealthy,
            numa: vec![1],
        };
        assert_eq!(unhealthy.apply_changes(2, &[(1, b)]), Some(true));
        assert_eq!(
            reservable(&unhealthy, &picked, &found, held.held_of("r")),
            Err(&picked[1]),
            "turned unhealthy"
        );

        let gone = set(&[("a", Healthy, &[0]), ("c", Healthy, &[1])]);
        assert_eq!(
            reservable(&gone, &picked, &found, held.held_of("r")),
            Err(&picked[1]),
            "no longer listed, another device in its place"
        );

        let mut all_gone = checked.clone();
        all_gone.mark_all_unhealthy();
        assert_eq!(
            reservable(&all_gone, &picked, &found, held.held_of("r")),
            Err(&picked[0])
        );
    }

    #[test]
    fn a_reservation_refuses_a_device_held_since_the_check() {
        let checked = set(&[("a", Health::Healthy, &[0]), ("b", Health::Healthy, &[1])]);
        let mut pods = PodDevices::default();
        let picked = chosen(&["a", "b"]);
        let found =
            check_answer_in(&ids(&["a", "b"]), 2, &checked, pods.held_of("r"), &[]).unwrap();
        pods.insert(
            HolderKey::new("p", "c", "r"),
            Holding {
                devices: chosen(&["b"]).into(),
                numa: Default::default(),
                state: HoldingState::Reserved { token: 1 },
                pod: None,
            },
        );
        assert_eq!(
            reservable(&checked, &picked, &found, pods.held_of("r")),
            Err(&picked[1])
        );
    }
}

#[cfg(test)]
mod alone {
    use std::collections::BTreeMap;

    use pluglet_checkpoint::Durability;
    use pluglet_proto::v1beta1::DevicePluginOptions;
    use tokio::sync::mpsc;
    use tokio_util::task::TaskTracker;

    use super::*;
    use crate::persistence::{JOURNAL_FILE_NAME, Paths, SIDE_FILE_NAME};
    use crate::registry::Settings;
    use pluglet_test_support::pipeline::{handlers, registration};
    use pluglet_test_support::stub::{Stub, devices};

    const GPU: &str = "vendor.com/gpu";

    /// A registry with a stub plugin of 4 devices of [`GPU`] connected, and its persistence,
    /// event log and cancel token.
    async fn connected(
        dir: &std::path::Path,
    ) -> (
        Stub,
        Registry,
        Persistence,
        pluglet_core::events::EventLog,
        CancellationToken,
    ) {
        let stub = Stub::start(
            &dir.join("gpu.sock"),
            devices(4, 2),
            DevicePluginOptions::default(),
        );
        let (persistence, _) = Persistence::open(
            Paths {
                checkpoint: dir.join("kubelet_internal_checkpoint"),
                side: dir.join(SIDE_FILE_NAME),
                journal: dir.join(JOURNAL_FILE_NAME),
            },
            Durability::NoFsync,
            Metrics::default(),
        )
        .unwrap();
        let cancel = CancellationToken::new();
        let log = pluglet_core::events::EventLog::default();
        let registry = Registry::new(
            BTreeMap::new(),
            Settings {
                grace_period: Duration::from_secs(300),
                dial_timeout: Duration::from_secs(5),
                allocate_batch: crate::DEFAULT_ALLOCATE_BATCH,
            },
            persistence.requests(),
            cancel.clone(),
            TaskTracker::new(),
            mpsc::unbounded_channel().0,
            log.clone(),
        );
        let mut changes = registry.changes();
        registry
            .connect(
                ResourceName::from(GPU),
                stub.socket.clone(),
                crate::endpoint::Flow::Classic,
                registration(GPU).await,
            )
            .await
            .unwrap();
        while registry.counts(GPU) != Some((4, 4)) {
            changes.changed().await.unwrap();
        }
        (stub, registry, persistence, log, cancel)
    }

    #[tokio::test]
    async fn alone_it_allocates_reuses_syncs_and_releases_durably() {
        let dir = tempfile::tempdir().unwrap();
        let (_stub, registry, persistence, log, cancel) = connected(dir.path()).await;
        let allocator = Allocator::new(
            PodDevices::default(),
            registry,
            persistence.clone(),
            handlers(),
            "node-1".into(),
            Metrics::default(),
            None,
            cancel,
        );
        let journaled = || std::fs::metadata(dir.path().join(JOURNAL_FILE_NAME)).unwrap();
        let before = journaled().modified().unwrap();

        let a = allocator
            .allocate(HolderKey::new("pod-a", "ctr", GPU), 2, None)
            .await
            .unwrap();
        assert!(!a.reused);
        let again = allocator
            .allocate(HolderKey::new("pod-a", "ctr", GPU), 2, None)
            .await
            .unwrap();
        assert!(again.reused && again.device_ids == a.device_ids);
        let b = allocator
            .allocate(HolderKey::new("pod-b", "ctr", GPU), 2, None)
            .await
            .unwrap();
        assert!(b.device_ids.iter().all(|id| !a.device_ids.contains(id)));
        let err = allocator
            .allocate(HolderKey::new("pod-c", "ctr", GPU), 1, None)
            .await
            .unwrap_err();
        assert!(
            matches!(err, AllocateError::Unavailable { available: 0, .. }),
            "{err}"
        );
        assert!(journaled().modified().unwrap() >= before);

        let keep = KeepList::from_iter(["pod-b"]);
        let would = allocator.sync_pods(&keep, true).await.unwrap();
        assert_eq!(would.len(), 1);
        assert_eq!(allocator.allocations().len(), 2, "a dry run frees nothing");
        let freed = allocator.sync_pods(&keep, false).await.unwrap();
        assert_eq!(freed, would);
        let pods: Vec<String> = allocator
            .allocations()
            .iter()
            .map(|a| a.pod_uid.to_string())
            .collect();
        assert_eq!(pods, ["pod-b"]);
        assert_eq!(allocator.release("pod-b", None).await.unwrap().len(), 1);
        assert!(allocator.allocations().is_empty());

        let events: Vec<(EventKind, String)> = log
            .recent()
            .into_iter()
            .filter(|e| e.kind != EventKind::Connected)
            .map(|e| (e.kind, e.message))
            .collect();
        let kinds: Vec<EventKind> = events.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            kinds,
            [
                EventKind::Allocated,
                EventKind::Allocated,
                EventKind::AllocateFailed,
                EventKind::Released,
                EventKind::Released
            ],
            "a reused allocation and a dry run record nothing: {events:?}"
        );
        assert!(
            events[0].1.ends_with("to pod pod-a container ctr"),
            "{events:?}"
        );
        assert!(events[3].1.contains("sync of pods"), "{events:?}");
        assert!(events[4].1.starts_with("2 devices ("), "{events:?}");
    }

    #[test]
    fn event_texts_name_the_devices_and_the_holder() {
        let one: Vec<DeviceId> = vec!["d0".into()];
        assert_eq!(
            holding_text(&one, "to", "pod-a", "ctr", &[]),
            "1 device (d0) to pod pod-a container ctr"
        );
        let two: Vec<DeviceId> = vec!["d0".into(), "d1".into()];
        assert_eq!(
            holding_text(&two, "of", "pod-a", "ctr", &[" (sync)", ": ", "gone"]),
            "2 devices (d0,d1) of pod pod-a container ctr (sync): gone"
        );
        assert_eq!(
            holding_text(&[], "of", "p", "c", &[]),
            "0 devices () of pod p container c"
        );
    }

    #[tokio::test]
    async fn specs_follow_allocations_and_an_answer_no_runtime_can_use_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (stub, registry, persistence, _log, cancel) = connected(dir.path()).await;
        let cdi_dir = dir.path().join("cdi");
        let allocator = Allocator::new(
            PodDevices::default(),
            registry,
            persistence,
            handlers(),
            "node-1".into(),
            Metrics::default(),
            Some(Handoff::new(cdi_dir.clone())),
            cancel,
        );
        let spec = cdi_dir.join("pluglet-vendor.com=gpu=pod-a_ctr.json");
        let a = allocator
            .allocate(HolderKey::new("pod-a", "ctr", GPU), 1, None)
            .await
            .unwrap();
        assert_eq!(a.cdi_names, ["vendor.com/gpu=pluglet-pod-a_ctr"]);
        assert!(spec.exists());
        let again = allocator
            .allocate(HolderKey::new("pod-a", "ctr", GPU), 1, None)
            .await
            .unwrap();
        assert_eq!(
            again.cdi_names, a.cdi_names,
            "a reused allocation has the same names"
        );
        allocator
            .sync_pods(&KeepList::default(), false)
            .await
            .unwrap();
        assert!(!spec.exists(), "the spec went with the allocation");

        *stub.state.allocate_answer.lock().unwrap() = Some(v1beta1::ContainerAllocateResponse {
            mounts: vec![v1beta1::Mount {
                container_path: "relative/path".into(),
                host_path: "/tmp".into(),
                read_only: true,
            }],
            ..Default::default()
        });
        let err = allocator
            .allocate(HolderKey::new("pod-b", "ctr", GPU), 1, None)
            .await
            .unwrap_err();
        let text = pluglet_core::error_chain(&err);
        assert!(matches!(err, AllocateError::Cdi { .. }), "{text}");
        assert!(
            text.contains("mount container path \"relative/path\" is not an absolute path"),
            "{text}"
        );
        assert!(allocator.allocations().is_empty(), "nothing held");

        *stub.state.allocate_answer.lock().unwrap() = None;
        std::fs::remove_dir_all(&cdi_dir).unwrap();
        std::fs::write(&cdi_dir, "not a directory").unwrap();
        let err = allocator
            .allocate(HolderKey::new("pod-c", "ctr", GPU), 1, None)
            .await
            .unwrap_err();
        let text = pluglet_core::error_chain(&err);
        assert!(text.contains("cannot write the CDI spec"), "{text}");
        assert!(allocator.allocations().is_empty(), "nothing held");
    }
}
