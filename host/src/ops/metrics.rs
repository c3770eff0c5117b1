//! The daemon's Prometheus registry: every stage's metrics, and the values read at scrape time
//! (resources, handlers, the daemon process itself).
//!
//! Served by [`super::http`] in the Prometheus text format (0.0.4) by default and in
//! OpenMetrics when the scraper asks for it. The names and what each counts are listed in
//! `docs/operating.md` ("Health, readiness and metrics"). No label takes an unbounded value: no pod UID, no device id; resource
//! names, plugin types, handler slots and module digests are bounded by what the node runs.
//!
//! The process metrics (`process_*`, as every Prometheus client library exports them) are read
//! from `/proc/self` here: `prometheus-client` has no process collector.

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use pluglet_device_manager::DeviceManager;
use pluglet_handlers::{FailureKind, Handlers, HandlersEvent, SlotKey};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use super::health::Health;

/// Buckets of a handler call's time, seconds: 10 µs to 1 s.
const HANDLER_BUCKETS: [f64; 11] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.01, 0.1, 1.0,
];

/// The registry the HTTP endpoint encodes: set once the stages it reads exist (the endpoint
/// serves `/healthz` and `/readyz` from the start of the daemon, `/metrics` from then on).
pub type LateRegistry = Arc<std::sync::OnceLock<Registry>>;

/// A handler slot as a label value: its one name ([`SlotKey::id`]), `plugin_type/<type>`,
/// `resource/<name>` or `default_policy`.
pub fn slot_label(slot: &SlotKey) -> String {
    slot.id()
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabel {
    resource_name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HandlerLabels {
    slot: String,
    sha256: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HandlerFailureLabels {
    slot: String,
    sha256: String,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HandlerInfoLabels {
    slot: String,
    sha256: String,
    module: String,
    role: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SwapLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SlotLabel {
    slot: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabel {
    version: &'static str,
}

/// Device plugin resources at scrape time.
#[derive(Debug)]
struct Resources(DeviceManager);

impl Collector for Resources {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let allocations = self.0.allocations();
        // Per resource: capacity, allocatable, allocated, plugin connected.
        let rows: Vec<(ResourceLabel, [i64; 4])> = self
            .0
            .resources()
            .into_iter()
            .map(|r| {
                let allocated: usize = allocations
                    .iter()
                    .filter(|a| a.resource == r.resource)
                    .map(|a| a.device_ids.len())
                    .sum();
                let values = [
                    r.capacity as i64,
                    r.allocatable as i64,
                    allocated as i64,
                    i64::from(r.connected),
                ];
                let label = ResourceLabel {
                    resource_name: r.resource.to_string(),
                };
                (label, values)
            })
            .collect();
        let families = [
            (
                "pluglet_resource_capacity_devices",
                "Devices a resource's plugin advertises (healthy or not), as the node's capacity.",
            ),
            (
                "pluglet_resource_allocatable_devices",
                "Healthy devices of a resource, as the node's allocatable.",
            ),
            (
                "pluglet_resource_allocated_devices",
                "Devices of a resource held by containers.",
            ),
            (
                "pluglet_resource_plugin_connected",
                "1 while a resource's device plugin stream is live, 0 during its grace period.",
            ),
        ];
        for (i, (name, help)) in families.into_iter().enumerate() {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (label, values) in &rows {
                ConstGauge::new(values[i]).encode(family.encode_family(label)?)?;
            }
        }
        Ok(())
    }
}

/// Publishing to a Kubernetes API server, at scrape time.
#[derive(Debug)]
struct Publishing(pluglet_fleet::Publisher);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

impl Collector for Publishing {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use pluglet_fleet::State;
        let s = self.0.status();
        let mut family = encoder.encode_descriptor(
            "pluglet_publish_state",
            "1 for the state publishing to the Kubernetes API server is in (starting, synced, \
             pending, failing, waiting-for-node), 0 for the others.",
            None,
            MetricType::Gauge,
        )?;
        for state in [
            State::Starting,
            State::Synced,
            State::Pending,
            State::Failing,
            State::WaitingForNode,
        ] {
            ConstGauge::new(i64::from(s.state == state)).encode(family.encode_family(
                &StateLabel {
                    state: state.as_str(),
                },
            )?)?;
        }
        let last_sync = s
            .last_sync
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0.0, |d| d.as_secs_f64());
        ConstGauge::new(last_sync).encode(encoder.encode_descriptor(
            "pluglet_publish_last_sync_timestamp_seconds",
            "When the Node and CSINode objects last matched this node's inventory (0: never).",
            None,
            MetricType::Gauge,
        )?)?;
        ConstGauge::new(s.pending_changes as i64).encode(encoder.encode_descriptor(
            "pluglet_publish_pending_changes",
            "Inventory changes not yet published to the API server.",
            None,
            MetricType::Gauge,
        )?)?;
        for (name, help, value) in [
            (
                "pluglet_publish_rounds",
                "Publishing rounds finished (successful or not).",
                s.rounds,
            ),
            (
                "pluglet_publish_failures",
                "Publishing rounds that failed (retried with backoff).",
                s.failures,
            ),
            (
                "pluglet_publish_writes",
                "Writes sent to the API server (create, patch, replace).",
                s.writes,
            ),
            (
                "pluglet_publish_conflicts",
                "Conflicts (409) met and retried from a fresh read.",
                s.conflicts,
            ),
        ] {
            ConstCounter::new(value).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Counter,
            )?)?;
        }
        Ok(())
    }
}

/// The fleet rollouts of handlers this node takes part in, at scrape time.
#[derive(Debug)]
struct Rollouts {
    view: Arc<std::sync::Mutex<pluglet_fleet::rollout::AgentView>>,
    stats: Arc<pluglet_fleet::rollout::CoordinatorStats>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RolloutStateLabels {
    rollout: String,
    state: &'static str,
}

impl Collector for Rollouts {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use std::sync::atomic::Ordering;
        let rollouts = self
            .view
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .rollouts
            .clone();
        let mut family = encoder.encode_descriptor(
            "pluglet_rollout_node_state",
            "1 for the state this node is in for each handler rollout it takes part in \
             (Applied, OnProbation, Healthy, RolledBack, Refused, Reverted), 0 for the others.",
            None,
            MetricType::Gauge,
        )?;
        for r in &rollouts {
            for state in pluglet_fleet::rollout::NodeState::ALL {
                ConstGauge::new(i64::from(r.state == state)).encode(family.encode_family(
                    &RolloutStateLabels {
                        rollout: r.name.clone(),
                        state: state.as_str(),
                    },
                )?)?;
            }
        }
        ConstGauge::new(i64::from(self.stats.holder.load(Ordering::Relaxed))).encode(
            encoder.encode_descriptor(
                "pluglet_rollout_coordinator",
                "1 while this daemon holds the Lease of the handler rollout coordinator.",
                None,
                MetricType::Gauge,
            )?,
        )?;
        ConstCounter::new(self.stats.waves_opened.load(Ordering::Relaxed)).encode(
            encoder.encode_descriptor(
                "pluglet_rollout_waves_opened",
                "Waves of handler rollouts this daemon opened as the coordinator.",
                None,
                MetricType::Counter,
            )?,
        )?;
        Ok(())
    }
}

/// Handler calls per slot and module at scrape time (the counters the handler set keeps per
/// served version).
#[derive(Debug)]
struct HandlerCalls(Handlers);

impl Collector for HandlerCalls {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let status = self.0.status();
        let served: Vec<(String, &'static str, Arc<pluglet_handlers::Served>)> = status
            .slots
            .iter()
            .flat_map(|s| {
                let slot = slot_label(&s.slot);
                std::iter::once((slot.clone(), "current", s.current.clone()))
                    .chain(s.previous.clone().map(|p| (slot, "previous", p)))
            })
            .collect();
        let labels = |slot: &str, served: &pluglet_handlers::Served| HandlerLabels {
            slot: slot.to_owned(),
            sha256: served.sha256().to_owned(),
        };

        let mut family = encoder.encode_descriptor(
            "pluglet_handler_info",
            "The handler modules in force (role current) and kept warm for rollback (previous).",
            None,
            MetricType::Gauge,
        )?;
        for (slot, role, s) in &served {
            let info = HandlerInfoLabels {
                slot: slot.clone(),
                sha256: s.sha256().to_owned(),
                module: s.module().to_owned(),
                role,
            };
            ConstGauge::new(1i64).encode(family.encode_family(&info)?)?;
        }
        for (name, help, pick) in [
            (
                "pluglet_handler_calls",
                "Hook calls per handler slot and module.",
                (|s: &pluglet_handlers::StatsSnapshot| s.calls) as fn(&_) -> u64,
            ),
            (
                "pluglet_handler_refusals",
                "Hook calls the module answered with a refusal.",
                |s: &pluglet_handlers::StatsSnapshot| s.refusals,
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (slot, _, s) in &served {
                let snapshot = s.stats().snapshot();
                ConstCounter::new(pick(&snapshot))
                    .encode(family.encode_family(&labels(slot, s))?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "pluglet_handler_failures",
            "Hook calls that failed, by kind (trap, deadline, memory, fuel, other).",
            None,
            MetricType::Counter,
        )?;
        for (slot, _, s) in &served {
            let f = s.stats().snapshot().failures;
            for (kind, n) in [
                (FailureKind::Trap, f.trap),
                (FailureKind::Deadline, f.deadline),
                (FailureKind::Memory, f.memory),
                (FailureKind::Fuel, f.fuel),
                (FailureKind::Other, f.other),
            ] {
                let l = HandlerFailureLabels {
                    slot: slot.clone(),
                    sha256: s.sha256().to_owned(),
                    kind: kind.as_str(),
                };
                ConstCounter::new(n).encode(family.encode_family(&l)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "pluglet_handler_call_duration_seconds",
            "Time of one hook call, instance creation included.",
            None,
            MetricType::Histogram,
        )?;
        for (slot, _, s) in &served {
            let (sum, count, cumulative) = s.stats().cumulative(&HANDLER_BUCKETS);
            // The encoder takes each bucket's own count (it sums them up) and a last, +Inf,
            // bucket.
            let mut below = 0;
            let mut buckets: Vec<(f64, u64)> = cumulative
                .into_iter()
                .map(|(bound, at_most)| {
                    let own = at_most.saturating_sub(below);
                    below = below.max(at_most);
                    (bound, own)
                })
                .collect();
            buckets.push((f64::INFINITY, count.saturating_sub(below)));
            family
                .encode_family(&labels(slot, s))?
                .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                    sum, count, &buckets, None,
                )?;
        }
        Ok(())
    }
}

/// Pulls of `oci://` handler modules at scrape time: by outcome, and how long each took.
#[derive(Debug)]
struct HandlerPulls(Handlers);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PullLabels {
    outcome: &'static str,
}

impl Collector for HandlerPulls {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats = self.0.pull_stats();
        let mut family = encoder.encode_descriptor(
            "pluglet_handler_pulls",
            "Pulls of handler modules from OCI registries, by outcome (pulled, unreachable, \
             timeout, unauthorized, not_found, wrong_artifact, too_large, digest_mismatch, \
             bad_referrer, error).",
            None,
            MetricType::Counter,
        )?;
        for outcome in pluglet_oci::Outcome::ALL {
            let n = stats.by_outcome.get(outcome.as_str()).copied().unwrap_or(0);
            ConstCounter::new(n).encode(family.encode_family(&PullLabels {
                outcome: outcome.as_str(),
            })?)?;
        }
        let mut buckets: Vec<(f64, u64)> = pluglet_handlers::PULL_BUCKETS
            .iter()
            .copied()
            .zip(stats.buckets)
            .collect();
        buckets.push((
            f64::INFINITY,
            stats.buckets[pluglet_handlers::PULL_BUCKETS.len()],
        ));
        encoder
            .encode_descriptor(
                "pluglet_handler_pull_duration_seconds",
                "Time of one pull of a handler module (resolve, manifest, layer, referrers).",
                None,
                MetricType::Histogram,
            )?
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                stats.sum_seconds,
                stats.count,
                &buckets,
                None,
            )?;
        Ok(())
    }
}

/// The daemon process (`/proc/self`), its version and readiness.
#[derive(Debug)]
struct Process(Health);

impl Collector for Process {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut family = encoder.encode_descriptor(
            "pluglet_build_info",
            "Always 1; the label carries the daemon's version.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(1i64).encode(family.encode_family(&VersionLabel {
            version: env!("CARGO_PKG_VERSION"),
        })?)?;
        let report = self.0.report();
        let gauges = [
            (
                "pluglet_ready",
                "1 once the daemon is ready (see /readyz), else 0.",
                f64::from(u8::from(report.ready)),
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch.",
                report
                    .started_at
                    .duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64()),
            ),
        ];
        for (name, help, value) in gauges {
            ConstGauge::new(value).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Gauge,
            )?)?;
        }
        if let Some(proc) = ProcSelf::read() {
            ConstGauge::new(proc.resident_bytes as f64).encode(encoder.encode_descriptor(
                "process_resident_memory_bytes",
                "Resident memory size.",
                None,
                MetricType::Gauge,
            )?)?;
            ConstGauge::new(proc.virtual_bytes as f64).encode(encoder.encode_descriptor(
                "process_virtual_memory_bytes",
                "Virtual memory size.",
                None,
                MetricType::Gauge,
            )?)?;
            ConstCounter::new(proc.cpu_seconds).encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "User and system CPU time spent.",
                None,
                MetricType::Counter,
            )?)?;
            ConstGauge::new(proc.open_fds as f64).encode(encoder.encode_descriptor(
                "process_open_fds",
                "Open file descriptors.",
                None,
                MetricType::Gauge,
            )?)?;
            ConstGauge::new(proc.threads as f64).encode(encoder.encode_descriptor(
                "process_threads",
                "OS threads.",
                None,
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

/// What `/proc/self/stat` and `/proc/self/fd` say.
struct ProcSelf {
    resident_bytes: u64,
    virtual_bytes: u64,
    cpu_seconds: f64,
    open_fds: usize,
    threads: u64,
}

impl ProcSelf {
    fn read() -> Option<ProcSelf> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the command name, which is in parentheses and may hold spaces.
        let fields: Vec<&str> = stat.get(stat.rfind(')')? + 2..)?.split(' ').collect();
        let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
        let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .filter(|t| *t > 0)? as f64;
        let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .filter(|p| *p > 0)? as u64;
        Some(ProcSelf {
            cpu_seconds: (field(14)? + field(15)?) as f64 / ticks,
            threads: field(20)?,
            virtual_bytes: field(23)?,
            resident_bytes: field(24)? * page,
            open_fds: std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count()),
        })
    }
}

/// Counts handler set changes and rollbacks from the handler set's events.
#[derive(Clone, Debug, Default)]
pub struct HandlerChanges {
    swaps: Family<SwapLabels, Counter>,
    rollbacks: Family<SlotLabel, Counter>,
    missed: Counter,
}

impl HandlerChanges {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "pluglet_handler_swaps",
            "Changes of the handler set: applied (a new set in force) or refused (the old kept)",
            self.swaps.clone(),
        );
        registry.register(
            "pluglet_handler_rollbacks",
            "Handler slots rolled back to their previous module, automatically or by hand",
            self.rollbacks.clone(),
        );
        registry.register(
            "pluglet_handler_events_missed",
            "Handler set events this counter fell behind on (the swap and rollback counts miss them)",
            self.missed.clone(),
        );
    }

    /// Counts the handler set's events until `cancel` fires.
    pub async fn run(self, handlers: Handlers, cancel: CancellationToken) {
        let mut events = handlers.subscribe();
        loop {
            let event = tokio::select! {
                _ = cancel.cancelled() => return,
                event = events.recv() => event,
            };
            match event {
                Ok(HandlersEvent::Applied { .. }) => {
                    self.swaps
                        .get_or_create(&SwapLabels { outcome: "applied" })
                        .inc();
                }
                Ok(HandlersEvent::Refused { .. }) => {
                    self.swaps
                        .get_or_create(&SwapLabels { outcome: "refused" })
                        .inc();
                }
                Ok(HandlersEvent::RolledBack { slot, .. }) => {
                    self.rollbacks
                        .get_or_create(&SlotLabel {
                            slot: slot_label(&slot),
                        })
                        .inc();
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    self.missed.inc_by(n);
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    }
}

/// The rollout stage's node view and coordinator counters.
pub type RolloutSources = (
    Arc<std::sync::Mutex<pluglet_fleet::rollout::AgentView>>,
    Arc<pluglet_fleet::rollout::CoordinatorStats>,
);

/// Everything the metrics registry reads from.
pub struct Sources<'a> {
    /// The daemon's health.
    pub health: &'a Health,
    /// The device manager.
    pub devices: &'a DeviceManager,
    /// Its counters.
    pub device_metrics: &'a pluglet_device_manager::Metrics,
    /// The handler set.
    pub handlers: &'a Handlers,
    /// Handler set changes.
    pub handler_changes: &'a HandlerChanges,
    /// The registration pipeline's counters.
    pub pipeline: &'a pluglet_registration::metrics::Metrics,
    /// The plugin manager's caches.
    pub plugins: &'a pluglet_plugin_manager::metrics::PluginCounts,
    /// Registration latency through the plugin watcher.
    pub latency: &'a pluglet_plugin_manager::metrics::RegistrationLatency,
    /// Publishing to a Kubernetes API server, when on.
    pub publisher: Option<&'a pluglet_fleet::Publisher>,
    /// The rollout stage's view and counters, when on.
    pub rollouts: Option<&'a RolloutSources>,
    /// The pod-resources API's requests and errors, when it is served.
    pub pod_resources: Option<&'a pluglet_device_manager::pod_resources::PodResourcesMetrics>,
}

/// Builds the registry over `sources`.
pub fn registry(sources: Sources<'_>) -> Registry {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(sources.plugins.clone()));
    sources.device_metrics.register(&mut registry);
    sources.pipeline.register(&mut registry);
    sources.latency.register(&mut registry);
    sources.handler_changes.register(&mut registry);
    registry.register_collector(Box::new(Resources(sources.devices.clone())));
    registry.register_collector(Box::new(HandlerCalls(sources.handlers.clone())));
    registry.register_collector(Box::new(HandlerPulls(sources.handlers.clone())));
    registry.register_collector(Box::new(Process(sources.health.clone())));
    if let Some(publisher) = sources.publisher {
        registry.register_collector(Box::new(Publishing(publisher.clone())));
    }
    if let Some((view, stats)) = sources.rollouts {
        registry.register_collector(Box::new(Rollouts {
            view: view.clone(),
            stats: stats.clone(),
        }));
    }
    if let Some(pod_resources) = sources.pod_resources {
        registry.register_collector(Box::new(pod_resources.clone()));
    }
    registry
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publishing_is_exported_with_its_state_and_counts() {
        let publisher =
            pluglet_fleet::Publisher::new(pluglet_fleet::PublisherConfig::new("n".into()));
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Publishing(publisher)));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "pluglet_publish_state{state=\"starting\"} 1\n",
            "pluglet_publish_state{state=\"synced\"} 0\n",
            "pluglet_publish_last_sync_timestamp_seconds 0.0\n",
            "pluglet_publish_pending_changes 0\n",
            "pluglet_publish_writes_total 0\n",
            "pluglet_publish_conflicts_total 0\n",
        ] {
            assert!(text.contains(line), "{line:?} not in\n{text}");
        }
    }

    #[test]
    fn process_figures_are_read() {
        let p = ProcSelf::read().expect("/proc/self");
        assert!(p.resident_bytes > 0 && p.virtual_bytes >= p.resident_bytes);
        assert!(p.threads >= 1 && p.open_fds >= 3);
    }
}
