//! The node agent: from the rollouts the daemon's watch holds, which ones this node takes part
//! in (a rollout in force whose opened waves name the node; of two for one slot, the later
//! created), puts their entries in force through the node's handler set (off the reactor),
//! follows each one's soak, and writes the node's own report, `NodeHandlerStatus/<node>` in
//! [`NAMESPACE`], when a state changes (never the Node, never another node's report).
//!
//! The handler set is reached through [`NodeHandlers`], so this crate knows nothing of WASM:
//! the daemon gives the real set, tests a fake.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::types::{
    HandlerRollout, NAMESPACE, NodeHandlerStatus, NodeReport, NodeRollout, NodeState, Phase,
    RolloutSpec,
};
use super::watch::Rollouts;
use crate::client::Connection;
use crate::publisher::FIELD_MANAGER;

/// A rollout this node takes part in, as the handler set is given it.
#[derive(Clone, Debug, PartialEq)]
pub struct Wanted {
    /// The rollout's name.
    pub name: String,
    /// Its UID.
    pub uid: String,
    /// Its spec.
    pub spec: RolloutSpec,
}

/// What the node's handler set shows of one rollout's slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Observation {
    /// The rollout's module serves the slot.
    Serving {
        /// The manifest digest served.
        digest: Option<String>,
        /// Calls since it was applied.
        calls: u64,
        /// Of those, the ones that did not fail.
        clean_calls: u64,
    },
    /// It served and was rolled back by the node (probation failed).
    RolledBack {
        /// Why.
        reason: String,
    },
    /// It does not serve the slot.
    NotServing,
}

/// The node's handler set, as the agent uses it. Both calls may block (compile, pull).
pub trait NodeHandlers: Send + Sync + 'static {
    /// Puts exactly `wanted` in force, one per slot (a slot no longer named returns to what
    /// the node's own configuration says). `Err`: refused, with the reason; nothing changed.
    fn apply(&self, wanted: &[Wanted]) -> Result<(), String>;
    /// What serves the slot of `wanted`.
    fn observe(&self, wanted: &Wanted) -> Observation;
}

/// What the node agent shows the daemon (`ctl status`, metrics).
#[derive(Clone, Debug, Default)]
pub struct AgentView {
    /// This node's state in every rollout it takes part in.
    pub rollouts: Vec<NodeRollout>,
}

/// The rollouts `node` takes part in, one per slot.
pub fn chosen<'a>(
    rollouts: &'a BTreeMap<String, HandlerRollout>,
    node: &str,
) -> Vec<&'a HandlerRollout> {
    let mut by_slot: BTreeMap<String, &HandlerRollout> = BTreeMap::new();
    for rollout in rollouts.values() {
        if !rollout.phase().in_force() || !rollout.opened_for(node) {
            continue;
        }
        let slot = rollout.spec.slot.id();
        match by_slot.get(&slot) {
            Some(other) if other.precedence() >= rollout.precedence() => {}
            _ => {
                by_slot.insert(slot, rollout);
            }
        }
    }
    by_slot.into_values().collect()
}

/// The state of one rollout the node serves (or served), given what the set shows and how
/// long ago it was applied: a failure is kept; a pass is kept; otherwise the soak decides.
pub fn state_of(
    before: Option<&NodeRollout>,
    observation: &Observation,
    soaked_for: Duration,
    spec: &RolloutSpec,
) -> (NodeState, Option<String>, bool) {
    if let Some(b) = before.filter(|b| b.state.failed() || b.state == NodeState::Healthy) {
        return (b.state, b.reason.clone(), b.idle);
    }
    match observation {
        Observation::RolledBack { reason } => (NodeState::RolledBack, Some(reason.clone()), false),
        Observation::NotServing => (NodeState::Applied, None, false),
        Observation::Serving {
            calls, clean_calls, ..
        } => {
            let soak = spec.soak.duration().unwrap_or(Duration::MAX);
            let enough = *calls == 0 || *clean_calls >= spec.soak.calls;
            if soaked_for >= soak && enough {
                (NodeState::Healthy, None, *calls == 0)
            } else {
                (NodeState::OnProbation, None, false)
            }
        }
    }
}

/// How often a soak is looked at while one runs.
const SOAK_TICK: Duration = Duration::from_secs(1);
/// The wait before writing the report again after a failed write.
const WRITE_RETRY: Duration = Duration::from_secs(2);

/// The node agent of `node`.
pub struct Agent {
    node: String,
    handlers: Arc<dyn NodeHandlers>,
    view: Arc<Mutex<AgentView>>,
}

impl Agent {
    /// An agent for `node` applying through `handlers`.
    pub fn new(node: String, handlers: Arc<dyn NodeHandlers>) -> Agent {
        Agent {
            node,
            handlers,
            view: Arc::default(),
        }
    }

    /// What it shows, kept current while it runs.
    pub fn view(&self) -> Arc<Mutex<AgentView>> {
        self.view.clone()
    }

    /// Runs until `cancel` fires, following `rollouts`.
    pub async fn run(
        self,
        connection: Connection,
        mut rollouts: watch::Receiver<Rollouts>,
        cancel: CancellationToken,
    ) {
        let api: Api<NodeHandlerStatus> = Api::namespaced(connection.client.clone(), NAMESPACE);
        // Nothing is decided before the watch has listed the rollouts once: a daemon that
        // starts while the API server is away keeps what it took from rollouts before.
        tokio::select! {
            _ = cancel.cancelled() => return,
            changed = rollouts.changed() => if changed.is_err() { return },
        }
        // What the node reported before a restart: a failure or a pass stays so.
        let mut report: BTreeMap<String, NodeRollout> = BTreeMap::new();
        tokio::select! {
            _ = cancel.cancelled() => return,
            got = api.get_opt(&self.node) => if let Ok(Some(old)) = got {
                report = old.status.rollouts.into_iter().map(|r| (r.uid.clone(), r)).collect();
            },
        }
        let mut written: Option<BTreeMap<String, NodeRollout>> = None;
        let mut in_force: Option<Vec<Wanted>> = None;
        let mut refused: BTreeMap<String, String> = BTreeMap::new();
        let mut applied_at: BTreeMap<String, Instant> = BTreeMap::new();
        // The spec each rollout had when this node last looked: a changed spec is a new
        // version, applied and soaked afresh.
        let mut specs: BTreeMap<String, RolloutSpec> = BTreeMap::new();
        loop {
            let all = rollouts.borrow_and_update().clone();
            let chosen = chosen(&all, &self.node);
            for r in &chosen {
                if specs.get(r.uid()).is_some_and(|s| *s != r.spec) {
                    report.remove(r.uid());
                    refused.remove(r.uid());
                    applied_at.remove(r.uid());
                }
                specs.insert(r.uid().to_owned(), r.spec.clone());
            }
            specs.retain(|uid, _| all.values().any(|r| r.uid() == uid));
            let wanted: Vec<Wanted> = chosen
                .iter()
                .filter(|r| !refused.contains_key(r.uid()))
                .map(|r| Wanted {
                    name: r.name().to_owned(),
                    uid: r.uid().to_owned(),
                    spec: r.spec.clone(),
                })
                .collect();
            if in_force.as_ref() != Some(&wanted) {
                let handlers = self.handlers.clone();
                let asked = wanted.clone();
                let outcome = tokio::task::spawn_blocking(move || handlers.apply(&asked))
                    .await
                    .unwrap_or_else(|e| Err(format!("the apply task failed: {e}")));
                match outcome {
                    Ok(()) => {
                        for w in &wanted {
                            applied_at.entry(w.uid.clone()).or_insert_with(Instant::now);
                        }
                        in_force = Some(wanted.clone());
                    }
                    Err(reason) => {
                        warn!(node = %self.node, %reason, "a handler rollout could not be applied on this node");
                        let before = in_force.clone().unwrap_or_default();
                        for w in wanted.iter().filter(|w| !before.contains(w)) {
                            refused.insert(w.uid.clone(), reason.clone());
                        }
                        continue;
                    }
                }
            }
            let now = Timestamp::now().to_string();
            let mut next: BTreeMap<String, NodeRollout> = BTreeMap::new();
            for w in &wanted {
                let observation = self.handlers.observe(w);
                let soaked = applied_at
                    .get(&w.uid)
                    .map_or(Duration::ZERO, Instant::elapsed);
                let before = report.get(&w.uid);
                let (state, reason, idle) = state_of(before, &observation, soaked, &w.spec);
                let (digest, calls, clean_calls) = match &observation {
                    Observation::Serving {
                        digest,
                        calls,
                        clean_calls,
                    } => (digest.clone(), *calls, *clean_calls),
                    _ => (before.and_then(|b| b.digest.clone()), 0, 0),
                };
                next.insert(
                    w.uid.clone(),
                    entry(
                        w,
                        state,
                        reason,
                        idle,
                        digest,
                        calls,
                        clean_calls,
                        before,
                        &now,
                    ),
                );
            }
            for (uid, reason) in &refused {
                if let Some(r) = chosen.iter().find(|r| r.uid() == uid) {
                    let w = Wanted {
                        name: r.name().to_owned(),
                        uid: uid.clone(),
                        spec: r.spec.clone(),
                    };
                    let before = report.get(uid);
                    next.insert(
                        uid.clone(),
                        entry(
                            &w,
                            NodeState::Refused,
                            Some(reason.clone()),
                            false,
                            None,
                            0,
                            0,
                            before,
                            &now,
                        ),
                    );
                }
            }
            // Rollouts this node took part in and no longer does: reverted (halted, rolled
            // back, superseded, deleted). A deleted rollout's entry stays as the node's word
            // that it returned the slot, the last few of them only.
            let mut gone = Vec::new();
            for (uid, old) in &report {
                if next.contains_key(uid) {
                    continue;
                }
                let rollout = all.values().find(|r| r.uid() == uid);
                let mut kept = old.clone();
                if old.state.serving() {
                    kept.state = NodeState::Reverted;
                    kept.reason = Some(
                        rollout.map_or_else(|| DELETED.to_owned(), |r| revert_reason(r.phase())),
                    );
                    kept.since = Some(now.clone());
                    info!(rollout = %kept.name, reason = kept.reason.as_deref().unwrap_or_default(), "this node no longer serves the rollout's module");
                }
                if rollout.is_none() {
                    gone.push((kept.since.clone().unwrap_or_default(), uid.clone()));
                }
                next.insert(uid.clone(), kept);
            }
            gone.sort();
            for (_, uid) in gone.iter().rev().skip(KEPT_DELETED) {
                next.remove(uid);
            }
            refused.retain(|uid, _| all.values().any(|r| r.uid() == uid));
            applied_at.retain(|uid, _| next.contains_key(uid));
            report = next;
            self.view.lock().unwrap_or_else(|e| e.into_inner()).rollouts =
                report.values().cloned().collect();

            let changed = written.as_ref().is_none_or(|w| !same_states(w, &report));
            let mut retry = false;
            if changed && (written.is_some() || !report.is_empty()) {
                match write(&api, &self.node, &report).await {
                    Ok(()) => written = Some(report.clone()),
                    Err(e) => {
                        warn!(node = %self.node, error = %e, "cannot write this node's NodeHandlerStatus; retrying");
                        retry = true;
                    }
                }
            }
            let soaking = report
                .values()
                .any(|r| matches!(r.state, NodeState::Applied | NodeState::OnProbation));
            let wait = if retry {
                WRITE_RETRY
            } else if soaking {
                SOAK_TICK
            } else {
                Duration::MAX
            };
            tokio::select! {
                _ = cancel.cancelled() => return,
                changed = rollouts.changed() => if changed.is_err() { return },
                () = sleep(wait) => {}
            }
        }
    }
}

async fn sleep(wait: Duration) {
    if wait == Duration::MAX {
        std::future::pending::<()>().await;
    }
    tokio::time::sleep(wait).await;
}

#[allow(clippy::too_many_arguments)]
fn entry(
    w: &Wanted,
    state: NodeState,
    reason: Option<String>,
    idle: bool,
    digest: Option<String>,
    calls: u64,
    clean_calls: u64,
    before: Option<&NodeRollout>,
    now: &str,
) -> NodeRollout {
    let since = before
        .filter(|b| b.state == state)
        .and_then(|b| b.since.clone())
        .unwrap_or_else(|| now.to_owned());
    NodeRollout {
        name: w.name.clone(),
        uid: w.uid.clone(),
        state,
        digest,
        reason,
        since: Some(since),
        calls,
        clean_calls,
        idle,
    }
}

/// The reason a node gives for a rollout that was deleted while it served its module.
const DELETED: &str = "the rollout was deleted: the slot returned to handlers.toml or the built-in";
/// How many deleted rollouts a node still reports (the newest).
const KEPT_DELETED: usize = 8;

fn revert_reason(phase: Phase) -> String {
    match phase {
        Phase::Halted | Phase::RolledBack => {
            "the rollout halted: the slot returned to what it had before".into()
        }
        Phase::Superseded => "a newer rollout of the slot superseded it".into(),
        _ => "the rollout no longer names this node".into(),
    }
}

/// Whether two reports say the same (the call counts alone do not make a write).
fn same_states(a: &BTreeMap<String, NodeRollout>, b: &BTreeMap<String, NodeRollout>) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|((ka, ra), (kb, rb))| {
            ka == kb
                && ra.state == rb.state
                && ra.digest == rb.digest
                && ra.reason == rb.reason
                && ra.idle == rb.idle
        })
}

/// Writes the node's report: a merge patch of its status, or a create the first time.
async fn write(
    api: &Api<NodeHandlerStatus>,
    node: &str,
    report: &BTreeMap<String, NodeRollout>,
) -> Result<(), kube::Error> {
    let status = NodeReport {
        count: u32::try_from(report.len()).unwrap_or(u32::MAX),
        rollouts: report.values().cloned().collect(),
    };
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    let patch = json!({ "status": status });
    match api.patch(node, &params, &Patch::Merge(&patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => {
            info!(
                node,
                "creating this node's NodeHandlerStatus in {NAMESPACE}"
            );
            let post = PostParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..PostParams::default()
            };
            api.create(&post, &NodeHandlerStatus::new(node, status))
                .await
                .map(|_| ())
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::types::{RolloutStatus, SlotRef, Soak, WaveSpec, WaveStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    fn rollout(name: &str, created: &str, phase: Phase, members: &[&str]) -> HandlerRollout {
        HandlerRollout {
            metadata: ObjectMeta {
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                creation_timestamp: Some(Time(created.parse().unwrap())),
                ..ObjectMeta::default()
            },
            spec: RolloutSpec {
                slot: SlotRef {
                    resource: Some("vendor.com/gpu".into()),
                    plugin_type: None,
                },
                waves: vec![WaveSpec { percent: 100 }],
                soak: Soak {
                    duration: "10s".into(),
                    calls: 3,
                },
                ..RolloutSpec::default()
            },
            status: Some(RolloutStatus {
                phase,
                waves: vec![WaveStatus {
                    nodes: members.iter().map(|m| (*m).to_owned()).collect(),
                    ..WaveStatus::default()
                }],
                ..RolloutStatus::default()
            }),
        }
    }

    fn by_name(list: Vec<HandlerRollout>) -> BTreeMap<String, HandlerRollout> {
        list.into_iter().map(|r| (r.name().to_owned(), r)).collect()
    }

    #[test]
    fn a_node_takes_part_in_the_latest_rollout_in_force_whose_waves_name_it() {
        let all = by_name(vec![
            rollout(
                "old",
                "2026-01-01T00:00:00Z",
                Phase::Complete,
                &["n1", "n2"],
            ),
            rollout("new", "2026-01-02T00:00:00Z", Phase::Progressing, &["n1"]),
            rollout(
                "halted",
                "2026-01-03T00:00:00Z",
                Phase::Halted,
                &["n1", "n2"],
            ),
        ]);
        let names = |node| {
            chosen(&all, node)
                .iter()
                .map(|r| r.name().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(names("n1"), ["new"]);
        assert_eq!(names("n2"), ["old"]);
        assert!(names("n3").is_empty());
    }

    #[test]
    fn the_soak_passes_on_time_and_clean_calls_or_no_call_and_a_failure_sticks() {
        let spec = rollout("r", "2026-01-01T00:00:00Z", Phase::Progressing, &[]).spec;
        let serving = |calls, clean_calls| Observation::Serving {
            digest: None,
            calls,
            clean_calls,
        };
        let early = Duration::from_secs(5);
        let late = Duration::from_secs(10);
        assert_eq!(
            state_of(None, &serving(5, 5), early, &spec).0,
            NodeState::OnProbation
        );
        assert_eq!(
            state_of(None, &serving(2, 2), late, &spec).0,
            NodeState::OnProbation
        );
        assert_eq!(
            state_of(None, &serving(4, 3), late, &spec),
            (NodeState::Healthy, None, false)
        );
        assert_eq!(
            state_of(None, &serving(0, 0), late, &spec),
            (NodeState::Healthy, None, true)
        );
        let failed = Observation::RolledBack {
            reason: "2 failed calls".into(),
        };
        let (state, reason, _) = state_of(None, &failed, early, &spec);
        assert_eq!(state, NodeState::RolledBack);
        let before = NodeRollout {
            name: "r".into(),
            uid: "uid-r".into(),
            state,
            digest: None,
            reason,
            since: None,
            calls: 0,
            clean_calls: 0,
            idle: false,
        };
        assert_eq!(
            state_of(Some(&before), &serving(9, 9), late, &spec).0,
            NodeState::RolledBack
        );
    }
}
