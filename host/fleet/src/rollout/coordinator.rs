//! The coordinator: one daemon of the fleet, the holder of the Lease
//! `pluglet-system/pluglet-rollout-coordinator` (`holderIdentity` its node name), advances the
//! rollouts. While it holds the Lease it renews it and, while any rollout is not over, reads
//! the Nodes each selects and every node's report, asks [`decide`](super::decide) for each
//! rollout's next status and writes the status where it differs. Everything it knows is in the
//! rollouts' status, so the next holder continues where it stopped. At rest (no rollout going
//! on) it only renews the Lease; the other daemons only watch it ([`lease`](super::lease)).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::decide::{Observed, decide};
use super::lease::{self, Candidate, LEASE_NAME, LeaseStep, Seen, lease_step};
use super::types::{HandlerRollout, NAMESPACE, NodeHandlerStatus, NodeRollout, Phase};
use super::watch::Rollouts;
use crate::client::Connection;
use crate::publisher::FIELD_MANAGER;

/// The Lease's duration unless told otherwise.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
/// How often the coordinator looks at the rollouts while one is going on.
const TICK: Duration = Duration::from_secs(1);
/// How long a daemon that holds nothing sleeps when nothing it watches changes.
const IDLE: Duration = Duration::from_secs(3600);

/// The coordinator's counters, for metrics.
#[derive(Debug, Default)]
pub struct CoordinatorStats {
    /// Whether this daemon holds the Lease.
    pub holder: AtomicBool,
    /// Waves this daemon opened.
    pub waves_opened: AtomicU64,
}

/// The coordinator of `node`.
pub struct Coordinator {
    node: String,
    duration: Duration,
    stats: Arc<CoordinatorStats>,
}

impl Coordinator {
    /// A coordinator candidate named `node`, with a Lease of `duration` (renewed after two
    /// thirds of it).
    pub fn new(node: String, duration: Duration) -> Coordinator {
        Coordinator {
            node,
            duration,
            stats: Arc::default(),
        }
    }

    /// Its counters.
    pub fn stats(&self) -> Arc<CoordinatorStats> {
        self.stats.clone()
    }

    /// Runs until `cancel` fires: holds the Lease when it can, and coordinates while it does.
    pub async fn run(
        self,
        connection: Connection,
        mut rollouts: watch::Receiver<Rollouts>,
        cancel: CancellationToken,
    ) {
        let (seen_tx, mut seen) = watch::channel(Seen::default());
        tokio::spawn(lease::follow(
            connection.clone(),
            seen_tx,
            cancel.child_token(),
        ));
        let mut candidate = Candidate::new(&connection, self.node.clone(), self.duration);
        let renew_every = self.duration * 2 / 3;
        // The Lease as this daemon last wrote it, while it holds it.
        let mut mine: Option<Lease> = None;
        let mut renew_at = Instant::now();
        let mut next_try = Instant::now();
        let mut round_at = Instant::now();
        loop {
            let now = Instant::now();
            let saw = seen.borrow_and_update().clone();
            if mine.as_ref().is_some_and(|m| taken_from(m, &saw)) {
                mine = None;
            }
            let held_before = mine.is_some();
            let mut wake = now + IDLE;
            if let Some(held) = mine.clone() {
                if now >= renew_at {
                    mine = candidate.take_or_renew(&held).await;
                    renew_at = Instant::now() + renew_every;
                }
            } else if saw.listed && now >= next_try {
                let step = lease_step(saw.lease.as_ref(), &self.node, now - saw.changed_at);
                match (step, saw.lease.as_ref()) {
                    (LeaseStep::Wait(left), _) => wake = now + left,
                    (LeaseStep::Renew | LeaseStep::Take, Some(lease)) => {
                        mine = candidate.take_or_renew(lease).await;
                    }
                    _ => mine = candidate.create().await,
                }
                if mine.is_some() {
                    renew_at = Instant::now() + renew_every;
                } else if !matches!(step, LeaseStep::Wait(_)) {
                    next_try = Instant::now() + renew_every / 2;
                    wake = next_try;
                }
            } else if saw.listed {
                wake = next_try;
            }
            if mine.is_some() != held_before {
                if mine.is_some() {
                    info!(node = %self.node, "this daemon coordinates the handler rollouts (it holds the Lease {NAMESPACE}/{LEASE_NAME})");
                    round_at = Instant::now();
                } else {
                    info!(node = %self.node, "this daemon no longer coordinates the handler rollouts");
                }
                self.stats.holder.store(mine.is_some(), Ordering::Relaxed);
            }
            if mine.is_some() {
                wake = renew_at;
                if Instant::now() >= round_at {
                    let all = rollouts.borrow_and_update().clone();
                    round_at = if self.round(&connection, &all).await {
                        Instant::now() + TICK
                    } else {
                        Instant::now() + IDLE
                    };
                }
                wake = wake.min(round_at);
            }
            tokio::select! {
                _ = cancel.cancelled() => {
                    if let Some(held) = &mine {
                        candidate.release(held).await;
                        self.stats.holder.store(false, Ordering::Relaxed);
                    }
                    return;
                }
                changed = rollouts.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    round_at = Instant::now();
                }
                changed = seen.changed() => if changed.is_err() { return },
                () = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    /// One look at every rollout; whether one is still going on.
    async fn round(&self, connection: &Connection, all: &BTreeMap<String, HandlerRollout>) -> bool {
        let winners = winners(all);
        let active: Vec<&HandlerRollout> = all
            .values()
            .filter(|r| {
                let phase = r.phase();
                !phase.is_final()
                    && (phase != Phase::Complete || !winners.contains(&r.name().to_owned()))
            })
            .collect();
        if active.is_empty() {
            return false;
        }
        let reports_api: Api<NodeHandlerStatus> =
            Api::namespaced(connection.client.clone(), NAMESPACE);
        let reports = match reports_api.list(&ListParams::default()).await {
            Ok(list) => list.items,
            Err(e) => {
                warn!(error = %e, "cannot list the nodes' NodeHandlerStatus reports");
                return true;
            }
        };
        let nodes: Api<Node> = Api::all(connection.client.clone());
        let rollouts: Api<HandlerRollout> = Api::all(connection.client.clone());
        for rollout in active {
            let superseded = !winners.contains(&rollout.name().to_owned());
            let selected = if superseded {
                Vec::new()
            } else {
                let selector = selector_string(rollout.spec.node_selector.as_ref());
                match nodes.list(&ListParams::default().labels(&selector)).await {
                    Ok(list) => list
                        .items
                        .into_iter()
                        .filter_map(|n| n.metadata.name)
                        .collect(),
                    Err(e) => {
                        warn!(rollout = rollout.name(), error = %e, "cannot list the Nodes a rollout selects");
                        continue;
                    }
                }
            };
            let by_node: BTreeMap<String, NodeRollout> = reports
                .iter()
                .filter_map(|r| {
                    let node = r.metadata.name.clone()?;
                    let mine = r.status.rollouts.iter().find(|x| x.uid == rollout.uid())?;
                    Some((node, mine.clone()))
                })
                .collect();
            let decision = decide(&Observed {
                rollout,
                selected,
                reports: by_node,
                superseded,
                now: Timestamp::now(),
            });
            if rollout.status.as_ref() == Some(&decision.status) {
                continue;
            }
            let patch = json!({ "status": decision.status });
            let params = PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..PatchParams::default()
            };
            match rollouts
                .patch_status(rollout.name(), &params, &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    if decision.opened {
                        self.stats.waves_opened.fetch_add(1, Ordering::Relaxed);
                        info!(
                            rollout = rollout.name(),
                            wave = decision.status.current_wave,
                            "a wave of the rollout opened"
                        );
                    }
                    if decision.status.phase != rollout.phase() {
                        info!(
                            rollout = rollout.name(),
                            phase = decision.status.phase.as_str(),
                            "the rollout's phase changed"
                        );
                    }
                }
                Err(e) => {
                    warn!(rollout = rollout.name(), error = %e, "cannot write a rollout's status")
                }
            }
        }
        true
    }
}

/// Whether the watch shows `mine` taken by another daemon since this one wrote it (a later
/// resourceVersion naming another holder; an echo of an older write is ignored).
fn taken_from(mine: &Lease, seen: &Seen) -> bool {
    let version = |l: &Lease| {
        l.metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse::<u64>().ok())
    };
    let Some(lease) = seen.lease.as_ref() else {
        return false;
    };
    let holder = |l: &Lease| l.spec.as_ref().and_then(|s| s.holder_identity.clone());
    holder(lease) != holder(mine)
        && matches!((version(lease), version(mine)), (Some(a), Some(b)) if a > b)
}

/// The rollout that wins each slot (the later created, then the greater name), by name; the
/// others of their slot are superseded. Rollouts already over take no part.
pub fn winners(all: &BTreeMap<String, HandlerRollout>) -> Vec<String> {
    let mut by_slot: BTreeMap<String, &HandlerRollout> = BTreeMap::new();
    for r in all.values().filter(|r| !r.phase().is_final()) {
        let slot = r.spec.slot.id();
        if by_slot
            .get(&slot)
            .is_none_or(|w| w.precedence() < r.precedence())
        {
            by_slot.insert(slot, r);
        }
    }
    by_slot.into_values().map(|r| r.name().to_owned()).collect()
}

/// A label selector as the `labelSelector` query parameter writes it (empty: every object).
pub fn selector_string(selector: Option<&LabelSelector>) -> String {
    let Some(selector) = selector else {
        return String::new();
    };
    let mut parts: Vec<String> = selector
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in selector.match_expressions.iter().flatten() {
        let values = e.values.clone().unwrap_or_default().join(",");
        parts.push(match e.operator.as_str() {
            "In" => format!("{} in ({values})", e.key),
            "NotIn" => format!("{} notin ({values})", e.key),
            "Exists" => e.key.clone(),
            _ => format!("!{}", e.key),
        });
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    #[test]
    fn selectors_are_written_as_the_api_server_reads_them() {
        assert_eq!(selector_string(None), "");
        let selector = LabelSelector {
            match_labels: Some(BTreeMap::from([("pool".to_owned(), "gpu".to_owned())])),
            match_expressions: Some(vec![
                LabelSelectorRequirement {
                    key: "zone".into(),
                    operator: "In".into(),
                    values: Some(vec!["a".into(), "b".into()]),
                },
                LabelSelectorRequirement {
                    key: "canary".into(),
                    operator: "DoesNotExist".into(),
                    values: None,
                },
            ]),
        };
        assert_eq!(
            selector_string(Some(&selector)),
            "pool=gpu,zone in (a,b),!canary"
        );
    }
}
