//! A runtime's configuration, and the wasmtime engine configuration made from it (pooling
//! allocator sized for the calls and the spares, epoch interruption, fuel). The daemon's engine
//! and a compiler child ([`crate::compiler`]) both build theirs here, so the child's artifacts fit.

use std::time::Duration;

use wasmtime::{Config, InstanceAllocationStrategy, PoolingAllocationConfig};

use crate::error::LoadError;
use crate::limits::{Limits, MAX_MEMORY_MIB, WASM_STACK_BYTES};

/// Core instances, memories and tables one component may hold in the pool. A Rust
/// `wasm32-wasip2` component has one memory, one main core instance and a few shim instances.
const CORE_INSTANCES_PER_COMPONENT: u32 = 20;
const MEMORIES_PER_COMPONENT: u32 = 2;
const TABLES_PER_COMPONENT: u32 = 8;

/// Instances ready for a call (made ahead, see [`crate::DeferredRelease`], or kept after one,
/// see [`Limits::reuse_instances`]) that a runtime keeps at most, over every handler, however
/// large its pool (see [`RuntimeConfig::spare_slots`]).
pub const MAX_SPARES: u32 = 16;

/// Bytes of each linear memory (and table) slot reset with `memset` instead of `madvise` when a
/// call's instance is freed, so its pages stay resident across calls: no page faults on the next
/// call and no `madvise` on this one. Measured on the 2-core dev machine with the hook_call
/// bench: 60 µs per call with neither, 25 µs with memory only, 14 µs with both. Where the kernel
/// has `PAGEMAP_SCAN` (Linux 6.7+) only the pages a call dirtied are reset, so the memory figure
/// can cover an allocation policy's 1,024-device request (about 1 MiB of guest heap) without
/// slowing small calls; elsewhere the low `MEMORY_KEEP_RESIDENT` bytes are reset every time.
pub(crate) const MEMORY_KEEP_RESIDENT: usize = 2 << 20;
const TABLE_KEEP_RESIDENT: usize = 64 << 10;

/// Configuration of a [`Runtime`](crate::Runtime).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// How many calls may run at once (pooling allocator slots); more calls wait for a slot.
    pub pool_size: u32,
    /// Period of the epoch ticker while calls run: the resolution of deadlines and of
    /// [`LONG_CALL_CPU`](crate::LONG_CALL_CPU). With no guest code running it does not tick
    /// at all, so an idle daemon has no timer of its own (see `ticker`).
    pub epoch_tick: Duration,
    /// Limits of handlers loaded without their own.
    pub default_limits: Limits,
    /// How many *long* calls (calls that have used [`LONG_CALL_CPU`](crate::LONG_CALL_CPU) of CPU time) may run at
    /// once, across every handler; a long call past them pauses, its CPU time not counted,
    /// until one ends. The default, one less than the cores (at least one), keeps a core for
    /// the short calls whatever runaway modules do.
    pub long_calls: u32,
}

impl RuntimeConfig {
    /// Spares this runtime keeps at most, over every handler: two per call slot and four more,
    /// at most [`MAX_SPARES`]. The pool has this many slots beyond [`RuntimeConfig::pool_size`]
    /// for them, so they never take a slot from a call. Each slot reserves address space for
    /// its memories (about 8.6 GB with their guard regions), so a runtime sized for one call at
    /// a time, as the daemon is run under valgrind, keeps six, which its address space holds.
    pub fn spare_slots(&self) -> u32 {
        self.pool_size
            .saturating_mul(2)
            .saturating_add(4)
            .min(MAX_SPARES)
    }
}

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
    let slots = config.pool_size.saturating_add(config.spare_slots());
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
