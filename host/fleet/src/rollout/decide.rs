//! The coordinator's decision for one rollout, from what it observed: the counts of every wave
//! from the nodes' reports, whether the failure budget is spent, whether every node of the
//! current wave passed its soak (then the next wave opens, its members frozen), whether nodes
//! never report, and the phase. Pure: the same observation gives the same status, so a new
//! coordinator continues from `status` where the last one stopped.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use super::types::{
    Condition, HandlerRollout, NodeFailure, NodeRollout, NodeState, Phase, RolloutStatus,
    WaveStatus,
};
use super::waves;

/// How long the members of an open wave may stay silent before the rollout pauses.
pub const REPORT_DEADLINE: Duration = Duration::from_secs(300);

/// The condition set when members of the open wave never reported.
pub const NOT_REPORTING: &str = "NodesNotReporting";
/// The condition set when the failure budget is spent.
pub const BUDGET_SPENT: &str = "FailureBudgetSpent";
/// The condition set once no node serves a halted rollout's module any more.
pub const ROLLED_BACK: &str = "RolledBack";

/// What the coordinator saw of one rollout.
#[derive(Debug)]
pub struct Observed<'a> {
    /// The rollout.
    pub rollout: &'a HandlerRollout,
    /// The Nodes its selector selects now.
    pub selected: Vec<String>,
    /// Each reporting node's state in this rollout (its UID).
    pub reports: BTreeMap<String, NodeRollout>,
    /// A newer rollout of the same slot exists.
    pub superseded: bool,
    /// Now.
    pub now: Timestamp,
}

/// The status the rollout should have, and whether a wave opened to get there.
#[derive(Debug, PartialEq)]
pub struct Decision {
    /// The status.
    pub status: RolloutStatus,
    /// A wave opened.
    pub opened: bool,
}

/// Decides the next status of `seen.rollout`.
pub fn decide(seen: &Observed<'_>) -> Decision {
    let rollout = seen.rollout;
    let mut status = rollout.status.clone().unwrap_or_default();
    status.observed_generation = rollout.metadata.generation.unwrap_or_default();
    let mut opened = false;
    if status.phase.is_final() {
        return Decision { status, opened };
    }
    if seen.superseded {
        status.phase = Phase::Superseded;
        return Decision { status, opened };
    }
    count(&mut status, &seen.reports);
    if status.phase == Phase::Halted {
        let serving = status
            .waves
            .iter()
            .flat_map(|w| &w.nodes)
            .any(|n| seen.reports.get(n).is_some_and(|r| r.state.serving()));
        if !serving {
            status.phase = Phase::RolledBack;
            let message = "no node serves the module any more".to_owned();
            set_condition(
                &mut status,
                ROLLED_BACK,
                "True",
                "AllNodesReturned",
                message,
                seen.now,
            );
        }
        return Decision { status, opened };
    }
    if status.rolled_back_count > rollout.spec.failure_budget {
        status.phase = Phase::Halted;
        let message = format!(
            "{} node(s) rolled back, more than the failure budget of {}: every node returns the slot",
            status.rolled_back_count, rollout.spec.failure_budget
        );
        set_condition(
            &mut status,
            BUDGET_SPENT,
            "True",
            "Halted",
            message,
            seen.now,
        );
        return Decision { status, opened };
    }
    if status.phase == Phase::Complete {
        return Decision { status, opened };
    }
    if rollout.spec.paused {
        status.phase = Phase::Paused;
        return Decision { status, opened };
    }
    if let Some(wave) = status.waves.last().cloned() {
        let silent = silent_members(&wave, &seen.reports, seen.now);
        if !silent.is_empty() {
            status.phase = Phase::Paused;
            let message = format!(
                "no report within {}s of the wave opening from: {}",
                REPORT_DEADLINE.as_secs(),
                silent.join(", ")
            );
            set_condition(
                &mut status,
                NOT_REPORTING,
                "True",
                "NoReport",
                message,
                seen.now,
            );
            return Decision { status, opened };
        }
        remove_condition(&mut status, NOT_REPORTING);
        status.phase = Phase::Progressing;
        let passed = wave.nodes.iter().all(|n| {
            seen.reports
                .get(n)
                .is_some_and(|r| r.state == NodeState::Healthy || r.state.failed())
        });
        if !passed {
            return Decision { status, opened };
        }
    }
    status.phase = Phase::Progressing;
    let percents: Vec<u32> = rollout.spec.waves.iter().map(|w| w.percent).collect();
    let index = status.waves.len();
    let frozen: BTreeSet<String> = status.waves.iter().flat_map(|w| w.nodes.clone()).collect();
    let members = waves::next_members(rollout.uid(), &percents, index, &seen.selected, &frozen);
    if members.is_empty() {
        if !status.waves.is_empty() {
            status.phase = Phase::Complete;
        }
        return Decision { status, opened };
    }
    status.waves.push(WaveStatus {
        percent: percents[index],
        opened_at: Some(seen.now.to_string()),
        targeted: u32::try_from(members.len()).unwrap_or(u32::MAX),
        nodes: members,
        ..WaveStatus::default()
    });
    status.current_wave = u32::try_from(status.waves.len()).unwrap_or(u32::MAX);
    count(&mut status, &seen.reports);
    opened = true;
    Decision { status, opened }
}

/// The counts of every wave, the totals and the nodes that rolled back, from the reports.
fn count(status: &mut RolloutStatus, reports: &BTreeMap<String, NodeRollout>) {
    let mut failures = Vec::new();
    for wave in &mut status.waves {
        let states: Vec<Option<&NodeRollout>> = wave.nodes.iter().map(|n| reports.get(n)).collect();
        let with = |f: &dyn Fn(NodeState) -> bool| {
            let n = states.iter().flatten().filter(|r| f(r.state)).count();
            u32::try_from(n).unwrap_or(u32::MAX)
        };
        wave.targeted = u32::try_from(wave.nodes.len()).unwrap_or(u32::MAX);
        wave.applied = with(&|s| s.serving());
        wave.on_probation = with(&|s| matches!(s, NodeState::Applied | NodeState::OnProbation));
        wave.healthy = with(&|s| s == NodeState::Healthy);
        wave.rolled_back = with(&|s| s.failed());
        for (node, report) in wave.nodes.iter().zip(&states) {
            if let Some(r) = report.filter(|r| r.state.failed()) {
                failures.push(NodeFailure {
                    node: node.clone(),
                    reason: r
                        .reason
                        .clone()
                        .unwrap_or_else(|| r.state.as_str().to_owned()),
                });
            }
        }
    }
    // Kept: a node that rolled back and then reverted (the rollout halted) still rolled back.
    for old in std::mem::take(&mut status.rolled_back) {
        if !failures.iter().any(|f| f.node == old.node) {
            failures.push(old);
        }
    }
    failures.sort_by(|a, b| a.node.cmp(&b.node));
    status.applied = status.waves.iter().map(|w| w.applied).sum();
    status.rolled_back_count = u32::try_from(failures.len()).unwrap_or(u32::MAX);
    status.rolled_back = failures;
}

/// Members of `wave` without a report once [`REPORT_DEADLINE`] has passed since it opened.
fn silent_members(
    wave: &WaveStatus,
    reports: &BTreeMap<String, NodeRollout>,
    now: Timestamp,
) -> Vec<String> {
    let Some(opened) = wave
        .opened_at
        .as_deref()
        .and_then(|t| t.parse::<Timestamp>().ok())
    else {
        return Vec::new();
    };
    let waited = now.duration_since(opened).unsigned_abs();
    if waited < REPORT_DEADLINE {
        return Vec::new();
    }
    wave.nodes
        .iter()
        .filter(|n| !reports.contains_key(*n))
        .cloned()
        .collect()
}

fn set_condition(
    status: &mut RolloutStatus,
    type_: &str,
    value: &str,
    reason: &str,
    message: String,
    now: Timestamp,
) {
    if let Some(c) = status.conditions.iter_mut().find(|c| c.type_ == type_) {
        if c.status != value {
            c.last_transition_time = Some(now.to_string());
        }
        c.status = value.into();
        c.reason = reason.into();
        c.message = message;
        return;
    }
    status.conditions.push(Condition {
        type_: type_.into(),
        status: value.into(),
        reason: reason.into(),
        message,
        last_transition_time: Some(now.to_string()),
    });
}

fn remove_condition(status: &mut RolloutStatus, type_: &str) {
    status.conditions.retain(|c| c.type_ != type_);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::types::{RolloutSpec, SlotRef, Soak, WaveSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn rollout(percents: &[u32], budget: u32) -> HandlerRollout {
        HandlerRollout {
            metadata: ObjectMeta {
                name: Some("r".into()),
                uid: Some("uid-1".into()),
                generation: Some(1),
                ..ObjectMeta::default()
            },
            spec: RolloutSpec {
                slot: SlotRef {
                    resource: Some("vendor.com/gpu".into()),
                    plugin_type: None,
                },
                module: "oci://r.example/p@sha256:00".into(),
                waves: percents
                    .iter()
                    .map(|&percent| WaveSpec { percent })
                    .collect(),
                soak: Soak {
                    duration: "1s".into(),
                    calls: 0,
                },
                failure_budget: budget,
                ..RolloutSpec::default()
            },
            status: None,
        }
    }

    fn nodes() -> Vec<String> {
        (1..=5).map(|i| format!("n{i}")).collect()
    }

    fn report(state: NodeState) -> NodeRollout {
        NodeRollout {
            name: "r".into(),
            uid: "uid-1".into(),
            state,
            digest: None,
            reason: (state == NodeState::RolledBack).then(|| "trapped".into()),
            since: None,
            calls: 0,
            clean_calls: 0,
            idle: false,
        }
    }

    fn now() -> Timestamp {
        "2026-01-01T00:00:00Z".parse().unwrap()
    }

    /// Runs `decide` and keeps its status on the rollout, as the coordinator's write does.
    fn step(
        r: &mut HandlerRollout,
        reports: &BTreeMap<String, NodeRollout>,
        at: Timestamp,
    ) -> bool {
        let decision = decide(&Observed {
            rollout: r,
            selected: nodes(),
            reports: reports.clone(),
            superseded: false,
            now: at,
        });
        r.status = Some(decision.status);
        decision.opened
    }

    fn status(r: &HandlerRollout) -> &RolloutStatus {
        r.status.as_ref().unwrap()
    }

    #[test]
    fn waves_open_one_after_the_other_as_their_nodes_pass_and_the_rollout_completes() {
        let mut r = rollout(&[20, 60, 100], 0);
        let mut reports = BTreeMap::new();
        assert!(step(&mut r, &reports, now()));
        assert_eq!(status(&r).current_wave, 1);
        assert_eq!(status(&r).phase, Phase::Progressing);
        let first = status(&r).waves[0].nodes.clone();
        assert_eq!(first.len(), 1);

        // On probation: the next wave waits.
        reports.insert(first[0].clone(), report(NodeState::OnProbation));
        assert!(!step(&mut r, &reports, now()));
        assert_eq!(status(&r).waves[0].on_probation, 1);
        assert_eq!(status(&r).applied, 1);

        let mut sizes = vec![1];
        for _ in 0..2 {
            for n in status(&r).waves.last().unwrap().nodes.clone() {
                reports.insert(n, report(NodeState::Healthy));
            }
            assert!(step(&mut r, &reports, now()));
            sizes.push(status(&r).waves.last().unwrap().nodes.len());
        }
        assert_eq!(sizes, [1, 2, 2]);
        assert_eq!(status(&r).current_wave, 3);
        for n in status(&r).waves[2].nodes.clone() {
            reports.insert(n, report(NodeState::Healthy));
        }
        assert!(!step(&mut r, &reports, now()));
        assert_eq!(status(&r).phase, Phase::Complete);
        assert_eq!(status(&r).applied, 5);
        // Deciding again changes nothing.
        let before = r.status.clone();
        step(&mut r, &reports, now());
        assert_eq!(r.status, before);
    }

    #[test]
    fn a_spent_budget_halts_and_the_rollout_is_rolled_back_once_no_node_serves_it() {
        let mut r = rollout(&[40, 100], 0);
        let mut reports = BTreeMap::new();
        step(&mut r, &reports, now());
        let first = status(&r).waves[0].nodes.clone();
        assert_eq!(first.len(), 2);
        reports.insert(first[0].clone(), report(NodeState::RolledBack));
        reports.insert(first[1].clone(), report(NodeState::Healthy));
        assert!(!step(&mut r, &reports, now()), "no wave opens after a halt");
        assert_eq!(status(&r).phase, Phase::Halted);
        assert_eq!(status(&r).rolled_back_count, 1);
        assert_eq!(status(&r).rolled_back[0].reason, "trapped");
        assert!(
            status(&r)
                .conditions
                .iter()
                .any(|c| c.type_ == BUDGET_SPENT)
        );

        reports.insert(first[0].clone(), report(NodeState::Reverted));
        step(&mut r, &reports, now());
        assert_eq!(status(&r).phase, Phase::Halted, "a node still serves it");
        reports.insert(first[1].clone(), report(NodeState::Reverted));
        step(&mut r, &reports, now());
        assert_eq!(status(&r).phase, Phase::RolledBack);
        assert_eq!(
            status(&r).rolled_back_count,
            1,
            "the node that rolled back is kept"
        );
        assert_eq!(status(&r).waves.len(), 1);
    }

    #[test]
    fn failures_within_the_budget_do_not_hold_the_rollout_up() {
        let mut r = rollout(&[40, 100], 1);
        let mut reports = BTreeMap::new();
        step(&mut r, &reports, now());
        let first = status(&r).waves[0].nodes.clone();
        reports.insert(first[0].clone(), report(NodeState::Refused));
        reports.insert(first[1].clone(), report(NodeState::Healthy));
        assert!(step(&mut r, &reports, now()));
        assert_eq!(status(&r).phase, Phase::Progressing);
        assert_eq!(status(&r).current_wave, 2);
    }

    #[test]
    fn paused_by_spec_or_by_silent_nodes_opens_nothing_and_resumes() {
        let mut r = rollout(&[20, 100], 0);
        r.spec.paused = true;
        let reports = BTreeMap::new();
        assert!(!step(&mut r, &reports, now()));
        assert_eq!(status(&r).phase, Phase::Paused);
        assert!(status(&r).waves.is_empty());
        r.spec.paused = false;
        assert!(step(&mut r, &reports, now()));
        let member = status(&r).waves[0].nodes[0].clone();

        // Silent past the deadline: paused, naming it; its report resumes the rollout.
        let later = now() + std::time::Duration::from_secs(301);
        step(&mut r, &reports, later);
        assert_eq!(status(&r).phase, Phase::Paused);
        let condition = status(&r)
            .conditions
            .iter()
            .find(|c| c.type_ == NOT_REPORTING)
            .unwrap();
        assert!(condition.message.contains(&member), "{}", condition.message);
        let mut reports = reports;
        reports.insert(member, report(NodeState::OnProbation));
        step(&mut r, &reports, later);
        assert_eq!(status(&r).phase, Phase::Progressing);
        assert!(status(&r).conditions.is_empty());
    }

    #[test]
    fn a_superseded_rollout_ends_so_and_stays_so() {
        let mut r = rollout(&[100], 0);
        let decision = decide(&Observed {
            rollout: &r,
            selected: nodes(),
            reports: BTreeMap::new(),
            superseded: true,
            now: now(),
        });
        assert_eq!(decision.status.phase, Phase::Superseded);
        r.status = Some(decision.status);
        step(&mut r, &BTreeMap::new(), now());
        assert_eq!(status(&r).phase, Phase::Superseded);
        assert!(status(&r).waves.is_empty());
    }
}
