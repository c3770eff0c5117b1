//! The runtime ([`Runtime`]), created once per daemon: it wires the leaf modules together (the
//! engine configuration of `config`, the call gates of `call_gate`, the store
//! making of `store`, the epoch ticker of `ticker`, the compile cache and the compiler), links
//! the host imports, and loads modules (compile + admission) into [`Handler`]s.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::time::Instant;

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::{Component, HasSelf, Linker, Resource};

use crate::admission::{self, ExportProblem};
use crate::bindings::{self, CONTRACT_MAJOR, CONTRACT_VERSION};
use crate::cache::{ActiveCache, CacheStats, CompileCache};
use crate::call_gate::CallGate;
use crate::call_state::CallState;
use crate::compiler::{ChildOutcome, Compiler, compile_in_child};
use crate::config::{RuntimeConfig, engine_config};
use crate::error::LoadError;
use crate::handler::{ExportIndices, Handler, HandlerParts};
use crate::limits::{Limits, check_limits};
use crate::store::StoreFactory;
use crate::ticker::Ticker;

/// The WASI clock interface whose timers [`cap_guest_sleeps`] replaces (the version
/// `wasmtime-wasi` provides; guests built for older 0.2 versions are linked to it).
const MONOTONIC_CLOCK: &str = "wasi:clocks/monotonic-clock@0.2.12";

/// Replaces WASI's `subscribe-duration` and `subscribe-instant` with timers that end when the
/// call's wall time runs out. A guest timer is waited for in host code, where the epoch deadline
/// cannot interrupt it: without the cap, a guest calling `thread::sleep` for an hour would hold
/// its host thread for an hour.
fn cap_guest_sleeps(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let mut clock = linker.instance(MONOTONIC_CLOCK)?;
    clock.func_wrap(
        "subscribe-duration",
        |mut store: wasmtime::StoreContextMut<'_, CallState>, (nanos,): (u64,)| {
            Ok((store.data_mut().sleep_for(nanos)?,))
        },
    )?;
    clock.func_wrap(
        "subscribe-instant",
        |mut store: wasmtime::StoreContextMut<'_, CallState>, (when,): (u64,)| {
            Ok((store.data_mut().sleep_until_instant(when)?,))
        },
    )?;
    linker.allow_shadowing(false);
    Ok(())
}

/// The WASI stdio interfaces whose streams [`hand_off_stdio`] guards (the versions
/// `wasmtime-wasi` provides).
const STDIN: &str = "wasi:cli/stdin@0.2.12";
const STDOUT: &str = "wasi:cli/stdout@0.2.12";
const STDERR: &str = "wasi:cli/stderr@0.2.12";

/// Replaces WASI's `get-stdin`, `get-stdout` and `get-stderr` with the same functions that
/// first hand a call running in place off its async worker (see [`crate::in_place`]): WASI's
/// synchronous streams wait on a tokio runtime of their own, which cannot start on a worker.
/// A guest that never asks for its stdio never reaches them; a timer is the other way to a
/// wait, guarded in [`cap_guest_sleeps`]'s timers.
fn hand_off_stdio(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    use wasmtime_wasi::cli::{WasiCliCtxView, WasiCliView};
    use wasmtime_wasi::p2::bindings::cli::{stderr, stdin, stdout};

    /// The `get-*` function that hands off first, then asks WASI's own.
    fn guarded<R: Send + 'static>(
        get: impl Fn(&mut WasiCliCtxView<'_>) -> wasmtime::Result<Resource<R>> + Send + Sync + 'static,
    ) -> impl Fn(wasmtime::StoreContextMut<'_, CallState>, ()) -> wasmtime::Result<(Resource<R>,)>
    + Send
    + Sync
    + 'static {
        move |mut store, ()| {
            if crate::in_place::hand_off() {
                return Err(wasmtime::Error::msg(crate::call_state::HANDED_OFF));
            }
            Ok((get(&mut store.data_mut().cli())?,))
        }
    }

    linker.allow_shadowing(true);
    linker
        .instance(STDIN)?
        .func_wrap("get-stdin", guarded(|cli| stdin::Host::get_stdin(cli)))?;
    linker
        .instance(STDOUT)?
        .func_wrap("get-stdout", guarded(|cli| stdout::Host::get_stdout(cli)))?;
    linker
        .instance(STDERR)?
        .func_wrap("get-stderr", guarded(|cli| stderr::Host::get_stderr(cli)))?;
    linker.allow_shadowing(false);
    Ok(())
}

/// Where a module comes from. Its id is `builtin:<name>` or the file path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModuleSource {
    /// A component embedded in the binary.
    Builtin {
        /// Short name, e.g. `csi`.
        name: String,
        /// The component bytes.
        bytes: &'static [u8],
    },
    /// A component file.
    File(PathBuf),
    /// A component already read into memory (so that the bytes hashed are the bytes compiled);
    /// `id` names it, usually the file it was read from.
    Bytes {
        /// The module id shown in messages.
        id: String,
        /// The component bytes.
        bytes: Arc<[u8]>,
    },
}

impl ModuleSource {
    /// The module id: `builtin:<name>` or the file path.
    pub fn id(&self) -> String {
        match self {
            ModuleSource::Builtin { name, .. } => format!("builtin:{name}"),
            ModuleSource::File(path) => path.display().to_string(),
            ModuleSource::Bytes { id, .. } => id.clone(),
        }
    }
}

/// What the clones of a runtime share: what its handlers make their stores from, and what
/// only loading needs.
struct RuntimeInner {
    stores: Arc<StoreFactory>,
    linker: Linker<CallState>,
    cache: Option<ActiveCache>,
    compiler: Compiler,
}

/// One wasmtime `Engine` + `Linker` + epoch ticker + call gate. Cheap to clone; the ticker
/// thread stops once the last clone (and every handler) is gone.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<RuntimeInner>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("config", &self.inner.stores.config)
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// Creates the engine (pooling allocator sized by `pool_size`, epoch interruption, fuel,
    /// no component-model concurrency), links WASI and the host imports, and starts the ticker.
    /// Every module is compiled at load; see [`Runtime::with_cache`] for a runtime that keeps
    /// compiled modules between starts.
    pub fn new(config: RuntimeConfig) -> Result<Runtime, LoadError> {
        Runtime::with_options(config, None, Compiler::InProcess)
    }

    /// Like [`Runtime::new`], with a compile cache: every [`Runtime::load`] first looks for the
    /// module's compiled code in `cache` (checked with the node's key before it is used), and
    /// writes what it compiles there.
    pub fn with_cache(config: RuntimeConfig, cache: CompileCache) -> Result<Runtime, LoadError> {
        Runtime::with_options(config, Some(cache), Compiler::InProcess)
    }

    /// A runtime with an optional compile cache that compiles what the cache lacks where
    /// `compiler` says (a long-running daemon: [`Compiler::ThisExecutable`], see
    /// [`crate::compiler`]).
    pub fn with_options(
        config: RuntimeConfig,
        cache: Option<CompileCache>,
        compiler: Compiler,
    ) -> Result<Runtime, LoadError> {
        let engine_err = |reason: &str| {
            let reason = reason.to_owned();
            move |e: wasmtime::Error| LoadError::Engine {
                reason,
                source: Some(e.into()),
            }
        };
        if config.epoch_tick.is_zero() {
            return Err(LoadError::Engine {
                reason: "epoch_tick must be longer than zero".into(),
                source: None,
            });
        }
        check_limits("default", &config.default_limits)?;

        let engine = Engine::new(&engine_config(&config)?)
            .map_err(engine_err("wasmtime refused the configuration"))?;

        let mut linker = Linker::<CallState>::new(&engine);
        let link_err = || engine_err("the host imports could not be linked");
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(link_err())?;
        cap_guest_sleeps(&mut linker).map_err(link_err())?;
        hand_off_stdio(&mut linker).map_err(link_err())?;
        bindings::pluglet::handler::types::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(link_err())?;
        bindings::pluglet::handler::host::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(link_err())?;

        let gate = Arc::new(CallGate::new());
        let ticker = Ticker::spawn(&engine, config.epoch_tick)?;
        let cache = cache.map(|cache| ActiveCache::new(cache, &engine));
        Ok(Runtime {
            inner: Arc::new(RuntimeInner {
                stores: Arc::new(StoreFactory {
                    engine,
                    pool_gate: gate,
                    ticker,
                    long_calls: Arc::new(CallGate::new()),
                    config,
                    spares_kept: AtomicU32::new(0),
                }),
                linker,
                cache,
                compiler,
            }),
        })
    }

    /// How many instances are kept ready for a call now, made ahead or kept after one (at most
    /// [`RuntimeConfig::spare_slots`]; see [`crate::DeferredRelease`] and
    /// [`crate::Limits::reuse_instances`]).
    pub fn spares(&self) -> u32 {
        self.inner
            .stores
            .spares_kept
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The wasmtime engine (for tests that build artifacts of their own).
    #[cfg(test)]
    pub(crate) fn engine(&self) -> &Engine {
        &self.inner.stores.engine
    }

    /// The configuration this runtime was created with.
    pub fn config(&self) -> &RuntimeConfig {
        &self.inner.stores.config
    }

    /// How many long calls hold a permit now (see [`RuntimeConfig::long_calls`]).
    pub fn long_calls_running(&self) -> u32 {
        self.inner.stores.long_calls.running()
    }

    /// The compile cache's directory, if this runtime has one.
    pub fn cache_dir(&self) -> Option<&Path> {
        self.inner.cache.as_ref().map(ActiveCache::dir)
    }

    /// What the compile cache did so far, if this runtime has one.
    pub fn cache_stats(&self) -> Option<CacheStats> {
        self.inner.cache.as_ref().map(ActiveCache::stats)
    }

    /// Compiles (or, with a compile cache, takes from the cache) and admits one module: refuses
    /// non-components, components of another contract and components with imports outside the
    /// allow-list; reads its families and contract version from its exports. `limits`: `None`
    /// uses the runtime's defaults.
    pub fn load(
        &self,
        source: ModuleSource,
        settings: BTreeMap<String, String>,
        limits: Option<Limits>,
    ) -> Result<Arc<Handler>, LoadError> {
        let module = source.id();
        let limits = limits.unwrap_or(self.inner.stores.config.default_limits);
        check_limits(&module, &limits)?;
        let owned;
        let bytes: &[u8] = match &source {
            ModuleSource::Builtin { bytes, .. } => bytes,
            ModuleSource::File(path) => {
                owned = std::fs::read(path).map_err(|source| LoadError::Io {
                    path: path.clone(),
                    source,
                })?;
                &owned
            }
            ModuleSource::Bytes { bytes, .. } => bytes,
        };
        if let Some(found) = admission::describe_non_component(bytes) {
            return Err(LoadError::NotAComponent { module, found });
        }
        let digest: [u8; 32] = Sha256::digest(bytes).into();
        let sha256 = hex::encode(digest);

        let started = Instant::now();
        let compile = || self.compile(&module, bytes);
        let (component, from_cache) = match &self.inner.cache {
            Some(cache) => cache.component(&self.inner.stores.engine, &module, &digest, compile)?,
            None => (compile()?, false),
        };
        let compile_time = started.elapsed();
        if from_cache {
            tracing::info!(
                module,
                ms = %format!("{:.1}", compile_time.as_secs_f64() * 1e3),
                "handler loaded from the compile cache"
            );
        } else {
            tracing::debug!(
                module,
                ms = %format!("{:.1}", compile_time.as_secs_f64() * 1e3),
                "handler compiled"
            );
        }

        let ty = component.component_type();
        let engine = &self.inner.stores.engine;
        let imports: Vec<String> = ty.imports(engine).map(|(n, _)| n.to_string()).collect();
        let forbidden = admission::forbidden_imports(imports.iter().map(String::as_str));
        if !forbidden.is_empty() {
            return Err(LoadError::ForbiddenImport {
                module,
                imports: forbidden.into_iter().map(str::to_string).collect(),
            });
        }
        let exports: Vec<String> = ty.exports(engine).map(|(n, _)| n.to_string()).collect();
        let contract =
            admission::read_exports(exports.iter().map(String::as_str)).map_err(|problem| {
                match problem {
                    ExportProblem::NoFamily { found } => LoadError::OtherContract {
                        module: module.clone(),
                        found,
                    },
                    ExportProblem::Incompatible { found } => LoadError::IncompatibleContract {
                        module: module.clone(),
                        found,
                        host: CONTRACT_VERSION,
                        host_major: CONTRACT_MAJOR,
                    },
                }
            })?;

        let pre = self
            .inner
            .linker
            .instantiate_pre(&component)
            .map_err(|e| LoadError::Link {
                module: module.clone(),
                source: e.into(),
            })?;
        let indices = ExportIndices::new(&component, &contract.families).map_err(|message| {
            LoadError::OtherContract {
                module: module.clone(),
                found: message,
            }
        })?;
        let handler = Handler::new(HandlerParts {
            stores: self.inner.stores.clone(),
            module,
            sha256,
            contract_version: contract.version,
            families: contract.families.keys().copied().collect(),
            compile_time,
            from_cache,
            pre,
            indices,
            settings: Arc::new(settings),
            limits,
        });
        Ok(Arc::new(handler))
    }
}

impl Runtime {
    /// Compiles `bytes` where the runtime's [`Compiler`] says.
    fn compile(&self, module: &str, bytes: &[u8]) -> Result<Component, LoadError> {
        let in_process = || {
            Component::new(&self.inner.stores.engine, bytes).map_err(|e| LoadError::Compile {
                module: module.to_owned(),
                source: e.into(),
            })
        };
        let Compiler::ThisExecutable { args } = &self.inner.compiler else {
            return in_process();
        };
        let started = Instant::now();
        match compile_in_child(&self.inner.stores.engine, args, bytes) {
            ChildOutcome::Compiled(component) => {
                tracing::info!(
                    module,
                    ms = %format!("{:.1}", started.elapsed().as_secs_f64() * 1e3),
                    "handler compiled by a compiler process"
                );
                Ok(component)
            }
            ChildOutcome::DoesNotCompile(reason) => Err(LoadError::Compile {
                module: module.to_owned(),
                source: reason.into(),
            }),
            ChildOutcome::Failed(reason) => {
                tracing::warn!(
                    module,
                    reason,
                    "the compiler process failed; compiling in the daemon instead (its memory stays resident)"
                );
                in_process()
            }
        }
    }
}
