//! The registration pipeline's metrics: registrations and deregistrations through either door,
//! by plugin type and outcome, and how long the pipeline's steps took. The daemon registers
//! them into its Prometheus registry ([`Metrics::register`]).
//!
//! Label values are bounded: a plugin type other than the known ones (`CSIPlugin`,
//! `DevicePlugin`, `DRAPlugin`) is counted as `other`, whatever a plugin claims to be.

use std::time::Duration;

use pluglet_core::PluginType;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::pipeline::{Door, EndReason};

/// Labels of a registration.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RegistrationLabels {
    /// `CSIPlugin`, `DevicePlugin`, `DRAPlugin` or `other`.
    pub plugin_type: &'static str,
    /// `registry` (the plugin watcher) or `kubelet_sock`.
    pub door: &'static str,
    /// `registered`, `refused` (a handler said no) or `failed` (anything else).
    pub outcome: &'static str,
}

/// Labels of a deregistration.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeregistrationLabels {
    /// As in [`RegistrationLabels`].
    pub plugin_type: &'static str,
    /// Why it ended: `socket_gone`, `grace_period_over`, `replaced`, `activation_failed`.
    pub reason: &'static str,
}

/// `plugin_type` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TypeLabel {
    /// As in [`RegistrationLabels`].
    pub plugin_type: &'static str,
}

/// The pipeline's metrics; cheap to clone.
#[derive(Clone, Debug)]
pub struct Metrics {
    registrations: Family<RegistrationLabels, Counter>,
    deregistrations: Family<DeregistrationLabels, Counter>,
    steps: Family<TypeLabel, Histogram, fn() -> Histogram>,
}

/// 100 µs to ~6.6 s.
fn step_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 17))
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            registrations: Family::default(),
            deregistrations: Family::default(),
            steps: Family::new_with_constructor(step_histogram),
        }
    }
}

/// The bounded label of a plugin type.
pub fn type_label(plugin_type: &PluginType) -> &'static str {
    match plugin_type {
        PluginType::Csi => pluglet_core::names::CSI_PLUGIN,
        PluginType::DevicePlugin => pluglet_core::names::DEVICE_PLUGIN,
        PluginType::Dra => pluglet_core::names::DRA_PLUGIN,
        PluginType::Other(_) => "other",
    }
}

impl Metrics {
    /// Registers every metric into `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "pluglet_registrations",
            "Registrations through the pipeline, by plugin type, door and outcome",
            self.registrations.clone(),
        );
        registry.register(
            "pluglet_deregistrations",
            "Registrations that ended, by plugin type and reason",
            self.deregistrations.clone(),
        );
        registry.register(
            "pluglet_registration_pipeline_duration_seconds",
            "Time from a plugin's arrival at the pipeline to its activation (hooks, facts, \
             activation), registered plugins only",
            self.steps.clone(),
        );
    }

    pub(crate) fn registration(
        &self,
        plugin_type: &PluginType,
        door: &Door,
        outcome: &'static str,
    ) {
        self.registrations
            .get_or_create(&RegistrationLabels {
                plugin_type: type_label(plugin_type),
                door: match door {
                    Door::Registry { .. } => "registry",
                    Door::KubeletSock => "kubelet_sock",
                },
                outcome,
            })
            .inc();
    }

    pub(crate) fn steps(&self, plugin_type: &PluginType, elapsed: Duration) {
        self.steps
            .get_or_create(&TypeLabel {
                plugin_type: type_label(plugin_type),
            })
            .observe(elapsed.as_secs_f64());
    }

    pub(crate) fn deregistration(&self, plugin_type: &PluginType, reason: EndReason) {
        self.deregistrations
            .get_or_create(&DeregistrationLabels {
                plugin_type: type_label(plugin_type),
                reason: match reason {
                    EndReason::SocketGone => "socket_gone",
                    EndReason::GracePeriodOver => "grace_period_over",
                    EndReason::Replaced => "replaced",
                    EndReason::ActivationFailed => "activation_failed",
                },
            })
            .inc();
    }
}
