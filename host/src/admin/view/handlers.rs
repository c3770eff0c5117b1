//! The handler set's views: slots and their modules (`ctl handlers`), their failures, last
//! changes and signatures, and what a rollback did.

use std::fmt::Write as _;

use pluglet_proto::admin::v1 as pb;
use serde::{Deserialize, Serialize};

use super::{Kind, Table, non_empty, table};

/// A handler slot and the module in force (`ctl handlers`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HandlerView {
    /// The slot's name, as in `ctl status`, metric labels and events: `plugin_type/<type>`,
    /// `resource/<name>` or `default_policy`.
    #[serde(default)]
    pub slot: String,
    /// Plugin type it serves; `None` for an allocation policy.
    pub plugin_type: Option<String>,
    /// Resource it governs as an allocation policy; `None` for the default policy and for
    /// plugin types.
    pub resource: Option<String>,
    /// `builtin:<name>` or the module's path.
    pub module: String,
    /// The module's sha256, hex.
    pub sha256: String,
    /// Contract version it implements.
    pub contract_version: String,
    /// Hook families it exports.
    pub families: Vec<String>,
    /// When this version was put in force (RFC 3339).
    pub applied_at: Option<String>,
    /// The previous version, kept loaded for a rollback.
    pub previous: Option<ModuleRef>,
    /// Calls since applied.
    pub calls: u64,
    /// Calls the guest answered with a refusal.
    pub refusals: u64,
    /// Failed calls by kind.
    pub failures: FailuresView,
    /// Mean call time, µs.
    pub mean_us: Option<f64>,
    /// 99th percentile call time, µs.
    pub p99_us: Option<u64>,
    /// The last failed call.
    pub last_failure: Option<FailureView>,
    /// The last change of the slot when one was applied, refused or rolled back.
    pub last_change: Option<ChangeView>,
    /// `rollback_after` of the entry (`None` for a built-in).
    pub rollback_after: Option<u32>,
    /// `on_failure` of the entry (`None` for a built-in).
    pub on_failure: Option<String>,
    /// Whether the module is still on probation.
    pub on_probation: bool,
    /// The minisign signature that vouched for the module when it was applied (`None`: none
    /// was checked).
    pub signature: Option<SignatureView>,
    /// Calls of the slot running now (absent for a built-in: not counted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_calls: Option<u32>,
    /// How many calls of the slot may run at once (absent for a built-in: not limited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_calls: Option<u32>,
    /// A short digest of the entry's settings, to tell versions of one module apart (absent
    /// without settings).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings_sha256: Option<String>,
    /// For a module named by an OCI reference: the reference as written in handlers.toml.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// For a module named by an OCI reference: the manifest digest in force (`sha256:HEX`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// For an entry put in force by a fleet rollout (it wins over handlers.toml):
    /// `rollout/NAME`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<String>,
}

/// A minisign signature that verified.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignatureView {
    /// The id of the key that made it, hex, as minisign prints it.
    pub key_id: String,
    /// Its trusted comment.
    pub trusted_comment: String,
}

/// A module and its digest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleRef {
    /// `builtin:<name>` or the module's path.
    pub module: String,
    /// sha256, hex.
    pub sha256: String,
    /// The `oci://` reference as written in handlers.toml (absent for a file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The manifest digest of an `oci://` module (`sha256:HEX`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// Failed calls by kind.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailuresView {
    /// Traps (panics, `unreachable`, guest exits).
    pub trap: u64,
    /// Deadlines exceeded.
    pub deadline: u64,
    /// Memory caps exceeded.
    pub memory: u64,
    /// Fuel budgets used up.
    pub fuel: u64,
    /// Calls the host could not run (not the module's failure).
    pub other: u64,
}

/// The last failed call of a handler.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureView {
    /// RFC 3339.
    pub at: String,
    /// `trap`, `deadline`, `memory`, `fuel` or `other`.
    pub kind: String,
    /// The handler's error.
    pub message: String,
}

/// The last change of a slot, or of `handlers.toml` as a whole.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeView {
    /// `applied`, `refused` or `rolled_back`.
    pub state: String,
    /// RFC 3339.
    pub at: String,
    /// Why.
    pub reason: String,
    /// The module concerned.
    pub module: Option<String>,
    /// Its sha256.
    pub sha256: Option<String>,
    /// The `oci://` reference concerned (absent for a file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Its manifest digest, when it was resolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

impl From<&pb::HandlerChange> for ChangeView {
    fn from(c: &pb::HandlerChange) -> ChangeView {
        ChangeView {
            state: c.state.clone(),
            at: c.at.clone(),
            reason: c.reason.clone(),
            module: non_empty(&c.module),
            sha256: non_empty(&c.sha256),
            source: non_empty(&c.source),
            digest: non_empty(&c.digest),
        }
    }
}

impl From<&pb::HandlerInfo> for HandlerView {
    fn from(h: &pb::HandlerInfo) -> HandlerView {
        let failures = h.failures.unwrap_or_default();
        HandlerView {
            slot: match (h.plugin_type.as_str(), h.resource.as_str()) {
                ("", "") => "default_policy".to_owned(),
                ("", r) => format!("resource/{r}"),
                (t, _) => format!("plugin_type/{t}"),
            },
            plugin_type: non_empty(&h.plugin_type),
            resource: non_empty(&h.resource),
            module: h.module.clone(),
            sha256: h.sha256.clone(),
            contract_version: h.contract_version.clone(),
            families: h.families.clone(),
            applied_at: non_empty(&h.applied_at),
            previous: (!h.previous_module.is_empty()).then(|| ModuleRef {
                module: h.previous_module.clone(),
                sha256: h.previous_sha256.clone(),
                source: non_empty(&h.previous_source),
                digest: non_empty(&h.previous_digest),
            }),
            source: non_empty(&h.source),
            digest: non_empty(&h.digest),
            rollout: non_empty(&h.rollout),
            calls: h.calls,
            refusals: h.refusals,
            failures: FailuresView {
                trap: failures.trap,
                deadline: failures.deadline,
                memory: failures.memory,
                fuel: failures.fuel,
                other: failures.other,
            },
            mean_us: h.has_timing.then_some(h.mean_us),
            p99_us: h.has_timing.then_some(h.p99_us),
            last_failure: h.last_failure.as_ref().map(|f| FailureView {
                at: f.at.clone(),
                kind: f.kind.clone(),
                message: f.message.clone(),
            }),
            last_change: h.last_change.as_ref().map(ChangeView::from),
            rollback_after: (!h.on_failure.is_empty()).then_some(h.rollback_after),
            on_failure: non_empty(&h.on_failure),
            on_probation: h.on_probation,
            signature: h.signature.as_ref().map(|sig| SignatureView {
                key_id: sig.key_id.clone(),
                trusted_comment: sig.trusted_comment.clone(),
            }),
            running_calls: (h.max_concurrent_calls > 0).then_some(h.running_calls),
            max_concurrent_calls: (h.max_concurrent_calls > 0).then_some(h.max_concurrent_calls),
            settings_sha256: non_empty(&h.settings_sha256),
        }
    }
}

/// `ctl handlers`: the slots, and a refusal of `handlers.toml` as a whole above them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HandlersView {
    /// One row per slot.
    pub items: Vec<HandlerView>,
    /// A refusal of the whole file (syntax, unknown key) until the next successful change.
    pub last_change: Option<ChangeView>,
}

impl From<&pb::ListHandlersResponse> for HandlersView {
    fn from(r: &pb::ListHandlersResponse) -> HandlersView {
        HandlersView {
            items: r.handlers.iter().map(HandlerView::from).collect(),
            last_change: r.last_change.as_ref().map(ChangeView::from),
        }
    }
}

impl HandlersView {
    /// The table, with a refusal of the whole file above it and each slot's refusal or
    /// rollback below it.
    pub fn table(&self) -> String {
        let mut out = String::new();
        if let Some(change) = &self.last_change {
            let _ = writeln!(
                out,
                "handlers.toml {} at {}: {}\n",
                change.state.replace('_', " "),
                change.at,
                change.reason
            );
        }
        out.push_str(&table(&self.items));
        let notes: Vec<String> = self
            .items
            .iter()
            .filter_map(|h| {
                let change = h.last_change.as_ref()?;
                (change.state != "applied").then(|| {
                    format!(
                        "{}: {} at {}: {}",
                        h.key(),
                        change.state.replace('_', " "),
                        change.at,
                        change.reason
                    )
                })
            })
            .collect();
        if !notes.is_empty() {
            out.push('\n');
            for note in notes {
                out.push_str(&note);
                out.push('\n');
            }
        }
        out
    }
}

impl HandlerView {
    fn key(&self) -> String {
        self.slot.clone()
    }
}

/// What `ctl handlers rollback` did: the slot as it is served after the rollback.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HandlerRollbackView {
    /// The slot after the rollback (`None` when the daemon did not say).
    pub handler: Option<HandlerView>,
}

impl Kind for HandlersView {
    const KIND: &'static str = "HandlerList";
}

/// `ctl handlers refresh`: the outcome and the `oci://` slots after it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HandlerRefreshView {
    /// `applied`, `unchanged` or `refused`.
    pub outcome: String,
    /// Why, when refused.
    pub reason: Option<String>,
    /// The `oci://` slots refreshed, after the refresh.
    pub items: Vec<HandlerView>,
}

impl Kind for HandlerRefreshView {
    const KIND: &'static str = "HandlerRefresh";
}

impl Kind for HandlerRollbackView {
    const KIND: &'static str = "HandlerRollback";
}

impl Table for HandlerView {
    const HEADER: &'static [&'static str] = &[
        "SLOT", "MODULE", "SHA256", "CALLS", "RUNNING", "FAILED", "P99", "PREVIOUS", "CHANGE",
    ];
    fn row(&self) -> Vec<String> {
        let failed = self.failures.trap
            + self.failures.deadline
            + self.failures.memory
            + self.failures.fuel
            + self.failures.other;
        vec![
            self.key(),
            module_cell(&self.module, self.source.as_deref(), self.digest.as_deref()),
            {
                let mut version: String = self.sha256.chars().take(12).collect();
                if let Some(sig) = &self.signature {
                    version.push_str(&format!(
                        " signed:{} \"{}\"",
                        sig.key_id, sig.trusted_comment
                    ));
                }
                if let Some(hash) = &self.settings_sha256 {
                    version.push_str(&format!(" settings:{hash}"));
                }
                if let Some(rollout) = &self.rollout {
                    version.push_str(&format!(" source:{rollout}"));
                }
                version
            },
            self.calls.to_string(),
            match (self.running_calls, self.max_concurrent_calls) {
                (Some(running), Some(limit)) => format!("{running}/{limit}"),
                _ => "-".to_owned(),
            },
            failed.to_string(),
            self.p99_us
                .map_or_else(|| "-".to_owned(), |us| format!("{us}µs")),
            self.previous.as_ref().map_or_else(
                || "-".to_owned(),
                |p| {
                    format!(
                        "{} ({})",
                        module_cell(&p.module, p.source.as_deref(), p.digest.as_deref()),
                        p.sha256.chars().take(12).collect::<String>()
                    )
                },
            ),
            self.last_change
                .as_ref()
                .map_or_else(|| "-".to_owned(), |c| c.state.clone()),
        ]
    }
}

/// The MODULE cell: the file, or for a module pulled from a registry the reference as written
/// in handlers.toml with the manifest digest in force, shortened (`REF@sha256:` and 12 hex
/// digits; a reference by digest is shown as written).
fn module_cell(module: &str, source: Option<&str>, digest: Option<&str>) -> String {
    match (source, digest) {
        (Some(source), _) if source.contains('@') => source.to_owned(),
        (Some(source), Some(digest)) => {
            let (algorithm, hex) = digest.split_once(':').unwrap_or(("sha256", digest));
            let short: String = hex.chars().take(12).collect();
            format!("{source}@{algorithm}:{short}")
        }
        (Some(source), None) => source.to_owned(),
        (None, _) => module.to_owned(),
    }
}
