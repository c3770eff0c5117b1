//! Built-in Pluglet handler for device plugins, and the default allocation policy.
//!
//! Registration (the same rules for plugins registering over `kubelet.sock` and through the
//! plugin watcher):
//! - `validate`: the supported versions must include `v1beta1`; the plugin's name must be an
//!   extended resource name (contains `/`, no `kubernetes.io/`, no `requests.` prefix, and
//!   `requests.<name>` is a qualified name); a plugin with the same name replaces the registered
//!   one (accepted, as the kubelet does). `accepted.version` is `v1beta1`.
//!
//! Allocation policy (`allocate`):
//! - refuses (`unsatisfiable`) when fewer than `count` devices are available or a must-include id
//!   is not available;
//! - with the plugin's preference: must-include first, then the preferred ids that are available,
//!   then fill by the packing order below;
//! - without: must-include first, then pack onto as few NUMA nodes as possible: nodes already used
//!   by the must-include devices, then the nodes with the most free devices, devices without
//!   topology last.
//!
//! Rules are plain functions ([`validate`], [`allocate`], …) so they are unit-tested natively.

use std::collections::BTreeMap;

use rustc_hash::{FxHashMap, FxHashSet};

use pluglet_guest::names::check_qualified_name;
use pluglet_guest::{
    Accepted, AllocationPolicy, AllocationRequest, PackedRequest, PluginInfo, Refusal, RefusalKind,
    RegisteredPlugin, Registration, RequestView,
};

/// The device plugin API version the kubelet supports.
pub const SUPPORTED_VERSION: &str = "v1beta1";

/// The device plugin handler (registration and allocation policy).
pub struct DevicePlugin;

impl Registration for DevicePlugin {
    fn validate(
        plugin: PluginInfo,
        existing: Option<RegisteredPlugin>,
    ) -> Result<Accepted, Refusal> {
        let accepted = validate(&plugin)?;
        if let Some(old) = existing {
            pluglet_guest::info(&format!(
                "device plugin {} replaces the one registered at {}",
                plugin.name, old.info.endpoint
            ));
        }
        Ok(accepted)
    }

    fn deregister(plugin: PluginInfo) {
        pluglet_guest::info(&format!("device plugin {} deregistered", plugin.name));
    }
}

impl AllocationPolicy for DevicePlugin {
    fn allocate(request: AllocationRequest) -> Result<Vec<String>, Refusal> {
        allocate(&RequestView::of(&request))
    }

    fn allocate_packed(request: PackedRequest) -> Result<Vec<String>, Refusal> {
        allocate(&RequestView::of_packed(&request))
    }
}

pluglet_guest::export_handler!(DevicePlugin: registration, allocation_policy);

/// The `validate` rules (see the crate doc). A registered plugin of the same name does not
/// matter: the new one replaces it.
pub fn validate(plugin: &PluginInfo) -> Result<Accepted, Refusal> {
    if !plugin
        .supported_versions
        .iter()
        .any(|v| v == SUPPORTED_VERSION)
    {
        return Err(Refusal::new(
            RefusalKind::UnsupportedVersion,
            format!(
                "requested API version {:?} is not supported by kubelet. Supported version is \
                 [{SUPPORTED_VERSION}]; build the plugin against deviceplugin {SUPPORTED_VERSION}",
                plugin.supported_versions
            ),
        ));
    }
    if let Err(reason) = check_extended_resource_name(&plugin.name) {
        return Err(Refusal::new(
            RefusalKind::InvalidName,
            format!(
                "the ResourceName {:?} is invalid: {reason}; use a name like vendor.com/gpu",
                plugin.name
            ),
        ));
    }
    Ok(Accepted {
        version: Some(SUPPORTED_VERSION.to_string()),
    })
}

/// Whether `name` is an extended resource name (Kubernetes `IsExtendedResourceName`); `Err` says
/// which rule it breaks.
pub fn check_extended_resource_name(name: &str) -> Result<(), String> {
    if !name.contains('/') {
        return Err("it has no domain prefix (an extended resource name contains '/')".into());
    }
    if name.contains("kubernetes.io/") {
        return Err("names under kubernetes.io/ are reserved for native resources".into());
    }
    if name.starts_with("requests.") {
        return Err("it must not start with \"requests.\"".into());
    }
    let quota_name = format!("requests.{name}");
    check_qualified_name(&quota_name)
        .map_err(|e| format!("\"requests.\" + the name must be a qualified name: {e}"))
}

/// The allocation policy (see the crate doc).
pub fn allocate(request: &RequestView<'_>) -> Result<Vec<String>, Refusal> {
    let count = request.count as usize;
    let resource = request.resource;
    let unsatisfiable = |message: String| Refusal::new(RefusalKind::Unsatisfiable, message);
    // First index of each id: lookups stay O(1) for thousands of devices. (FxHash: no random
    // seed to fetch from the host, and a fraction of SipHash's cost on short ids.)
    let mut first_index: FxHashMap<&str, usize> =
        FxHashMap::with_capacity_and_hasher(request.available.len(), Default::default());
    for (i, device) in request.available.iter().enumerate() {
        first_index.entry(device.id).or_insert(i);
    }
    let index_of = |id: &str| first_index.get(id).copied();

    let mut chosen: Vec<usize> = Vec::with_capacity(count);
    let mut taken: FxHashSet<usize> =
        FxHashSet::with_capacity_and_hasher(count, Default::default());
    for id in request.must_include {
        let Some(i) = index_of(id) else {
            return Err(unsatisfiable(format!(
                "device {id} of {resource} must be included but is not available"
            )));
        };
        if taken.insert(i) {
            chosen.push(i);
        }
    }
    if chosen.len() > count {
        return Err(unsatisfiable(format!(
            "{} devices of {resource} must be included but only {count} were requested",
            chosen.len()
        )));
    }
    let distinct = first_index.len();
    if distinct < count {
        return Err(unsatisfiable(format!(
            "requested {count} devices of {resource} but only {distinct} are available"
        )));
    }

    if let Some(preferred) = request.preferred {
        for id in preferred {
            if chosen.len() == count {
                break;
            }
            if let Some(i) = index_of(id)
                && taken.insert(i)
            {
                chosen.push(i);
            }
        }
    }
    if chosen.len() < count {
        for i in packing_order(request, &first_index, &taken) {
            if chosen.len() == count {
                break;
            }
            chosen.push(i);
        }
    }
    Ok(chosen
        .into_iter()
        .map(|i| request.available[i].id.to_owned())
        .collect())
}

/// Indices of the devices not yet chosen (`taken`), in packing order: devices on NUMA nodes
/// already used by the chosen ones first, then node by node from the node with the most free devices (ties: lower
/// node id), then devices without topology. A device on several nodes counts on its lowest.
fn packing_order(
    request: &RequestView<'_>,
    first_index: &FxHashMap<&str, usize>,
    taken: &FxHashSet<usize>,
) -> Vec<usize> {
    let node_of = |i: usize| request.available[i].numa_nodes.iter().min().copied();
    let used_nodes: Vec<i64> = taken.iter().filter_map(|&i| node_of(i)).collect();
    let mut by_node: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
    let mut no_topology = Vec::new();
    for (i, device) in request.available.iter().enumerate() {
        // Skip the chosen ones and later duplicates of an id.
        if taken.contains(&i) || first_index.get(device.id) != Some(&i) {
            continue;
        }
        match node_of(i) {
            Some(node) => by_node.entry(node).or_default().push(i),
            None => no_topology.push(i),
        }
    }
    let mut nodes: Vec<(i64, Vec<usize>)> = by_node.into_iter().collect();
    nodes.sort_by(|(a_node, a), (b_node, b)| {
        let a_used = used_nodes.contains(a_node);
        let b_used = used_nodes.contains(b_node);
        b_used
            .cmp(&a_used)
            .then(b.len().cmp(&a.len()))
            .then(a_node.cmp(b_node))
    });
    nodes
        .into_iter()
        .flat_map(|(_, devices)| devices)
        .chain(no_topology)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pluglet_guest::Device;

    fn plugin(name: &str, versions: &[&str]) -> PluginInfo {
        PluginInfo {
            plugin_type: "DevicePlugin".into(),
            name: name.into(),
            endpoint: "vendor.sock".into(),
            supported_versions: versions.iter().map(|v| v.to_string()).collect(),
        }
    }

    fn dev(id: &str, numa: &[i64]) -> Device {
        Device {
            id: id.into(),
            numa_nodes: numa.to_vec(),
        }
    }

    fn request(available: Vec<Device>, must: &[&str], count: u32) -> AllocationRequest {
        AllocationRequest {
            resource: "vendor.com/gpu".into(),
            available,
            must_include: must.iter().map(|s| s.to_string()).collect(),
            count,
            preferred: None,
        }
    }

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn validate_accepts_v1beta1_and_extended_names() {
        let accepted = validate(&plugin("vendor.com/gpu", &["v1alpha", "v1beta1"])).unwrap();
        assert_eq!(accepted.version.as_deref(), Some("v1beta1"));
    }

    #[test]
    fn validate_refuses_other_versions() {
        let refusal = validate(&plugin("vendor.com/gpu", &["v1alpha"])).unwrap_err();
        assert_eq!(refusal.kind, RefusalKind::UnsupportedVersion);
        assert!(refusal.message.contains("not supported by kubelet"));
        assert!(validate(&plugin("vendor.com/gpu", &[])).is_err());
    }

    #[test]
    fn validate_refuses_non_extended_resource_names() {
        for bad in [
            "gpu",
            "kubernetes.io/gpu",
            "Vendor.com/gpu",
            "requests.vendor.com/gpu",
            "vendor.com/-gpu",
            "vendor.com/a/b",
            "/gpu",
            "vendor.com/",
        ] {
            let refusal = validate(&plugin(bad, &["v1beta1"])).unwrap_err();
            assert_eq!(refusal.kind, RefusalKind::InvalidName, "{bad}");
            assert!(
                refusal.message.contains("is invalid"),
                "{}",
                refusal.message
            );
        }
        let long_name = format!("vendor.com/{}", "g".repeat(64));
        assert!(check_extended_resource_name(&long_name).is_err());
        // "requests." counts towards the 253 characters of the prefix.
        let long_prefix = format!("{}.com/gpu", "a".repeat(245));
        assert!(check_extended_resource_name(&long_prefix).is_err());
        assert!(check_extended_resource_name("nvidia.com/gpu").is_ok());
        assert!(check_extended_resource_name("example.com/Foo_bar.1").is_ok());
    }

    #[test]
    fn same_name_replaces() {
        let old = RegisteredPlugin {
            info: plugin("vendor.com/gpu", &["v1beta1"]),
            version: Some("v1beta1".into()),
        };
        let accepted = <DevicePlugin as Registration>::validate(
            plugin("vendor.com/gpu", &["v1beta1"]),
            Some(old),
        );
        assert!(accepted.is_ok());
    }

    #[test]
    fn allocate_packs_onto_the_fullest_numa_node() {
        let r = request(
            vec![
                dev("a0", &[0]),
                dev("b0", &[1]),
                dev("b1", &[1]),
                dev("b2", &[1]),
                dev("a1", &[0]),
            ],
            &[],
            3,
        );
        assert_eq!(
            allocate(&RequestView::of(&r)).unwrap(),
            ids(&["b0", "b1", "b2"])
        );
    }

    #[test]
    fn allocate_puts_must_include_first_and_stays_on_its_node() {
        let r = request(
            vec![
                dev("a0", &[0]),
                dev("a1", &[0]),
                dev("b0", &[1]),
                dev("b1", &[1]),
                dev("b2", &[1]),
            ],
            &["a1"],
            2,
        );
        assert_eq!(allocate(&RequestView::of(&r)).unwrap(), ids(&["a1", "a0"]));
    }

    #[test]
    fn allocate_takes_devices_without_topology_last() {
        let r = request(
            vec![
                dev("x", &[]),
                dev("a0", &[0]),
                dev("b0", &[1]),
                dev("b1", &[1]),
            ],
            &[],
            4,
        );
        assert_eq!(
            allocate(&RequestView::of(&r)).unwrap(),
            ids(&["b0", "b1", "a0", "x"])
        );
    }

    #[test]
    fn allocate_takes_the_preference_filtered_then_fills() {
        let mut r = request(
            vec![dev("a0", &[0]), dev("a1", &[0]), dev("b0", &[1])],
            &["a1"],
            3,
        );
        r.preferred = Some(ids(&["gone", "b0", "a1"]));
        assert_eq!(
            allocate(&RequestView::of(&r)).unwrap(),
            ids(&["a1", "b0", "a0"])
        );
    }

    #[test]
    fn allocate_refuses_when_too_few_or_must_include_missing() {
        let r = request(vec![dev("a0", &[0])], &[], 2);
        let refusal = allocate(&RequestView::of(&r)).unwrap_err();
        assert_eq!(refusal.kind, RefusalKind::Unsatisfiable);
        assert!(
            refusal.message.contains("only 1 are available"),
            "{}",
            refusal.message
        );
        let r = request(vec![dev("a0", &[0])], &["zz"], 1);
        assert_eq!(
            allocate(&RequestView::of(&r)).unwrap_err().kind,
            RefusalKind::Unsatisfiable
        );
        let r = request(vec![dev("a0", &[0]), dev("a1", &[0])], &["a0", "a1"], 1);
        assert_eq!(
            allocate(&RequestView::of(&r)).unwrap_err().kind,
            RefusalKind::Unsatisfiable
        );
    }

    #[test]
    fn allocate_zero_is_empty() {
        assert_eq!(
            allocate(&RequestView::of(&request(vec![], &[], 0))).unwrap(),
            Vec::<String>::new()
        );
    }
}
