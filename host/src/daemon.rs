//! `pluglet run`: builds the stages, owns the root cancellation token, and stops everything on
//! SIGINT/SIGTERM (exit status 0, admin socket removed).
//!
//! Start order: directories → state lock (a second daemon on the same state directory is refused
//! with the holder's pid) → the metrics/health endpoint when `--metrics-addr` is set (it answers
//! "not ready" from here on) → handler modules, compiled or taken from the compile cache in the
//! state directory (then their directory is watched: changes apply as transactions) → device
//! manager (checkpoint restored, `kubelet.sock` served) → the pod-resources API (unless
//! `--no-pod-resources`) → plugin manager (watch in place and
//! start-up scan done): ready → admin socket. Once the admin socket answers, the daemon is fully
//! up.
//!
//! Every long-running stage runs under [`Supervisor`]: one that ends while the daemon runs
//! stops the daemon with an error naming it (see [`crate::ops`]).

use std::fs::File;
use std::io::{Read as _, Seek as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use pluglet_core::PluginType;
use pluglet_core::events::EventLog;
use pluglet_csi::CsiKind;
use pluglet_handler_runtime::{CompileCache, Compiler, LoadError, Runtime, RuntimeConfig};
use pluglet_handlers::{Builtins, Handlers, Trust, TrustedKey};
use pluglet_plugin_manager::{PluginManager, PluginManagerConfig};
use pluglet_registration::Pipeline;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::admin::server::{AdminService, bind_and_serve, set_socket_group};
use crate::config::{Config, Signatures};
use crate::ops::health::{Condition, Health};
use crate::ops::metrics::{self, HandlerChanges, LateRegistry};
use crate::ops::supervise::Supervisor;
use crate::ops::{http, notify};
use pluglet_device_manager::pod_resources::{self, PodResourcesMetrics, PodResourcesService};

/// Another daemon holds the state directory.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// The lock is held by another process.
    #[error(
        "state directory {dir} is in use by another pluglet daemon (pid {holder}); stop it or pass another --root/--state-dir"
    )]
    Held {
        /// The state directory.
        dir: PathBuf,
        /// Holder's pid as written in the lock file (`unknown` if unreadable).
        holder: String,
    },
    /// The lock file could not be opened or written.
    #[error("cannot lock {path}")]
    Io {
        /// The lock file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// An exclusive `flock` on `<state>/pluglet.lock`, holding the holder's pid; released on drop.
#[derive(Debug)]
pub struct StateLock {
    _lock: Flock<File>,
}

impl StateLock {
    /// Takes the lock without waiting.
    pub fn acquire(path: &Path) -> Result<StateLock, LockError> {
        let io = |source| LockError::Io {
            path: path.to_owned(),
            source,
        };
        let (file, writable) = match File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
        {
            Ok(file) => (file, true),
            // A read-only state directory: the lock still keeps a second daemon out (the
            // device manager then refuses changes it cannot record); the pid is not written.
            Err(e) if e.kind() == std::io::ErrorKind::ReadOnlyFilesystem => {
                (File::open(path).map_err(|_| io(e))?, false)
            }
            Err(e) => return Err(io(e)),
        };
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(mut lock) => {
                if writable {
                    lock.set_len(0).map_err(io)?;
                    lock.rewind().map_err(io)?;
                    writeln!(lock, "{}", std::process::id()).map_err(io)?;
                    lock.sync_data().map_err(io)?;
                } else {
                    tracing::warn!(path = %path.display(), "the state directory is read-only: locked without writing the pid");
                }
                Ok(StateLock { _lock: lock })
            }
            Err((mut file, Errno::EWOULDBLOCK)) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                Err(LockError::Held {
                    dir: path.parent().unwrap_or(path).to_owned(),
                    holder: if holder.is_empty() {
                        "unknown".to_owned()
                    } else {
                        holder.to_owned()
                    },
                })
            }
            Err((_, errno)) => Err(io(errno.into())),
        }
    }
}

/// Reads the trusted public keys of `signatures` (a key file that cannot be used fails the
/// start).
pub fn trust(signatures: &Signatures) -> anyhow::Result<Trust> {
    let keys = signatures
        .trusted_keys
        .iter()
        .map(|path| TrustedKey::read(path))
        .collect::<Result<Vec<_>, _>>()
        .context("cannot use a --trusted-key")?;
    for key in &keys {
        tracing::info!(
            key_id = key.id(),
            "trusting handler module signatures by key"
        );
    }
    Ok(Trust {
        keys,
        require: signatures.require,
    })
}

/// Loads the handler set from `dir` over the built-ins, with rollback decisions kept in
/// `state_dir`, compiled modules cached in `<state_dir>/handler-cache` and signatures checked
/// against `trust` (compiles modules: CPU-bound, off the reactor).
pub async fn load_handlers(
    dir: &Path,
    state_dir: Option<&Path>,
    trust: Trust,
    pool_size: u32,
    registry: pluglet_oci::RegistryOptions,
) -> anyhow::Result<Handlers> {
    let dir = dir.to_owned();
    let state_dir = state_dir.map(Path::to_path_buf);
    tokio::task::spawn_blocking(move || -> anyhow::Result<Handlers> {
        let started = Instant::now();
        let runtime =
            runtime(state_dir.as_deref(), pool_size).context("cannot start the WASM runtime")?;
        let builtins = Builtins::embedded(&runtime).context("built-in handler failed to load")?;
        let handlers = Handlers::load_with_registry(
            runtime.clone(),
            &dir,
            state_dir.as_deref(),
            builtins,
            trust,
            registry,
        )
        .with_context(|| format!("cannot load handlers from {}", dir.display()))?;
        let ms = format!("{:.1}", started.elapsed().as_secs_f64() * 1e3);
        match runtime.cache_stats() {
            Some(cache) => info!(
                ms = %ms,
                from_cache = cache.hits,
                compiled = cache.compiled,
                untrusted = cache.untrusted,
                "handler modules loaded"
            ),
            None => info!(ms = %ms, "handler modules loaded (no compile cache)"),
        }
        Ok(handlers)
    })
    .await
    .context("handler loading panicked")?
}

/// The WASM runtime, with the compile cache under `state_dir` when there is one; a cache that
/// cannot be used (another owner, a symlink, an I/O error) is logged and left out.
/// Modules the cache lacks are compiled in a child process (`compile_child`), so the daemon
/// never keeps the compiler's memory (BENCHMARKS.md, "Memory").
fn runtime(state_dir: Option<&Path>, pool_size: u32) -> Result<Runtime, LoadError> {
    let compiler = Compiler::ThisExecutable {
        args: crate::compile_child::ARGS.iter().map(Into::into).collect(),
    };
    let cache = state_dir.and_then(|state_dir| match CompileCache::open(state_dir) {
        Ok(cache) => Some(cache),
        Err(e) => {
            warn!(
                error = %e,
                "compile cache not used: handler modules are compiled at every start"
            );
            None
        }
    });
    let config = RuntimeConfig {
        pool_size,
        ..runtime_config()
    };
    Runtime::with_options(config, cache, compiler)
}

/// The WASM runtime's configuration: the daemon's, and its compiler child's (whose artifacts
/// must fit the daemon's engine).
pub fn runtime_config() -> RuntimeConfig {
    RuntimeConfig::default()
}

/// Runs the daemon until SIGINT or SIGTERM, or until one of its stages ends (an error naming
/// the stage: the binary exits non-zero).
pub async fn run(config: Config) -> anyhow::Result<()> {
    raise_open_files_limit();
    let paths = &config.paths;
    for dir in [
        &paths.registry_dir,
        &paths.device_plugins_dir,
        &paths.handlers_dir,
        &paths.state_dir,
    ] {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create directory {}", dir.display()))?;
    }
    let _lock = StateLock::acquire(&paths.lock_file())?;

    // Signals are caught from here on, so a SIGTERM during start-up still stops cleanly.
    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;

    let health = Health::new();
    let cancel = CancellationToken::new();
    let mut stages = Supervisor::new(health.clone(), cancel.clone());
    // Health answers from the start, so a probe sees the daemon starting, not refusing.
    let registry = LateRegistry::default();
    if let Some(addr) = config.metrics_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on --metrics-addr {addr}"))?;
        info!(addr = %listener.local_addr().unwrap_or(addr), "serving /metrics, /healthz and /readyz");
        let serving = http::serve(
            listener,
            registry.clone(),
            health.clone(),
            cancel.child_token(),
        );
        stages.spawn("metrics-server", async move {
            serving.await.map_err(|e| e.to_string())
        });
    }
    tokio::spawn(notify::run(health.clone(), cancel.child_token()));

    let events = EventLog::default();
    let trust = trust(&config.signatures)?;
    let handlers = load_handlers(
        &paths.handlers_dir,
        Some(&paths.state_dir),
        trust,
        config.handler_pool_size,
        config.registry.clone(),
    )
    .await?
    .with_events(events.clone());
    for slot in handlers.status().slots {
        info!(
            slot = %slot.slot,
            module = slot.current.module(),
            sha256 = slot.current.sha256(),
            contract = slot.current.handler().contract_version(),
            from_cache = slot.current.handler().from_cache(),
            load_ms = %format!("{:.1}", slot.current.handler().compile_time().as_secs_f64() * 1e3),
            "handler in force"
        );
    }
    health.met(Condition::HandlersLoaded);

    // The handlers directory is watched from here on: a change applies as one transaction.
    let handler_watch = handlers.watch(cancel.child_token())?;
    stages.spawn("handler-watcher", async move {
        handler_watch.await;
        Ok(())
    });
    let timings = config.timings.clone();

    // Device manager: kubelet.sock, endpoints, allocations, checkpoint. It also receives the
    // device plugins the plugin manager finds through the watcher.
    let mut device_config = pluglet_device_manager::Config::new(
        paths.device_plugins_dir.clone(),
        paths.state_dir.clone(),
        config.node_name.clone(),
    );
    device_config.grace_period = timings.device_grace_period;
    device_config.dial_timeout = timings.dial_timeout;
    device_config.allocate_batch = config.device_allocate_batch as usize;
    let device_metrics = device_config.metrics.clone();
    device_config.events = events.clone();
    device_config.cdi_spec_dir = config.cdi.then(|| paths.cdi_spec_dir.clone());
    // One registration pipeline for both doors: the device manager gives it the device plugin
    // type's steps and serves kubelet.sock through it; the plugin manager feeds it what the
    // watcher finds.
    // Publishing to a Kubernetes API server, when asked for: the CSI plugin type hands its
    // drivers to the publisher, the device manager its counts.
    let fleet = crate::fleet::connect(&config, &handlers).await?;
    let publisher = fleet.as_ref().map(|f| f.publisher.clone());
    let rollouts = fleet
        .as_ref()
        .map(|f| (f.rollouts.view.clone(), f.rollouts.stats.clone()));
    let pipeline =
        Pipeline::new(handlers.clone(), config.node_name.clone()).with_events(events.clone());
    pipeline.set_kind(
        PluginType::Csi,
        Arc::new(CsiKind {
            dial_timeout: timings.dial_timeout,
            node_get_info_timeout: timings.node_get_info_timeout,
            publisher: publisher.clone(),
        }),
    );
    let devices = pluglet_device_manager::DeviceManager::start(
        device_config,
        pipeline.clone(),
        cancel.child_token(),
    )
    .await
    .context("cannot start the device manager")?;
    health.met(Condition::CheckpointRestored);
    health.met(Condition::KubeletSocketServing);
    let device_stages = devices.clone();
    let stopping = cancel.clone();
    stages.spawn("device-manager", async move {
        tokio::select! {
            cause = device_stages.stopped() => Err(cause),
            _ = stopping.cancelled() => Ok(()),
        }
    });

    // The pod-resources API: what monitoring and topology agents read from a kubelet.
    let pod_resources_metrics = match &config.pod_resources {
        Some(served) => {
            let metrics = PodResourcesMetrics::default();
            let serving = serve_pod_resources(
                &paths.pod_resources_socket,
                served,
                PodResourcesService::new(devices.clone(), served.limits, metrics.clone()),
                cancel.child_token(),
            )?;
            stages.spawn("pod-resources-server", serving);
            Some(metrics)
        }
        None => None,
    };

    if let Some(fleet) = fleet {
        let fed = devices.clone();
        let stopping = cancel.child_token();
        stages.spawn("fleet-publisher", async move {
            fleet.run(fed, stopping).await;
            Ok(())
        });
    }

    #[cfg(feature = "test-hooks")]
    crate::ops::test_hooks::hold_scan().await?;
    let pipeline_metrics = pipeline.metrics().clone();
    let manager = PluginManager::start(
        PluginManagerConfig {
            registry_dir: paths.registry_dir.clone(),
            timings: (&timings).into(),
        },
        pipeline.clone(),
        cancel.clone(),
    )
    .context(
        "the plugin watcher cannot watch the plugin registry, and Pluglet does not start \
         without it (a daemon that silently never saw new plugins would be worse)",
    )?;
    health.met(Condition::RegistryScanned);
    let PluginManager {
        handle,
        tasks,
        counts,
        latency,
    } = manager;
    for (name, task) in tasks {
        stages.spawn(name, async move { task.await.map_err(|e| e.to_string()) });
    }

    let handler_changes = HandlerChanges::default();
    let _ = registry.set(metrics::registry(metrics::Sources {
        health: &health,
        devices: &devices,
        device_metrics: &device_metrics,
        handlers: &handlers,
        handler_changes: &handler_changes,
        pipeline: &pipeline_metrics,
        plugins: &counts,
        latency: &latency,
        publisher: publisher.as_ref(),
        rollouts: rollouts.as_ref(),
        pod_resources: pod_resources_metrics.as_ref(),
    }));
    let counting = handler_changes.run(handlers.clone(), cancel.child_token());
    stages.spawn("handler-metrics", async move {
        counting.await;
        Ok(())
    });

    let admin = bind_and_serve(
        &paths.admin_socket,
        config.admin_socket_mode,
        AdminService::new(handle, handlers.clone())
            .with_pipeline(pipeline.clone())
            .with_devices(devices.clone())
            .with_publisher(publisher.clone())
            .with_rollouts(rollouts.as_ref().map(|(view, _)| view.clone()))
            .with_health(health.clone())
            .with_events(events),
        cancel.child_token(),
    )?;
    set_socket_group(&paths.admin_socket, config.admin_socket_group.as_ref())?;
    stages.spawn("admin-server", async move {
        admin.await;
        Ok(())
    });
    // Bound and listening: a connection from now on is served.
    health.met(Condition::AdminSocketServing);
    info!(
        registry = %paths.registry_dir.display(),
        admin_socket = %paths.admin_socket.display(),
        node = %config.node_name,
        "pluglet running"
    );

    let mut failure = None;
    tokio::select! {
        _ = sigterm.recv() => info!("SIGTERM received, stopping"),
        _ = sigint.recv() => info!("SIGINT received, stopping"),
        ended = stages.first_failure() => {
            error!(stage = ended.stage, cause = %ended.cause, "a stage stopped unexpectedly; stopping the daemon");
            failure = Some(anyhow::Error::new(ended));
        }
    }

    notify::stopping();
    cancel.cancel();
    let stopping = async {
        tokio::join!(stages.wait(), devices.shutdown());
    };
    if tokio::time::timeout(timings.shutdown_grace, stopping)
        .await
        .is_err()
    {
        warn!(grace = ?timings.shutdown_grace, "stages did not stop within the grace period");
    }
    let _ = std::fs::remove_file(&paths.admin_socket);
    info!("pluglet stopped");
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Binds the pod-resources socket at `path` (mode 0600, or 0660 in `served`'s group) and returns
/// the server to run, which removes the socket when it stops. A socket that answers at `path`
/// (a kubelet's) stops the start, as `kubelet.sock` does; a stale one is replaced.
fn serve_pod_resources(
    path: &Path,
    served: &crate::config::PodResources,
    service: PodResourcesService,
    cancel: CancellationToken,
) -> anyhow::Result<impl Future<Output = Result<(), String>> + use<>> {
    if pluglet_uds::answers(path) {
        anyhow::bail!(
            "{} answers: a kubelet (or another Pluglet) serves the pod-resources API there; stop it, \
             give Pluglet another --pod-resources-socket, or pass --no-pod-resources (nothing was changed)",
            path.display()
        );
    }
    let listener = pluglet_uds::bind(path, Some(served.mode()))
        .with_context(|| format!("cannot serve the pod-resources API on {}", path.display()))?;
    set_socket_group(path, served.group.as_ref())?;
    info!(
        path = %path.display(),
        mode = format!("{:04o}", served.mode()),
        qps = served.limits.qps,
        burst = served.limits.burst,
        "pod-resources API listening"
    );
    let path = path.to_owned();
    Ok(async move {
        pod_resources::serve(service, listener, cancel).await;
        let _ = std::fs::remove_file(&path);
        Ok(())
    })
}

/// Raises the soft limit on open files to the hard limit, as the Go runtime does for the
/// kubelet: every plugin being registered and every connected device plugin holds a
/// connection, and a burst of a thousand sockets must not run into a soft limit of 1024.
fn raise_open_files_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => info!(from = soft, to = hard, "raised the open files limit"),
            Err(e) => warn!(soft, hard, error = %e, "cannot raise the open files limit"),
        },
        Ok(_) => {}
        Err(e) => warn!(error = %e, "cannot read the open files limit"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_names_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pluglet.lock");
        let first = StateLock::acquire(&path).unwrap();
        let err = StateLock::acquire(&path).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        drop(first);
        StateLock::acquire(&path).unwrap();
    }
}
