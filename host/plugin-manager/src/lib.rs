//! Pluglet's plugin manager: registration sockets in the plugin registry directory → registered
//! plugins (the kubelet's `pkg/kubelet/pluginmanager`). It knows no plugin type: what a type
//! does at registration is that type's [`pluglet_registration::PluginKind`], set on the
//! pipeline by the daemon. The CSI type's steps live in `pluglet-csi` (`host/csi/src/kind.rs`),
//! the device plugin type's in `pluglet-device-manager` (`host/device-manager/src/kind.rs`).
//!
//! Start at [`PluginManager::start`]. Data flow, one module per stage:
//!
//! ```text
//!  registry dir ──inotify + start-up scan + resync──▶ watcher
//!                                                       │ writes (socket, generation)
//!                                                       ▼
//!                                                 desired_state ──changed()──┐
//!                                                                            ▼
//!  admin API ──PluginManagerHandle queries──────────────────────────────▶ reconciler
//!                                                     plan(desired, actual)  │ owns actual_state
//!                                                                            ▼ and the executor
//!                                 executor: one task per socket path, backoff per path
//!                                                                            │
//!                                  operation::register / operation::deregister
//!                                                                            │
//!       registration (dial, GetInfo, NotifyRegistrationStatus over pluglet-uds)
//!       + the registration pipeline (pluglet-registration: hooks, each type's steps)
//!                                                                            │ outcome
//!                                                                            ▼
//!                      reconciler applies it ──▶ actual_state (registered or refused)
//! ```
//!
//! Modules: [`watcher`], [`desired_state`], [`reconciler`], [`executor`], [`operation`],
//! [`registration`], [`actual_state`], [`plugin`] (the record kept per socket), [`metrics`].

pub mod actual_state;
pub mod desired_state;
pub mod executor;
pub mod metrics;
pub mod operation;
pub mod plugin;
pub mod reconciler;
pub mod registration;
pub mod timings;
pub mod watcher;

use std::path::PathBuf;
use std::sync::Arc;

use pluglet_registration::Pipeline;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use plugin::{PluginType, SocketPath, SocketPlugin};
pub use reconciler::{SocketState, SocketStatus};
pub use timings::PluginManagerTimings;
pub use watcher::WatchError;

/// The reconciler is gone (the daemon is stopping).
#[derive(Debug, thiserror::Error)]
#[error("the plugin manager has stopped")]
pub struct Stopped;

/// Cloneable handle for readers of the plugin manager's state (the admin API).
#[derive(Clone, Debug)]
pub struct PluginManagerHandle {
    queries: mpsc::Sender<reconciler::Query>,
}

impl PluginManagerHandle {
    /// Registered plugins.
    pub async fn plugins(&self) -> Result<Vec<SocketPlugin>, Stopped> {
        let (tx, rx) = oneshot::channel();
        self.queries
            .send(reconciler::Query::Plugins(tx))
            .await
            .map_err(|_| Stopped)?;
        rx.await.map_err(|_| Stopped)
    }

    /// Every socket the watcher knows, with its registration state.
    pub async fn sockets(&self) -> Result<Vec<SocketStatus>, Stopped> {
        let (tx, rx) = oneshot::channel();
        self.queries
            .send(reconciler::Query::Sockets(tx))
            .await
            .map_err(|_| Stopped)?;
        rx.await.map_err(|_| Stopped)
    }
}

/// What the plugin manager needs.
pub struct PluginManagerConfig {
    /// Registry directory to watch.
    pub registry_dir: PathBuf,
    /// Deadlines and backoff.
    pub timings: PluginManagerTimings,
}

/// A running plugin manager: its handle and its tasks (watcher, reconciler).
pub struct PluginManager {
    /// Handle for the admin API.
    pub handle: PluginManagerHandle,
    /// The watcher and reconciler (with its executor) tasks, by stage name; they end when the
    /// cancel token fires.
    pub tasks: Vec<(&'static str, JoinHandle<()>)>,
    /// `plugin_manager_total_plugins`, read from the caches at scrape time.
    pub counts: metrics::PluginCounts,
    /// `pluglet_registration_duration_seconds`.
    pub latency: metrics::RegistrationLatency,
}

impl PluginManager {
    /// Starts the watcher (watch in place and start-up scan done before this returns) and the
    /// reconciler.
    pub fn start(
        config: PluginManagerConfig,
        pipeline: Pipeline,
        cancel: CancellationToken,
    ) -> Result<PluginManager, WatchError> {
        let (mut writer, reader) = desired_state::channel();
        let changes = writer.subscribe_changes();
        let watcher =
            watcher::Watcher::start(&config.registry_dir, writer, config.timings.resync_period)?;
        let actual = actual_state::ActualState::new();
        let counts = metrics::PluginCounts {
            desired: reader.clone(),
            actual: actual.sockets(),
        };
        let latency = metrics::RegistrationLatency::default();
        let cx = operation::OperationContext {
            pipeline,
            timings: Arc::new(config.timings),
            latency: latency.clone(),
        };
        let (queries_tx, queries_rx) = mpsc::channel(16);
        let reconciler = reconciler::Reconciler::new(
            reader,
            changes,
            actual,
            cx,
            queries_rx,
            cancel.child_token(),
        );
        let tasks = vec![
            ("watcher", tokio::spawn(watcher.run(cancel.child_token()))),
            ("reconciler", tokio::spawn(reconciler.run())),
        ];
        Ok(PluginManager {
            handle: PluginManagerHandle {
                queries: queries_tx,
            },
            tasks,
            counts,
            latency,
        })
    }
}
