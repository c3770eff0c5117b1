//! Built-in Pluglet handler for CSI node plugins: the kubelet's CSI registration rules.
//!
//! - `validate`: the driver name must be a DNS-1123 subdomain (the API server would refuse its
//!   CSINode entry later); the highest supported version is chosen as the kubelet does (scan the
//!   list from last to first, apimachinery "generic" version rules, skip unparsable entries and
//!   majors above 1, the result must have major 1); an empty list is refused; a driver of the same
//!   name may only replace a registered one with a strictly higher version. The chosen version
//!   (the plugin's own string) is returned in `accepted.version`.
//! - `register`: NodeGetInfo's node id must not be empty; topology segments must be valid node
//!   labels (the kubelet copies them onto the Node); a negative volume limit is logged and ignored.
//!
//! Rules are plain functions ([`validate`], [`register`], [`parse_generic`], …) so they are
//! unit-tested natively; the component is built for `wasm32-wasip2` by `pluglet-wasm-guests`.

use std::cmp::Ordering;

use pluglet_guest::names::{is_dns1123_subdomain, is_label_value, is_qualified_name};
use pluglet_guest::{
    Accepted, PluginInfo, Refusal, RefusalKind, RegisteredPlugin, Registration, RegistrationFacts,
};

/// The CSI registration handler.
pub struct Csi;

impl Registration for Csi {
    fn validate(
        plugin: PluginInfo,
        existing: Option<RegisteredPlugin>,
    ) -> Result<Accepted, Refusal> {
        let accepted = validate(&plugin, existing.as_ref())?;
        pluglet_guest::debug(&format!(
            "CSI driver {} accepted with version {}",
            plugin.name,
            accepted.version.as_deref().unwrap_or("-")
        ));
        Ok(accepted)
    }

    fn register(plugin: PluginInfo, facts: RegistrationFacts) -> Result<(), Refusal> {
        if let Some(max) = facts.max_volumes_per_node.filter(|m| *m < 0) {
            pluglet_guest::warn(&format!(
                "CSI driver {} reported a negative max_volumes_per_node ({max}); ignoring it",
                plugin.name
            ));
        }
        register(&plugin, &facts)
    }

    fn deregister(plugin: PluginInfo) {
        pluglet_guest::debug(&format!("CSI driver {} deregistered", plugin.name));
    }
}

pluglet_guest::export_handler!(Csi: registration);

/// A version parsed with apimachinery's "generic" rules (`k8s.io/apimachinery/pkg/util/version`
/// `ParseGeneric`): optional leading whitespace and `v`, at least two dot-separated numeric
/// components, the first without a leading zero, any trailing text ignored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GenericVersion {
    components: Vec<u64>,
}

impl GenericVersion {
    /// The major (first) component.
    pub fn major(&self) -> u64 {
        self.components[0]
    }

    /// The numeric components.
    pub fn components(&self) -> &[u64] {
        &self.components
    }
}

impl Ord for GenericVersion {
    /// Component by component; a missing component counts as 0 (`1.0` == `1.0.0`).
    fn cmp(&self, other: &Self) -> Ordering {
        let len = self.components.len().max(other.components.len());
        for i in 0..len {
            let a = self.components.get(i).copied().unwrap_or(0);
            let b = other.components.get(i).copied().unwrap_or(0);
            match a.cmp(&b) {
                Ordering::Equal => continue,
                unequal => return unequal,
            }
        }
        Ordering::Equal
    }
}

impl PartialOrd for GenericVersion {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl std::fmt::Display for GenericVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.components.iter().map(u64::to_string).collect();
        f.write_str(&parts.join("."))
    }
}

/// Parses `text` with apimachinery's generic version rules; `Err` says why not.
pub fn parse_generic(text: &str) -> Result<GenericVersion, String> {
    let trimmed = text.trim_start();
    let rest = trimmed.strip_prefix('v').unwrap_or(trimmed);
    // The regexp `v?([0-9]+(\.[0-9]+)*)(.*)`: digits, then any `.digits` groups; the rest is
    // ignored by the generic rules.
    let bytes = rest.as_bytes();
    let digits_from = |mut i: usize| {
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        i
    };
    let mut end = digits_from(0);
    if end == 0 {
        return Err(format!("could not parse {text:?} as version"));
    }
    while end + 1 < bytes.len() && bytes[end] == b'.' && bytes[end + 1].is_ascii_digit() {
        end = digits_from(end + 1);
    }
    let numbers = &rest[..end];
    let parts: Vec<&str> = numbers.split('.').collect();
    if parts.len() < 2 {
        return Err(format!("illegal version string {text:?}"));
    }
    let mut components = Vec::with_capacity(parts.len());
    for (i, part) in parts.iter().enumerate() {
        if i == 0 && part.starts_with('0') && *part != "0" {
            return Err(format!(
                "illegal zero-prefixed version component {part:?} in {text:?}"
            ));
        }
        let n = part
            .parse::<u64>()
            .map_err(|e| format!("illegal version component {part:?} in {text:?}: {e}"))?;
        components.push(n);
    }
    Ok(GenericVersion { components })
}

/// The kubelet's `highestSupportedVersion`: scans `versions` from last to first, skips
/// unparsable entries and majors above 1, keeps the highest (the later entry wins a tie), and
/// requires major 1. Returns the chosen entry as the plugin wrote it, with its parsed form.
pub fn highest_supported_version(
    versions: &[String],
) -> Result<(String, GenericVersion), VersionError> {
    if versions.is_empty() {
        return Err(VersionError::Empty);
    }
    let mut best: Option<(&String, GenericVersion)> = None;
    let mut last_error = None;
    for entry in versions.iter().rev() {
        let parsed = match parse_generic(entry) {
            Ok(parsed) => parsed,
            Err(e) => {
                last_error = Some(e);
                continue;
            }
        };
        if parsed.major() > 1 {
            continue;
        }
        if best.as_ref().is_none_or(|(_, b)| *b < parsed) {
            best = Some((entry, parsed));
        }
    }
    match best {
        None => Err(VersionError::NoneUsable { last_error }),
        Some((_, parsed)) if parsed.major() == 0 => Err(VersionError::MajorZero(parsed)),
        Some((entry, parsed)) => Ok((entry.trim().to_string(), parsed)),
    }
}

/// Why no version could be chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VersionError {
    /// The plugin listed no versions.
    Empty,
    /// No entry is parsable with major ≤ 1; the last parse error, if any.
    NoneUsable {
        /// The last parse error.
        last_error: Option<String>,
    },
    /// The highest usable version is 0.x.
    MajorZero(GenericVersion),
}

/// The `validate` rules (see the crate doc).
pub fn validate(
    plugin: &PluginInfo,
    existing: Option<&RegisteredPlugin>,
) -> Result<Accepted, Refusal> {
    let name = &plugin.name;
    if !is_dns1123_subdomain(name) {
        return Err(Refusal::new(
            RefusalKind::InvalidName,
            format!(
                "CSI driver name {name:?} is not a DNS-1123 subdomain (at most 253 characters of \
                 lowercase letters, digits, '-' and '.', each part starting and ending with a \
                 letter or digit); the API server would refuse its CSINode entry later, so \
                 rename the driver"
            ),
        ));
    }
    let (chosen, parsed) = highest_supported_version(&plugin.supported_versions).map_err(|e| {
        let message = match e {
            VersionError::Empty => format!(
                "CSI driver {name} reported an empty list of supported versions; it must \
                     support a 1.x version of the CSI spec"
            ),
            VersionError::NoneUsable { last_error } => format!(
                "none of the versions {:?} supported by CSI driver {name} is usable: the \
                     kubelet needs a parsable 1.x version{}",
                plugin.supported_versions,
                last_error
                    .map(|e| format!(" (last error: {e})"))
                    .unwrap_or_default()
            ),
            VersionError::MajorZero(v) => format!(
                "highest supported version reported by CSI driver {name} is {v}, must be \
                     v1.x (0.x drivers are not supported since Kubernetes 1.17)"
            ),
        };
        Refusal::new(RefusalKind::UnsupportedVersion, message)
    })?;
    if let Some(existing) = existing
        && let Some(old) = existing_version(existing)
        && old >= parsed
    {
        return Err(Refusal::new(
            RefusalKind::AlreadyRegistered,
            format!(
                "another CSI driver named {name} is already registered with version {old} \
                 (endpoint {}), and {chosen} is not higher; a driver of the same name may only \
                 replace it with a strictly higher supported version, so remove the old \
                 driver's socket first",
                existing.info.endpoint
            ),
        ));
    }
    Ok(Accepted {
        version: Some(chosen),
    })
}

/// The version a registered driver holds: the one its handler chose, else its highest usable one.
fn existing_version(existing: &RegisteredPlugin) -> Option<GenericVersion> {
    existing
        .version
        .as_deref()
        .and_then(|v| parse_generic(v).ok())
        .or_else(|| {
            highest_supported_version(&existing.info.supported_versions)
                .ok()
                .map(|(_, v)| v)
        })
}

/// The `register` rules (see the crate doc).
pub fn register(plugin: &PluginInfo, facts: &RegistrationFacts) -> Result<(), Refusal> {
    let name = &plugin.name;
    if facts.node_id.as_deref().is_none_or(|id| id.is_empty()) {
        return Err(Refusal::new(
            RefusalKind::InvalidFacts,
            format!(
                "CSI driver {name} returned an empty node id from NodeGetInfo; the kubelet \
                 requires one, so fix the driver's NodeGetInfo"
            ),
        ));
    }
    for kv in &facts.topology {
        if !is_qualified_name(&kv.key) || !is_label_value(&kv.value) {
            return Err(Refusal::new(
                RefusalKind::InvalidFacts,
                format!(
                    "CSI driver {name} reported topology segment {:?}={:?}, which is not a valid \
                     node label (the kubelet copies segments onto the Node); fix the driver's \
                     NodeGetInfo accessible_topology",
                    kv.key, kv.value
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pluglet_guest::KeyValue;

    fn plugin(name: &str, versions: &[&str]) -> PluginInfo {
        PluginInfo {
            plugin_type: "CSIPlugin".into(),
            name: name.into(),
            endpoint: format!("/var/lib/kubelet/plugins/{name}/csi.sock"),
            supported_versions: versions.iter().map(|v| v.to_string()).collect(),
        }
    }

    fn v(text: &str) -> GenericVersion {
        parse_generic(text).unwrap()
    }

    #[test]
    fn generic_versions_parse_like_apimachinery() {
        assert_eq!(v("1.2").components(), &[1, 2]);
        assert_eq!(v("v1.2.3").components(), &[1, 2, 3]);
        assert_eq!(v("  1.2.3-beta+x").components(), &[1, 2, 3]);
        assert_eq!(v("1.2.x").components(), &[1, 2]);
        assert_eq!(v("1.0.0.1").components(), &[1, 0, 0, 1]);
        assert_eq!(v("1.02").components(), &[1, 2]);
        assert_eq!(v("1.2..3").components(), &[1, 2]);
        for bad in ["1", "v1", "", "x1.0", "01.0", "1.", "v", ".1.0", "1..2"] {
            assert!(parse_generic(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn generic_versions_compare_with_missing_components_as_zero() {
        assert_eq!(v("1.0"), v("1.0").clone());
        assert_eq!(v("1.0").cmp(&v("1.0.0")), Ordering::Equal);
        assert!(v("1.0.1") > v("1.0"));
        assert!(v("1.10.0") > v("1.9.9"));
    }

    #[test]
    fn highest_version_is_chosen_scanning_from_the_end() {
        let versions: Vec<String> = ["0.3.0", "1.0.0", "1.5.0", "2.0.0", "junk"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(highest_supported_version(&versions).unwrap().0, "1.5.0");
        // A tie keeps the later entry (the first one scanned).
        let tie: Vec<String> = ["v1.2", "1.2.0"].iter().map(|s| s.to_string()).collect();
        assert_eq!(highest_supported_version(&tie).unwrap().0, "1.2.0");
    }

    #[test]
    fn validate_accepts_and_reports_the_chosen_version() {
        let accepted = validate(&plugin("csi.example.com", &["1.0.0", "1.2.0"]), None).unwrap();
        assert_eq!(accepted.version.as_deref(), Some("1.2.0"));
    }

    #[test]
    fn validate_refuses_empty_and_unusable_versions() {
        let empty = validate(&plugin("csi.example.com", &[]), None).unwrap_err();
        assert_eq!(empty.kind, RefusalKind::UnsupportedVersion);
        assert!(empty.message.contains("empty list"), "{}", empty.message);

        let zero = validate(&plugin("csi.example.com", &["0.3.0"]), None).unwrap_err();
        assert_eq!(zero.kind, RefusalKind::UnsupportedVersion);
        assert!(zero.message.contains("must be v1.x"), "{}", zero.message);

        let two = validate(&plugin("csi.example.com", &["2.0.0", "nope"]), None).unwrap_err();
        assert_eq!(two.kind, RefusalKind::UnsupportedVersion);
        assert!(
            two.message.contains("none of the versions"),
            "{}",
            two.message
        );
    }

    #[test]
    fn validate_refuses_names_that_are_not_dns_subdomains() {
        for bad in ["Csi.Example.com", "csi_example", "-csi.example.com", ""] {
            let refusal = validate(&plugin(bad, &["1.0.0"]), None).unwrap_err();
            assert_eq!(refusal.kind, RefusalKind::InvalidName, "{bad:?}");
            assert!(refusal.message.contains("API server would refuse"));
        }
    }

    #[test]
    fn same_name_needs_a_strictly_higher_version() {
        let old = RegisteredPlugin {
            info: plugin("csi.example.com", &["1.2.0"]),
            version: Some("1.2.0".into()),
        };
        let same = validate(&plugin("csi.example.com", &["1.2.0"]), Some(&old)).unwrap_err();
        assert_eq!(same.kind, RefusalKind::AlreadyRegistered);
        assert!(same.message.contains("strictly higher"), "{}", same.message);
        let lower = validate(&plugin("csi.example.com", &["1.1.0"]), Some(&old)).unwrap_err();
        assert_eq!(lower.kind, RefusalKind::AlreadyRegistered);
        let higher = validate(&plugin("csi.example.com", &["1.3.0"]), Some(&old)).unwrap();
        assert_eq!(higher.version.as_deref(), Some("1.3.0"));
        // Without a recorded version the old driver's own list counts.
        let unrecorded = RegisteredPlugin {
            info: plugin("csi.example.com", &["1.4.0"]),
            version: None,
        };
        assert!(validate(&plugin("csi.example.com", &["1.3.0"]), Some(&unrecorded)).is_err());
    }

    #[test]
    fn register_needs_a_node_id_and_label_safe_topology() {
        let p = plugin("csi.example.com", &["1.0.0"]);
        let mut facts = RegistrationFacts {
            node_id: Some("node-1".into()),
            max_volumes_per_node: Some(10),
            topology: vec![KeyValue {
                key: "topology.example.com/zone".into(),
                value: "zone-a".into(),
            }],
        };
        assert_eq!(register(&p, &facts), Ok(()));
        facts.topology[0].value = "not a label!".into();
        assert_eq!(
            register(&p, &facts).unwrap_err().kind,
            RefusalKind::InvalidFacts
        );
        facts.topology.clear();
        facts.node_id = Some(String::new());
        let refusal = register(&p, &facts).unwrap_err();
        assert_eq!(refusal.kind, RefusalKind::InvalidFacts);
        assert!(refusal.message.contains("empty node id"));
        facts.node_id = None;
        assert!(register(&p, &facts).is_err());
    }
}
