//! The coordinator: one daemon of the fleet, the holder of the Lease
//! `pluglet-system/pluglet-rollout-coordinator` (`holderIdentity` its node name), advances the
//! rollouts. While it holds the Lease it renews it and, while any rollout is not over, reads
//! the Nodes each selects and every node's report, asks [`decide`](super::decide) for each
//! rollout's next status and writes the status where it differs. Everything it knows is in the
//! rollouts' status, so the next holder continues where it stopped. At rest (no rollout going
//! on) it only renews the Lease.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::decide::{Observed, decide};
use super::types::{HandlerRollout, NAMESPACE, NodeHandlerStatus, NodeRollout, Phase};
use super::watch::Rollouts;
use crate::client::Connection;
use crate::publisher::FIELD_MANAGER;

/// The Lease's name.
pub const LEASE_NAME: &str = "pluglet-rollout-coordinator";
/// The Lease's duration unless told otherwise.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
/// How often the coordinator looks at the rollouts while one is going on.
const TICK: Duration = Duration::from_secs(1);

/// What to do with the Lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseStep {
    /// No Lease: create it, holding it.
    Create,
    /// Held by this node: renew it.
    Renew,
    /// Held by nobody, or its holder let it expire: take it.
    Take,
    /// Another node holds it.
    Wait,
}

/// What `me` does with `lease` at `now`.
pub fn lease_step(lease: Option<&Lease>, me: &str, now: Timestamp) -> LeaseStep {
    let Some(lease) = lease else {
        return LeaseStep::Create;
    };
    let spec = lease.spec.clone().unwrap_or_default();
    match spec.holder_identity.as_deref() {
        Some(holder) if holder == me => return LeaseStep::Renew,
        None | Some("") => return LeaseStep::Take,
        Some(_) => {}
    }
    let duration =
        Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0));
    let renewed = spec.renew_time.or(spec.acquire_time).map(|t| t.0);
    match renewed {
        Some(at) if now.duration_since(at).unsigned_abs() <= duration || at > now => {
            LeaseStep::Wait
        }
        _ => LeaseStep::Take,
    }
}

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
        let leases: Api<Lease> = Api::namespaced(connection.client.clone(), NAMESPACE);
        let renew_every = self.duration * 2 / 3;
        let mut renew_at = tokio::time::Instant::now();
        let mut holding_since: Option<tokio::time::Instant> = None;
        loop {
            if tokio::time::Instant::now() >= renew_at {
                let held = self.hold(&leases).await;
                if held != holding_since.is_some() {
                    if held {
                        info!(node = %self.node, "this daemon coordinates the handler rollouts (it holds the Lease {NAMESPACE}/{LEASE_NAME})");
                    } else {
                        info!(node = %self.node, "this daemon no longer coordinates the handler rollouts");
                    }
                }
                holding_since = if held {
                    holding_since.or_else(|| Some(tokio::time::Instant::now()))
                } else {
                    None
                };
                self.stats.holder.store(held, Ordering::Relaxed);
                renew_at =
                    tokio::time::Instant::now() + if held { renew_every } else { renew_every / 2 };
            }
            let mut busy = false;
            if holding_since.is_some() {
                let all = rollouts.borrow_and_update().clone();
                busy = self.round(&connection, &all).await;
            }
            let wait = if busy {
                TICK
            } else {
                renew_at.saturating_duration_since(tokio::time::Instant::now())
            };
            tokio::select! {
                _ = cancel.cancelled() => {
                    if holding_since.is_some() {
                        self.release(&leases).await;
                    }
                    return;
                }
                changed = rollouts.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Creates, renews or takes the Lease when it may; whether this node holds it.
    async fn hold(&self, leases: &Api<Lease>) -> bool {
        let now = Timestamp::now();
        let lease = match leases.get_opt(LEASE_NAME).await {
            Ok(lease) => lease,
            Err(e) => {
                debug!(error = %e, "cannot read the coordinator Lease");
                return false;
            }
        };
        let step = lease_step(lease.as_ref(), &self.node, now);
        let seconds = i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX);
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PostParams::default()
        };
        let result = match step {
            LeaseStep::Wait => return false,
            LeaseStep::Create => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(LEASE_NAME.into()),
                        namespace: Some(NAMESPACE.into()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.node.clone()),
                        lease_duration_seconds: Some(seconds),
                        acquire_time: Some(MicroTime(now)),
                        renew_time: Some(MicroTime(now)),
                        lease_transitions: Some(0),
                        ..LeaseSpec::default()
                    }),
                };
                leases.create(&params, &lease).await
            }
            LeaseStep::Renew | LeaseStep::Take => {
                let mut lease = lease.unwrap_or_default();
                let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
                if step == LeaseStep::Take {
                    spec.holder_identity = Some(self.node.clone());
                    spec.acquire_time = Some(MicroTime(now));
                    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                }
                spec.lease_duration_seconds = Some(seconds);
                spec.renew_time = Some(MicroTime(now));
                // The resourceVersion read makes it a compare-and-swap: of two takers, one wins.
                leases.replace(LEASE_NAME, &params, &lease).await
            }
        };
        match result {
            Ok(_) => true,
            Err(e) => {
                debug!(error = %e, ?step, "the coordinator Lease was not written");
                false
            }
        }
    }

    /// Gives the Lease up at shutdown, so another daemon takes it at once.
    async fn release(&self, leases: &Api<Lease>) {
        let Ok(Some(mut lease)) = leases.get_opt(LEASE_NAME).await else {
            return;
        };
        let Some(spec) = lease.spec.as_mut() else {
            return;
        };
        if spec.holder_identity.as_deref() != Some(self.node.as_str()) {
            return;
        }
        spec.holder_identity = None;
        if let Err(e) = leases
            .replace(LEASE_NAME, &PostParams::default(), &lease)
            .await
        {
            debug!(error = %e, "the coordinator Lease was not released");
        }
        self.stats.holder.store(false, Ordering::Relaxed);
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

    fn lease(holder: &str, renewed: &str, seconds: i32) -> Lease {
        Lease {
            metadata: ObjectMeta::default(),
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                lease_duration_seconds: Some(seconds),
                renew_time: Some(MicroTime(renewed.parse().unwrap())),
                ..LeaseSpec::default()
            }),
        }
    }

    #[test]
    fn the_lease_is_created_renewed_waited_for_and_taken_once_expired() {
        let at = |t: &str| t.parse::<Timestamp>().unwrap();
        let held = lease("n1", "2026-01-01T00:00:00Z", 15);
        assert_eq!(
            lease_step(None, "n2", at("2026-01-01T00:00:00Z")),
            LeaseStep::Create
        );
        assert_eq!(
            lease_step(Some(&held), "n1", at("2026-01-01T00:00:30Z")),
            LeaseStep::Renew
        );
        assert_eq!(
            lease_step(Some(&held), "n2", at("2026-01-01T00:00:14Z")),
            LeaseStep::Wait
        );
        assert_eq!(
            lease_step(Some(&held), "n2", at("2026-01-01T00:00:16Z")),
            LeaseStep::Take
        );
        assert_eq!(
            lease_step(
                Some(&lease("", "2026-01-01T00:00:00Z", 15)),
                "n2",
                at("2026-01-01T00:00:01Z")
            ),
            LeaseStep::Take
        );
    }

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
