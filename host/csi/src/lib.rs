//! Pluglet's CSI plugin type: the native steps of a CSI node plugin's registration, as a
//! [`pluglet_registration::PluginKind`] the daemon sets on the registration pipeline for
//! `CSIPlugin`. It is the CSI counterpart of the device plugin type's steps
//! (`host/device-manager/src/kind.rs`); the plugin manager (`pluglet-plugin-manager`), which
//! finds both in the plugin registry, knows neither.
//!
//! ```text
//!  Candidate ─▶ validate hook ─▶ register hook ─▶ activate: the fleet publisher, when there is
//!               gather_facts: NodeGetInfo          one, gets the driver (CSINode entry, node id
//!               (asked while the hook runs)        annotation, topology labels)
//!  registration ends ─▶ deactivate: the publisher forgets the driver
//! ```
//!
//! The decision to accept or refuse belongs to the handler module; nothing here knows about
//! WASM.

mod kind;

pub use kind::{CsiError, CsiKind, CsiNodeInfo, endpoint_path, node_get_info};
