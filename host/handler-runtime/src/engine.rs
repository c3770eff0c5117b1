//! The engine, linker, epoch ticker and call gate, created once per daemon ([`Runtime`]), and
//! loading (compile + admission) of modules into [`Handler`]s.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use crate::admission::{self, ExportProblem};
use crate::bindings::{self, CONTRACT_MAJOR, CONTRACT_VERSION};
use crate::cache::{ActiveCache, CacheStats, CompileCache};
use crate::call_state::CallState;
use crate::compiler::{ChildOutcome, Compiler, compile_in_child};
use crate::error::LoadError;
use crate::handler::{ExportIndices, Handler};

/// The largest memory cap a handler may ask for; also the pool's per-memory maximum.
pub const MAX_MEMORY_MIB: u32 = 256;

/// The native stack one call's WebAssembly may use (wasmtime's `max_wasm_stack`, here its
/// default made explicit so that the stack overflow error can name it).
pub const WASM_STACK_BYTES: usize = 512 << 10;

/// Core instances, memories and tables one component may hold in the pool. A Rust
/// `wasm32-wasip2` component has one memory, one main core instance and a few shim instances.
const CORE_INSTANCES_PER_COMPONENT: u32 = 20;
const MEMORIES_PER_COMPONENT: u32 = 2;
const TABLES_PER_COMPONENT: u32 = 8;

/// Instances made ahead of their call (see [`crate::spent`]) that a runtime keeps at most, over
/// every handler; the pool has this many slots beyond [`RuntimeConfig::pool_size`] for them, so
/// they never take a slot from a call.
pub const MAX_SPARES: u32 = 4;

/// Bytes of each linear memory (and table) slot reset with `memset` instead of `madvise` when a
/// call's instance is freed, so its pages stay resident across calls: no page faults on the next
/// call and no `madvise` on this one. Measured on the 2-core dev machine with the hook_call
/// bench: 60 µs per call with neither, 25 µs with memory only, 14 µs with both. Where the kernel
/// has `PAGEMAP_SCAN` (Linux 6.7+) only the pages a call dirtied are reset, so the memory figure
/// can cover an allocation policy's 1,024-device request (about 1 MiB of guest heap) without
/// slowing small calls; elsewhere the low `MEMORY_KEEP_RESIDENT` bytes are reset every time.
const MEMORY_KEEP_RESIDENT: usize = 2 << 20;
const TABLE_KEEP_RESIDENT: usize = 64 << 10;

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

/// Per-call budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Wall-clock CPU deadline of one call (epoch interruption; resolution: the epoch tick).
    pub deadline: Duration,
    /// Linear memory cap of one call, in MiB (at most [`MAX_MEMORY_MIB`]).
    pub memory_mib: u32,
    /// Fuel (instruction budget) of one call; `None`: unlimited.
    pub fuel: Option<u64>,
}

/// Fuel an `allocate` call gets per device offered, on top of [`Limits::fuel`]. Reading the
/// request already costs the guest a few hundred instructions per device, so a fixed budget
/// would cap how many devices any policy can be offered; the plain example policy uses about
/// 1,400 per device.
pub const FUEL_PER_DEVICE: u64 = 2_000;

/// A call may take at most this many times its deadline in wall time, however little CPU it got.
pub const WALL_CAP_FACTOR: u32 = 20;
/// … and at least this long.
pub const MIN_WALL_CAP: Duration = Duration::from_secs(1);

impl Limits {
    /// The fuel budget of a call offered `devices` devices (0 for the registration hooks):
    /// [`Limits::fuel`] plus [`FUEL_PER_DEVICE`] per device; `None` when unlimited.
    pub fn fuel_for(&self, devices: usize) -> Option<u64> {
        let extra = FUEL_PER_DEVICE.saturating_mul(u64::try_from(devices).unwrap_or(u64::MAX));
        self.fuel.map(|fuel| fuel.saturating_add(extra))
    }

    /// The most wall time one call may take: [`WALL_CAP_FACTOR`] times the deadline, at least
    /// [`MIN_WALL_CAP`] (the deadline itself counts CPU time).
    pub fn wall_cap(&self) -> Duration {
        (self.deadline * WALL_CAP_FACTOR).max(MIN_WALL_CAP)
    }
}

impl Default for Limits {
    /// 50 ms, 16 MiB, 50 million fuel: generous for registration hooks, which run in microseconds.
    fn default() -> Limits {
        Limits {
            deadline: Duration::from_millis(50),
            memory_mib: 16,
            fuel: Some(50_000_000),
        }
    }
}

/// Configuration of a [`Runtime`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// How many calls may run at once (pooling allocator slots); more calls wait for a slot.
    pub pool_size: u32,
    /// Period of the epoch ticker while calls run: the resolution of deadlines and of
    /// [`LONG_CALL_CPU`]. With no call running it ticks every [`IDLE_EPOCH_TICK`], so an idle
    /// daemon wakes up rarely.
    pub epoch_tick: Duration,
    /// Limits of handlers loaded without their own.
    pub default_limits: Limits,
    /// How many *long* calls (calls that have used [`LONG_CALL_CPU`] of CPU time) may run at
    /// once, across every handler; a long call past them pauses, its CPU time not counted,
    /// until one ends. The default, one less than the cores (at least one), keeps a core for
    /// the short calls whatever runaway modules do.
    pub long_calls: u32,
}

/// Period of the epoch ticker while no call runs (a call starting then gets its first tick
/// within this, and every [`RuntimeConfig::epoch_tick`] after).
pub const IDLE_EPOCH_TICK: Duration = Duration::from_millis(10);

/// CPU time after which a call counts as long (see [`RuntimeConfig::long_calls`]). Hook calls
/// take microseconds; a call past this is a runaway or an unusually large request.
pub const LONG_CALL_CPU: Duration = Duration::from_millis(2);

/// One less than the cores, at least one.
pub fn default_long_calls() -> u32 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    u32::try_from(cores.saturating_sub(1).max(1)).unwrap_or(u32::MAX)
}

impl Default for RuntimeConfig {
    fn default() -> RuntimeConfig {
        RuntimeConfig {
            pool_size: 64,
            epoch_tick: Duration::from_millis(2),
            default_limits: Limits::default(),
            long_calls: default_long_calls(),
        }
    }
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

/// A counting gate: at most a given number of calls hold a permit at once; the others wait.
///
/// The runtime keeps one in front of its instance pool (a burst of calls waits for a slot rather
/// than failing instantiation); the host keeps one per slot, so that one runaway module cannot
/// take every permit and every core ([`CallGate::enter`] with the slot's limit). The limit is
/// given at each entry, so versions of a slot with different limits can share one count.
#[derive(Debug, Default)]
pub struct CallGate {
    running: Mutex<u32>,
    freed: Condvar,
}

impl CallGate {
    /// A gate with no call running.
    pub fn new() -> CallGate {
        CallGate::default()
    }

    /// Waits until fewer than `limit` calls hold a permit, then holds one until the permit
    /// drops. `wait`: how long to wait at most (`None`: as long as it takes); `Err` is the time
    /// waited, when it gave up.
    pub fn enter(&self, limit: u32, wait: Option<Duration>) -> Result<GatePermit<'_>, Duration> {
        let started = Instant::now();
        let limit = limit.max(1);
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        while *running >= limit {
            running = match wait {
                None => self.freed.wait(running).unwrap_or_else(|e| e.into_inner()),
                Some(wait) => {
                    let Some(left) = wait.checked_sub(started.elapsed()).filter(|l| !l.is_zero())
                    else {
                        return Err(started.elapsed());
                    };
                    self.freed
                        .wait_timeout(running, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
        *running += 1;
        Ok(GatePermit { gate: self })
    }

    /// How many calls hold a permit now.
    pub fn running(&self) -> u32 {
        *self.running.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One held permit of a [`CallGate`]; dropping it lets the next call in.
#[derive(Debug)]
pub struct GatePermit<'a> {
    gate: &'a CallGate,
}

impl GatePermit<'_> {
    /// The same permit, holding its gate by `Arc` so it can be kept where a borrow cannot.
    pub(crate) fn owned(self, gate: &Arc<CallGate>) -> OwnedGatePermit {
        debug_assert!(std::ptr::eq(self.gate, Arc::as_ptr(gate)));
        std::mem::forget(self);
        OwnedGatePermit { gate: gate.clone() }
    }
}

impl Drop for GatePermit<'_> {
    fn drop(&mut self) {
        self.gate.leave();
    }
}

/// A [`GatePermit`] that owns its gate.
#[derive(Debug)]
pub(crate) struct OwnedGatePermit {
    gate: Arc<CallGate>,
}

impl Drop for OwnedGatePermit {
    fn drop(&mut self) {
        self.gate.leave();
    }
}

impl CallGate {
    fn leave(&self) {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        *running -= 1;
        self.freed.notify_all();
    }
}

/// What every handler of a runtime shares.
pub(crate) struct RuntimeInner {
    pub(crate) engine: Engine,
    pub(crate) linker: Linker<CallState>,
    pub(crate) gate: Arc<CallGate>,
    /// Admits long calls ([`RuntimeConfig::long_calls`]).
    pub(crate) long_calls: Arc<CallGate>,
    pub(crate) config: RuntimeConfig,
    /// Instances made ahead of their call, kept now (at most [`MAX_SPARES`]).
    pub(crate) spares: AtomicU32,
    cache: Option<ActiveCache>,
    compiler: Compiler,
}

/// One wasmtime `Engine` + `Linker` + epoch ticker + call gate. Cheap to clone; the ticker
/// thread stops once the last clone (and every handler) is gone.
#[derive(Clone)]
pub struct Runtime {
    pub(crate) inner: Arc<RuntimeInner>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("config", &self.inner.config)
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
        bindings::pluglet::handler::types::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(link_err())?;
        bindings::pluglet::handler::host::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(link_err())?;

        let gate = Arc::new(CallGate::new());
        spawn_ticker(&engine, config.epoch_tick, gate.clone())?;
        let cache = cache.map(|cache| ActiveCache::new(cache, &engine));
        Ok(Runtime {
            inner: Arc::new(RuntimeInner {
                engine,
                linker,
                gate,
                long_calls: Arc::new(CallGate::new()),
                config,
                spares: AtomicU32::new(0),
                cache,
                compiler,
            }),
        })
    }

    /// How many instances are kept made ahead of their calls now (at most [`MAX_SPARES`]; see
    /// [`crate::Spent`]).
    pub fn spares(&self) -> u32 {
        self.inner.spares.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The configuration this runtime was created with.
    pub fn config(&self) -> &RuntimeConfig {
        &self.inner.config
    }

    /// How many long calls hold a permit now (see [`RuntimeConfig::long_calls`]).
    pub fn long_calls_running(&self) -> u32 {
        self.inner.long_calls.running()
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
        let limits = limits.unwrap_or(self.inner.config.default_limits);
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
            Some(cache) => cache.component(&self.inner.engine, &module, &digest, compile)?,
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
        let engine = &self.inner.engine;
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
        let handler = Handler::new(crate::handler::HandlerParts {
            runtime: self.inner.clone(),
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
            Component::new(&self.inner.engine, bytes).map_err(|e| LoadError::Compile {
                module: module.to_owned(),
                source: e.into(),
            })
        };
        let Compiler::ThisExecutable { args } = &self.inner.compiler else {
            return in_process();
        };
        let started = Instant::now();
        match compile_in_child(&self.inner.engine, args, bytes) {
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

/// The engine configuration of a runtime of `config`: the daemon's engine and a compiler child
/// ([`crate::compiler::precompile`]) build theirs here, so the child's artifacts fit.
pub(crate) fn engine_config(config: &RuntimeConfig) -> Result<Config, LoadError> {
    if config.pool_size == 0 {
        return Err(LoadError::Engine {
            reason: "pool_size must be at least 1".into(),
            source: None,
        });
    }
    let mut pool = PoolingAllocationConfig::default();
    let slots = config.pool_size.saturating_add(MAX_SPARES);
    pool.total_component_instances(slots)
        .total_core_instances(slots * CORE_INSTANCES_PER_COMPONENT)
        .total_memories(slots * MEMORIES_PER_COMPONENT)
        .total_tables(slots * TABLES_PER_COMPONENT)
        .max_core_instances_per_component(CORE_INSTANCES_PER_COMPONENT)
        .max_memories_per_component(MEMORIES_PER_COMPONENT)
        .max_tables_per_component(TABLES_PER_COMPONENT)
        .max_memory_size((MAX_MEMORY_MIB as usize) << 20)
        .linear_memory_keep_resident(MEMORY_KEEP_RESIDENT)
        .table_keep_resident(TABLE_KEEP_RESIDENT)
        .pagemap_scan(wasmtime::Enabled::Auto);

    let mut cfg = Config::new();
    cfg.epoch_interruption(true)
        .max_wasm_stack(WASM_STACK_BYTES)
        .consume_fuel(true)
        .concurrency_support(false)
        .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    Ok(cfg)
}

/// Refuses limits the pool cannot honour.
pub(crate) fn check_limits(module: &str, limits: &Limits) -> Result<(), LoadError> {
    let invalid = |message: String| LoadError::InvalidLimits {
        module: module.to_string(),
        message,
    };
    if limits.memory_mib == 0 || limits.memory_mib > MAX_MEMORY_MIB {
        return Err(invalid(format!(
            "memory_mib must be between 1 and {MAX_MEMORY_MIB}, not {}",
            limits.memory_mib
        )));
    }
    if limits.deadline.is_zero() {
        return Err(invalid("deadline must be longer than zero".into()));
    }
    if limits.fuel == Some(0) {
        return Err(invalid(
            "fuel must be at least 1 (leave it out for no fuel limit)".into(),
        ));
    }
    Ok(())
}

/// Starts the epoch ticker: a dedicated thread holding only a weak reference to the engine, so it
/// ends once the engine is gone. A late wake-up gives one tick, never a burst (missed ticks are
/// skipped), so a stalled ticker cannot time calls out spuriously.
fn spawn_ticker(
    engine: &Engine,
    busy_tick: Duration,
    calls: Arc<CallGate>,
) -> Result<(), LoadError> {
    let weak = engine.weak();
    std::thread::Builder::new()
        .name("pluglet-epoch".into())
        .spawn(move || {
            let idle_tick = IDLE_EPOCH_TICK.max(busy_tick);
            let period = || {
                if calls.running() > 0 {
                    busy_tick
                } else {
                    idle_tick
                }
            };
            let mut next = Instant::now() + period();
            loop {
                let tick = period();
                next = next.min(Instant::now() + tick);
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                }
                let Some(engine) = weak.upgrade() else {
                    return;
                };
                engine.increment_epoch();
                drop(engine);
                next += tick;
                let now = Instant::now();
                if next < now {
                    next = now + tick;
                }
            }
        })
        .map_err(|e| LoadError::Engine {
            reason: "the epoch ticker thread did not start".into(),
            source: Some(Box::new(e)),
        })?;
    Ok(())
}
