//! The devices of one resource: health, NUMA nodes, capacity and allocatable (see
//! `docs/kubelet-compatibility.md`, "Endpoints, health and the grace period" and "Capacity and
//! allocatable").
//!
//! Owned by the [`crate::registry`]; written by each endpoint's task (every ListAndWatch update
//! is the full new list) and by disconnects; read by the allocator and the admin API.
//!
//! A node may serve a resource of 100,000 devices, so a [`DeviceSet`] holds its devices in
//! columns rather than as [`ListedDevice`]s: every id once, one after another in one string
//! with where each ends; the health one byte each; the NUMA nodes likewise one after another
//! with where each device's nodes end. Its id index is a `hashbrown` [`HashTable`] of positions whose
//! hash is the id's, read from that string, and the id order is a list of positions: neither
//! copies an id. A device costs its id's bytes and about 20 bytes more (against some 250 as
//! `ListedDevice`s with an index of copied ids). The ListAndWatch decoder builds the set
//! ([`DeviceList`], then [`DeviceSet::from_list`]) and keeps a copy of it to compare the next
//! update with, which shares these columns.

use std::hash::BuildHasher;
use std::sync::Arc;

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;
use pluglet_handler_runtime::{ColumnRun, ListColumn, TextColumn};

use pluglet_proto::constants::HEALTHY;
use pluglet_proto::v1beta1;

use crate::device_id::DeviceId;

/// The hasher of maps and sets keyed by device id: foldhash rather than std's SipHash. The ids
/// come from the node's own plugins, and an allocation of 1,024 devices looks each one up
/// several times (candidates, the answer check, the reservation).
pub type IdHasher = foldhash::fast::RandomState;

/// The hasher of maps keyed by resource name, for the same reason: the names come from the
/// node's own plugins, and every allocation and release looks its resource up several times.
pub type NameHasher = foldhash::fast::RandomState;

/// A device's health. The kubelet counts a device as healthy only when the plugin's `health`
/// string is exactly `"Healthy"`; any other value, empty included, is unhealthy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Health {
    /// Counted in allocatable; may be allocated.
    Healthy,
    /// Counted in capacity only.
    Unhealthy,
}

impl Health {
    /// Parses the plugin's wire string as the kubelet does.
    pub fn from_wire(health: &str) -> Health {
        if health == HEALTHY {
            Health::Healthy
        } else {
            Health::Unhealthy
        }
    }

    /// The wire string: `"Healthy"` or `"Unhealthy"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => pluglet_proto::constants::HEALTHY,
            Health::Unhealthy => pluglet_proto::constants::UNHEALTHY,
        }
    }
}

/// One device as its plugin last listed it (in ListAndWatch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedDevice {
    /// Device id, unique within its resource.
    pub id: DeviceId,
    /// Current health.
    pub health: Health,
    /// NUMA nodes it is attached to; empty when the plugin gave no topology.
    pub numa: Vec<i64>,
}

impl ListedDevice {
    /// Converts a ListAndWatch device.
    pub fn from_wire(device: v1beta1::Device) -> ListedDevice {
        ListedDevice {
            health: Health::from_wire(&device.health),
            numa: device
                .topology
                .map(|t| t.nodes.into_iter().map(|n| n.id).collect())
                .unwrap_or_default(),
            id: device.id.into(),
        }
    }
}

/// One device of a [`DeviceSet`] or a [`DeviceList`], read from its columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Device<'a> {
    /// Device id, unique within its resource (in a set).
    pub id: &'a str,
    /// Current health.
    pub health: Health,
    /// NUMA nodes it is attached to; empty when the plugin gave no topology.
    pub numa: &'a [i64],
}

impl Device<'_> {
    /// The device as an owned [`ListedDevice`].
    pub fn to_listed(self) -> ListedDevice {
        ListedDevice {
            id: DeviceId::from(self.id),
            health: self.health,
            numa: self.numa.to_vec(),
        }
    }
}

/// A position in a set. A set holds one plugin's device list, which is at most
/// [`crate::endpoint::MAX_DEVICE_LIST_BYTES`] on the wire (a restored list was such a list),
/// so it has far fewer than 4 billion devices.
fn end(len: usize) -> u32 {
    u32::try_from(len).expect("a device list has fewer than 4 billion devices")
}

/// Devices in the order a plugin listed them, as read: empty and repeated ids included.
/// Held in columns (see the module doc); [`DeviceSet::from_list`] makes a set of it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceList {
    ids: TextColumn,
    health: Vec<Health>,
    numa: ListColumn<i64>,
}

impl DeviceList {
    /// Room for `devices` devices whose ids take about `id_bytes` bytes in all.
    pub fn with_capacity(devices: usize, id_bytes: usize) -> DeviceList {
        DeviceList {
            ids: TextColumn::with_capacity(devices, id_bytes),
            health: Vec::with_capacity(devices),
            numa: ListColumn::with_capacity(devices, devices),
        }
    }

    /// Adds a device.
    pub fn push(&mut self, id: &str, health: Health, numa: &[i64]) {
        self.ids.push(id);
        self.health.push(health);
        self.numa.push(numa);
    }

    /// How many devices.
    pub fn len(&self) -> usize {
        self.health.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.health.is_empty()
    }

    /// The device at `at` (below [`DeviceList::len`]).
    fn device(&self, at: usize) -> Device<'_> {
        Device {
            id: self.ids.get(at),
            health: self.health[at],
            numa: self.numa.get(at),
        }
    }

    /// The devices, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Device<'_>> + '_ {
        (0..self.len()).map(|at| self.device(at))
    }

    fn shrink_to_fit(&mut self) {
        self.ids.shrink_to_fit();
        self.health.shrink_to_fit();
        self.numa.shrink_to_fit();
    }
}

impl FromIterator<ListedDevice> for DeviceList {
    fn from_iter<I: IntoIterator<Item = ListedDevice>>(devices: I) -> DeviceList {
        let mut list = DeviceList::default();
        for d in devices {
            list.push(d.id.as_str(), d.health, &d.numa);
        }
        list
    }
}

/// The ids of a set (each once), their index and their order.
#[derive(Default)]
struct Ids {
    column: TextColumn,
    /// Positions, hashed by their id (with `hasher`).
    index: HashTable<u32>,
    /// Positions ordered by id (Go's string order, as the checkpoint lists them).
    by_id: Vec<u32>,
    hasher: IdHasher,
}

impl std::fmt::Debug for Ids {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries((0..self.column.len()).map(|at| self.column.get(at)))
            .finish()
    }
}

impl Ids {
    fn position(&self, id: &str) -> Option<usize> {
        let hash = self.hasher.hash_one(id);
        self.index
            .find(hash, |&at| self.column.get(at as usize) == id)
            .map(|&at| at as usize)
    }
}

/// Every device of one resource, in the order the plugin listed them, in columns (see the
/// module doc).
///
/// Cheap to clone (shared, copy-on-write): the checkpoint writer clones the sets under the state
/// lock and does its sorting and encoding after releasing it.
#[derive(Clone, Debug, Default)]
pub struct DeviceSet {
    ids: Arc<Ids>,
    health: Arc<Vec<Health>>,
    numa: Arc<ListColumn<i64>>,
    healthy: usize,
    /// Changes with every change of the devices or their health (unique across sets; `0` for
    /// an empty set never changed), so a view built from the set can tell it is still current.
    generation: u64,
}

/// Where some devices are in a [`DeviceSet`], one position per device in the order they were
/// looked up. A set of the same [`DeviceSet::generation`] holds the same devices in the same
/// places, so the positions stand for the ids there and spare looking each id up again.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Positions {
    generation: u64,
    at: Vec<u32>,
}

impl Positions {
    /// `at`, positions in `set`.
    pub fn new(set: &DeviceSet, at: Vec<u32>) -> Positions {
        Positions {
            generation: set.generation,
            at,
        }
    }

    /// The positions, if `set` is of the generation they were found in (else `None`: the
    /// devices may have changed since, and only their ids name them).
    pub fn in_set(&self, set: &DeviceSet) -> Option<&[u32]> {
        (set.generation == self.generation).then_some(&self.at)
    }
}

/// The source of [`DeviceSet`] generations.
static GENERATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn next_generation() -> u64 {
    GENERATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// What [`DeviceSet::from_list`] refused of a list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Replaced {
    /// Devices left out for an empty id.
    pub empty_ids: usize,
    /// Devices whose id an earlier device in the list had (the last one listed is served).
    pub duplicates: usize,
    /// The first few duplicated ids, for the message.
    pub duplicate_ids: Vec<DeviceId>,
}

impl Replaced {
    /// How many duplicated ids a message names at most.
    pub const NAMED: usize = 5;

    /// Whether any id was refused.
    pub fn refused_any(&self) -> bool {
        self.empty_ids > 0 || self.duplicates > 0
    }
}

impl DeviceSet {
    /// A set holding `devices` (see [`DeviceSet::from_list`] for the ids it refuses).
    pub fn new(devices: Vec<ListedDevice>) -> DeviceSet {
        DeviceSet::from_list(devices.into_iter().collect()).0
    }

    /// The set of a plugin's list: a device with an empty id is not served, and of devices
    /// sharing an id only the last one listed is, at the place of the first (each id names one
    /// device, as in the kubelet). Says which ids it refused.
    pub fn from_list(list: DeviceList) -> (DeviceSet, Replaced) {
        let hasher = IdHasher::default();
        let (mut list, index, refused) = match index_of(&list.ids, &hasher) {
            Some(index) => (list, index, Replaced::default()),
            None => {
                let (kept, refused) = served(&list, &hasher);
                let index =
                    index_of(&kept.ids, &hasher).expect("the ids served are unique and not empty");
                (kept, index, refused)
            }
        };
        list.shrink_to_fit();
        let mut by_id: Vec<u32> = (0..end(list.len())).collect();
        by_id.sort_unstable_by(|&a, &b| list.ids.get(a as usize).cmp(list.ids.get(b as usize)));
        let healthy = list
            .health
            .iter()
            .filter(|&&h| h == Health::Healthy)
            .count();
        let set = DeviceSet {
            ids: Arc::new(Ids {
                column: list.ids,
                index,
                by_id,
                hasher,
            }),
            health: Arc::new(list.health),
            numa: Arc::new(list.numa),
            healthy,
            generation: next_generation(),
        };
        (set, refused)
    }

    /// Takes `set`'s devices in place of these (a new ListAndWatch list, made by the stream's
    /// decoder, which keeps a copy sharing its columns): devices absent from `set` are gone.
    /// Returns whether they differ from these.
    pub fn adopt(&mut self, set: DeviceSet) -> bool {
        let changed = !self.same_devices(&set);
        *self = set;
        changed
    }

    /// Whether `other` holds the same devices with the same health, in the same order.
    fn same_devices(&self, other: &DeviceSet) -> bool {
        (Arc::ptr_eq(&self.ids, &other.ids) || self.ids.column == other.ids.column)
            && self.health == other.health
            && self.numa == other.numa
    }

    /// Applies an update that kept the ids and their order (the ListAndWatch decoder's `Changed`):
    /// `changes` holds each changed device by position, `len` the update's device count.
    /// Returns whether anything changed, or `None` (and changes nothing) when the set does not
    /// hold those `len` devices in that order, so the positions do not name its devices.
    pub fn apply_changes(&mut self, len: usize, changes: &[(usize, ListedDevice)]) -> Option<bool> {
        let in_step = self.capacity() == len
            && changes
                .iter()
                .all(|(at, d)| *at < len && self.ids.column.get(*at) == d.id.as_str());
        if !in_step {
            return None;
        }
        if changes.is_empty() {
            return Some(false);
        }
        self.generation = next_generation();
        let health = Arc::make_mut(&mut self.health);
        for (at, device) in changes {
            health[*at] = device.health;
        }
        self.healthy = health.iter().filter(|&&h| h == Health::Healthy).count();
        if changes
            .iter()
            .any(|(at, d)| self.numa.get(*at) != d.numa.as_slice())
        {
            let mut order: Vec<&(usize, ListedDevice)> = changes.iter().collect();
            // Stable: of two changes of one device, the later one stays later and wins.
            order.sort_by_key(|(at, _)| *at);
            let mut next = order.into_iter().peekable();
            let mut numa = ListColumn::default();
            for at in 0..len {
                let mut nodes = self.numa.get(at);
                while let Some((_, device)) = next.next_if(|(changed, _)| *changed == at) {
                    nodes = device.numa.as_slice();
                }
                numa.push(nodes);
            }
            numa.shrink_to_fit();
            self.numa = Arc::new(numa);
        }
        Some(true)
    }

    /// Turns every device unhealthy at once (the plugin's stream ended or its socket went).
    pub fn mark_all_unhealthy(&mut self) {
        self.generation = next_generation();
        match Arc::get_mut(&mut self.health) {
            Some(health) => health.fill(Health::Unhealthy),
            None => self.health = Arc::new(vec![Health::Unhealthy; self.health.len()]),
        }
        self.healthy = 0;
    }

    /// Every device, healthy or not (the kubelet's capacity).
    pub fn capacity(&self) -> usize {
        self.health.len()
    }

    /// Healthy devices (the kubelet's allocatable).
    pub fn allocatable(&self) -> usize {
        self.healthy
    }

    /// The devices in plugin order.
    pub fn devices(&self) -> impl ExactSizeIterator<Item = Device<'_>> + '_ {
        (0..self.capacity()).map(|at| self.device(at))
    }

    /// See the field: equal generations mean the same devices with the same health.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The device at `at` (below [`DeviceSet::capacity`]).
    fn device(&self, at: usize) -> Device<'_> {
        Device {
            id: self.ids.column.get(at),
            health: self.health[at],
            numa: self.numa.get(at),
        }
    }

    /// The device at `position` in plugin order.
    pub fn at(&self, position: usize) -> Option<Device<'_>> {
        (position < self.capacity()).then(|| self.device(position))
    }

    /// The devices at `range` (positions in plugin order, within [`DeviceSet::capacity`]) as
    /// one run of the set's columns, for the policy's candidates.
    pub fn run(&self, range: std::ops::Range<usize>) -> ColumnRun<'_> {
        ColumnRun {
            ids: self.ids.column.run(range.clone()),
            numa: self.numa.run(range),
        }
    }

    /// The position in plugin order of the device with this id.
    pub fn position(&self, id: &str) -> Option<usize> {
        self.ids.position(id)
    }

    /// Whether the device at `position` (below [`DeviceSet::capacity`]) is healthy.
    pub fn is_healthy_at(&self, position: usize) -> bool {
        self.health[position] == Health::Healthy
    }

    /// The device with this id.
    pub fn get(&self, id: &str) -> Option<Device<'_>> {
        self.position(id).map(|at| self.device(at))
    }

    /// Whether `id` is known and healthy.
    pub fn is_healthy(&self, id: &str) -> bool {
        self.position(id)
            .is_some_and(|at| self.health[at] == Health::Healthy)
    }

    /// Ids of the healthy devices, sorted (what the kubelet checkpoints as `RegisteredDevices`).
    pub fn healthy_ids(&self) -> Vec<DeviceId> {
        self.healthy_id_strs().map(DeviceId::from).collect()
    }

    /// [`DeviceSet::healthy_ids`], borrowed from the set.
    pub fn healthy_id_strs(&self) -> impl Iterator<Item = &str> {
        self.ids
            .by_id
            .iter()
            .map(|&at| at as usize)
            .filter(|&at| self.health[at] == Health::Healthy)
            .map(|at| self.ids.column.get(at))
    }
}

/// The index of `ids`, or `None` when one of them is empty or repeated.
fn index_of(ids: &TextColumn, hasher: &IdHasher) -> Option<HashTable<u32>> {
    let mut index: HashTable<u32> = HashTable::with_capacity(ids.len());
    for at in 0..ids.len() {
        let id = ids.get(at);
        if id.is_empty() {
            return None;
        }
        match index.entry(
            hasher.hash_one(id),
            |&other| ids.get(other as usize) == id,
            |&other| hasher.hash_one(ids.get(other as usize)),
        ) {
            Entry::Occupied(_) => return None,
            Entry::Vacant(place) => {
                place.insert(end(at));
            }
        }
    }
    Some(index)
}

/// The devices of `list` a set serves (see [`DeviceSet::from_list`]) and what it refused.
fn served(list: &DeviceList, hasher: &IdHasher) -> (DeviceList, Replaced) {
    let mut refused = Replaced::default();
    // For each device served, the position in `list` of the one listed last under its id.
    let mut served: Vec<u32> = Vec::new();
    let mut slots: HashTable<u32> = HashTable::new();
    for at in 0..list.len() {
        let id = list.ids.get(at);
        if id.is_empty() {
            refused.empty_ids += 1;
            continue;
        }
        let id_of = |slot: u32| list.ids.get(served[slot as usize] as usize);
        match slots.entry(
            hasher.hash_one(id),
            |&slot| id_of(slot) == id,
            |&slot| hasher.hash_one(id_of(slot)),
        ) {
            Entry::Occupied(place) => {
                let slot = *place.get() as usize;
                if refused.duplicate_ids.len() < Replaced::NAMED {
                    refused.duplicate_ids.push(DeviceId::from(id));
                }
                refused.duplicates += 1;
                served[slot] = end(at);
            }
            Entry::Vacant(place) => {
                place.insert(end(served.len()));
                served.push(end(at));
            }
        }
    }
    let mut kept = DeviceList::with_capacity(served.len(), list.ids.text().len());
    for &at in &served {
        let d = list.device(at as usize);
        kept.push(d.id, d.health, d.numa);
    }
    (kept, refused)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(id: &str, health: &str, numa: &[i64]) -> v1beta1::Device {
        v1beta1::Device {
            id: id.into(),
            health: health.into(),
            topology: (!numa.is_empty()).then(|| v1beta1::TopologyInfo {
                nodes: numa.iter().map(|&id| v1beta1::NumaNode { id }).collect(),
            }),
        }
    }

    #[test]
    fn only_exactly_healthy_counts_as_healthy() {
        assert_eq!(Health::from_wire("Healthy"), Health::Healthy);
        for other in ["", "healthy", "Unhealthy", "Healthy "] {
            assert_eq!(Health::from_wire(other), Health::Unhealthy, "{other:?}");
        }
    }

    #[test]
    fn capacity_is_all_allocatable_is_healthy() {
        let set = DeviceSet::new(
            [
                wire("a", "Healthy", &[0]),
                wire("b", "Unhealthy", &[1]),
                wire("c", "", &[]),
            ]
            .into_iter()
            .map(ListedDevice::from_wire)
            .collect(),
        );
        assert_eq!(set.capacity(), 3);
        assert_eq!(set.allocatable(), 1);
        assert_eq!(set.get("a").unwrap().numa, [0]);
        assert!(set.get("c").unwrap().numa.is_empty());
        assert_eq!(set.healthy_ids(), ["a"]);
    }

    #[test]
    fn changes_apply_only_to_the_devices_they_name() {
        let device = |id: &str, health| ListedDevice {
            id: id.into(),
            health,
            numa: vec![],
        };
        let mut set = DeviceSet::new(vec![
            device("a", Health::Healthy),
            device("b", Health::Healthy),
        ]);
        assert_eq!(
            set.apply_changes(2, &[(1, device("b", Health::Unhealthy))]),
            Some(true)
        );
        assert_eq!(set.allocatable(), 1);
        assert_eq!(set.healthy_ids(), ["a"]);
        assert_eq!(set.apply_changes(2, &[]), Some(false));
        assert_eq!(
            set.apply_changes(3, &[]),
            None,
            "another count: out of step"
        );
        assert_eq!(
            set.apply_changes(2, &[(0, device("b", Health::Healthy))]),
            None,
            "another id at that position: out of step"
        );
        assert_eq!(set.allocatable(), 1, "nothing changed");
    }

    #[test]
    fn empty_ids_are_not_served_and_a_duplicate_id_is_served_once() {
        let mut set = DeviceSet::default();
        let (list, replaced) = DeviceSet::from_list(
            [
                wire("", "Healthy", &[0]),
                wire("a", "Healthy", &[0]),
                wire("a", "Unhealthy", &[1]),
                wire("b", "Healthy", &[0]),
            ]
            .into_iter()
            .map(ListedDevice::from_wire)
            .collect(),
        );
        let changed = set.adopt(list);
        assert!(changed && replaced.refused_any());
        assert_eq!((replaced.empty_ids, replaced.duplicates), (1, 1));
        assert_eq!(replaced.duplicate_ids, ["a"]);
        assert_eq!((set.capacity(), set.allocatable()), (2, 1));
        assert!(set.get("").is_none());
        assert!(
            !set.is_healthy("a"),
            "the last device listed under an id is served"
        );
    }

    #[test]
    fn an_update_replaces_the_whole_list() {
        let mut set = DeviceSet::new(vec![
            ListedDevice::from_wire(wire("a", "Healthy", &[])),
            ListedDevice::from_wire(wire("b", "Healthy", &[])),
        ]);
        let c = || DeviceSet::new(vec![ListedDevice::from_wire(wire("c", "Healthy", &[0]))]);
        assert!(set.adopt(c()));
        assert_eq!(set.capacity(), 1);
        assert!(set.get("a").is_none());
        assert!(set.is_healthy("c"));
        assert!(!set.adopt(c()));
    }

    #[test]
    fn marking_all_unhealthy_keeps_capacity() {
        let mut set = DeviceSet::new(vec![
            ListedDevice::from_wire(wire("a", "Healthy", &[])),
            ListedDevice::from_wire(wire("b", "Healthy", &[])),
        ]);
        set.mark_all_unhealthy();
        assert_eq!((set.capacity(), set.allocatable()), (2, 0));
        assert!(set.healthy_ids().is_empty());
    }

    #[test]
    fn a_repeated_id_serves_the_last_device_at_the_place_of_the_first() {
        let (set, refused) = DeviceSet::from_list(
            [
                wire("b", "Healthy", &[0]),
                wire("", "Healthy", &[]),
                wire("a", "Healthy", &[1]),
                wire("b", "Unhealthy", &[1, 2]),
                wire("c", "Healthy", &[]),
                wire("a", "Healthy", &[3]),
            ]
            .into_iter()
            .map(ListedDevice::from_wire)
            .collect(),
        );
        assert_eq!((refused.empty_ids, refused.duplicates), (1, 2));
        assert_eq!(refused.duplicate_ids, ["b", "a"]);
        let served: Vec<(&str, Health, &[i64])> =
            set.devices().map(|d| (d.id, d.health, d.numa)).collect();
        assert_eq!(
            served,
            [
                ("b", Health::Unhealthy, &[1, 2][..]),
                ("a", Health::Healthy, &[3][..]),
                ("c", Health::Healthy, &[][..]),
            ]
        );
        assert_eq!(set.position("c"), Some(2));
        assert_eq!(set.healthy_ids(), ["a", "c"], "in id order");
    }

    #[test]
    fn a_change_of_numa_nodes_moves_only_that_device() {
        let mut set = DeviceSet::new(
            [
                wire("a", "Healthy", &[0]),
                wire("b", "Healthy", &[]),
                wire("c", "Healthy", &[1]),
            ]
            .into_iter()
            .map(ListedDevice::from_wire)
            .collect(),
        );
        let copy = set.clone();
        let b = ListedDevice {
            id: "b".into(),
            health: Health::Unhealthy,
            numa: vec![2, 3],
        };
        assert_eq!(set.apply_changes(3, &[(1, b)]), Some(true));
        let numa: Vec<&[i64]> = set.devices().map(|d| d.numa).collect();
        assert_eq!(numa, [&[0][..], &[2, 3][..], &[1][..]]);
        assert_eq!(set.allocatable(), 2);
        assert_eq!(
            copy.get("b").unwrap().numa,
            [] as [i64; 0],
            "a copy keeps its own"
        );
        assert!(copy.is_healthy("b"));
        assert_ne!(copy.generation(), set.generation());
    }
}
