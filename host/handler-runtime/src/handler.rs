//! A loaded handler: one compiled component behind a shared `InstancePre`, called through a
//! fresh `Store` and instance per call (or, with [`Limits::reuse_instances`], one an earlier
//! call succeeded in) with that call's limits.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use wasmtime::component::{Component, ComponentExportIndex, Instance, InstancePre};
use wasmtime::{Store, Trap};

use crate::answer;
use crate::bindings::pluglet::handler::types as wit_types;
use crate::call_state::{CallState, MAX_LOG_LINES};
use crate::deferred_release::release_or_defer;
use crate::error::{HandlerError, HandlerFault, LoadError};
use crate::in_place::{self, HANDED_OFF_CALLS};
use crate::limits::{Limits, WASM_STACK_BYTES, check_limits};
use crate::spare::{SpareBuilder, Spares, keep_for_reuse, take_spare};
use crate::store::StoreFactory;
use crate::types::{
    Accepted, AllocationRequest, Call, CallContext, Family, GuestLog, Hook, ListedRequest,
    LogLevel, PackedRequest, PluginInfo, Refusal, RegisteredPlugin, RegistrationFacts,
};

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

/// Everything [`Handler::new`] needs (built by [`Runtime::load`](crate::Runtime::load)).
pub(crate) struct HandlerParts {
    pub stores: Arc<StoreFactory>,
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
    stores: Arc<StoreFactory>,
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
    /// Instances ready for the next calls: made ahead, or kept after a call (see
    /// [`crate::spare`]).
    spares: Arc<Spares>,
    /// Calls still to send straight off the async worker since one had to move (see
    /// [`crate::in_place`]).
    handed_off_calls: AtomicU32,
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

impl Handler {
    pub(crate) fn new(parts: HandlerParts) -> Handler {
        Handler {
            stores: parts.stores,
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
            spares: Arc::default(),
            handed_off_calls: AtomicU32::new(0),
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
    ) -> Result<Arc<Handler>, LoadError> {
        let limits = limits.unwrap_or(self.stores.config.default_limits);
        check_limits(&module, &limits)?;
        Ok(Arc::new(Handler {
            stores: self.stores.clone(),
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
            spares: Arc::default(),
            handed_off_calls: AtomicU32::new(0),
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
    fn spare_builder(&self, node_name: &str) -> SpareBuilder {
        SpareBuilder {
            stores: self.stores.clone(),
            pre: self.pre.clone(),
            module: self.module_arc.clone(),
            node_name: node_name.to_owned(),
            settings: self.settings.clone(),
            limits: self.limits,
            spares: self.spares.clone(),
        }
    }

    /// One call: wait for a pool slot, take a spare instance (made ahead, or kept from a call
    /// before) or build a fresh store (WASI, limits) and instantiate, arm `fuel` and the
    /// deadline, run `body`, turn any failure into a [`HandlerError`]; then keep the instance
    /// for the next call (a handler that reuses instances, after a call that succeeded) or
    /// free it.
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
        // In place on an async worker, a call that would wait (or whose handler's calls have
        // lately had to move) hands off at once (see `in_place`).
        let permit = if in_place::in_place() {
            let recently_moved = self
                .handed_off_calls
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok();
            let permit = if recently_moved {
                None
            } else {
                self.stores.try_enter_pool()
            };
            if permit.is_none() {
                in_place::hand_off();
                return Err(fail(HandlerFault::HandedOff));
            }
            permit
        } else {
            self.stores.enter_pool()
        };
        let started = Instant::now();
        let spare = take_spare(&self.spares, &cx.node_name);
        let (mut store, instance) = match spare {
            Some((store, instance)) => (store, Some(instance)),
            None => {
                let store = self.stores.new_store(
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
        let ticking = self.stores.arm_deadline(&self.limits, &mut store);

        let instance = match instance {
            Some(instance) => Ok(instance),
            None => self.pre.instantiate(&mut store),
        };
        let ran_in = instance.as_ref().ok().copied();
        let outcome = instance.and_then(|instance| body(&mut store, &instance, &index));
        drop(ticking);
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
                            state.dropped_logs, MAX_LOG_LINES
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
            Err(_) if in_place::handing_off() => {
                self.handed_off_calls
                    .store(HANDED_OFF_CALLS, Ordering::Relaxed);
                Err(fail(HandlerFault::HandedOff))
            }
            Err(error) => Err(fail(self.classify(error, store.data(), fuel))),
        };
        // A call that failed leaves no spare behind: a module whose instantiation fails or runs
        // into its deadline is not instantiated again until its next call. Nor is its instance
        // ever kept: a trap may have stopped the guest halfway through its own state.
        let succeeded = result.is_ok();
        let store = match ran_in {
            Some(instance) if succeeded && self.limits.reuse_instances => {
                match keep_for_reuse(&self.spares, &self.stores, store, instance) {
                    Ok(()) => return result,
                    Err(store) => store,
                }
            }
            _ => store,
        };
        release_or_defer(store, permit, || {
            succeeded.then(|| self.spare_builder(&cx.node_name))
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
                stack: format!("the call stack of {} KiB", WASM_STACK_BYTES >> 10),
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
