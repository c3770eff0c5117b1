//! The rollout stage: with an API server, every daemon takes part in the fleet rollouts of
//! handlers ([`pluglet_fleet::rollout`]): one watch of the HandlerRollouts, the node agent that
//! puts this node's share in force through the handler set, and a candidate coordinator.
//!
//! Here the handler set is given to the agent ([`NodeSet`]): a rollout's spec becomes an entry
//! named for the rollout (it wins over `handlers.toml`, see
//! [`Handlers::set_rollout_entries`]), and what serves its slot is read back from the set in
//! force and its rollback decisions.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pluglet_fleet::Connection;
use pluglet_fleet::rollout::{
    Agent, AgentView, Coordinator, CoordinatorStats, NodeHandlers, Observation, Wanted, watch,
};
use pluglet_handlers::{Handlers, OnFailure, ReloadOutcome, SlotEntry, SlotKey};
use tokio_util::sync::CancellationToken;

/// The rollout stage, ready to run.
pub struct Rollouts {
    agent: Agent,
    coordinator: Coordinator,
    /// What the node agent shows (`ctl status`, metrics).
    pub view: Arc<Mutex<AgentView>>,
    /// The coordinator's counters.
    pub stats: Arc<CoordinatorStats>,
}

impl Rollouts {
    /// The stage for `node`, applying through `handlers`, with a coordinator Lease of
    /// `lease_duration`.
    pub fn new(node: String, handlers: Handlers, lease_duration: Duration) -> Rollouts {
        let agent = Agent::new(node.clone(), Arc::new(NodeSet(handlers)));
        let coordinator = Coordinator::new(node, lease_duration);
        Rollouts {
            view: agent.view(),
            stats: coordinator.stats(),
            agent,
            coordinator,
        }
    }

    /// Runs the watch, the agent and the coordinator until `cancel` fires.
    pub async fn run(self, connection: Connection, cancel: CancellationToken) {
        let (sender, receiver) = tokio::sync::watch::channel(Arc::default());
        tokio::join!(
            watch::run(connection.clone(), sender, cancel.clone()),
            self.agent
                .run(connection.clone(), receiver.clone(), cancel.clone()),
            self.coordinator.run(connection, receiver, cancel),
        );
    }
}

/// The handler set, as the node agent uses it.
struct NodeSet(Handlers);

/// The slot a rollout names.
fn slot(w: &Wanted) -> Option<SlotKey> {
    match (&w.spec.slot.resource, &w.spec.slot.plugin_type) {
        (Some(r), _) => Some(SlotKey::Resource(r.clone())),
        (None, Some(t)) => Some(SlotKey::PluginType(t.clone())),
        (None, None) => None,
    }
}

/// The handler set's entry for a rollout.
fn entry(w: &Wanted) -> Result<(SlotKey, SlotEntry), String> {
    let slot = slot(w).ok_or_else(|| format!("rollout {} names no slot", w.name))?;
    let mut entry =
        SlotEntry::new(&w.spec.module).map_err(|e| format!("rollout {}: {e}", w.name))?;
    let limits = &w.spec.limits;
    entry.rollout = Some(w.name.clone());
    entry.settings = w.spec.settings.clone();
    entry.deadline_ms = limits.deadline_ms;
    entry.memory_mib = limits.memory_mib;
    entry.fuel = limits.fuel;
    entry.max_concurrent_calls = limits.max_concurrent_calls;
    entry.reuse_instances = limits.reuse_instances;
    if let Some(n) = limits.rollback_after {
        entry.rollback_after = n;
    }
    entry.on_failure = match limits.on_failure.as_deref() {
        None | Some("fail") => OnFailure::Fail,
        Some("builtin") => OnFailure::Builtin,
        Some(other) => {
            return Err(format!(
                "rollout {}: on_failure {other:?} is neither fail nor builtin",
                w.name
            ));
        }
    };
    Ok((slot, entry))
}

impl NodeHandlers for NodeSet {
    fn apply(&self, wanted: &[Wanted]) -> Result<(), String> {
        let entries = wanted
            .iter()
            .map(entry)
            .collect::<Result<BTreeMap<_, _>, _>>()?;
        match self.0.set_rollout_entries(entries) {
            ReloadOutcome::Refused(reason) => Err(reason),
            ReloadOutcome::Applied(_) | ReloadOutcome::Unchanged | ReloadOutcome::Waiting(_) => {
                Ok(())
            }
        }
    }

    fn observe(&self, wanted: &Wanted) -> Observation {
        let Some(slot) = slot(wanted) else {
            return Observation::NotServing;
        };
        let ours = |e: &SlotEntry| e.rollout.as_deref() == Some(wanted.name.as_str());
        let set = self.0.current();
        if let Some(state) = set.slot(&slot)
            && let Some(entry) = state.current.entry().filter(|e| ours(e))
        {
            let stats = state.current.stats().snapshot();
            let f = stats.failures;
            let failed = f.trap + f.deadline + f.memory + f.fuel + f.other;
            return Observation::Serving {
                digest: entry.digest.clone(),
                calls: stats.calls,
                clean_calls: stats.calls.saturating_sub(failed),
            };
        }
        match self
            .0
            .rollbacks()
            .into_iter()
            .find(|d| d.slot == slot && ours(&d.rejected.entry))
        {
            Some(decision) => Observation::RolledBack {
                reason: decision.reason,
            },
            None => Observation::NotServing,
        }
    }
}
