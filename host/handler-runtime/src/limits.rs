//! What one call may use: the limits of a handler's calls (deadline, memory, fuel) and the
//! bounds the runtime puts on them. A leaf: it knows no engine, store or handler.

use std::time::Duration;

use crate::error::LoadError;

/// The largest memory cap a handler may ask for; also the pool's per-memory maximum.
pub const MAX_MEMORY_MIB: u32 = 256;

/// The native stack one call's WebAssembly may use (wasmtime's `max_wasm_stack`, here its
/// default made explicit so that the stack overflow error can name it).
pub const WASM_STACK_BYTES: usize = 512 << 10;

/// Per-call budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Wall-clock CPU deadline of one call (epoch interruption; resolution: the epoch tick).
    pub deadline: Duration,
    /// Linear memory cap of one call, in MiB (at most [`MAX_MEMORY_MIB`]).
    pub memory_mib: u32,
    /// Fuel (instruction budget) of one call; `None`: unlimited.
    pub fuel: Option<u64>,
    /// Whether an instance whose call succeeded may serve the handler's later calls (at most
    /// [`MAX_CALLS_PER_INSTANCE`], while its memory stays within half the cap and 2 MiB and
    /// its guest printed nothing) instead of a fresh instance each call. Only for modules
    /// whose calls keep nothing in the guest between them: the built-ins, or an entry that
    /// says `reuse_instances = true`.
    pub reuse_instances: bool,
}

/// Calls one instance serves at most when [`Limits::reuse_instances`] is set; the next call
/// then gets a fresh instance, so that whatever a guest leaves behind (a fragmented heap,
/// handles it never closed) is bounded.
pub const MAX_CALLS_PER_INSTANCE: u32 = 1_000;

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
    /// 50 ms, 16 MiB, 50 million fuel, a fresh instance each call: generous for registration
    /// hooks, which run in microseconds.
    fn default() -> Limits {
        Limits {
            deadline: Duration::from_millis(50),
            memory_mib: 16,
            fuel: Some(50_000_000),
            reuse_instances: false,
        }
    }
}

/// CPU time after which a call counts as long (see [`RuntimeConfig::long_calls`](crate::RuntimeConfig::long_calls)). Hook calls
/// take microseconds; a call past this is a runaway or an unusually large request.
pub const LONG_CALL_CPU: Duration = Duration::from_millis(2);

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
