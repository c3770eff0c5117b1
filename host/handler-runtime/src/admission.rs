//! Admission policy in plain Rust (no wasmtime): which imports a handler may have, and what its
//! exports say about the contract version and the families it implements.
//!
//! The runtime feeds these functions the names from `Component::component_type()`; the decisions
//! are unit-tested here on names alone.

use std::collections::BTreeMap;

use semver::{BuildMetadata, Version};

use crate::bindings::{CONTRACT_MAJOR, CONTRACT_PACKAGE};
use crate::types::Family;

/// WASI interfaces (package `wasi:<pkg>`, any 0.2.x version) a plain Rust `wasm32-wasip2` guest
/// imports without touching files or the network. Everything else is refused at load.
const ALLOWED_WASI: &[(&str, &[&str])] = &[
    ("io", &["error", "poll", "streams"]),
    (
        "cli",
        &[
            "environment",
            "exit",
            "stdin",
            "stdout",
            "stderr",
            "terminal-input",
            "terminal-output",
            "terminal-stdin",
            "terminal-stdout",
            "terminal-stderr",
        ],
    ),
    ("clocks", &["monotonic-clock", "wall-clock"]),
    ("random", &["random", "insecure", "insecure-seed"]),
];

/// Contract interfaces a handler may import.
const ALLOWED_CONTRACT_IMPORTS: &[&str] = &["host", "types"];

/// A parsed interface name `namespace:package/interface@version`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct InterfaceName<'a> {
    /// `namespace:package`, e.g. `wasi:io`.
    pub package: &'a str,
    /// Interface, e.g. `poll`.
    pub interface: &'a str,
    /// Version text after `@`, if any.
    pub version: Option<&'a str>,
}

impl<'a> InterfaceName<'a> {
    /// Parses `ns:pkg/iface[@version]`; `None` for anything else (a bare function, a plain name).
    pub(crate) fn parse(name: &'a str) -> Option<InterfaceName<'a>> {
        let (path, version) = match name.split_once('@') {
            Some((path, version)) => (path, Some(version)),
            None => (name, None),
        };
        let (package, interface) = path.split_once('/')?;
        if !package.contains(':') || interface.is_empty() {
            return None;
        }
        Some(InterfaceName {
            package,
            interface,
            version,
        })
    }
}

/// Parses a release version `major.minor.patch` as WIT package versions are written: build
/// metadata is dropped (it does not order versions), a pre-release or anything that is not a
/// semantic version gives `None`.
pub(crate) fn parse_release(text: &str) -> Option<Version> {
    let mut version = Version::parse(text).ok()?;
    if !version.pre.is_empty() {
        return None;
    }
    version.build = BuildMetadata::EMPTY;
    Some(version)
}

/// Whether a component may import `name`.
pub(crate) fn import_allowed(name: &str) -> bool {
    let Some(parsed) = InterfaceName::parse(name) else {
        return false;
    };
    if parsed.package == CONTRACT_PACKAGE {
        let major_ok = parsed
            .version
            .and_then(parse_release)
            .is_some_and(|v| v.major == CONTRACT_MAJOR);
        return major_ok && ALLOWED_CONTRACT_IMPORTS.contains(&parsed.interface);
    }
    let Some(pkg) = parsed.package.strip_prefix("wasi:") else {
        return false;
    };
    let version_ok = parsed
        .version
        .and_then(parse_release)
        .is_some_and(|v| v.major == 0 && v.minor == 2);
    version_ok
        && ALLOWED_WASI
            .iter()
            .any(|(p, ifaces)| *p == pkg && ifaces.contains(&parsed.interface))
}

/// Every import that is not allowed, in order.
pub(crate) fn forbidden_imports<'a>(imports: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    imports
        .into_iter()
        .filter(|name| !import_allowed(name))
        .collect()
}

/// What a component's exports say about the contract.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ContractExports {
    /// Contract version, e.g. `1.1.0` (the highest of the family exports).
    pub version: String,
    /// Families implemented, each with the exact export name carrying it.
    pub families: BTreeMap<Family, String>,
}

/// Why the exports do not describe a loadable handler.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ExportProblem {
    /// No family of the contract is exported; `found` lists what is.
    NoFamily { found: String },
    /// Families of another major version of the contract.
    Incompatible { found: String },
}

/// Reads the families and contract version from the component's export names.
pub(crate) fn read_exports<'a>(
    exports: impl IntoIterator<Item = &'a str>,
) -> Result<ContractExports, ExportProblem> {
    let mut all = Vec::new();
    let mut families = BTreeMap::new();
    let mut version: Option<Version> = None;
    let mut incompatible = Vec::new();
    for name in exports {
        all.push(name.to_string());
        let Some(parsed) = InterfaceName::parse(name) else {
            continue;
        };
        if parsed.package != CONTRACT_PACKAGE {
            continue;
        }
        let Some(family) = Family::from_interface(parsed.interface) else {
            continue;
        };
        match parsed.version.and_then(parse_release) {
            Some(v) if v.major == CONTRACT_MAJOR => {
                version = Some(match version.take() {
                    Some(old) if old >= v => old,
                    _ => v,
                });
                families.insert(family, name.to_string());
            }
            _ => incompatible.push(name.to_string()),
        }
    }
    if families.is_empty() {
        if !incompatible.is_empty() {
            return Err(ExportProblem::Incompatible {
                found: incompatible.join(", "),
            });
        }
        let found = if all.is_empty() {
            "nothing".to_string()
        } else {
            all.iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Err(ExportProblem::NoFamily { found });
    }
    Ok(ContractExports {
        version: version.map(|v| v.to_string()).unwrap_or_default(),
        families,
    })
}

/// Describes bytes that are not a component: a core module, other WebAssembly, or not WebAssembly.
pub(crate) fn describe_non_component(bytes: &[u8]) -> Option<String> {
    const MAGIC: &[u8] = b"\0asm";
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        let shown = bytes.len().min(4);
        return Some(format!(
            "not WebAssembly at all: {} bytes starting with {:02x?}",
            bytes.len(),
            &bytes[..shown]
        ));
    }
    // Bytes 4..8: version (2 bytes) + layer (2 bytes). Core modules: version 1, layer 0;
    // components: layer 1.
    let layer = u16::from_le_bytes([bytes[6], bytes[7]]);
    if layer == 0 {
        return Some(
            "a core WebAssembly module, e.g. built for wasm32-unknown-unknown or wasm32-wasip1"
                .to_string(),
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_versions_parse_without_build_metadata() {
        assert_eq!(parse_release("1.2.0"), Some(Version::new(1, 2, 0)));
        assert_eq!(parse_release("1.2.0+build.5"), Some(Version::new(1, 2, 0)));
        assert_eq!(parse_release("1.2.0+build.5").unwrap().to_string(), "1.2.0");
        for bad in ["1.2.0-rc.1", "1.2", "1.2.3.4", "v1.2.3", "", "x.y.z"] {
            assert_eq!(parse_release(bad), None, "{bad:?}");
        }
        assert!(parse_release("1.10.0") > parse_release("1.9.9"));
    }

    #[test]
    fn plain_rust_guest_imports_are_allowed() {
        for name in [
            "wasi:io/poll@0.2.6",
            "wasi:io/error@0.2.0",
            "wasi:io/streams@0.2.6",
            "wasi:cli/environment@0.2.6",
            "wasi:cli/exit@0.2.6",
            "wasi:cli/stderr@0.2.6",
            "wasi:cli/terminal-stdout@0.2.6",
            "wasi:clocks/monotonic-clock@0.2.6",
            "wasi:random/random@0.2.6",
            "pluglet:handler/host@1.1.0",
            "pluglet:handler/host@1.0.0",
            "pluglet:handler/types@1.1.0",
        ] {
            assert!(import_allowed(name), "{name} should be allowed");
        }
    }

    #[test]
    fn files_sockets_http_and_unknown_imports_are_refused() {
        for name in [
            "wasi:filesystem/types@0.2.6",
            "wasi:filesystem/preopens@0.2.6",
            "wasi:sockets/tcp@0.2.6",
            "wasi:sockets/ip-name-lookup@0.2.6",
            "wasi:http/outgoing-handler@0.2.6",
            "wasi:io/poll@0.3.0",
            "wasi:io/poll",
            "acme:evil/backdoor@1.0.0",
            "pluglet:handler/host@2.0.0",
            "pluglet:handler/registration@1.1.0",
            "some-function",
        ] {
            assert!(!import_allowed(name), "{name} should be refused");
        }
        assert_eq!(
            forbidden_imports(["wasi:io/poll@0.2.6", "wasi:filesystem/types@0.2.6"]),
            vec!["wasi:filesystem/types@0.2.6"]
        );
    }

    #[test]
    fn exports_give_families_and_version() {
        let got = read_exports([
            "pluglet:handler/registration@1.1.0",
            "pluglet:handler/allocation-policy@1.1.0",
        ])
        .unwrap();
        assert_eq!(got.version, "1.1.0");
        assert_eq!(
            got.families.keys().copied().collect::<Vec<_>>(),
            vec![Family::Registration, Family::AllocationPolicy]
        );

        let old = read_exports(["pluglet:handler/registration@1.0.0"]).unwrap();
        assert_eq!(old.version, "1.0.0");
        assert_eq!(
            old.families.get(&Family::Registration).map(String::as_str),
            Some("pluglet:handler/registration@1.0.0")
        );
    }

    #[test]
    fn exports_of_another_contract_are_named() {
        assert_eq!(
            read_exports(["wasi:cli/run@0.2.6"]),
            Err(ExportProblem::NoFamily {
                found: "`wasi:cli/run@0.2.6`".into()
            })
        );
        assert_eq!(
            read_exports([]),
            Err(ExportProblem::NoFamily {
                found: "nothing".into()
            })
        );
        assert_eq!(
            read_exports(["pluglet:handler/registration@2.0.0"]),
            Err(ExportProblem::Incompatible {
                found: "pluglet:handler/registration@2.0.0".into()
            })
        );
    }

    #[test]
    fn non_components_are_described() {
        assert!(
            describe_non_component(b"hello world")
                .unwrap()
                .contains("not WebAssembly")
        );
        let core = [0, b'a', b's', b'm', 1, 0, 0, 0];
        assert!(describe_non_component(&core).unwrap().contains("core"));
        let component = [0, b'a', b's', b'm', 0x0d, 0, 1, 0];
        assert_eq!(describe_non_component(&component), None);
    }
}
