//! The plugin types whose native steps live in the daemon itself, each a
//! [`pluglet_registration::PluginKind`] with its own facts type: [`csi`] asks the driver's
//! `NodeGetInfo` before the register hook. Device plugins' steps live with the device manager
//! (`pluglet-device-manager`), which connects their endpoints. The decision to accept or refuse
//! belongs to the handler module; nothing here knows about WASM.

pub mod csi;
