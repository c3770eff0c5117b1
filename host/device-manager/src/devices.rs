//! The devices of one resource: health, NUMA nodes, capacity and allocatable (see
//! `docs/kubelet-compatibility.md`, "Endpoints, health and the grace period" and "Capacity and
//! allocatable").
//!
//! Owned by the [`crate::registry`]; written by each endpoint's task (every ListAndWatch update
//! is the full new list) and by disconnects; read by the allocator and the admin API.

use std::collections::HashMap;
use std::sync::Arc;

use pluglet_proto::constants::HEALTHY;
use pluglet_proto::v1beta1;

use crate::device_id::DeviceId;

/// The hasher of maps and sets keyed by device id: foldhash rather than std's SipHash. The ids
/// come from the node's own plugins, and an allocation of 1,024 devices looks each one up
/// several times (candidates, the answer check, the reservation).
pub type IdHasher = foldhash::fast::RandomState;

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

/// Every device of one resource, in the order the plugin listed them.
///
/// Cheap to clone (shared, copy-on-write): the checkpoint writer clones the sets under the state
/// lock and does its sorting and encoding after releasing it.
#[derive(Clone, Debug, Default)]
pub struct DeviceSet {
    devices: Arc<Vec<ListedDevice>>,
    index: Arc<HashMap<DeviceId, usize, IdHasher>>,
    /// Positions in `devices`, ordered by id (Go's string order, as the checkpoint lists them).
    by_id: Arc<Vec<usize>>,
    healthy: usize,
    /// Changes with every change of the devices or their health (unique across sets; `0` for
    /// an empty set never changed), so a view built from the set can tell it is still current.
    generation: u64,
}

/// The source of [`DeviceSet`] generations.
static GENERATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn next_generation() -> u64 {
    GENERATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// What [`DeviceSet::replace_checked`] did with a list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Replaced {
    /// Whether the set changed.
    pub changed: bool,
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
    /// A set holding `devices` (see [`DeviceSet::replace`] for the ids it refuses).
    pub fn new(devices: Vec<ListedDevice>) -> DeviceSet {
        let mut set = DeviceSet::default();
        set.replace(devices);
        set
    }

    /// Replaces the whole list (one ListAndWatch update): devices absent from `devices` are gone.
    /// Returns whether anything changed.
    pub fn replace(&mut self, devices: Vec<ListedDevice>) -> bool {
        self.replace_checked(devices).changed
    }

    /// [`DeviceSet::replace`], saying which ids it refused: a device with an empty id is not
    /// served, and of devices sharing an id only the last one listed is (each id names one
    /// device, as in the kubelet).
    pub fn replace_checked(&mut self, devices: Vec<ListedDevice>) -> Replaced {
        // The common update (a health flip) keeps the same ids in the same order: keep the
        // index and the id order instead of rebuilding them.
        if devices.len() == self.devices.len()
            && devices
                .iter()
                .zip(self.devices.iter())
                .all(|(a, b)| a.id == b.id)
        {
            if devices
                .iter()
                .zip(self.devices.iter())
                .all(|(a, b)| a.health == b.health && a.numa == b.numa)
            {
                return Replaced::default();
            }
            self.healthy = devices
                .iter()
                .filter(|d| d.health == Health::Healthy)
                .count();
            self.devices = Arc::new(devices);
            self.generation = next_generation();
            return Replaced {
                changed: true,
                ..Replaced::default()
            };
        }
        let mut refused = Replaced::default();
        let mut index = HashMap::with_capacity_and_hasher(devices.len(), IdHasher::default());
        let mut list: Vec<ListedDevice> = Vec::with_capacity(devices.len());
        for device in devices {
            if device.id.is_empty() {
                refused.empty_ids += 1;
                continue;
            }
            match index.get(&device.id) {
                Some(&at) => {
                    if refused.duplicate_ids.len() < Replaced::NAMED {
                        refused.duplicate_ids.push(device.id.clone());
                    }
                    refused.duplicates += 1;
                    list[at] = device;
                }
                None => {
                    index.insert(device.id.clone(), list.len());
                    list.push(device);
                }
            }
        }
        if list == *self.devices {
            return refused;
        }
        let mut by_id: Vec<usize> = (0..list.len()).collect();
        by_id.sort_unstable_by(|&a, &b| list[a].id.cmp(&list[b].id));
        self.healthy = list.iter().filter(|d| d.health == Health::Healthy).count();
        self.devices = Arc::new(list);
        self.index = Arc::new(index);
        self.by_id = Arc::new(by_id);
        self.generation = next_generation();
        refused.changed = true;
        refused
    }

    /// Applies an update that kept the ids and their order (the ListAndWatch decoder's `Changed`):
    /// `changes` holds each changed device by position, `len` the update's device count.
    /// Returns whether anything changed, or `None` (and changes nothing) when the set does not
    /// hold those `len` devices in that order, so the positions do not name its devices.
    pub fn apply_changes(
        &mut self,
        len: usize,
        changes: Vec<(usize, ListedDevice)>,
    ) -> Option<bool> {
        let in_step = self.devices.len() == len
            && self.index.len() == len
            && changes
                .iter()
                .all(|(at, d)| self.devices.get(*at).is_some_and(|old| old.id == d.id));
        if !in_step {
            return None;
        }
        if changes.is_empty() {
            return Some(false);
        }
        self.generation = next_generation();
        let devices = Arc::make_mut(&mut self.devices);
        for (at, device) in changes {
            devices[at] = device;
        }
        self.healthy = devices
            .iter()
            .filter(|d| d.health == Health::Healthy)
            .count();
        Some(true)
    }

    /// Turns every device unhealthy at once (the plugin's stream ended or its socket went).
    pub fn mark_all_unhealthy(&mut self) {
        self.generation = next_generation();
        for device in Arc::make_mut(&mut self.devices) {
            device.health = Health::Unhealthy;
        }
        self.healthy = 0;
    }

    /// Every device, healthy or not (the kubelet's capacity).
    pub fn capacity(&self) -> usize {
        self.devices.len()
    }

    /// Healthy devices (the kubelet's allocatable).
    pub fn allocatable(&self) -> usize {
        self.healthy
    }

    /// The devices in plugin order.
    pub fn iter(&self) -> impl Iterator<Item = &ListedDevice> {
        self.devices.iter()
    }

    /// See the field: equal generations mean the same devices with the same health.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The device at `position` in plugin order.
    pub fn at(&self, position: usize) -> Option<&ListedDevice> {
        self.devices.get(position)
    }

    /// The position in plugin order of the device with this id.
    pub fn position(&self, id: &str) -> Option<usize> {
        self.index.get(id).copied()
    }

    /// The device with this id.
    pub fn get(&self, id: &str) -> Option<&ListedDevice> {
        self.index.get(id).map(|&at| &self.devices[at])
    }

    /// Whether `id` is known and healthy.
    pub fn is_healthy(&self, id: &str) -> bool {
        self.get(id).is_some_and(|d| d.health == Health::Healthy)
    }

    /// Ids of the healthy devices, sorted (what the kubelet checkpoints as `RegisteredDevices`).
    pub fn healthy_ids(&self) -> Vec<DeviceId> {
        self.by_id
            .iter()
            .map(|&at| &self.devices[at])
            .filter(|d| d.health == Health::Healthy)
            .map(|d| d.id.clone())
            .collect()
    }
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
            set.apply_changes(2, vec![(1, device("b", Health::Unhealthy))]),
            Some(true)
        );
        assert_eq!(set.allocatable(), 1);
        assert_eq!(set.healthy_ids(), ["a"]);
        assert_eq!(set.apply_changes(2, vec![]), Some(false));
        assert_eq!(
            set.apply_changes(3, vec![]),
            None,
            "another count: out of step"
        );
        assert_eq!(
            set.apply_changes(2, vec![(0, device("b", Health::Healthy))]),
            None,
            "another id at that position: out of step"
        );
        assert_eq!(set.allocatable(), 1, "nothing changed");
    }

    #[test]
    fn empty_ids_are_not_served_and_a_duplicate_id_is_served_once() {
        let mut set = DeviceSet::default();
        let replaced = set.replace_checked(vec![
            ListedDevice::from_wire(wire("", "Healthy", &[0])),
            ListedDevice::from_wire(wire("a", "Healthy", &[0])),
            ListedDevice::from_wire(wire("a", "Unhealthy", &[1])),
            ListedDevice::from_wire(wire("b", "Healthy", &[0])),
        ]);
        assert!(replaced.changed && replaced.refused_any());
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
        assert!(set.replace(vec![ListedDevice::from_wire(wire("c", "Healthy", &[0]))]));
        assert_eq!(set.capacity(), 1);
        assert!(set.get("a").is_none());
        assert!(set.is_healthy("c"));
        assert!(!set.replace(vec![ListedDevice::from_wire(wire("c", "Healthy", &[0]))]));
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
}
