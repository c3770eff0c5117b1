//! The API objects of a rollout: `HandlerRollout` (cluster scoped, written by the operator,
//! its status by the coordinator) and `NodeHandlerStatus` (one per node in
//! [`NAMESPACE`], written by that node's daemon only), as their CRDs in
//! `examples/deploy/` describe them.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use serde::{Deserialize, Serialize};

/// The API group of both kinds.
pub const GROUP: &str = "pluglet.io";
/// Their version.
pub const VERSION: &str = "v1alpha1";
/// Where the node reports and the coordinator's Lease live.
pub const NAMESPACE: &str = "pluglet-system";

/// A fleet rollout of one handler.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HandlerRollout {
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// What the operator asks for.
    pub spec: RolloutSpec,
    /// Where the rollout is, written by the coordinator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<RolloutStatus>,
}

/// The slot a rollout serves: exactly one of the two.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SlotRef {
    /// A resource's allocation policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// A plugin type's registration hooks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin_type: Option<String>,
}

impl SlotRef {
    /// `resource/NAME` or `plugin_type/NAME`, as the handler set names slots.
    pub fn id(&self) -> String {
        match (&self.resource, &self.plugin_type) {
            (Some(r), _) => format!("resource/{r}"),
            (None, Some(t)) => format!("plugin_type/{t}"),
            (None, None) => String::new(),
        }
    }
}

/// The limits of a `handlers.toml` entry, under the same keys.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// `deadline_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// `memory_mib`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    /// `fuel`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fuel: Option<u64>,
    /// `max_concurrent_calls`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_calls: Option<u32>,
    /// `reuse_instances`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reuse_instances: Option<bool>,
    /// `rollback_after`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback_after: Option<u32>,
    /// `on_failure` (`fail` or `builtin`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_failure: Option<String>,
}

/// One wave: the cumulative share of the selected nodes that runs the module once it opens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaveSpec {
    /// 1 to 100.
    pub percent: u32,
}

/// What every node of a wave must show before the next one opens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Soak {
    /// A Go duration string (`90s`, `2m`, `1h30m`).
    pub duration: String,
    /// Clean calls the node must make in that time (none at all also passes).
    #[serde(default)]
    pub calls: u64,
}

impl Soak {
    /// The duration, parsed (`None`: not a Go duration).
    pub fn duration(&self) -> Option<Duration> {
        parse_go_duration(&self.duration)
    }
}

/// `HandlerRollout.spec`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// The slot.
    pub slot: SlotRef,
    /// `oci://HOST/REPO@sha256:HEX`.
    pub module: String,
    /// Settings handed to the guest.
    #[serde(default)]
    pub settings: BTreeMap<String, String>,
    /// The entry's limits.
    #[serde(default)]
    pub limits: Limits,
    /// Which Nodes take part (none: every Node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
    /// The waves, cumulative.
    pub waves: Vec<WaveSpec>,
    /// The soak of every wave.
    pub soak: Soak,
    /// Nodes that may roll back before the rollout halts.
    #[serde(default)]
    pub failure_budget: u32,
    /// No wave opens while set.
    #[serde(default)]
    pub paused: bool,
}

/// Where a rollout is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Waves open one after the other.
    #[default]
    Progressing,
    /// No wave opens (by `spec.paused`, or nodes that never report).
    Paused,
    /// The failure budget is spent: every node is returning the slot.
    Halted,
    /// Halted, and every node that had applied it returned the slot.
    RolledBack,
    /// Every wave passed its soak.
    Complete,
    /// A newer rollout for the same slot took over.
    Superseded,
}

impl Phase {
    /// Whether nodes serve the rollout's module in this phase (when in an open wave).
    pub fn in_force(self) -> bool {
        matches!(self, Phase::Progressing | Phase::Paused | Phase::Complete)
    }

    /// Whether the rollout is over and the coordinator leaves it alone.
    pub fn is_final(self) -> bool {
        matches!(self, Phase::RolledBack | Phase::Superseded)
    }

    /// The name in `status.phase`.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Progressing => "Progressing",
            Phase::Paused => "Paused",
            Phase::Halted => "Halted",
            Phase::RolledBack => "RolledBack",
            Phase::Complete => "Complete",
            Phase::Superseded => "Superseded",
        }
    }
}

/// One wave as it went.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WaveStatus {
    /// Its cumulative percent.
    pub percent: u32,
    /// When it opened (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opened_at: Option<String>,
    /// Its members, frozen when it opened.
    #[serde(default)]
    pub nodes: Vec<String>,
    /// Members.
    #[serde(default)]
    pub targeted: u32,
    /// Members serving the module (on probation or healthy).
    #[serde(default)]
    pub applied: u32,
    /// Members still soaking.
    #[serde(default)]
    pub on_probation: u32,
    /// Members that passed the soak.
    #[serde(default)]
    pub healthy: u32,
    /// Members that rolled back (or refused it).
    #[serde(default)]
    pub rolled_back: u32,
}

/// A node that rolled back, and why.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeFailure {
    /// The node.
    pub node: String,
    /// Its reason.
    pub reason: String,
}

/// A condition, as Kubernetes objects carry them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// E.g. `NodesNotReporting`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True` or `False`.
    pub status: String,
    /// One word.
    #[serde(default)]
    pub reason: String,
    /// For people.
    #[serde(default)]
    pub message: String,
    /// RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
}

/// `HandlerRollout.status`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStatus {
    /// The phase.
    #[serde(default)]
    pub phase: Phase,
    /// The last wave opened, from 1 (0: none yet).
    #[serde(default)]
    pub current_wave: u32,
    /// Nodes serving the module, over every wave.
    #[serde(default)]
    pub applied: u32,
    /// Nodes that rolled back, over every wave.
    #[serde(default)]
    pub rolled_back_count: u32,
    /// The spec's generation this status answers.
    #[serde(default)]
    pub observed_generation: i64,
    /// Every wave opened so far.
    #[serde(default)]
    pub waves: Vec<WaveStatus>,
    /// The nodes that rolled back, with their reason.
    #[serde(default)]
    pub rolled_back: Vec<NodeFailure>,
    /// Conditions.
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

impl HandlerRollout {
    /// The rollout's name.
    pub fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }

    /// The rollout's UID.
    pub fn uid(&self) -> &str {
        self.metadata.uid.as_deref().unwrap_or_default()
    }

    /// Its phase (`Progressing` before the coordinator wrote a status).
    pub fn phase(&self) -> Phase {
        self.status.as_ref().map(|s| s.phase).unwrap_or_default()
    }

    /// Whether `node` is a member of a wave opened so far.
    pub fn opened_for(&self, node: &str) -> bool {
        self.status
            .as_ref()
            .is_some_and(|s| s.waves.iter().any(|w| w.nodes.iter().any(|n| n == node)))
    }

    /// The order in which rollouts of one slot win: the later created, then the greater name.
    pub fn precedence(&self) -> (String, String) {
        let created = self
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default();
        (created, self.name().to_owned())
    }
}

/// A node's state in one rollout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeState {
    /// Applied; nothing known of its calls yet.
    Applied,
    /// Applied and soaking.
    OnProbation,
    /// Passed the soak.
    Healthy,
    /// Applied, failed and rolled back by the node.
    RolledBack,
    /// Could not be applied (pull, signature, vectors, admission).
    Refused,
    /// Returned the slot because the rollout halted or ended.
    Reverted,
}

impl NodeState {
    /// The name in the report (and the `state` label of the metric).
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Applied => "Applied",
            NodeState::OnProbation => "OnProbation",
            NodeState::Healthy => "Healthy",
            NodeState::RolledBack => "RolledBack",
            NodeState::Refused => "Refused",
            NodeState::Reverted => "Reverted",
        }
    }

    /// Every state, for metrics.
    pub const ALL: [NodeState; 6] = [
        NodeState::Applied,
        NodeState::OnProbation,
        NodeState::Healthy,
        NodeState::RolledBack,
        NodeState::Refused,
        NodeState::Reverted,
    ];

    /// Whether the node serves the module.
    pub fn serving(self) -> bool {
        matches!(
            self,
            NodeState::Applied | NodeState::OnProbation | NodeState::Healthy
        )
    }

    /// Whether this counts against the failure budget.
    pub fn failed(self) -> bool {
        matches!(self, NodeState::RolledBack | NodeState::Refused)
    }
}

/// One rollout in a node's report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeRollout {
    /// The rollout's name.
    pub name: String,
    /// Its UID (a rollout deleted and created again is another one).
    pub uid: String,
    /// The node's state in it.
    pub state: NodeState,
    /// The manifest digest served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Why it rolled back, was refused or reverted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When the state began (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// Calls since it applied.
    #[serde(default)]
    pub calls: u64,
    /// Clean calls since it applied.
    #[serde(default)]
    pub clean_calls: u64,
    /// Healthy having made no call in its soak.
    #[serde(default)]
    pub idle: bool,
}

/// `NodeHandlerStatus.status`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    /// How many rollouts (for the printer column).
    #[serde(default)]
    pub count: u32,
    /// The node's state in every rollout it takes part in.
    #[serde(default)]
    pub rollouts: Vec<NodeRollout>,
}

/// A node's report: `NodeHandlerStatus`, named for the node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeHandlerStatus {
    /// `pluglet.io/v1alpha1`.
    #[serde(default = "api_version")]
    pub api_version: String,
    /// `NodeHandlerStatus`.
    #[serde(default = "node_kind")]
    pub kind: String,
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// The report.
    #[serde(default)]
    pub status: NodeReport,
}

fn api_version() -> String {
    format!("{GROUP}/{VERSION}")
}

fn node_kind() -> String {
    "NodeHandlerStatus".into()
}

impl NodeHandlerStatus {
    /// The report of `node`.
    pub fn new(node: &str, report: NodeReport) -> NodeHandlerStatus {
        NodeHandlerStatus {
            api_version: api_version(),
            kind: node_kind(),
            metadata: ObjectMeta {
                name: Some(node.to_owned()),
                namespace: Some(NAMESPACE.to_owned()),
                ..ObjectMeta::default()
            },
            status: report,
        }
    }
}

macro_rules! resource {
    ($ty:ty, $kind:literal, $plural:literal, $scope:ty) => {
        impl kube::Resource for $ty {
            type DynamicType = ();
            type Scope = $scope;
            fn kind(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($kind)
            }
            fn group(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(GROUP)
            }
            fn version(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(VERSION)
            }
            fn plural(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($plural)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

resource!(
    HandlerRollout,
    "HandlerRollout",
    "handlerrollouts",
    k8s_openapi::ClusterResourceScope
);
resource!(
    NodeHandlerStatus,
    "NodeHandlerStatus",
    "nodehandlerstatuses",
    k8s_openapi::NamespaceResourceScope
);

/// Parses a Go duration string (`300ms`, `1.5h`, `2h45m`); `None` when it is not one.
pub fn parse_go_duration(text: &str) -> Option<Duration> {
    if text == "0" {
        return Some(Duration::ZERO);
    }
    let mut rest = text;
    let mut total = 0f64;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += number * seconds;
    }
    Some(Duration::from_secs_f64(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_parse_as_go_does() {
        assert_eq!(parse_go_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_go_duration("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_go_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_go_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_go_duration("2"), None);
        assert_eq!(parse_go_duration("2d"), None);
        assert_eq!(parse_go_duration(""), None);
    }

    #[test]
    fn a_rollout_reads_as_the_api_server_sends_it() {
        let rollout: HandlerRollout = serde_json::from_value(serde_json::json!({
            "apiVersion": "pluglet.io/v1alpha1",
            "kind": "HandlerRollout",
            "metadata": {"name": "gpu-v2", "uid": "u-1", "generation": 1},
            "spec": {
                "slot": {"resource": "vendor.com/gpu"},
                "module": format!("oci://r.example:5000/p@sha256:{}", "0".repeat(64)),
                "settings": {"mode": "spread"},
                "limits": {"deadline_ms": 50, "rollback_after": 2},
                "waves": [{"percent": 20}, {"percent": 100}],
                "soak": {"duration": "2m", "calls": 100},
            },
            "status": {"phase": "Progressing", "currentWave": 1,
                       "waves": [{"percent": 20, "nodes": ["n1"]}]},
        }))
        .unwrap();
        assert_eq!(rollout.spec.slot.id(), "resource/vendor.com/gpu");
        assert_eq!(rollout.spec.limits.deadline_ms, Some(50));
        assert_eq!(rollout.spec.failure_budget, 0);
        assert_eq!(rollout.spec.soak.duration(), Some(Duration::from_secs(120)));
        assert!(rollout.opened_for("n1"));
        assert!(!rollout.opened_for("n2"));
        assert_eq!(rollout.phase(), Phase::Progressing);
        let report = NodeHandlerStatus::new("n1", NodeReport::default());
        let value = serde_json::to_value(&report).unwrap();
        assert_eq!(value["apiVersion"], "pluglet.io/v1alpha1");
        assert_eq!(value["metadata"]["namespace"], NAMESPACE);
    }
}
