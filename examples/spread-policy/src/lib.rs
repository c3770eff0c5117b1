//! Example vendor allocation policy: spread a container's devices across NUMA nodes.
//!
//! The built-in policy packs a container onto as few NUMA nodes as possible; a vendor whose
//! workload is bound by memory bandwidth may want the opposite. This component exports only the
//! `allocation-policy` family and is chosen per resource in `handlers.toml`, so it governs that
//! resource and nothing else:
//!
//! ```toml
//! [resources."vendor.com/gpu"]
//! module = "spread-policy.wasm"   # relative to the handlers directory
//! ```
//!
//! Rule: the must-include ids first; then, one device at a time, a device from the NUMA node
//! that holds the fewest chosen devices so far (ties: the lowest node id); devices without
//! topology come last. Within a node, devices the plugin preferred (GetPreferredAllocation) come
//! first, then the plugin's order. Too few devices, or a must-include id that is not available,
//! is refused as `unsatisfiable`.
//!
//! Build: `cargo build --release --target wasm32-wasip2 -p example-spread-policy` (the host's
//! `pluglet-wasm-guests` build script does it for the tests). Try it:
//! `pluglet handler test spread-policy.wasm --hook allocate --event request.json`. Its
//! conformance vectors, `spread-policy.vectors.json` (install it beside `spread-policy.wasm`):
//! `pluglet handler test spread-policy.wasm --vectors spread-policy.vectors.json`.

use std::collections::BTreeMap;

use pluglet_guest::{AllocationPolicy, AllocationRequest, Refusal, RefusalKind};

/// The spread policy.
pub struct Spread;

impl AllocationPolicy for Spread {
    fn allocate(request: AllocationRequest) -> Result<Vec<String>, Refusal> {
        let chosen = spread(&request)?;
        pluglet_guest::debug(&format!(
            "spread {} of {}: {chosen:?}",
            request.count, request.resource
        ));
        Ok(chosen)
    }
}

pluglet_guest::export_handler!(Spread: allocation_policy);

/// The rule (see the crate doc), as a plain function so it is unit-tested natively.
pub fn spread(request: &AllocationRequest) -> Result<Vec<String>, Refusal> {
    let count = request.count as usize;
    if request.available.len() < count {
        return Err(Refusal::new(
            RefusalKind::Unsatisfiable,
            format!(
                "requested {count} devices of {} but only {} are available",
                request.resource,
                request.available.len()
            ),
        ));
    }
    let preferred = request.preferred.as_deref().unwrap_or_default();
    let rank = |id: &str| preferred.iter().position(|p| p == id).unwrap_or(usize::MAX);

    // The must-include ids open the answer (the SDK checks them) and count towards their nodes.
    let mut chosen = pluglet_guest::must_include_first(request)?;
    // Devices chosen per NUMA node; a device on several nodes counts on each.
    let mut load: BTreeMap<i64, usize> = BTreeMap::new();
    for id in &chosen {
        let nodes = request.available.iter().find(|d| &d.id == id);
        for node in nodes.map(|d| d.numa_nodes.as_slice()).unwrap_or_default() {
            *load.entry(*node).or_default() += 1;
        }
    }

    // Free devices per node (first listed node), in preference order, then plugin order.
    let mut by_node: BTreeMap<i64, Vec<(usize, usize, &str)>> = BTreeMap::new();
    let mut no_topology: Vec<(usize, usize, &str)> = Vec::new();
    for (order, device) in request.available.iter().enumerate() {
        if chosen.contains(&device.id) {
            continue;
        }
        let item = (rank(&device.id), order, device.id.as_str());
        match device.numa_nodes.first() {
            Some(node) => by_node.entry(*node).or_default().push(item),
            None => no_topology.push(item),
        }
    }
    for list in by_node
        .values_mut()
        .chain(std::iter::once(&mut no_topology))
    {
        // Reversed, so `pop` yields the best candidate.
        list.sort_by(|a, b| b.cmp(a));
    }
    while chosen.len() < count {
        let node = by_node
            .iter()
            .filter(|(_, free)| !free.is_empty())
            .min_by_key(|(node, _)| (load.get(node).copied().unwrap_or(0), **node))
            .map(|(node, _)| *node);
        let next = match node {
            Some(node) => {
                *load.entry(node).or_default() += 1;
                by_node.get_mut(&node).and_then(Vec::pop)
            }
            None => no_topology.pop(),
        };
        match next {
            Some((_, _, id)) => chosen.push(id.to_owned()),
            None => break,
        }
    }
    if chosen.len() < count {
        return Err(Refusal::new(
            RefusalKind::Unsatisfiable,
            format!("could not find {count} devices of {}", request.resource),
        ));
    }
    Ok(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pluglet_guest::Device;

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

    fn four() -> Vec<Device> {
        vec![
            dev("dev-0", &[0]),
            dev("dev-1", &[1]),
            dev("dev-2", &[0]),
            dev("dev-3", &[1]),
        ]
    }

    #[test]
    fn spreads_one_device_per_node_first() {
        assert_eq!(
            spread(&request(four(), &[], 2)).unwrap(),
            ["dev-0", "dev-1"]
        );
        assert_eq!(
            spread(&request(four(), &[], 4)).unwrap(),
            ["dev-0", "dev-1", "dev-2", "dev-3"]
        );
    }

    #[test]
    fn must_include_counts_toward_its_node() {
        assert_eq!(
            spread(&request(four(), &["dev-2"], 2)).unwrap(),
            ["dev-2", "dev-1"]
        );
    }

    #[test]
    fn preference_orders_devices_within_a_node() {
        let mut r = request(four(), &[], 2);
        r.preferred = Some(vec!["dev-3".into(), "dev-2".into()]);
        assert_eq!(spread(&r).unwrap(), ["dev-2", "dev-3"]);
    }

    #[test]
    fn devices_without_topology_come_last() {
        let r = request(vec![dev("x", &[]), dev("a", &[0]), dev("b", &[0])], &[], 3);
        assert_eq!(spread(&r).unwrap(), ["a", "b", "x"]);
    }

    #[test]
    fn refuses_what_cannot_be_met() {
        let r = request(four(), &[], 5);
        assert_eq!(spread(&r).unwrap_err().kind, RefusalKind::Unsatisfiable);
        let r = request(four(), &["nope"], 1);
        assert_eq!(spread(&r).unwrap_err().kind, RefusalKind::Unsatisfiable);
    }
}
