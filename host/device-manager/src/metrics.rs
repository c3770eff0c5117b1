//! The device manager's metrics, registered by the daemon into its Prometheus registry.
//!
//! Two carry the kubelet's names and meaning, so existing dashboards keep working:
//! `kubelet_device_plugin_registration_total{resource_name}` (each `kubelet.sock` Register,
//! counted before validation) and `kubelet_device_plugin_alloc_duration_seconds{resource_name}`
//! (the plugin's `Allocate` call, Prometheus default buckets). The rest are Pluglet's own, under
//! `pluglet_`. Label values are bounded: a resource name that is not a valid extended resource
//! name is counted under `resource_name="invalid"`, so a misbehaving client cannot create series
//! at will. Capacity and allocatable per resource are read at scrape time by the daemon.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Prometheus' default histogram buckets (seconds), as the kubelet's allocation metric uses.
pub const DEFAULT_BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// `resource_name` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabel {
    /// The extended resource name, or `invalid`.
    pub resource_name: String,
}

/// `resource_name` and `outcome` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceOutcome {
    /// The extended resource name.
    pub resource_name: String,
    /// `allocated`, `reused` or `failed`.
    pub outcome: &'static str,
}

/// `operation` and `stage` labels: one step of an allocation or a release.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabel {
    /// `allocate` or `release`.
    pub operation: &'static str,
    /// The step (see [`Stage`]).
    pub stage: &'static str,
}

/// The steps an allocation or a release is timed in, in their order; each value is a
/// `stage` label value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Waiting for the resource's decision lock (other allocations of it before this one).
    Queue,
    /// The candidates: the registry's healthy devices minus those held.
    Candidates,
    /// The plugin's GetPreferredAllocation (only for plugins that offer it).
    Preferred,
    /// The allocation policy's WASM call and the check of its answer.
    Policy,
    /// Holding the chosen devices in the records.
    Reserve,
    /// The plugin's Allocate, and PreStartContainer when it asks for it.
    Plugin,
    /// Checking and rendering the CDI spec.
    Cdi,
    /// The journal record with `fdatasync` (for an allocation, with the CDI spec written
    /// beside it).
    Commit,
    /// Removing the CDI specs of released allocations.
    CdiRemove,
}

/// How many stages there are.
const STAGES: usize = Stage::CdiRemove as usize + 1;

/// What a [`StageClock`] times; each value is an `operation` label value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Operation {
    /// An allocation.
    Allocate,
    /// A release (or the releases of a sync of pods).
    Release,
}

impl Operation {
    fn label(self) -> &'static str {
        match self {
            Operation::Allocate => "allocate",
            Operation::Release => "release",
        }
    }
}

impl Stage {
    /// The `stage` label value.
    pub fn label(self) -> &'static str {
        match self {
            Stage::Queue => "queue",
            Stage::Candidates => "candidates",
            Stage::Preferred => "preferred",
            Stage::Policy => "policy",
            Stage::Reserve => "reserve",
            Stage::Plugin => "plugin",
            Stage::Cdi => "cdi",
            Stage::Commit => "commit",
            Stage::CdiRemove => "cdi_remove",
        }
    }
}

/// `outcome` label of a write.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteOutcome {
    /// `ok` or `error`.
    pub outcome: &'static str,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// The device manager's metrics; cheap to clone (every clone counts into the same series).
#[derive(Clone, Debug)]
pub struct Metrics {
    registrations: Family<ResourceLabel, Counter>,
    alloc_duration: Histograms<ResourceLabel>,
    allocate_calls: Family<ResourceLabel, Counter>,
    allocations: Family<ResourceOutcome, Counter>,
    released: Family<ResourceLabel, Counter>,
    journal_writes: Family<WriteOutcome, Counter>,
    journal_duration: Histogram,
    journal_syncs: Counter,
    checkpoint_writes: Family<WriteOutcome, Counter>,
    checkpoint_duration: Histogram,
    stage_duration: Histograms<StageLabel>,
    /// Each series of `stage_duration` once used, by operation and stage: an allocation times
    /// seven steps, and finding a series in the family takes a lock and a hash of its labels.
    stage_series: Arc<[OnceLock<Histogram>; 2 * STAGES]>,
}

fn default_histogram() -> Histogram {
    Histogram::new(DEFAULT_BUCKETS)
}

/// 10 µs to ~1.3 s: a step of an allocation takes from a few µs (reserving one device) to
/// milliseconds (a plugin's Allocate of many devices).
fn stage_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.00001, 2.0, 18))
}

/// 100 µs to ~3.3 s: a journal record or checkpoint write is a fraction of a millisecond to a
/// few milliseconds on a healthy disk.
fn disk_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 16))
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            registrations: Family::default(),
            alloc_duration: Family::new_with_constructor(default_histogram),
            allocate_calls: Family::default(),
            allocations: Family::default(),
            released: Family::default(),
            journal_writes: Family::default(),
            journal_duration: disk_histogram(),
            journal_syncs: Counter::default(),
            checkpoint_writes: Family::default(),
            checkpoint_duration: disk_histogram(),
            stage_duration: Family::new_with_constructor(stage_histogram),
            stage_series: Arc::new(std::array::from_fn(|_| OnceLock::new())),
        }
    }
}

impl Metrics {
    /// Registers every metric into `registry` (names without a prefix: each name is whole).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kubelet_device_plugin_registration",
            "Device plugin registrations on kubelet.sock, by resource, counted before validation",
            self.registrations.clone(),
        );
        registry.register(
            "kubelet_device_plugin_alloc_duration_seconds",
            "Duration of the device plugin's Allocate call for one allocation (with its wait for the plugin's previous call), by resource",
            self.alloc_duration.clone(),
        );
        registry.register(
            "pluglet_device_plugin_allocate_calls",
            "Allocate calls made to device plugins, by resource (one call asks for every allocation that waited for the previous one)",
            self.allocate_calls.clone(),
        );
        registry.register(
            "pluglet_device_allocations",
            "Allocation requests by resource and outcome (allocated, reused, failed)",
            self.allocations.clone(),
        );
        registry.register(
            "pluglet_device_releases",
            "Allocations released (one per container and resource), by resource",
            self.released.clone(),
        );
        registry.register(
            "pluglet_journal_writes",
            "Allocation journal records written, by outcome",
            self.journal_writes.clone(),
        );
        registry.register(
            "pluglet_journal_syncs",
            "fdatasync calls that made allocation journal records durable (one per group of records written together)",
            self.journal_syncs.clone(),
        );
        registry.register(
            "pluglet_journal_write_duration_seconds",
            "Time to write a group of allocation journal records and fdatasync them (one per group)",
            self.journal_duration.clone(),
        );
        registry.register(
            "pluglet_checkpoint_writes",
            "kubelet_internal_checkpoint writes (with the side file), by outcome",
            self.checkpoint_writes.clone(),
        );
        registry.register(
            "pluglet_checkpoint_write_duration_seconds",
            "Time to write the checkpoint and the side file (temporary file, fsync, rename)",
            self.checkpoint_duration.clone(),
        );
        registry.register(
            "pluglet_device_stage_duration_seconds",
            "Time spent in each step of an allocation or a release, by operation and stage",
            self.stage_duration.clone(),
        );
    }

    pub(crate) fn registration(&self, resource_name: &str) {
        let resource_name = if looks_like_a_resource_name(resource_name) {
            resource_name.to_owned()
        } else {
            "invalid".to_owned()
        };
        self.registrations
            .get_or_create(&ResourceLabel { resource_name })
            .inc();
    }

    /// One `fdatasync` made journal records durable.
    pub(crate) fn journal_sync(&self) {
        self.journal_syncs.inc();
    }

    /// A group of `records` journal records written (and synced, when `ok`) in `elapsed`.
    pub(crate) fn journal_group(&self, ok: bool, records: u64, elapsed: Duration) {
        self.journal_writes
            .get_or_create(&outcome(ok))
            .inc_by(records);
        self.journal_duration.observe(elapsed.as_secs_f64());
    }

    pub(crate) fn stage(&self, operation: Operation, stage: Stage, elapsed: Duration) {
        self.stage_series[operation as usize * STAGES + stage as usize]
            .get_or_init(|| {
                self.stage_duration
                    .get_or_create(&StageLabel {
                        operation: operation.label(),
                        stage: stage.label(),
                    })
                    .clone()
            })
            .observe(elapsed.as_secs_f64());
    }

    pub(crate) fn checkpoint_write(&self, ok: bool, elapsed: Duration) {
        self.checkpoint_writes.get_or_create(&outcome(ok)).inc();
        self.checkpoint_duration.observe(elapsed.as_secs_f64());
    }
}

/// Times the steps of one allocation or release, each from the end of the one before.
pub(crate) struct StageClock<'a> {
    metrics: &'a Metrics,
    operation: Operation,
    last: Instant,
}

impl<'a> StageClock<'a> {
    /// Starts timing an `operation` now.
    pub(crate) fn start(metrics: &'a Metrics, operation: Operation) -> StageClock<'a> {
        StageClock {
            metrics,
            operation,
            last: Instant::now(),
        }
    }

    /// Records the time since the previous step (or the start) as `stage`.
    pub(crate) fn done(&mut self, stage: Stage) {
        let now = Instant::now();
        self.metrics.stage(
            self.operation,
            stage,
            now.saturating_duration_since(self.last),
        );
        self.last = now;
    }
}

/// How an allocation request ended, as `pluglet_device_allocations` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// New devices allocated.
    Allocated,
    /// The container's allocation already held, answered again.
    Reused,
    /// Refused or failed.
    Failed,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Allocated => "allocated",
            Outcome::Reused => "reused",
            Outcome::Failed => "failed",
        }
    }
}

/// One resource's allocation and release series, each looked up in its family at its first
/// use and kept (with the allocator's other state of the resource): a family lookup copies the
/// name and hashes it, on every allocation and release otherwise. A series is exposed from its
/// first use on.
#[derive(Debug, Default)]
pub(crate) struct ResourceSeries {
    alloc_duration: OnceLock<Histogram>,
    allocate_calls: OnceLock<Counter>,
    /// By [`Outcome`].
    allocations: [OnceLock<Counter>; 3],
    released: OnceLock<Counter>,
}

impl ResourceSeries {
    /// An allocation's `Allocate` call to `resource_name`'s plugin took `elapsed` (its wait
    /// for the plugin's previous call included).
    pub(crate) fn alloc_duration(&self, metrics: &Metrics, resource_name: &str, elapsed: Duration) {
        of_resource(&self.alloc_duration, &metrics.alloc_duration, resource_name)
            .observe(elapsed.as_secs_f64());
    }

    /// `calls` Allocate calls were made to `resource_name`'s plugin.
    pub(crate) fn allocate_calls(&self, metrics: &Metrics, resource_name: &str, calls: u32) {
        if calls > 0 {
            of_resource(&self.allocate_calls, &metrics.allocate_calls, resource_name)
                .inc_by(u64::from(calls));
        }
    }

    /// An allocation of `resource_name` was released.
    pub(crate) fn released(&self, metrics: &Metrics, resource_name: &str) {
        of_resource(&self.released, &metrics.released, resource_name).inc();
    }

    /// An allocation request for `resource_name` ended with `outcome`.
    pub(crate) fn allocation(&self, metrics: &Metrics, resource_name: &str, outcome: Outcome) {
        self.allocations[outcome as usize]
            .get_or_init(|| {
                metrics
                    .allocations
                    .get_or_create(&ResourceOutcome {
                        resource_name: resource_name.to_owned(),
                        outcome: outcome.label(),
                    })
                    .clone()
            })
            .inc();
    }
}

/// `resource_name`'s series of `family`, looked up at its first use and kept in `kept`.
fn of_resource<'a, M: Clone, C: MetricConstructor<M>>(
    kept: &'a OnceLock<M>,
    family: &Family<ResourceLabel, M, C>,
    resource_name: &str,
) -> &'a M {
    kept.get_or_init(|| {
        family
            .get_or_create(&ResourceLabel {
                resource_name: resource_name.to_owned(),
            })
            .clone()
    })
}

/// The shape of an extended resource name (`domain/name`, at most 253 + 1 + 63 characters of
/// `[A-Za-z0-9._-]`): the handlers decide validity; this only bounds the label's values.
fn looks_like_a_resource_name(name: &str) -> bool {
    let Some((domain, rest)) = name.split_once('/') else {
        return false;
    };
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_');
    (1..=253).contains(&domain.len())
        && (1..=63).contains(&rest.len())
        && domain.chars().all(allowed)
        && rest.chars().all(allowed)
}

fn outcome(ok: bool) -> WriteOutcome {
    WriteOutcome {
        outcome: if ok { "ok" } else { "error" },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_resource_names_share_one_label() {
        assert!(looks_like_a_resource_name("vendor.com/gpu"));
        for name in ["gpu", "", "a/b/c", "vendor.com/g pu", &"x".repeat(400)] {
            assert!(!looks_like_a_resource_name(name), "{name:?}");
        }
    }
}
