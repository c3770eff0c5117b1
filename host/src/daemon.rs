//! `pluglet run`: builds the stages, owns the root cancellation token, and stops everything on
//! SIGINT/SIGTERM (exit status 0, admin socket removed).
//!
//! Start order: directories → state lock (a second daemon on the same state directory is refused
//! with the holder's pid) → handler modules, compiled or taken from the compile cache in the state
//! directory (then their directory is watched: changes apply as transactions) → plugin manager
//! (watch in place and start-up scan done)
//! → admin socket. Once the admin socket answers, the daemon is fully up.

use std::fs::File;
use std::io::{Read as _, Seek as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use pluglet_core::PluginType;
use pluglet_handler_runtime::{CompileCache, Compiler, LoadError, Runtime, RuntimeConfig};
use pluglet_handlers::{Builtins, Handlers, Trust, TrustedKey};
use pluglet_registration::Pipeline;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::admin::server::{AdminService, bind_and_serve, set_socket_group};
use crate::config::{Config, Signatures};
use crate::plugin_manager::{PluginManager, PluginManagerConfig};
use crate::plugin_types::csi::CsiKind;

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
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io)?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(mut lock) => {
                lock.set_len(0).map_err(io)?;
                lock.rewind().map_err(io)?;
                writeln!(lock, "{}", std::process::id()).map_err(io)?;
                lock.sync_data().map_err(io)?;
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
) -> anyhow::Result<Handlers> {
    let dir = dir.to_owned();
    let state_dir = state_dir.map(Path::to_path_buf);
    tokio::task::spawn_blocking(move || -> anyhow::Result<Handlers> {
        let started = Instant::now();
        let runtime = runtime(state_dir.as_deref()).context("cannot start the WASM runtime")?;
        let builtins = Builtins::embedded(&runtime).context("built-in handler failed to load")?;
        let handlers = Handlers::load(runtime.clone(), &dir, state_dir.as_deref(), builtins, trust)
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
fn runtime(state_dir: Option<&Path>) -> Result<Runtime, LoadError> {
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
    Runtime::with_options(runtime_config(), cache, compiler)
}

/// The WASM runtime's configuration: the daemon's, and its compiler child's (whose artifacts
/// must fit the daemon's engine).
pub fn runtime_config() -> RuntimeConfig {
    RuntimeConfig::default()
}

/// Runs the daemon until SIGINT or SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
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

    let trust = trust(&config.signatures)?;
    let handlers = load_handlers(&paths.handlers_dir, Some(&paths.state_dir), trust).await?;
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

    let cancel = CancellationToken::new();
    // The handlers directory is watched from here on: a change applies as one transaction.
    let handler_watch = handlers
        .watch(cancel.child_token())
        .context("cannot watch the handlers directory")?;
    let mut handler_watch = tokio::spawn(handler_watch);
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
    // One registration pipeline for both doors: the device manager gives it the device plugin
    // type's steps and serves kubelet.sock through it; the plugin manager feeds it what the
    // watcher finds.
    let pipeline = Pipeline::new(handlers.clone(), config.node_name.clone());
    pipeline.set_kind(
        PluginType::Csi,
        Arc::new(CsiKind {
            dial_timeout: timings.dial_timeout,
            node_get_info_timeout: timings.node_get_info_timeout,
        }),
    );
    let devices = pluglet_device_manager::DeviceManager::start(
        device_config,
        pipeline.clone(),
        cancel.child_token(),
    )
    .await
    .context("cannot start the device manager")?;

    let manager = PluginManager::start(
        PluginManagerConfig {
            registry_dir: paths.registry_dir.clone(),
            timings: timings.clone(),
        },
        pipeline,
        cancel.clone(),
    )?;

    let admin = bind_and_serve(
        &paths.admin_socket,
        config.admin_socket_mode,
        AdminService::new(manager.handle.clone(), handlers.clone()).with_devices(devices.clone()),
        cancel.child_token(),
    )?;
    set_socket_group(&paths.admin_socket, config.admin_socket_group.as_ref())?;
    let mut admin = tokio::spawn(admin);
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
        result = &mut handler_watch => {
            let e = match result {
                Ok(()) => anyhow::anyhow!("handlers directory watch stopped unexpectedly"),
                Err(e) => anyhow::Error::new(e).context("handlers directory watch panicked"),
            };
            error!(error = %format!("{e:#}"), "stopping");
            failure = Some(e);
        }
        result = &mut admin => {
            let e = match result {
                Ok(Ok(())) => anyhow::anyhow!("admin server stopped unexpectedly"),
                Ok(Err(e)) => anyhow::Error::new(e),
                Err(e) => anyhow::Error::new(e).context("admin server panicked"),
            };
            error!(error = %format!("{e:#}"), "stopping");
            failure = Some(e);
        }
    }

    cancel.cancel();
    let stopping = async {
        if !admin.is_finished() {
            let _ = (&mut admin).await;
        }
        for task in manager.tasks {
            let _ = task.await;
        }
        devices.shutdown().await;
        if !handler_watch.is_finished() {
            let _ = (&mut handler_watch).await;
        }
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
