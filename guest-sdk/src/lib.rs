//! Guest SDK for Pluglet handlers: write a handler as a plain Rust trait impl and export it with
//! one macro; build it with `cargo build --release --target wasm32-wasip2` to get a component.
//!
//! The contract is the WIT package `pluglet:handler` in this crate's `wit/handler.wit`. Each hook
//! family is one exported interface, and a component exports only the families it implements:
//! - [`Registration`]: `validate`, `register`, `deregister` (every method has a default);
//! - [`AllocationPolicy`]: `allocate` (the default takes the must-include ids, then the first
//!   available ones).
//!
//! Helpers for the rules themselves: [`names`] (Kubernetes name rules: DNS-1123 subdomains,
//! label values, qualified names) and [`must_include_first`] (the opening every allocation
//! answer shares).
//!
//! ```
//! use pluglet_guest::{Accepted, PluginInfo, Refusal, RefusalKind, RegisteredPlugin, Registration};
//!
//! /// Accepts plugins whose name ends with `.example.com`.
//! pub struct ExampleOnly;
//!
//! impl Registration for ExampleOnly {
//!     fn validate(plugin: PluginInfo, _existing: Option<RegisteredPlugin>) -> Result<Accepted, Refusal> {
//!         check_name(&plugin.name)?;
//!         pluglet_guest::info(&format!("accepting {}", plugin.name));
//!         Ok(Accepted { version: None })
//!     }
//! }
//!
//! /// The rule as a plain function: unit tests call it natively.
//! pub fn check_name(name: &str) -> Result<(), Refusal> {
//!     if name.ends_with(".example.com") {
//!         Ok(())
//!     } else {
//!         Err(Refusal::new(RefusalKind::InvalidName, format!("{name} is not an example.com plugin")))
//!     }
//! }
//!
//! pluglet_guest::export_handler!(ExampleOnly: registration);
//! # fn main() { assert!(check_name("a.example.com").is_ok()); }
//! ```
//!
//! Building and trying a handler:
//! ```text
//! # Cargo.toml: [lib] crate-type = ["cdylib", "rlib"]; [dependencies] pluglet-guest = ...
//! cargo build --release --target wasm32-wasip2      # needs `rustup target add wasm32-wasip2`
//! pluglet handler check target/wasm32-wasip2/release/my_handler.wasm
//! pluglet handler test target/wasm32-wasip2/release/my_handler.wasm --hook validate --event plugin.json
//! ```
//! Calls are cheapest with a small shadow stack (the built-ins use 64 KiB: the pages a call
//! touches then stay resident in the host's instance pool), e.g. in `.cargo/config.toml`:
//! `[target.wasm32-wasip2] rustflags = ["-C", "link-arg=-zstack-size=65536"]`.
//! A handler may use the clocks, randomness and stdout/stderr, but not files, sockets or HTTP:
//! the host refuses such a component when it loads it, naming the import.
//!
//! The guest crate must depend on this crate under the name `pluglet_guest` (the export macro
//! refers to it by that path) and be a `cdylib` (`crate-type = ["cdylib", "rlib"]` keeps native
//! unit tests working). On targets other than `wasm32` the macro only type-checks the impl, and
//! the host helpers ([`log`], [`node_name`], [`setting`]) fall back to stderr and empty answers,
//! so handler logic runs in native unit tests.

pub mod names;

#[doc(hidden)]
pub mod __private {
    pub use wit_bindgen;

    /// Types and host imports of the contract, generated once here; guests' export glue refers
    /// to these (see `__pluglet_generate_world!`).
    #[allow(missing_docs, unsafe_code, clippy::all)]
    pub mod bindings {
        wit_bindgen::generate!({
            path: "wit",
            inline: "package pluglet:guest-sdk;
                     world imports { import pluglet:handler/host@1.2.0; }",
            world: "pluglet:guest-sdk/imports",
            generate_all,
            generate_unused_types: true,
            additional_derives: [PartialEq, Eq],
        });
    }
}

include!(concat!(env!("OUT_DIR"), "/generate_world.rs"));

#[cfg(target_arch = "wasm32")]
use __private::bindings::pluglet::handler::host;

pub use __private::bindings::pluglet::handler::host::Level;
pub use __private::bindings::pluglet::handler::types::{
    Accepted, AllocationRequest, Device, KeyValue, PackedRequest, PluginInfo, Refusal, RefusalKind,
    RegisteredPlugin, RegistrationFacts,
};

impl Refusal {
    /// A refusal of `kind` with a message saying what was wrong and what to do.
    pub fn new(kind: RefusalKind, message: impl Into<String>) -> Refusal {
        Refusal {
            kind,
            message: message.into(),
        }
    }
}

impl Accepted {
    /// Accepted, choosing `version` of the type-specific API.
    pub fn with_version(version: impl Into<String>) -> Accepted {
        Accepted {
            version: Some(version.into()),
        }
    }
}

/// The `registration` hook family: run when a plugin registers and deregisters. Every method has
/// a default, so implement only the hooks you care about.
pub trait Registration {
    /// Decides whether `plugin` may register; `existing` is the plugin already registered under
    /// the same type and name, if any. Default: accept, choosing no version.
    fn validate(
        plugin: PluginInfo,
        existing: Option<RegisteredPlugin>,
    ) -> Result<Accepted, Refusal> {
        let _ = (plugin, existing);
        Ok(Accepted { version: None })
    }

    /// Runs once the host has gathered its native facts (for CSI: NodeGetInfo). Default: accept.
    fn register(plugin: PluginInfo, facts: RegistrationFacts) -> Result<(), Refusal> {
        let _ = (plugin, facts);
        Ok(())
    }

    /// Runs when the plugin's socket has gone. Default: nothing.
    fn deregister(plugin: PluginInfo) {
        let _ = plugin;
    }
}

/// The `allocation-policy` hook family: which devices a container gets.
pub trait AllocationPolicy {
    /// Chooses exactly `request.count` distinct ids from `request.available`, including every
    /// `must_include` id. Default: [`first_fit`].
    fn allocate(request: AllocationRequest) -> Result<Vec<String>, Refusal> {
        first_fit(&request)
    }

    /// The same request in columns: what a 1.2.0 host sends. Default: [`unpack`] it and call
    /// [`AllocationPolicy::allocate`]. A policy for thousands of devices overrides it to read
    /// [`RequestView::of_packed`] instead, with no copy per device.
    fn allocate_packed(request: PackedRequest) -> Result<Vec<String>, Refusal> {
        Self::allocate(unpack(request))
    }
}

/// A device of an allocation request, borrowed: what a policy reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRef<'a> {
    /// Device id as the plugin reported it.
    pub id: &'a str,
    /// NUMA nodes the device is attached to; empty when it has no topology.
    pub numa_nodes: &'a [i64],
}

/// An allocation request borrowed from either form ([`AllocationRequest`] or the columns of
/// [`PackedRequest`]): one vector of [`DeviceRef`]s, no copy of any id. A policy written
/// against it serves both entry points without allocating per device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestView<'a> {
    /// Extended resource name.
    pub resource: &'a str,
    /// Healthy devices held by no other container.
    pub available: Vec<DeviceRef<'a>>,
    /// Ids that must be part of the answer.
    pub must_include: &'a [String],
    /// How many ids to choose.
    pub count: u32,
    /// The plugin's GetPreferredAllocation answer, when it offers one.
    pub preferred: Option<&'a [String]>,
}

impl<'a> RequestView<'a> {
    /// A view of a request of records.
    pub fn of(request: &'a AllocationRequest) -> RequestView<'a> {
        RequestView {
            resource: &request.resource,
            available: request
                .available
                .iter()
                .map(|d| DeviceRef {
                    id: &d.id,
                    numa_nodes: &d.numa_nodes,
                })
                .collect(),
            must_include: &request.must_include,
            count: request.count,
            preferred: request.preferred.as_deref(),
        }
    }

    /// A view of a request in columns. Ends out of range or not increasing are clamped (an id
    /// that would split a character is empty), so a bad request yields fewer or shorter ids
    /// rather than a trap; the host never sends one.
    pub fn of_packed(request: &'a PackedRequest) -> RequestView<'a> {
        let mut available = Vec::with_capacity(request.id_ends.len());
        let (mut id_start, mut numa_start) = (0usize, 0usize);
        for (i, &end) in request.id_ends.iter().enumerate() {
            let id_end = (end as usize).clamp(id_start, request.ids.len());
            let numa_end = request.numa_ends.get(i).map_or(numa_start, |&e| {
                (e as usize).clamp(numa_start, request.numa_nodes.len())
            });
            available.push(DeviceRef {
                id: request.ids.get(id_start..id_end).unwrap_or_default(),
                numa_nodes: &request.numa_nodes[numa_start..numa_end],
            });
            (id_start, numa_start) = (id_end, numa_end);
        }
        RequestView {
            resource: &request.resource,
            available,
            must_include: &request.must_include,
            count: request.count,
            preferred: request.preferred.as_deref(),
        }
    }

    /// An owned [`AllocationRequest`] with the same content.
    pub fn to_request(&self) -> AllocationRequest {
        AllocationRequest {
            resource: self.resource.to_owned(),
            available: self
                .available
                .iter()
                .map(|d| Device {
                    id: d.id.to_owned(),
                    numa_nodes: d.numa_nodes.to_vec(),
                })
                .collect(),
            must_include: self.must_include.to_vec(),
            count: self.count,
            preferred: self.preferred.map(<[String]>::to_vec),
        }
    }
}

/// Turns a request in columns (`allocate-packed`, contract 1.2.0) into an [`AllocationRequest`]
/// (see [`RequestView::of_packed`] for how bad ends are treated).
pub fn unpack(request: PackedRequest) -> AllocationRequest {
    RequestView::of_packed(&request).to_request()
}

/// The opening every valid allocation answer shares: the must-include ids of `request`, each
/// once, in order. Refuses (`unsatisfiable`) when one of them is not available or when there are
/// more of them than `request.count`. A policy appends its own choices to what this returns.
pub fn must_include_first(request: &AllocationRequest) -> Result<Vec<String>, Refusal> {
    let mut chosen: Vec<String> = Vec::with_capacity(request.count as usize);
    for id in &request.must_include {
        if !request.available.iter().any(|d| &d.id == id) {
            return Err(Refusal::new(
                RefusalKind::Unsatisfiable,
                format!("must-include device {id} is not available"),
            ));
        }
        if !chosen.contains(id) {
            chosen.push(id.clone());
        }
    }
    if chosen.len() > request.count as usize {
        return Err(Refusal::new(
            RefusalKind::Unsatisfiable,
            format!(
                "{} must-include devices but only {} requested",
                chosen.len(),
                request.count
            ),
        ));
    }
    Ok(chosen)
}

/// The simplest valid allocation: the must-include ids, then available ids in order. Refuses
/// (`unsatisfiable`) when a must-include id is not available or too few devices are.
pub fn first_fit(request: &AllocationRequest) -> Result<Vec<String>, Refusal> {
    let count = request.count as usize;
    let mut chosen = must_include_first(request)?;
    for device in &request.available {
        if chosen.len() == count {
            break;
        }
        if !chosen.contains(&device.id) {
            chosen.push(device.id.clone());
        }
    }
    if chosen.len() < count {
        return Err(Refusal::new(
            RefusalKind::Unsatisfiable,
            format!(
                "requested {count} devices of {} but only {} are available",
                request.resource,
                chosen.len()
            ),
        ));
    }
    Ok(chosen)
}

/// Writes a line to the daemon's log, attributed to this handler. Natively: to stderr.
pub fn log(level: Level, message: &str) {
    #[cfg(target_arch = "wasm32")]
    host::log(level, message);
    #[cfg(not(target_arch = "wasm32"))]
    eprintln!("[{level:?}] {message}");
}

/// [`log`] at debug level.
pub fn debug(message: &str) {
    log(Level::Debug, message);
}

/// [`log`] at info level.
pub fn info(message: &str) {
    log(Level::Info, message);
}

/// [`log`] at warn level.
pub fn warn(message: &str) {
    log(Level::Warn, message);
}

/// [`log`] at error level.
pub fn error(message: &str) {
    log(Level::Error, message);
}

/// The node's name. Natively: an empty string.
pub fn node_name() -> String {
    #[cfg(target_arch = "wasm32")]
    return host::node_name();
    #[cfg(not(target_arch = "wasm32"))]
    String::new()
}

/// One read-only setting of this handler (from `handlers.toml`). Natively: `None`.
pub fn setting(key: &str) -> Option<String> {
    #[cfg(target_arch = "wasm32")]
    return host::setting(key);
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = key;
        None
    }
}

/// Every setting of this handler, sorted by key. Natively: empty.
pub fn settings() -> Vec<KeyValue> {
    #[cfg(target_arch = "wasm32")]
    return host::settings();
    #[cfg(not(target_arch = "wasm32"))]
    Vec::new()
}

/// Exports a handler type as a component implementing the listed families: `registration`,
/// `allocation_policy`, or both (`registration, allocation_policy`).
///
/// ```
/// use pluglet_guest::{AllocationPolicy, Registration};
///
/// /// Accepts every plugin (default hooks) and allocates first-fit (default policy).
/// pub struct Lenient;
/// impl Registration for Lenient {}
/// impl AllocationPolicy for Lenient {}
///
/// pluglet_guest::export_handler!(Lenient: registration, allocation_policy);
/// # fn main() {}
/// ```
/// The type must implement [`Registration`] and/or [`AllocationPolicy`] accordingly. Use it once
/// per guest crate, at the crate root. The component exports exactly these families, which is how
/// the host knows what the handler implements. On targets other than `wasm32` it only checks the
/// trait impls.
#[macro_export]
macro_rules! export_handler {
    ($ty:ty: registration) => {
        $crate::__pluglet_export!($ty, "registration-handler", [registration]);
    };
    ($ty:ty: allocation_policy) => {
        $crate::__pluglet_export!($ty, "allocation-handler", [allocation_policy]);
    };
    ($ty:ty: registration, allocation_policy) => {
        $crate::__pluglet_export!($ty, "handler", [registration allocation_policy]);
    };
    ($ty:ty: allocation_policy, registration) => {
        $crate::__pluglet_export!($ty, "handler", [registration allocation_policy]);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __pluglet_export {
    ($ty:ty, $world:tt, [$($family:ident)*]) => {
        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        #[allow(missing_docs, unsafe_code, unused_imports, clippy::all)]
        mod __pluglet_guest_export {
            use super::*;
            $crate::__pluglet_generate_world!($world);
            struct __PlugletAdapter;
            $( $crate::__pluglet_impl!($family, $ty); )*
            export!(__PlugletAdapter);
        }
        #[cfg(not(target_arch = "wasm32"))]
        const _: () = {
            $( $crate::__pluglet_check!($family, $ty); )*
        };
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __pluglet_check {
    (registration, $ty:ty) => {
        let _ = <$ty as $crate::Registration>::validate;
    };
    (allocation_policy, $ty:ty) => {
        let _ = <$ty as $crate::AllocationPolicy>::allocate;
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __pluglet_impl {
    (registration, $ty:ty) => {
        impl exports::pluglet::handler::registration::Guest for __PlugletAdapter {
            fn validate(
                plugin: $crate::PluginInfo,
                existing: Option<$crate::RegisteredPlugin>,
            ) -> Result<$crate::Accepted, $crate::Refusal> {
                <$ty as $crate::Registration>::validate(plugin, existing)
            }
            fn register(
                plugin: $crate::PluginInfo,
                facts: $crate::RegistrationFacts,
            ) -> Result<(), $crate::Refusal> {
                <$ty as $crate::Registration>::register(plugin, facts)
            }
            fn deregister(plugin: $crate::PluginInfo) {
                <$ty as $crate::Registration>::deregister(plugin)
            }
        }
    };
    (allocation_policy, $ty:ty) => {
        impl exports::pluglet::handler::allocation_policy::Guest for __PlugletAdapter {
            fn allocate(
                request: $crate::AllocationRequest,
            ) -> Result<Vec<String>, $crate::Refusal> {
                <$ty as $crate::AllocationPolicy>::allocate(request)
            }
            fn allocate_packed(
                request: $crate::PackedRequest,
            ) -> Result<Vec<String>, $crate::Refusal> {
                <$ty as $crate::AllocationPolicy>::allocate_packed(request)
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(available: &[&str], must: &[&str], count: u32) -> AllocationRequest {
        AllocationRequest {
            resource: "vendor.com/gpu".into(),
            available: available
                .iter()
                .map(|id| Device {
                    id: id.to_string(),
                    numa_nodes: vec![],
                })
                .collect(),
            must_include: must.iter().map(|s| s.to_string()).collect(),
            count,
            preferred: None,
        }
    }

    #[test]
    fn first_fit_takes_must_include_then_in_order() {
        assert_eq!(
            first_fit(&request(&["a", "b", "c"], &["c"], 2)).unwrap(),
            vec!["c", "a"]
                .into_iter()
                .map(String::from)
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn unpack_restores_the_columns() {
        let unpacked = unpack(PackedRequest {
            resource: "vendor.com/gpu".into(),
            ids: "d0gpu-1x".into(),
            id_ends: vec![2, 7, 8],
            numa_nodes: vec![0, 0, 1],
            numa_ends: vec![1, 1, 3],
            must_include: vec!["x".into()],
            count: 2,
            preferred: Some(vec!["d0".into()]),
        });
        let devices: Vec<(&str, &[i64])> = unpacked
            .available
            .iter()
            .map(|d| (d.id.as_str(), d.numa_nodes.as_slice()))
            .collect();
        assert_eq!(
            devices,
            [("d0", &[0][..]), ("gpu-1", &[][..]), ("x", &[0, 1][..])]
        );
        assert_eq!(unpacked.must_include, ["x"]);
        assert_eq!(
            (unpacked.count, unpacked.preferred),
            (2, Some(vec!["d0".into()]))
        );
    }

    #[test]
    fn unpack_clamps_bad_ends_instead_of_trapping() {
        let unpacked = unpack(PackedRequest {
            resource: "r".into(),
            ids: "ab".into(),
            id_ends: vec![5, 1],
            numa_nodes: vec![],
            numa_ends: vec![9],
            must_include: vec![],
            count: 1,
            preferred: None,
        });
        let ids: Vec<&str> = unpacked.available.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["ab", ""]);
    }

    #[test]
    fn first_fit_refuses_when_too_few() {
        let refusal = first_fit(&request(&["a"], &[], 2)).unwrap_err();
        assert_eq!(refusal.kind, RefusalKind::Unsatisfiable);
        assert!(refusal.message.contains("only 1 are available"));
    }

    #[test]
    fn must_include_first_keeps_order_and_drops_repeats() {
        assert_eq!(
            must_include_first(&request(&["a", "b", "c"], &["c", "a", "c"], 3)).unwrap(),
            ["c", "a"]
        );
        assert!(
            must_include_first(&request(&["a"], &[], 1))
                .unwrap()
                .is_empty()
        );
        let refusal = must_include_first(&request(&["a", "b"], &["a", "b"], 1)).unwrap_err();
        assert_eq!(refusal.kind, RefusalKind::Unsatisfiable);
        assert!(
            refusal
                .message
                .contains("2 must-include devices but only 1 requested"),
            "{}",
            refusal.message
        );
        let refusal = must_include_first(&request(&["a"], &["z"], 1)).unwrap_err();
        assert!(
            refusal.message.contains("z is not available"),
            "{}",
            refusal.message
        );
    }

    #[test]
    fn first_fit_refuses_unavailable_must_include() {
        let refusal = first_fit(&request(&["a"], &["z"], 1)).unwrap_err();
        assert_eq!(refusal.kind, RefusalKind::Unsatisfiable);
    }

    #[test]
    fn native_host_helpers_do_not_panic() {
        info("hello");
        assert_eq!(node_name(), "");
        assert_eq!(setting("x"), None);
        assert!(settings().is_empty());
    }
}
