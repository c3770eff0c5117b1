//! `plugin_manager_total_plugins{socket_path,state}`, as the kubelet's plugin manager exports
//! it: one series of value 1 per socket in the desired state (`desired_state_of_world`) and per
//! socket in the actual state (`actual_state_of_world`), read from both caches at scrape time.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use super::desired_state::DesiredStateReader;
use super::plugin::SocketPath;

/// Labels of `plugin_manager_total_plugins`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginLabels {
    socket_path: String,
    state: &'static str,
}

/// Reads the plugin manager's two caches at scrape time.
#[derive(Clone, Debug)]
pub struct PluginCounts {
    pub(super) desired: DesiredStateReader,
    pub(super) actual: Arc<Mutex<BTreeSet<SocketPath>>>,
}

impl Collector for PluginCounts {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let desired: Vec<String> = self
            .desired
            .snapshot()
            .keys()
            .map(|s| s.to_string())
            .collect();
        let actual: Vec<String> = self
            .actual
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut family = encoder.encode_descriptor(
            "plugin_manager_total_plugins",
            "Number of plugins in the plugin manager's caches, by socket and cache.",
            None,
            MetricType::Gauge,
        )?;
        for (sockets, state) in [
            (desired, "desired_state_of_world"),
            (actual, "actual_state_of_world"),
        ] {
            for socket_path in sockets {
                let labels = PluginLabels { socket_path, state };
                ConstGauge::new(1i64).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// `plugin_type` label (bounded: unknown types are `other`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TypeLabel {
    plugin_type: &'static str,
}

/// `pluglet_registration_duration_seconds{plugin_type}`: from the moment the watcher first saw
/// a registration socket to the plugin being told it is registered (retries included).
#[derive(Clone, Debug)]
pub struct RegistrationLatency(Family<TypeLabel, Histogram, fn() -> Histogram>);

/// 1 ms to ~131 s: a registration takes milliseconds; with retries, up to minutes.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 18))
}

impl Default for RegistrationLatency {
    fn default() -> RegistrationLatency {
        RegistrationLatency(Family::new_with_constructor(latency_histogram))
    }
}

impl RegistrationLatency {
    /// Records one registration of `plugin_type` (the wire string).
    pub fn observe(&self, plugin_type: &str, elapsed: std::time::Duration) {
        let plugin_type = pluglet_registration::metrics::type_label(
            &pluglet_core::PluginType::parse(plugin_type),
        );
        self.0
            .get_or_create(&TypeLabel { plugin_type })
            .observe(elapsed.as_secs_f64());
    }

    /// Registers the histogram into `registry`.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "pluglet_registration_duration_seconds",
            "Time from a registration socket first seen to the plugin told it is registered, \
             by plugin type",
            self.0.clone(),
        );
    }
}
