//! Pluglet's guest components, built from source for `wasm32-wasip2` by this crate's build script
//! (an inner `cargo build --release --target wasm32-wasip2` into `<target>/wasm-guests`).
//!
//! The built-in handlers are embedded ([`CSI`], [`DEVICE_PLUGIN`]); the examples and (with the
//! `test-guests` feature, which only test builds turn on) the test guests are found by
//! [`guest_path`]. `.wasm` files are build outputs, never committed.

use std::path::PathBuf;

/// The built-in CSI handler component (`handlers/csi`).
pub const CSI: &[u8] = include_bytes!(concat!(
    env!("PLUGLET_WASM_GUESTS_DIR"),
    "/pluglet_handler_csi.wasm"
));

/// The built-in device plugin handler component, also the default allocation policy
/// (`handlers/device-plugin`).
pub const DEVICE_PLUGIN: &[u8] = include_bytes!(concat!(
    env!("PLUGLET_WASM_GUESTS_DIR"),
    "/pluglet_handler_device_plugin.wasm"
));

/// The directory holding the built components.
pub const GUESTS_DIR: &str = env!("PLUGLET_WASM_GUESTS_DIR");

/// Short names of the guests the build produced, e.g. `csi`, `misbehave`, `spread-policy`.
pub fn built_guests() -> Vec<&'static str> {
    env!("PLUGLET_WASM_GUESTS_BUILT")
        .split(',')
        .filter(|s| !s.is_empty())
        .collect()
}

/// The path of a built guest component by short name: `csi`, `device-plugin`, `spread-policy`,
/// and, with the `test-guests` feature, `misbehave`, `uses-fs`, `uses-tcp`, `contract-v1-0`,
/// `contract-v1-1` ([`built_guests`] says which were built). Other names map to
/// `<name with - as _>.wasm` in [`GUESTS_DIR`].
pub fn guest_path(name: &str) -> PathBuf {
    let file = match name {
        "csi" => "pluglet_handler_csi",
        "device-plugin" => "pluglet_handler_device_plugin",
        "misbehave" => "test_guest_misbehave",
        "uses-fs" => "test_guest_uses_fs",
        "uses-tcp" => "test_guest_uses_tcp",
        "contract-v1-0" => "test_guest_contract_v1_0",
        "contract-v1-1" => "test_guest_contract_v1_1",
        "spread-policy" => "example_spread_policy",
        other => {
            return PathBuf::from(GUESTS_DIR).join(format!("{}.wasm", other.replace('-', "_")));
        }
    };
    PathBuf::from(GUESTS_DIR).join(format!("{file}.wasm"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_are_components() {
        for bytes in [CSI, DEVICE_PLUGIN] {
            assert_eq!(&bytes[..4], b"\0asm");
            assert_eq!(&bytes[6..8], &[1, 0], "layer 1: a component");
        }
    }

    #[test]
    fn test_guests_are_built_with_their_feature_only() {
        for name in [
            "misbehave",
            "uses-fs",
            "uses-tcp",
            "contract-v1-0",
            "contract-v1-1",
        ] {
            assert_eq!(
                built_guests().contains(&name),
                cfg!(feature = "test-guests"),
                "{name}: {:?}",
                built_guests()
            );
            if cfg!(feature = "test-guests") {
                assert!(guest_path(name).exists(), "{}", guest_path(name).display());
            }
        }
    }
}
