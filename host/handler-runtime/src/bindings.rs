//! The one `bindgen!` of the host: the `pluglet:handler` contract from guest-sdk/wit.
//!
//! Only the `host` import interface is used from here (its `Host` trait and `add_to_linker`); the
//! exported families are called through typed functions looked up by the exact export name the
//! component carries (see [`crate::handler`]), because a component may export only one family and
//! may have been built for an older minor version of the contract.

#![allow(missing_docs)]

wasmtime::component::bindgen!({
    path: "../../guest-sdk/wit",
    world: "handler",
});

/// The contract version this host implements (the WIT package version).
pub const CONTRACT_VERSION: &str = "1.2.0";

/// The contract's major version: components of the same major version load.
pub const CONTRACT_MAJOR: u64 = 1;

/// The contract's WIT package name, without version.
pub const CONTRACT_PACKAGE: &str = "pluglet:handler";
