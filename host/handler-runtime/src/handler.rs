//! A loaded handler: one compiled component behind a shared `InstancePre`, called through a
//! fresh `Store` and instance per call with that call's limits.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use wasmtime::component::{Component, ComponentExportIndex, Instance, InstancePre};
use wasmtime::{Store, Trap, UpdateDeadline};

use crate::answer;
use crate::bindings::pluglet::handler::types as wit_types;
use crate::call_state::CallState;
use crate::engine::{LONG_CALL_CPU, Limits, RuntimeInner};
use crate::error::{HandlerError, HandlerFault};
use crate::spent::{Maker, Ready};
use crate::types::{
    Accepted, AllocationRequest, Call, CallContext, Family, GuestLog, Hook, ListedRequest,
    LogLevel, PackedRequest, PluginInfo, Refusal, RegisteredPlugin, RegistrationFacts,
};

/// CPU time the calling thread has used so far (`CLOCK_THREAD_CPUTIME_ID`); `None` if the clock
/// is unavailable (the deadline then counts wall time).
fn thread_cpu_time() -> Option<Duration> {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).ok()?;
    Some(Duration::new(
        u64::try_from(ts.tv_sec()).ok()?,
        u32::try_from(ts.tv_nsec()).ok()?,
    ))
}

/// What wasmtime adds to a memory trap: the address the guest touched.
const MEMORY_FAULT: &str = "memory fault at wasm address 0x";

/// Whether a memory trap touched just below address 0 (wrapped round to the top of the 32-bit
/// address space): a guest's shadow stack, which sits at the bottom of its memory and grows
/// down (the Rust and C toolchains' layout), has overflowed. Recursion with locals on the
/// shadow stack ends here rather than on the native stack.
fn below_address_zero(error: &wasmtime::Error) -> bool {
    error.chain().any(|cause| {
        let text = cause.to_string();
        let Some(rest) = text.split(MEMORY_FAULT).nth(1) else {
            return false;
        };
        let hex: String = rest.chars().take_while(char::is_ascii_hexdigit).collect();
        u64::from_str_radix(&hex, 16).is_ok_and(|address| {
            (u64::from(u32::MAX) - (1 << 20)..=u64::from(u32::MAX) + (1 << 20)).contains(&address)
        })
    })
}

/// Export indices of the families a component implements, looked up once at load by the exact
/// export names the component carries (so a 1.0.0 component serves a 1.1.0 host).
#[derive(Clone, Debug)]
pub(crate) struct ExportIndices {
    registration: Option<RegistrationIndices>,
    allocate: Option<ComponentExportIndex>,
    /// `allocate-packed` (1.2.0); absent from components built for 1.1.0.
    allocate_packed: Option<ComponentExportIndex>,
}

#[derive(Clone, Debug)]
struct RegistrationIndices {
    validate: ComponentExportIndex,
    register: ComponentExportIndex,
    deregister: ComponentExportIndex,
}

impl ExportIndices {
    /// Looks the functions of each family up; `Err` names a missing function.
    pub(crate) fn new(
        component: &Component,
        families: &BTreeMap<Family, String>,
    ) -> Result<ExportIndices, String> {
        let lookup = |export: &str, func: &str| -> Result<ComponentExportIndex, String> {
            let instance = component
                .get_export_index(None, export)
                .ok_or_else(|| format!("no export named `{export}`"))?;
            component
                .get_export_index(Some(&instance), func)
                .ok_or_else(|| format!("`{export}` without the function `{func}`"))
        };
        let registration = match families.get(&Family::Registration) {
            Some(export) => Some(RegistrationIndices {
                validate: lookup(export, "validate")?,
                register: lookup(export, "register")?,
                deregister: lookup(export, "deregister")?,
            }),
            None => None,
        };
        let allocate = match families.get(&Family::AllocationPolicy) {
            Some(export) => Some(lookup(export, "allocate")?),
            None => None,
        };
        let allocate_packed = families
            .get(&Family::AllocationPolicy)
            .and_then(|export| lookup(export, "allocate-packed").ok());
        Ok(ExportIndices {
            registration,
            allocate,
            allocate_packed,
        })
    }
}

/// Everything [`Handler::new`] needs (built by [`crate::Runtime::load`]).
pub(crate) struct HandlerParts {
    pub runtime: Arc<RuntimeInner>,
    pub module: String,
    pub sha256: String,
    pub contract_version: String,
    pub families: Vec<Family>,
    pub compile_time: Duration,
    pub from_cache: bool,
    pub pre: InstancePre<CallState>,
    pub indices: ExportIndices,
    pub settings: Arc<BTreeMap<String, String>>,
    pub limits: Limits,
}

/// One loaded handler module. Calls are synchronous and CPU-bound, bounded by the deadline:
/// async callers wrap them in [`run_in_place`].
pub struct Handler {
    runtime: Arc<RuntimeInner>,
    module: String,
    module_arc: Arc<str>,
    sha256: String,
    contract_version: String,
    families: Vec<Family>,
    compile_time: Duration,
    from_cache: bool,
    pre: InstancePre<CallState>,
    indices: ExportIndices,
    settings: Arc<BTreeMap<String, String>>,
    limits: Limits,
    /// An instance made ahead of the next call, if any (see [`crate::spent`]).
    spare: Arc<Mutex<Option<Ready>>>,
}

impl std::fmt::Debug for Handler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handler")
            .field("module", &self.module)
            .field("sha256", &self.sha256)
            .field("contract_version", &self.contract_version)
            .field("families", &self.families)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// Runs a handler call (or other short work bounded by a deadline) from async code on the
/// calling thread, with no hop to another thread and back: on tokio's multi-thread runtime the
/// worker first hands its queued tasks to another thread (`block_in_place`), elsewhere the call
/// simply runs. A hook call costs microseconds; a thread hop on a busy two-core node costs
/// hundreds of them.
pub fn run_in_place<T>(call: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(call)
        }
        _ => call(),
    }
}

impl Handler {
    pub(crate) fn new(parts: HandlerParts) -> Handler {
        Handler {
            runtime: parts.runtime,
            module_arc: Arc::from(parts.module.as_str()),
            module: parts.module,
            sha256: parts.sha256,
            contract_version: parts.contract_version,
            families: parts.families,
            compile_time: parts.compile_time,
            from_cache: parts.from_cache,
            pre: parts.pre,
            indices: parts.indices,
            settings: parts.settings,
            limits: parts.limits,
            spare: Arc::default(),
        }
    }

    /// The same compiled component under another id, settings and limits: no compile, no
    /// admission (the bytes are the ones admitted already). For a changed entry whose module did
    /// not change.
    pub fn reconfigured(
        &self,
        module: String,
        settings: BTreeMap<String, String>,
        limits: Option<Limits>,
    ) -> Result<Arc<Handler>, crate::LoadError> {
        let limits = limits.unwrap_or(self.runtime.config.default_limits);
        crate::engine::check_limits(&module, &limits)?;
        Ok(Arc::new(Handler {
            runtime: self.runtime.clone(),
            module_arc: Arc::from(module.as_str()),
            module,
            sha256: self.sha256.clone(),
            contract_version: self.contract_version.clone(),
            families: self.families.clone(),
            compile_time: Duration::ZERO,
            from_cache: self.from_cache,
            pre: self.pre.clone(),
            indices: self.indices.clone(),
            settings: Arc::new(settings),
            limits,
            spare: Arc::default(),
        }))
    }

    /// Module id: `builtin:<name>` or the file path.
    pub fn module(&self) -> &str {
        &self.module
    }

    /// Hex sha256 of the component bytes.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// Contract version read from the component's exports, e.g. `1.1.0`.
    pub fn contract_version(&self) -> &str {
        &self.contract_version
    }

    /// Families the component exports, in a fixed order (registration first).
    pub fn families(&self) -> &[Family] {
        &self.families
    }

    /// Whether the component exports `family`.
    pub fn implements(&self, family: Family) -> bool {
        self.families.contains(&family)
    }

    /// How long compiling the component took; when it came from the compile cache
    /// ([`Handler::from_cache`]), how long reading, checking and deserialising it took.
    pub fn compile_time(&self) -> Duration {
        self.compile_time
    }

    /// Whether the compiled component came from the runtime's compile cache (no compile).
    pub fn from_cache(&self) -> bool {
        self.from_cache
    }

    /// The limits every call of this handler runs under.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The handler's read-only settings.
    pub fn settings(&self) -> &BTreeMap<String, String> {
        &self.settings
    }

    /// Runs `registration.validate`: may `plugin` register, given the plugin `existing` already
    /// registered under the same type and name?
    pub fn validate(
        &self,
        cx: &CallContext,
        plugin: &PluginInfo,
        existing: Option<&RegisteredPlugin>,
    ) -> Result<Call<Result<Accepted, Refusal>>, HandlerError> {
        let index = self.indices.registration.as_ref().map(|r| r.validate);
        self.call(
            cx,
            Hook::Validate,
            index,
            self.limits.fuel,
            |store, instance, index| {
                let func = instance.get_typed_func::<
                (&PluginInfo, Option<&RegisteredPlugin>),
                (Result<Accepted, Refusal>,),
            >(&mut *store, index)?;
                let (out,) = func.call(&mut *store, (plugin, existing))?;
                Ok(out)
            },
            answer::check_validate,
        )
    }

    /// Runs `registration.register` with the facts the host gathered natively.
    pub fn register(
        &self,
        cx: &CallContext,
        plugin: &PluginInfo,
        facts: &RegistrationFacts,
    ) -> Result<Call<Result<(), Refusal>>, HandlerError> {
        let index = self.indices.registration.as_ref().map(|r| r.register);
        let wire = wit_types::RegistrationFacts {
            node_id: facts.node_id.clone(),
            max_volumes_per_node: facts.max_volumes_per_node,
            topology: facts
                .topology
                .iter()
                .map(|(key, value)| wit_types::KeyValue {
                    key: key.clone(),
                    value: value.clone(),
                })
                .collect(),
        };
        self.call(
            cx,
            Hook::Register,
            index,
            self.limits.fuel,
            |store, instance, index| {
                let func = instance.get_typed_func::<
                (&PluginInfo, &wit_types::RegistrationFacts),
                (Result<(), Refusal>,),
            >(&mut *store, index)?;
                let (out,) = func.call(&mut *store, (plugin, &wire))?;
                Ok(out)
            },
            answer::check_register,
        )
    }

    /// Runs `registration.deregister` (the plugin's socket has gone).
    pub fn deregister(
        &self,
        cx: &CallContext,
        plugin: &PluginInfo,
    ) -> Result<Call<()>, HandlerError> {
        let index = self.indices.registration.as_ref().map(|r| r.deregister);
        self.call(
            cx,
            Hook::Deregister,
            index,
            self.limits.fuel,
            |store, instance, index| {
                let func = instance.get_typed_func::<(&PluginInfo,), ()>(&mut *store, index)?;
                func.call(&mut *store, (plugin,))?;
                Ok(())
            },
            |_| Ok(()),
        )
    }

    /// Runs `allocation-policy.allocate`: which `count` device ids to give one container.
    pub fn allocate(
        &self,
        cx: &CallContext,
        request: &AllocationRequest,
    ) -> Result<Call<Result<Vec<String>, Refusal>>, HandlerError> {
        let fuel = self.limits.fuel_for(request.available.len());
        if let Some(packed) = self.indices.allocate_packed {
            let request = PackedRequest::from(request);
            return self.call(
                cx,
                Hook::Allocate,
                Some(packed),
                fuel,
                |store, instance, index| {
                    let func = instance
                        .get_typed_func::<(PackedRequest<'_>,), (Result<Vec<String>, Refusal>,)>(
                            &mut *store,
                            index,
                        )?;
                    let (out,) = func.call(&mut *store, (request,))?;
                    Ok(out)
                },
                answer::check_allocate,
            );
        }
        let index = self.indices.allocate;
        let request = ListedRequest::from(request);
        self.call(
            cx,
            Hook::Allocate,
            index,
            fuel,
            |store, instance, index| {
                let func = instance
                    .get_typed_func::<(&ListedRequest,), (Result<Vec<String>, Refusal>,)>(
                        &mut *store,
                        index,
                    )?;
                let (out,) = func.call(&mut *store, (&request,))?;
                Ok(out)
            },
            answer::check_allocate,
        )
    }

    /// What makes this handler's spare for calls on `node_name`.
    fn maker(&self, node_name: &str) -> Maker {
        Maker {
            runtime: self.runtime.clone(),
            pre: self.pre.clone(),
            module: self.module_arc.clone(),
            node_name: node_name.to_owned(),
            settings: self.settings.clone(),
            limits: self.limits,
            spare: self.spare.clone(),
        }
    }

    /// One call: wait for a pool slot, take the instance made ahead for it or build a fresh
    /// store (WASI, limits) and instantiate, arm `fuel` and the deadline, run `body`, turn any
    /// failure into a [`HandlerError`].
    fn call<R>(
        &self,
        cx: &CallContext,
        hook: Hook,
        index: Option<ComponentExportIndex>,
        fuel: Option<u64>,
        body: impl FnOnce(
            &mut Store<CallState>,
            &Instance,
            &ComponentExportIndex,
        ) -> wasmtime::Result<R>,
        check: impl FnOnce(&R) -> Result<(), HandlerFault>,
    ) -> Result<Call<R>, HandlerError> {
        let fail = |fault: HandlerFault| HandlerError {
            module: self.module.clone(),
            hook,
            fault,
        };
        let Some(index) = index else {
            return Err(fail(HandlerFault::MissingFamily {
                family: hook.family(),
            }));
        };
        // Without a bound on the wait, entering never gives up.
        let permit = self
            .runtime
            .gate
            .enter(self.runtime.config.pool_size, None)
            .ok();
        let started = Instant::now();
        let spare = crate::spent::take_spare(&self.spare, &cx.node_name);
        let (mut store, instance) = match spare {
            Some((store, instance)) => (store, Some(instance)),
            None => {
                let store = new_store(
                    &self.runtime,
                    self.module_arc.clone(),
                    cx.node_name.clone(),
                    self.settings.clone(),
                    &self.limits,
                );
                (store, None)
            }
        };
        let fuel = fuel.unwrap_or(u64::MAX);
        store
            .set_fuel(fuel)
            .map_err(|e| fail(HandlerFault::Instantiate { source: e.into() }))?;
        arm_deadline(&self.runtime, &self.limits, &mut store);

        let outcome = match instance {
            Some(instance) => Ok(instance),
            None => self.pre.instantiate(&mut store),
        }
        .and_then(|instance| body(&mut store, &instance, &index));
        let elapsed = started.elapsed();
        let result = match outcome {
            Ok(value) => check(&value).map_err(fail).map(|()| {
                let fuel_used = fuel.saturating_sub(store.get_fuel().unwrap_or(fuel));
                let state = store.data_mut();
                let mut logs = std::mem::take(&mut state.logs);
                if state.dropped_logs > 0 {
                    logs.push(GuestLog {
                        level: LogLevel::Warn,
                        message: format!(
                            "{} more log lines dropped (at most {} per call)",
                            state.dropped_logs,
                            crate::call_state::MAX_LOG_LINES
                        ),
                    });
                }
                Call {
                    value,
                    logs,
                    elapsed,
                    fuel_used,
                }
            }),
            Err(error) => Err(fail(self.classify(error, store.data(), fuel))),
        };
        // A call that failed leaves no spare behind: a module whose instantiation fails or runs
        // into its deadline is not instantiated again until its next call.
        let succeeded = result.is_ok();
        crate::spent::finish(store, permit.map(|p| p.owned(&self.runtime.gate)), || {
            succeeded.then(|| self.maker(&cx.node_name))
        });
        result
    }

    /// Names the cause of a failed call (`fuel`: the call's budget).
    fn classify(&self, error: wasmtime::Error, state: &CallState, fuel: u64) -> HandlerFault {
        if state.limiter.refused {
            return HandlerFault::MemoryCap {
                mib: self.limits.memory_mib,
            };
        }
        if answer::is_transfer_bound(&error) {
            return answer::transfer_too_large();
        }
        match error.downcast_ref::<Trap>().copied() {
            Some(Trap::StackOverflow) => HandlerFault::StackOverflow {
                stack: format!(
                    "the call stack of {} KiB",
                    crate::engine::WASM_STACK_BYTES >> 10
                ),
            },
            Some(Trap::MemoryOutOfBounds) if below_address_zero(&error) => {
                HandlerFault::StackOverflow {
                    stack: "the guest's own stack (in its memory, below its data)".into(),
                }
            }
            Some(Trap::Interrupt) => HandlerFault::Deadline {
                deadline: self.limits.deadline,
            },
            Some(Trap::OutOfFuel) => HandlerFault::Fuel { fuel },
            Some(trap) => {
                let output = state.output_text();
                // A trap's own text starts with `wasm trap: `.
                let message = if output.is_empty() {
                    trap.to_string()
                } else {
                    format!("{output} ({trap})")
                };
                HandlerFault::Trapped { message }
            }
            None => HandlerFault::Failed {
                output: state.output_text(),
                source: error.into(),
            },
        }
    }
}

/// A fresh store for one call of `module` on `node_name`: WASI, the memory cap, the transfer
/// bound; fuel and the deadline are armed by the caller.
pub(crate) fn new_store(
    runtime: &RuntimeInner,
    module: Arc<str>,
    node_name: String,
    settings: Arc<BTreeMap<String, String>>,
    limits: &Limits,
) -> Store<CallState> {
    let state = CallState::new(
        module,
        node_name,
        settings,
        (limits.memory_mib as usize) << 20,
    );
    let mut store = Store::new(&runtime.engine, state);
    store.limiter(|s| &mut s.limiter);
    store.set_hostcall_fuel(answer::MAX_TRANSFER_BYTES);
    store
}

/// Arms the deadline as a CPU-time budget of this thread. The epoch deadline fires after the
/// deadline in wall time; the callback then looks at the CPU time the calling thread actually
/// used, and only interrupts if the budget is spent (or the call has taken
/// [`Limits::wall_cap`] in wall time). A call that was merely descheduled on
/// a loaded machine gets the rest of its budget instead of failing spuriously.
///
/// Once the call has used [`LONG_CALL_CPU`] it is long: it goes on only with a permit of the
/// runtime's long-call gate ([`crate::RuntimeConfig::long_calls`]), waiting for one (its
/// CPU time not counted, its wall time still capped) while other long calls hold them all.
pub(crate) fn arm_deadline(runtime: &RuntimeInner, limits: &Limits, store: &mut Store<CallState>) {
    let tick = runtime.config.epoch_tick;
    let budget = limits.deadline;
    let wall_cap = limits.wall_cap();
    let long_calls = runtime.long_calls.clone();
    let long_limit = runtime.config.long_calls;
    let started = Instant::now();
    let cpu_start = thread_cpu_time();
    store.data_mut().wall_end = started.checked_add(wall_cap);
    store.set_epoch_deadline(ticks(tick, budget.min(LONG_CALL_CPU)));
    store.epoch_deadline_callback(move |mut cx| {
        let used = || match (cpu_start, thread_cpu_time()) {
            (Some(start), Some(now)) => now.saturating_sub(start),
            _ => started.elapsed(),
        };
        let spent = used();
        if spent >= budget || started.elapsed() >= wall_cap {
            return Ok(UpdateDeadline::Interrupt);
        }
        if spent < LONG_CALL_CPU {
            return Ok(UpdateDeadline::Continue(ticks(tick, LONG_CALL_CPU - spent)));
        }
        if cx.data().long_permit.is_none() {
            let left = wall_cap.saturating_sub(started.elapsed());
            match long_calls.enter(long_limit, Some(left)) {
                Ok(permit) => cx.data_mut().long_permit = Some(permit.owned(&long_calls)),
                Err(_) => return Ok(UpdateDeadline::Interrupt),
            }
        }
        Ok(UpdateDeadline::Continue(ticks(
            tick,
            budget.saturating_sub(used()),
        )))
    });
}

/// Epoch ticks covering `span`: rounded up, at least one.
fn ticks(tick: Duration, span: Duration) -> u64 {
    let ticks = span.as_nanos().div_ceil(tick.as_nanos().max(1));
    u64::try_from(ticks).unwrap_or(u64::MAX).max(1)
}
