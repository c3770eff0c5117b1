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

use rustc_hash::{FxHashMap, FxHashSet};

use pluglet_guest::names::check_qualified_name;
use pluglet_guest::{
    Accepted, AllocationPolicy, AllocationRequest, DeviceRef, PackedRequest, PluginInfo, Refusal,
    RefusalKind, RegisteredPlugin, Registration, RequestView,
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
        allocate_packed(&request)
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
///
/// The work is linear in the devices offered and cheap per device, so a plugin listing 100,000
/// devices is served within the default fuel: ids are hashed only to find the must-include and
/// preferred ids (one pass, and none when neither is given) and to keep an answer of more than
/// a few devices free of repeats (the ids chosen, not all of them); the packing order is a
/// counting sort by NUMA node.
/// An id listed twice is offered once, but counts twice towards its node's free devices.
pub fn allocate(request: &RequestView<'_>) -> Result<Vec<String>, Refusal> {
    choose(
        request.available.as_slice(),
        request.resource,
        request.must_include,
        request.count,
        request.preferred,
    )
}

/// [`allocate`] of a request in columns: the same answer as for
/// [`RequestView::of_packed`]`(request)`, read from the columns in place when their ends are in
/// order and in range (as the host sends them), so no vector of the devices is made.
pub fn allocate_packed(request: &PackedRequest) -> Result<Vec<String>, Refusal> {
    match Columns::of(request) {
        Some(columns) => choose(
            &columns,
            &request.resource,
            &request.must_include,
            request.count,
            request.preferred.as_deref(),
        ),
        None => allocate(&RequestView::of_packed(request)),
    }
}

/// The devices offered, by index.
trait Offered<'a> {
    /// How many.
    fn len(&self) -> usize;
    /// The id of device `i` (below [`Offered::len`]).
    fn id(&self, i: usize) -> &'a str;
    /// Calls `f` with each device's lowest NUMA node (`None`: no topology), in list order.
    fn for_each_lowest_node(&self, f: impl FnMut(Option<i64>));
}

/// The lowest of a device's NUMA nodes (most devices have one).
fn lowest(nodes: &[i64]) -> Option<i64> {
    match nodes {
        [one] => Some(*one),
        _ => nodes.iter().min().copied(),
    }
}

impl<'a> Offered<'a> for [DeviceRef<'a>] {
    fn len(&self) -> usize {
        <[DeviceRef<'a>]>::len(self)
    }

    fn id(&self, i: usize) -> &'a str {
        self[i].id
    }

    fn for_each_lowest_node(&self, mut f: impl FnMut(Option<i64>)) {
        for device in self {
            f(lowest(device.numa_nodes));
        }
    }
}

/// The columns of a packed request whose ends are in order, in range and (for ids) on
/// character boundaries, one NUMA end per id end: device `i` is what lies between its ends, the
/// device [`RequestView::of_packed`] reads there.
struct Columns<'a> {
    ids: &'a str,
    id_ends: &'a [u32],
    numa_nodes: &'a [i64],
    numa_ends: &'a [u32],
}

impl<'a> Columns<'a> {
    /// The columns of `request`, or `None` when an end is out of order or range.
    fn of(request: &'a PackedRequest) -> Option<Columns<'a>> {
        // Never decreasing, and the last within `len`: one pass without a branch per end.
        fn in_order(ends: &[u32], len: usize) -> bool {
            let mut last = 0;
            let mut backwards = false;
            for &end in ends {
                backwards |= end < last;
                last = end;
            }
            !backwards && last as usize <= len
        }
        let ids = request.ids.as_str();
        let whole = in_order(&request.id_ends, ids.len())
            && (ids.is_ascii()
                || request
                    .id_ends
                    .iter()
                    .all(|&end| ids.is_char_boundary(end as usize)))
            && request.numa_ends.len() == request.id_ends.len()
            && in_order(&request.numa_ends, request.numa_nodes.len());
        whole.then_some(Columns {
            ids,
            id_ends: &request.id_ends,
            numa_nodes: &request.numa_nodes,
            numa_ends: &request.numa_ends,
        })
    }
}

/// Where item `i` of a column whose items end at `ends` starts.
fn start(ends: &[u32], i: usize) -> usize {
    i.checked_sub(1).map_or(0, |before| ends[before] as usize)
}

impl<'a> Offered<'a> for Columns<'a> {
    fn len(&self) -> usize {
        self.id_ends.len()
    }

    fn id(&self, i: usize) -> &'a str {
        &self.ids[start(self.id_ends, i)..self.id_ends[i] as usize]
    }

    fn for_each_lowest_node(&self, mut f: impl FnMut(Option<i64>)) {
        // One pass along the ends, each device's nodes starting where the last one's ended.
        let mut start = 0;
        for &end in self.numa_ends {
            let end = end as usize;
            f(lowest(&self.numa_nodes[start..end]));
            start = end;
        }
    }
}

/// The policy over the devices `available` (see [`allocate`]).
fn choose<'a, O: Offered<'a> + ?Sized>(
    available: &O,
    resource: &str,
    must_include: &'a [String],
    count: u32,
    preferred: Option<&'a [String]>,
) -> Result<Vec<String>, Refusal> {
    let count = count as usize;
    let unsatisfiable = |message: String| Refusal::new(RefusalKind::Unsatisfiable, message);
    let preferred = preferred.unwrap_or_default();
    let found = first_indices(available, must_include.iter().chain(preferred));

    let mut chosen = Chosen::new(available, count.min(available.len()));
    for id in must_include {
        let Some(&i) = found.get(id.as_str()).filter(|&&i| i != NOT_FOUND) else {
            return Err(unsatisfiable(format!(
                "device {id} of {resource} must be included but is not available"
            )));
        };
        chosen.take(i);
    }
    if chosen.len() > count {
        return Err(unsatisfiable(format!(
            "{} devices of {resource} must be included but only {count} were requested",
            chosen.len()
        )));
    }
    if available.len() < count {
        let distinct = (0..available.len())
            .map(|i| available.id(i))
            .collect::<FxHashSet<_>>()
            .len();
        return Err(unsatisfiable(format!(
            "requested {count} devices of {resource} but only {distinct} are available"
        )));
    }

    for id in preferred {
        if chosen.len() == count {
            break;
        }
        if let Some(&i) = found.get(id.as_str()).filter(|&&i| i != NOT_FOUND) {
            chosen.take(i);
        }
    }
    if chosen.len() < count {
        PackingOrder::new(available, &chosen.indices).offer(|i| {
            chosen.take(i);
            chosen.len() == count
        });
    }
    if chosen.len() < count {
        // Every distinct id was taken: the list repeats ids.
        return Err(unsatisfiable(format!(
            "requested {count} devices of {resource} but only {} are available",
            chosen.len()
        )));
    }
    Ok(chosen
        .indices
        .into_iter()
        .map(|i| available.id(i).to_owned())
        .collect())
}

/// Answers up to this long are kept free of repeats by comparing ids one by one; longer ones
/// hash them (a set would cost more than the comparisons for the commonest answers, of a few
/// devices).
const FEW: usize = 16;

/// The devices in the answer so far, by index, none with the id of another (a repeat is
/// skipped).
struct Chosen<'a, 'o, O: Offered<'a> + ?Sized> {
    available: &'o O,
    indices: Vec<usize>,
    /// The ids of `indices`, once there are more than [`FEW`].
    ids: Option<FxHashSet<&'a str>>,
}

impl<'a, 'o, O: Offered<'a> + ?Sized> Chosen<'a, 'o, O> {
    fn new(available: &'o O, capacity: usize) -> Self {
        Chosen {
            available,
            indices: Vec::with_capacity(capacity),
            ids: None,
        }
    }

    fn len(&self) -> usize {
        self.indices.len()
    }

    /// Adds device `i` unless its id is already in the answer. In line where it is called:
    /// the packing order calls it per device offered.
    #[inline(always)]
    fn take(&mut self, i: usize) {
        let id = self.available.id(i);
        let repeat = match &mut self.ids {
            Some(ids) => !ids.insert(id),
            None => {
                let repeat = self.indices.iter().any(|&j| self.available.id(j) == id);
                if !repeat && self.indices.len() == FEW {
                    // Sized for the whole answer at once, not grown (and rehashed) step by step.
                    let mut ids: FxHashSet<&'a str> = FxHashSet::with_capacity_and_hasher(
                        self.indices.capacity(),
                        Default::default(),
                    );
                    ids.extend(self.indices.iter().map(|&j| self.available.id(j)));
                    ids.insert(id);
                    self.ids = Some(ids);
                }
                repeat
            }
        };
        if !repeat {
            self.indices.push(i);
        }
    }
}

/// Index of a wanted id that is not available.
const NOT_FOUND: usize = usize::MAX;

/// The first index in `available` of each of `wanted` ([`NOT_FOUND`] when absent), in one pass
/// that ends once all are found; no pass at all when nothing is wanted.
fn first_indices<'a, O: Offered<'a> + ?Sized>(
    available: &O,
    wanted: impl Iterator<Item = &'a String>,
) -> FxHashMap<&'a str, usize> {
    let mut found: FxHashMap<&str, usize> = FxHashMap::default();
    for id in wanted {
        found.insert(id.as_str(), NOT_FOUND);
    }
    let mut missing = found.len();
    for i in 0..available.len() {
        if missing == 0 {
            break;
        }
        if let Some(slot) = found.get_mut(available.id(i))
            && *slot == NOT_FOUND
        {
            *slot = i;
            missing -= 1;
        }
    }
    found
}

/// NUMA nodes below this are looked up in a table indexed by node; others in a hash map.
const DENSE_NODES: usize = 256;

/// Slot of the devices without topology.
const NO_TOPOLOGY: u32 = u32::MAX;

/// The packing order of a request's devices: devices on NUMA nodes already used by the chosen
/// ones first, then node by node from the node with the most free devices (ties: lower node
/// id), then devices without topology; in list order within a node. A device on several nodes
/// counts on its lowest.
struct PackingOrder {
    /// Each device's node, as an index into [`PackingOrder::nodes`] ([`NO_TOPOLOGY`]: none).
    slot_of_device: Vec<u32>,
    /// The nodes listed, in the order first met.
    nodes: Vec<Node>,
    /// Nodes (slots) in packing order.
    ranked: Vec<u32>,
}

/// One NUMA node of a request.
struct Node {
    id: i64,
    /// Devices listed on it.
    listed: usize,
    /// Of which already in the answer (the node is used; the rest are free).
    chosen: usize,
}

impl PackingOrder {
    /// Counts the devices per node and ranks the nodes; `chosen` are the devices already in the
    /// answer (their nodes come first, and they do not count as free).
    fn new<'a, O: Offered<'a> + ?Sized>(available: &O, chosen: &[usize]) -> PackingOrder {
        let mut dense = [NO_TOPOLOGY; DENSE_NODES];
        let mut sparse: FxHashMap<i64, u32> = FxHashMap::default();
        let mut nodes: Vec<Node> = Vec::new();
        let mut slot_of_device: Vec<u32> = Vec::with_capacity(available.len());
        // The node of the device before and its slot: neighbours usually share a node.
        let mut last: Option<(i64, u32)> = None;
        available.for_each_lowest_node(|node| {
            let Some(node) = node else {
                slot_of_device.push(NO_TOPOLOGY);
                return;
            };
            let slot = match last {
                Some((last_node, slot)) if last_node == node => slot,
                _ => {
                    let slot = match usize::try_from(node) {
                        Ok(n) if n < DENSE_NODES => &mut dense[n],
                        _ => sparse.entry(node).or_insert(NO_TOPOLOGY),
                    };
                    if *slot == NO_TOPOLOGY {
                        *slot = nodes.len() as u32;
                        nodes.push(Node {
                            id: node,
                            listed: 0,
                            chosen: 0,
                        });
                    }
                    last = Some((node, *slot));
                    *slot
                }
            };
            nodes[slot as usize].listed += 1;
            slot_of_device.push(slot);
        });

        for &i in chosen {
            let slot = slot_of_device[i];
            if slot != NO_TOPOLOGY {
                nodes[slot as usize].chosen += 1;
            }
        }
        let mut ranked: Vec<u32> = Vec::with_capacity(nodes.len() + 1);
        ranked.extend(0..nodes.len() as u32);
        ranked.sort_by(|&a, &b| {
            let (a, b) = (&nodes[a as usize], &nodes[b as usize]);
            (b.chosen > 0)
                .cmp(&(a.chosen > 0))
                .then((b.listed - b.chosen).cmp(&(a.listed - a.chosen)))
                .then(a.id.cmp(&b.id))
        });
        ranked.push(NO_TOPOLOGY);
        PackingOrder {
            slot_of_device,
            nodes,
            ranked,
        }
    }

    /// Offers the device indices to `take`, in packing order, until it says it is full. The
    /// first node is found by a scan that stops there (enough for most requests); the others,
    /// if needed, by one counting sort.
    fn offer(&self, mut take: impl FnMut(usize) -> bool) {
        let first = self.ranked[0];
        for (i, &slot) in self.slot_of_device.iter().enumerate() {
            if slot == first && take(i) {
                return;
            }
        }
        let rest = &self.ranked[1..];
        if rest.is_empty() {
            return;
        }
        // Where each slot's devices start among the rest; devices without topology last.
        let mut next = vec![0usize; self.nodes.len()];
        let mut start = 0;
        for &slot in rest.iter().filter(|&&s| s != NO_TOPOLOGY) {
            next[slot as usize] = start;
            start += self.nodes[slot as usize].listed;
        }
        let first_len = self.nodes.get(first as usize).map_or(0, |node| node.listed);
        let mut next_without_topology = start;
        let mut order = vec![0usize; self.slot_of_device.len() - first_len];
        for (i, &slot) in self.slot_of_device.iter().enumerate() {
            if slot == first {
                continue;
            }
            let at = if slot == NO_TOPOLOGY {
                &mut next_without_topology
            } else {
                &mut next[slot as usize]
            };
            order[*at] = i;
            *at += 1;
        }
        for i in order {
            if take(i) {
                return;
            }
        }
    }
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
    fn allocate_offers_a_repeated_id_once() {
        let r = request(
            vec![dev("a", &[0]), dev("a", &[0]), dev("b", &[1])],
            &["a"],
            2,
        );
        assert_eq!(allocate(&RequestView::of(&r)).unwrap(), ids(&["a", "b"]));
        let r = request(vec![dev("a", &[0]), dev("a", &[0]), dev("b", &[0])], &[], 3);
        let refusal = allocate(&RequestView::of(&r)).unwrap_err();
        assert!(
            refusal.message.contains("requested 3") && refusal.message.contains("only 2"),
            "{}",
            refusal.message
        );
    }

    #[test]
    fn a_long_answer_repeats_no_id_either() {
        // Past the answers whose ids are compared one by one: 40 devices, each id listed twice.
        let devices: Vec<Device> = (0..40)
            .map(|i| dev(&format!("d{}", i % 20), &[0]))
            .collect();
        let r = request(devices.clone(), &["d3", "d3"], 20);
        let answer = allocate(&RequestView::of(&r)).unwrap();
        let expected: Vec<String> = std::iter::once(3)
            .chain((0..20).filter(|&i| i != 3))
            .map(|i| format!("d{i}"))
            .collect();
        assert_eq!(answer, expected);
        let refusal = allocate(&RequestView::of(&request(devices, &[], 21))).unwrap_err();
        assert!(
            refusal.message.contains("requested 21") && refusal.message.contains("only 20"),
            "{}",
            refusal.message
        );
    }

    #[test]
    fn allocate_orders_nodes_out_of_the_table_range_too() {
        let r = request(
            vec![
                dev("small", &[3]),
                dev("huge-0", &[1 << 40]),
                dev("neg-0", &[-2]),
                dev("huge-1", &[1 << 40]),
                dev("neg-1", &[-2]),
                dev("huge-2", &[1 << 40]),
            ],
            &["small"],
            5,
        );
        assert_eq!(
            allocate(&RequestView::of(&r)).unwrap(),
            ids(&["small", "huge-0", "huge-1", "huge-2", "neg-0"])
        );
    }

    #[test]
    fn allocate_among_a_hundred_thousand_devices_takes_the_first_of_the_fullest_node() {
        let available: Vec<Device> = (0..100_000)
            .map(|i| dev(&format!("dev-{i}"), &[i % 4 / 3]))
            .collect();
        let r = request(available, &[], 1_000);
        let got = allocate(&RequestView::of(&r)).unwrap();
        let expected: Vec<String> = (0..100_000)
            .filter(|i| i % 4 != 3)
            .take(1_000)
            .map(|i| format!("dev-{i}"))
            .collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn allocate_zero_is_empty() {
        assert_eq!(
            allocate(&RequestView::of(&request(vec![], &[], 0))).unwrap(),
            Vec::<String>::new()
        );
    }

    /// `request` in columns, as the host sends it.
    fn packed(request: &AllocationRequest) -> PackedRequest {
        let mut packed = PackedRequest {
            resource: request.resource.clone(),
            ids: String::new(),
            id_ends: Vec::new(),
            numa_nodes: Vec::new(),
            numa_ends: Vec::new(),
            must_include: request.must_include.clone(),
            count: request.count,
            preferred: request.preferred.clone(),
        };
        for d in &request.available {
            packed.ids.push_str(&d.id);
            packed.id_ends.push(packed.ids.len() as u32);
            packed.numa_nodes.extend_from_slice(&d.numa_nodes);
            packed.numa_ends.push(packed.numa_nodes.len() as u32);
        }
        packed
    }

    #[test]
    fn columns_read_in_place_answer_as_the_records_do() {
        let available: Vec<Device> = (0..40)
            .map(|i| match i % 5 {
                0 => dev(&format!("d{i}"), &[]),
                1 => dev(&format!("d{i}"), &[1, 0]),
                4 => dev(&format!("é{}", i / 10), &[(i % 3) as i64]),
                _ => dev(&format!("d{i}"), &[(i % 3) as i64]),
            })
            .collect();
        for (must, count, preferred) in [
            (vec![], 1, None),
            (vec![], 7, None),
            (vec!["d3"], 5, None),
            (vec!["d3", "d3"], 2, None),
            (vec!["x"], 2, None),
            (vec![], 40, None),
            (vec![], 41, None),
            (vec!["d2"], 4, Some(vec!["d7", "nope", "d2", "d13"])),
        ] {
            let mut r = request(available.clone(), &must, count);
            r.preferred = preferred.map(|p| ids(&p));
            let answer = allocate(&RequestView::of(&r));
            assert_eq!(allocate_packed(&packed(&r)), answer, "{must:?} {count}");
        }
    }

    #[test]
    fn columns_of_one_node_each_answer_as_the_view() {
        // The shape the daemon sends most: every device on exactly one node, nodes interleaved
        // and out of order, the lowest node not the first listed.
        let available: Vec<Device> = (0..60)
            .map(|i| dev(&format!("d{i}"), &[[3, 1, 2, 1, 0][i % 5]]))
            .collect();
        for (must, count) in [(vec![], 1), (vec![], 13), (vec!["d4"], 3), (vec![], 60)] {
            let r = request(available.clone(), &must, count);
            let answer = allocate(&RequestView::of(&r));
            assert!(answer.is_ok(), "{must:?} {count}");
            assert_eq!(allocate_packed(&packed(&r)), answer, "{must:?} {count}");
        }
    }

    #[test]
    fn columns_out_of_order_answer_as_the_view_reads_them() {
        let r = request(vec![dev("ab", &[0]), dev("c", &[1])], &[], 1);
        for (id_ends, numa_ends) in [
            (vec![5, 1], vec![1, 2]),
            (vec![2, 1], vec![1, 2]),
            (vec![2, 3], vec![2, 1]),
            (vec![2, 3], vec![1]),
            (vec![1, 3], vec![1, 2]),
        ] {
            let mut columns = packed(&r);
            columns.ids = "éb".into();
            columns.id_ends = id_ends;
            columns.numa_ends = numa_ends;
            assert_eq!(
                allocate_packed(&columns),
                allocate(&RequestView::of_packed(&columns)),
                "{:?} {:?}",
                columns.id_ends,
                columns.numa_ends
            );
        }
    }
}
