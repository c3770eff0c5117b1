//! The publisher: a handle that takes the inventory's changes without ever waiting, and the
//! single task that converges the API objects to it.
//!
//! Level-triggered: the task compares the whole desired inventory with what it last published,
//! so any number of changes between two rounds costs one round. Rounds are at least
//! [`PublisherConfig::min_interval`] apart (a plugin flapping a thousand times a second makes a
//! few writes a second), a failed round is retried after a backoff that doubles up to
//! [`PublisherConfig::backoff_max`] (an API server that is down, slow or refusing never holds
//! up the node), and a conflict (409) is retried at once from a fresh read. When nothing
//! changes, nothing is sent.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::CSINode;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use pluglet_core::BackoffPolicy;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::client::Connection;
use crate::csinode::{self, Step};
use crate::inventory::{Counts, CsiDriver, Desired, Inventory};
use crate::node::{self, with_resource_version};

/// The field manager Pluglet's writes are recorded under.
pub const FIELD_MANAGER: &str = "pluglet";

/// Longest wait between two reads of a Node that does not exist yet.
const NODE_WAIT_MAX: Duration = Duration::from_secs(5);

/// Conflicts (409) in a row before a round counts as failed.
const CONFLICT_RETRIES: u32 = 5;

/// How the publisher behaves.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// The Node's name.
    pub node_name: String,
    /// Create the Node when it does not exist (else wait for it).
    pub register_node: bool,
    /// Labels of a Node created with `register_node`.
    pub node_labels: BTreeMap<String, String>,
    /// How long a resource that left the device manager is published at 0 before it is
    /// removed from the Node.
    pub linger: Duration,
    /// Least time between two rounds.
    pub min_interval: Duration,
    /// First retry delay after a failed round.
    pub backoff_initial: Duration,
    /// Longest retry delay.
    pub backoff_max: Duration,
}

impl PublisherConfig {
    /// Defaults for `node_name`: wait for the Node, 5 minutes at 0, rounds 250 ms apart,
    /// backoff 500 ms doubling to 30 s.
    pub fn new(node_name: String) -> PublisherConfig {
        PublisherConfig {
            node_name,
            register_node: false,
            node_labels: BTreeMap::new(),
            linger: Duration::from_secs(300),
            min_interval: Duration::from_millis(250),
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
        }
    }
}

/// Where publishing stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// No round has finished yet.
    Starting,
    /// The API objects show the inventory.
    Synced,
    /// Changes are waiting for the next round.
    Pending,
    /// The last round failed; retried with backoff.
    Failing,
    /// The Node does not exist (and `register_node` is off).
    WaitingForNode,
}

impl State {
    /// The name `ctl status` and the metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Synced => "synced",
            State::Pending => "pending",
            State::Failing => "failing",
            State::WaitingForNode => "waiting-for-node",
        }
    }
}

/// A snapshot of the publisher's progress.
#[derive(Clone, Debug)]
pub struct SyncStatus {
    /// The Node's name.
    pub node: String,
    /// The API server's URL (empty until connected).
    pub server: String,
    /// Where it stands.
    pub state: State,
    /// When the API objects last matched the inventory.
    pub last_sync: Option<SystemTime>,
    /// The last round's error, while failing.
    pub last_error: Option<String>,
    /// Inventory changes not yet published.
    pub pending_changes: u64,
    /// Rounds finished (successful or not).
    pub rounds: u64,
    /// Rounds that failed.
    pub failures: u64,
    /// Writes sent (create, patch, replace).
    pub writes: u64,
    /// Conflicts (409) met and retried.
    pub conflicts: u64,
    /// What could not be published because others' data disagrees (label values, unreadable
    /// annotations), from the last round.
    pub warnings: Vec<String>,
    /// Resources desired now.
    pub resources: usize,
    /// CSI drivers desired now.
    pub csi_drivers: usize,
}

struct Shared {
    config: PublisherConfig,
    desired: Mutex<Desired>,
    wake: Notify,
    status: Mutex<SyncStatus>,
}

/// The handle the device manager and the CSI registrations feed; cheap to clone.
#[derive(Clone)]
pub struct Publisher {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("node", &self.shared.config.node_name)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    /// A publisher for `config`'s Node; nothing is sent until [`Publisher::run`].
    pub fn new(config: PublisherConfig) -> Publisher {
        let status = SyncStatus {
            node: config.node_name.clone(),
            server: String::new(),
            state: State::Starting,
            last_sync: None,
            last_error: None,
            pending_changes: 0,
            rounds: 0,
            failures: 0,
            writes: 0,
            conflicts: 0,
            warnings: Vec::new(),
            resources: 0,
            csi_drivers: 0,
        };
        Publisher {
            shared: Arc::new(Shared {
                desired: Mutex::new(Desired::new(config.linger)),
                config,
                wake: Notify::new(),
                status: Mutex::new(status),
            }),
        }
    }

    /// The device manager's resources now (every resource it knows, by name).
    pub fn set_resources(&self, resources: BTreeMap<String, Counts>) {
        if self.desired().set_resources(resources, Instant::now()) {
            self.shared.wake.notify_one();
        }
    }

    /// Registration `id` of CSI driver `name` is in force.
    pub fn install_csi_driver(&self, name: &str, id: u64, driver: CsiDriver) {
        self.desired().install_driver(name, id, driver);
        self.shared.wake.notify_one();
    }

    /// Registration `id` of CSI driver `name` ended.
    pub fn remove_csi_driver(&self, name: &str, id: u64) {
        self.desired().remove_driver(name, id);
        self.shared.wake.notify_one();
    }

    /// Where publishing stands.
    pub fn status(&self) -> SyncStatus {
        let mut status = lock(&self.shared.status).clone();
        let desired = self.desired();
        (status.resources, status.csi_drivers) = desired.sizes();
        status
    }

    /// The Node's name.
    pub fn node_name(&self) -> &str {
        &self.shared.config.node_name
    }

    fn desired(&self) -> MutexGuard<'_, Desired> {
        lock(&self.shared.desired)
    }

    fn update(&self, f: impl FnOnce(&mut SyncStatus)) {
        f(&mut lock(&self.shared.status));
    }

    /// Converges the API objects to the inventory until `cancel` fires: the single writer.
    pub async fn run(self, connection: Connection, cancel: CancellationToken) {
        let server = connection.server().to_owned();
        let client = connection.client;
        self.update(|s| s.server = server.clone());
        let config = self.shared.config.clone();
        let mut task = Task {
            nodes: Api::all(client.clone()),
            csinodes: Api::all(client),
            node: None,
            csinode: None,
            publisher: self.clone(),
        };
        let mut published: Option<Inventory> = None;
        let mut published_generation = 0u64;
        let mut failures = 0u32;
        let mut not_before: Option<Instant> = None;
        loop {
            let now = Instant::now();
            let (generation, want, next_change) = {
                let mut desired = self.desired();
                let generation = desired.generation();
                let (want, next) = desired.inventory(now);
                (generation, want, next)
            };
            if published.as_ref() == Some(&want) {
                published_generation = generation;
                self.update(|s| {
                    s.pending_changes = 0;
                    if s.state == State::Pending {
                        s.state = State::Synced;
                    }
                });
                let lingering = async {
                    match next_change {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = self.shared.wake.notified() => {}
                    _ = lingering => {}
                }
                continue;
            }
            self.update(|s| {
                s.pending_changes = generation.saturating_sub(published_generation).max(1);
                if s.state == State::Synced {
                    s.state = State::Pending;
                }
            });
            // Rate limit and backoff: changes meanwhile are taken in the round that follows.
            if let Some(at) = not_before.filter(|at| *at > now) {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep_until(at) => {}
                }
                continue;
            }
            let started = Instant::now();
            let outcome = tokio::select! {
                _ = cancel.cancelled() => return,
                outcome = task.round(&want) => outcome,
            };
            match outcome {
                Ok(()) => {
                    if failures > 0 || published.is_none() {
                        info!(node = %config.node_name, %server, "node published to the API server");
                    }
                    failures = 0;
                    published = Some(want);
                    not_before = Some(started + config.min_interval);
                    self.update(|s| {
                        s.rounds += 1;
                        s.state = State::Synced;
                        s.last_sync = Some(SystemTime::now());
                        s.last_error = None;
                    });
                }
                Err(e) => {
                    // Some writes of the round may have landed: the next round plans again
                    // from a fresh read, even if the inventory goes back to what was published.
                    task.forget();
                    published = None;
                    failures += 1;
                    let waiting = matches!(e, RoundError::NodeMissing { .. });
                    let mut delay = backoff(&config, failures);
                    if waiting {
                        // Whoever creates the Node is usually at work right now.
                        delay = delay.min(NODE_WAIT_MAX);
                    }
                    not_before = Some(Instant::now() + delay);
                    let message = e.to_string();
                    let repeated =
                        lock(&self.shared.status).last_error.as_deref() == Some(&message);
                    if !repeated {
                        warn!(node = %config.node_name, error = %message, retry_in = ?delay, "publishing to the API server failed");
                    }
                    self.update(|s| {
                        s.rounds += 1;
                        s.failures += 1;
                        s.state = if waiting {
                            State::WaitingForNode
                        } else {
                            State::Failing
                        };
                        s.last_error = Some(message);
                    });
                }
            }
        }
    }
}

/// The retry delay after `failures` failed rounds in a row: doubling from the initial delay up
/// to the maximum, less up to a fifth at random so a fleet's daemons do not retry in step.
fn backoff(config: &PublisherConfig, failures: u32) -> Duration {
    let delay = BackoffPolicy {
        initial: config.backoff_initial,
        max: config.backoff_max,
    }
    .delay(failures);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    delay - delay.mul_f64(f64::from(nanos % 1000) / 5000.0)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why a round failed.
#[derive(Debug, thiserror::Error)]
enum RoundError {
    /// The Node does not exist and Pluglet may not create it.
    #[error("Node {node} does not exist: create it, or start Pluglet with --register-node")]
    NodeMissing { node: String },
    /// A request failed.
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// The objects kept changing under every fresh read.
    #[error("{what}: conflict (409) {CONFLICT_RETRIES} times in a row")]
    Conflicts { what: String },
}

/// Which part of the Node a patch writes.
#[derive(Clone, Copy)]
enum Part {
    Metadata,
    Status,
}

enum Attempt {
    Done,
    Conflict(String),
}

/// The writer's state between rounds: the objects as last read or written (no read is sent
/// while they are known), dropped after any failure.
struct Task {
    nodes: Api<Node>,
    csinodes: Api<CSINode>,
    node: Option<Node>,
    csinode: Option<Option<CSINode>>,
    publisher: Publisher,
}

impl Task {
    fn forget(&mut self) {
        self.node = None;
        self.csinode = None;
    }

    async fn round(&mut self, want: &Inventory) -> Result<(), RoundError> {
        let mut conflicts = 0;
        loop {
            match self.attempt(want).await? {
                Attempt::Done => return Ok(()),
                Attempt::Conflict(what) => {
                    self.forget();
                    conflicts += 1;
                    self.publisher.update(|s| s.conflicts += 1);
                    if conflicts >= CONFLICT_RETRIES {
                        return Err(RoundError::Conflicts { what });
                    }
                }
            }
        }
    }

    fn wrote(&self) {
        self.publisher.update(|s| s.writes += 1);
    }

    async fn attempt(&mut self, want: &Inventory) -> Result<Attempt, RoundError> {
        let publisher = self.publisher.clone();
        let name = publisher.shared.config.node_name.as_str();
        let mut node = match self.node.take() {
            Some(node) => node,
            None => self.fetch_node().await?,
        };
        let plan = node::plan(&node, want);
        self.publisher
            .update(|s| s.warnings = plan.warnings.clone());

        if let Some(patch) = plan.metadata
            && !self.patch_node(&mut node, patch, Part::Metadata).await?
        {
            return Ok(Attempt::Conflict(format!("patch Node {name} metadata")));
        }
        if let Some(patch) = plan.status
            && !self.patch_node(&mut node, patch, Part::Status).await?
        {
            return Ok(Attempt::Conflict(format!("patch Node {name} status")));
        }
        if !want.csi_drivers.is_empty() || !plan.published.csi_drivers.is_empty() {
            let existing = match self.csinode.take() {
                Some(known) => known,
                None => self
                    .csinodes
                    .get_opt(name)
                    .await
                    .map_err(|source| RoundError::Api {
                        what: format!("get CSINode {name}"),
                        source,
                    })?,
            };
            let mut current = existing;
            let post = PostParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..Default::default()
            };
            for step in csinode::plan(
                &node,
                current.as_ref(),
                &plan.published.csi_drivers,
                &want.csi_drivers,
            ) {
                let result = match step {
                    Step::Create(object) => check(
                        self.csinodes.create(&post, &object).await,
                        "create CSINode",
                        name,
                    )?,
                    Step::Replace(drivers) => {
                        let mut object = current.clone().unwrap_or_else(|| CSINode {
                            metadata: ObjectMeta {
                                name: Some(name.to_owned()),
                                ..Default::default()
                            },
                            spec: Default::default(),
                        });
                        object.spec.drivers = drivers;
                        check(
                            self.csinodes.replace(name, &post, &object).await,
                            "replace CSINode",
                            name,
                        )?
                    }
                };
                match result {
                    Some(object) => current = Some(object),
                    None => return Ok(Attempt::Conflict(format!("write CSINode {name}"))),
                }
                self.wrote();
            }
            self.csinode = Some(current);
        }
        if let Some(patch) = plan.narrow
            && !self.patch_node(&mut node, patch, Part::Metadata).await?
        {
            return Ok(Attempt::Conflict(format!("patch Node {name} metadata")));
        }
        self.node = Some(node);
        Ok(Attempt::Done)
    }

    /// Applies a merge patch to `node`'s metadata or status, on the condition that the Node is
    /// still at `node`'s `resourceVersion`; `node` becomes the Node written. `false`: a conflict.
    async fn patch_node(
        &mut self,
        node: &mut Node,
        patch: serde_json::Value,
        part: Part,
    ) -> Result<bool, RoundError> {
        let name = self.publisher.shared.config.node_name.clone();
        let patch = with_resource_version(patch, node.metadata.resource_version.as_deref());
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        let patch = Patch::Merge(&patch);
        let (result, what) = match part {
            Part::Metadata => (
                self.nodes.patch(&name, &params, &patch).await,
                "patch Node metadata",
            ),
            Part::Status => (
                self.nodes.patch_status(&name, &params, &patch).await,
                "patch Node status",
            ),
        };
        match check(result, what, &name)? {
            Some(written) => {
                *node = written;
                self.wrote();
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Reads the Node; creates it when missing and allowed to.
    async fn fetch_node(&mut self) -> Result<Node, RoundError> {
        let publisher = self.publisher.clone();
        let config = &publisher.shared.config;
        let name = config.node_name.as_str();
        let found = self
            .nodes
            .get_opt(name)
            .await
            .map_err(|source| RoundError::Api {
                what: format!("get Node {name}"),
                source,
            })?;
        if let Some(node) = found {
            return Ok(node);
        }
        if !config.register_node {
            return Err(RoundError::NodeMissing {
                node: name.to_owned(),
            });
        }
        let node = Node {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                labels: (!config.node_labels.is_empty()).then(|| config.node_labels.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        let post = PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        match self.nodes.create(&post, &node).await {
            Ok(node) => {
                self.wrote();
                info!(node = name, "created the Node object (--register-node)");
                Ok(node)
            }
            // Created meanwhile by someone else: read it.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                self.nodes
                    .get(name)
                    .await
                    .map_err(|source| RoundError::Api {
                        what: format!("get Node {name}"),
                        source,
                    })
            }
            Err(source) => Err(RoundError::Api {
                what: format!("create Node {name}"),
                source,
            }),
        }
    }
}

/// A write's result: the object written, `None` on a conflict (409), or the failure.
fn check<T>(
    result: Result<T, kube::Error>,
    what: &str,
    name: &str,
) -> Result<Option<T>, RoundError> {
    match result {
        Ok(object) => Ok(Some(object)),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
        Err(source) => Err(RoundError::Api {
            what: format!("{what} {name}"),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_maximum_with_jitter_below() {
        let config = PublisherConfig::new("n".into());
        for (failures, full) in [(1, 500), (2, 1000), (3, 2000), (7, 30_000), (40, 30_000)] {
            let d = backoff(&config, failures).as_millis() as u64;
            assert!(
                d <= full && d >= full * 4 / 5,
                "{failures} failures: {d} ms"
            );
        }
    }

    #[tokio::test]
    async fn changes_never_wait_for_the_api_server() {
        let p = Publisher::new(PublisherConfig::new("n".into()));
        for i in 0..10_000u64 {
            p.set_resources(
                [(
                    "v/gpu".to_owned(),
                    Counts {
                        capacity: 8,
                        allocatable: i % 8,
                    },
                )]
                .into(),
            );
        }
        let s = p.status();
        assert_eq!((s.resources, s.state), (1, State::Starting));
    }
}
