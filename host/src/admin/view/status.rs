//! The daemon's status (`ctl status`): stages, plugin counts, resources, handlers,
//! publishing.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use pluglet_proto::admin::v1 as pb;
use serde::{Deserialize, Serialize};

use super::{EventView, Kind, columns, non_empty, table};

/// A stage of the daemon (`ctl status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageView {
    /// Its name.
    pub name: String,
    /// Why it ended; `None` while it runs.
    pub ended: Option<String>,
}

/// Plugins of one type by state (`ctl status`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginCountView {
    /// Wire type string.
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// Registered.
    pub registered: u32,
    /// Refused or retrying.
    pub failing: u32,
    /// Pending or in progress.
    pub waiting: u32,
}

/// One resource's numbers (`ctl status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceSummaryView {
    /// Extended resource name.
    pub resource: String,
    /// Every device.
    pub capacity: i64,
    /// Healthy devices.
    pub allocatable: i64,
    /// Devices held by containers.
    pub allocated: i64,
    /// Whether a plugin's ListAndWatch stream is live.
    pub connected: bool,
    /// Why it is not connected, or what was wrong with the plugin's last device list (absent
    /// while all is well).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// A handler slot's module in force (`ctl status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandlerSummaryView {
    /// The slot's name: `plugin_type/CSIPlugin`, `resource/vendor.com/gpu` or
    /// `default_policy`.
    pub slot: String,
    /// `builtin:<name>` or the module's path.
    pub module: String,
    /// The module's sha256, hex.
    pub sha256: String,
}

/// The daemon on one screen (`ctl status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusView {
    /// The daemon's version.
    pub version: String,
    /// When it started (RFC 3339, UTC).
    pub started_at: String,
    /// Milliseconds since it started.
    pub uptime_ms: u64,
    /// No stage has ended.
    pub live: bool,
    /// Live and every readiness condition met.
    pub ready: bool,
    /// Readiness conditions not met yet.
    pub waiting_for: Vec<String>,
    /// The stages started so far.
    pub stages: Vec<StageView>,
    /// Plugins per type, by state, sorted by type.
    pub plugins: Vec<PluginCountView>,
    /// Device plugin resources; `None` when the daemon runs without a device manager.
    pub resources: Option<Vec<ResourceSummaryView>>,
    /// The handler module in force per slot.
    pub handlers: Vec<HandlerSummaryView>,
    /// The newest refusals and failures, newest last.
    pub last_errors: Vec<EventView>,
    /// Publishing to a Kubernetes API server; `None` when off.
    pub publishing: Option<PublishingView>,
    /// The fleet rollouts of handlers this node takes part in.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rollouts: Vec<RolloutPartView>,
}

/// This node's part in one fleet rollout of a handler (`ctl status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutPartView {
    /// The rollout's name.
    pub name: String,
    /// `Applied`, `OnProbation`, `Healthy`, `RolledBack`, `Refused` or `Reverted`.
    pub state: String,
    /// The manifest digest served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Why it rolled back, was refused or reverted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Where publishing to a Kubernetes API server stands (`ctl status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishingView {
    /// The Node's name.
    pub node: String,
    /// The API server's URL.
    pub server: String,
    /// `starting`, `synced`, `pending`, `failing` or `waiting-for-node`.
    pub state: String,
    /// When the API objects last matched (RFC 3339, UTC); `None`: never.
    pub last_sync: Option<String>,
    /// The last round's error while failing.
    pub last_error: Option<String>,
    /// Inventory changes not yet published.
    pub pending_changes: u64,
    /// Rounds finished.
    pub rounds: u64,
    /// Rounds that failed.
    pub failures: u64,
    /// Writes sent.
    pub writes: u64,
    /// Conflicts (409) retried.
    pub conflicts: u64,
    /// What could not be published because others' data disagrees.
    pub warnings: Vec<String>,
    /// Resources published.
    pub resources: u32,
    /// CSI drivers published.
    pub csi_drivers: u32,
}

impl From<&pb::Publishing> for PublishingView {
    fn from(p: &pb::Publishing) -> PublishingView {
        PublishingView {
            node: p.node.clone(),
            server: p.server.clone(),
            state: p.state.clone(),
            last_sync: non_empty(&p.last_sync),
            last_error: non_empty(&p.last_error),
            pending_changes: p.pending_changes,
            rounds: p.rounds,
            failures: p.failures,
            writes: p.writes,
            conflicts: p.conflicts,
            warnings: p.warnings.clone(),
            resources: p.resources,
            csi_drivers: p.csi_drivers,
        }
    }
}

impl From<&pb::GetStatusResponse> for StatusView {
    fn from(r: &pb::GetStatusResponse) -> StatusView {
        let mut plugins: BTreeMap<String, PluginCountView> = BTreeMap::new();
        for c in &r.plugins {
            let row = plugins
                .entry(c.r#type.clone())
                .or_insert_with(|| PluginCountView {
                    plugin_type: c.r#type.clone(),
                    ..PluginCountView::default()
                });
            match c.state.as_str() {
                "registered" => row.registered += c.count,
                "failing" => row.failing += c.count,
                _ => row.waiting += c.count,
            }
        }
        StatusView {
            version: r.version.clone(),
            started_at: r.started_at.clone(),
            uptime_ms: r.uptime_ms,
            live: r.live,
            ready: r.ready,
            waiting_for: r.waiting_for.clone(),
            stages: r
                .stages
                .iter()
                .map(|s| StageView {
                    name: s.name.clone(),
                    ended: non_empty(&s.ended),
                })
                .collect(),
            plugins: plugins.into_values().collect(),
            resources: r.devices.then(|| {
                r.resources
                    .iter()
                    .map(|x| ResourceSummaryView {
                        resource: x.resource.clone(),
                        capacity: x.capacity,
                        allocatable: x.allocatable,
                        allocated: x.allocated,
                        connected: x.connected,
                        last_error: non_empty(&x.last_error),
                    })
                    .collect()
            }),
            handlers: r
                .handlers
                .iter()
                .map(|h| HandlerSummaryView {
                    slot: h.slot.clone(),
                    module: h.module.clone(),
                    sha256: h.sha256.clone(),
                })
                .collect(),
            last_errors: r.last_errors.iter().map(EventView::from).collect(),
            publishing: r.publishing.as_ref().map(PublishingView::from),
            rollouts: r
                .rollouts
                .iter()
                .map(|x| RolloutPartView {
                    name: x.name.clone(),
                    state: x.state.clone(),
                    digest: non_empty(&x.digest),
                    reason: non_empty(&x.reason),
                })
                .collect(),
        }
    }
}

impl StatusView {
    /// The screen: version and uptime, readiness, then one table per part.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let uptime = std::time::Duration::from_secs(self.uptime_ms / 1000);
        let _ = writeln!(
            out,
            "pluglet {}, up {} (since {})",
            self.version,
            humantime::format_duration(uptime),
            self.started_at
        );
        let ended: Vec<String> = self
            .stages
            .iter()
            .filter_map(|s| Some(format!("{} ended: {}", s.name, s.ended.as_deref()?)))
            .collect();
        let readiness = match (self.live, self.ready) {
            (true, true) => "ready".to_owned(),
            (true, false) => format!("not ready: waiting for {}", self.waiting_for.join(", ")),
            (false, _) => format!("not live: {}", ended.join("; ")),
        };
        let _ = writeln!(out, "{readiness}");

        out.push_str("\nPLUGINS\n");
        if self.plugins.is_empty() {
            out.push_str("none\n");
        } else {
            out.push_str(&columns(
                &["TYPE", "REGISTERED", "FAILING", "WAITING"],
                self.plugins
                    .iter()
                    .map(|p| {
                        vec![
                            p.plugin_type.clone(),
                            p.registered.to_string(),
                            p.failing.to_string(),
                            p.waiting.to_string(),
                        ]
                    })
                    .collect(),
            ));
        }

        out.push_str("\nRESOURCES\n");
        match &self.resources {
            None => out.push_str("no device manager\n"),
            Some(r) if r.is_empty() => out.push_str("none\n"),
            Some(resources) => out.push_str(&columns(
                &[
                    "RESOURCE",
                    "CAPACITY",
                    "ALLOCATABLE",
                    "ALLOCATED",
                    "CONNECTED",
                ],
                resources
                    .iter()
                    .map(|r| {
                        vec![
                            r.resource.clone(),
                            r.capacity.to_string(),
                            r.allocatable.to_string(),
                            r.allocated.to_string(),
                            r.connected.to_string(),
                        ]
                    })
                    .collect(),
            )),
        }
        for r in self.resources.iter().flatten() {
            if let Some(why) = &r.last_error {
                let _ = writeln!(out, "{}: {why}", r.resource);
            }
        }

        out.push_str("\nHANDLERS\n");
        out.push_str(&columns(
            &["SLOT", "MODULE", "SHA256"],
            self.handlers
                .iter()
                .map(|h| {
                    vec![
                        h.slot.clone(),
                        h.module.clone(),
                        h.sha256.chars().take(12).collect(),
                    ]
                })
                .collect(),
        ));

        if !self.rollouts.is_empty() {
            out.push_str("\nROLLOUTS\n");
            for r in &self.rollouts {
                let _ = write!(out, "{}: {}", r.name, r.state);
                if let Some(d) = &r.digest {
                    let _ = write!(out, " ({d})");
                }
                if let Some(why) = &r.reason {
                    let _ = write!(out, ": {why}");
                }
                out.push('\n');
            }
        }
        if let Some(p) = &self.publishing {
            out.push_str("\nPUBLISHING\n");
            let _ = writeln!(
                out,
                "node {} to {}: {}, last sync {}; {} resources, {} CSI drivers; {} pending \
                 changes, {} writes, {} conflicts, {} of {} rounds failed",
                p.node,
                p.server,
                p.state,
                p.last_sync.as_deref().unwrap_or("never"),
                p.resources,
                p.csi_drivers,
                p.pending_changes,
                p.writes,
                p.conflicts,
                p.failures,
                p.rounds,
            );
            if let Some(e) = &p.last_error {
                let _ = writeln!(out, "error: {e}");
            }
            for w in &p.warnings {
                let _ = writeln!(out, "warning: {w}");
            }
        }

        out.push_str("\nLAST ERRORS\n");
        if self.last_errors.is_empty() {
            out.push_str("none\n");
        } else {
            out.push_str(&table(&self.last_errors));
        }
        out
    }
}

impl Kind for StatusView {
    const KIND: &'static str = "Status";
}
