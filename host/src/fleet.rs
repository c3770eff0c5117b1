//! The fleet stage: with `--kubeconfig FILE` or `--in-cluster`, this node's device plugin
//! resources and CSI drivers are published to a Kubernetes API server by
//! [`pluglet_fleet::Publisher`] (`docs/fleet.md`).
//!
//! Here the client is made at start (a kubeconfig that cannot be used stops the start; an API
//! server that cannot be reached does not: the publisher retries while the node works), and
//! the device manager's counts are handed to the publisher after every change of devices or
//! plugin connections. CSI drivers are handed over by the CSI plugin type
//! (`pluglet-csi`) when their registrations start and end. The same client serves the
//! rollout stage ([`crate::rollout`]).

use std::collections::BTreeMap;

use anyhow::Context as _;
use pluglet_device_manager::DeviceManager;
use pluglet_fleet::{Connection, Counts, Publisher, PublisherConfig};
use pluglet_handlers::Handlers;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::config::Config;
use crate::rollout::Rollouts;

/// A publisher with its client, and the rollout stage, ready to run.
pub struct Fleet {
    /// The handle fed by the device manager and the CSI registrations.
    pub publisher: Publisher,
    /// The fleet rollouts of handlers this node takes part in.
    pub rollouts: Rollouts,
    connection: Connection,
}

/// The fleet stage for `config`, or `None` when publishing is off; rollouts apply through
/// `handlers`.
pub async fn connect(config: &Config, handlers: &Handlers) -> anyhow::Result<Option<Fleet>> {
    let Some(publish) = &config.publish else {
        return Ok(None);
    };
    let connection = pluglet_fleet::client::connect(&publish.source)
        .await
        .context("cannot publish to the Kubernetes API server")?;
    let mut settings = PublisherConfig::new(config.node_name.clone());
    settings.register_node = publish.register_node;
    settings.node_labels = publish.node_labels.clone();
    settings.linger = config.removed_resource_linger;
    info!(
        server = connection.server(),
        node = %config.node_name,
        register_node = publish.register_node,
        "publishing this node's resources and CSI drivers to the Kubernetes API server"
    );
    Ok(Some(Fleet {
        publisher: Publisher::new(settings),
        rollouts: Rollouts::new(
            config.node_name.clone(),
            handlers.clone(),
            publish.coordinator_lease_duration,
        ),
        connection,
    }))
}

impl Fleet {
    /// Runs the publisher, fed by `devices`, and the rollout stage until `cancel` fires.
    pub async fn run(self, devices: DeviceManager, cancel: CancellationToken) {
        let feeding = feed(self.publisher.clone(), devices, cancel.clone());
        let rolling = self.rollouts.run(self.connection.clone(), cancel.clone());
        let publishing = self.publisher.run(self.connection, cancel);
        tokio::join!(feeding, publishing, rolling);
    }
}

/// Hands the device manager's counts to `publisher` now and after every change.
async fn feed(publisher: Publisher, devices: DeviceManager, cancel: CancellationToken) {
    let mut changes = devices.changes();
    loop {
        changes.borrow_and_update();
        let counts: BTreeMap<String, Counts> = devices
            .all_counts()
            .into_iter()
            .map(|(name, capacity, allocatable)| {
                (
                    name.as_str().to_owned(),
                    Counts {
                        capacity: capacity as u64,
                        allocatable: allocatable as u64,
                    },
                )
            })
            .collect();
        publisher.set_resources(counts);
        tokio::select! {
            _ = cancel.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
    }
}
