//! What the node offers, as the API objects should show it: the desired state the publisher
//! converges to. [`Desired`] is fed by the device manager and the CSI registrations and never
//! waits for the API server.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

/// One extended resource's numbers, as the kubelet reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Every device, healthy or not.
    pub capacity: u64,
    /// Healthy devices.
    pub allocatable: u64,
}

/// A registered CSI driver, from its `NodeGetInfo` answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CsiDriver {
    /// The driver's id for this node (never empty).
    pub node_id: String,
    /// Accessible topology segments; each becomes a Node label.
    pub topology: BTreeMap<String, String>,
    /// Maximum volumes per node; 0 or less: not given.
    pub max_volumes_per_node: i64,
}

/// The whole desired state at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inventory {
    /// Extended resources by name. A resource whose plugin is gone past its grace period is
    /// here at 0 for a while (see [`Desired`]), then absent.
    pub resources: BTreeMap<String, Counts>,
    /// CSI drivers by name.
    pub csi_drivers: BTreeMap<String, CsiDriver>,
}

/// The desired state as it changes: resources from the device manager, drivers from
/// registrations, and the resources that left the device manager (published at 0 for
/// `linger`, then removed, so a scheduler sees them drop to zero before they disappear).
#[derive(Debug)]
pub(crate) struct Desired {
    generation: u64,
    resources: BTreeMap<String, Counts>,
    retired: BTreeMap<String, Instant>,
    drivers: BTreeMap<String, (u64, CsiDriver)>,
    linger: Duration,
}

impl Desired {
    pub(crate) fn new(linger: Duration) -> Desired {
        Desired {
            generation: 0,
            resources: BTreeMap::new(),
            retired: BTreeMap::new(),
            drivers: BTreeMap::new(),
            linger,
        }
    }

    /// Bumped by every change.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Replaces the resources; those no longer present retire at `now`. Returns whether
    /// anything changed.
    pub(crate) fn set_resources(
        &mut self,
        resources: BTreeMap<String, Counts>,
        now: Instant,
    ) -> bool {
        if resources == self.resources {
            return false;
        }
        for name in self.resources.keys() {
            if !resources.contains_key(name) {
                self.retired.insert(name.clone(), now);
            }
        }
        for name in resources.keys() {
            self.retired.remove(name);
        }
        self.resources = resources;
        self.generation += 1;
        true
    }

    /// Registration `id` of driver `name` is in force.
    pub(crate) fn install_driver(&mut self, name: &str, id: u64, driver: CsiDriver) {
        let changed = self.drivers.get(name).is_none_or(|(_, d)| *d != driver);
        self.drivers.insert(name.to_owned(), (id, driver));
        if changed {
            self.generation += 1;
        }
    }

    /// Registration `id` of driver `name` ended (a newer registration of the name stays).
    pub(crate) fn remove_driver(&mut self, name: &str, id: u64) {
        if self.drivers.get(name).is_some_and(|(held, _)| *held == id) {
            self.drivers.remove(name);
            self.generation += 1;
        }
    }

    /// The inventory at `now`, and when it next changes by itself (a retired resource's
    /// linger ending). Retired resources past their linger are forgotten.
    pub(crate) fn inventory(&mut self, now: Instant) -> (Inventory, Option<Instant>) {
        let linger = self.linger;
        self.retired.retain(|_, at| now < *at + linger);
        let mut resources = self.resources.clone();
        for name in self.retired.keys() {
            resources.insert(name.clone(), Counts::default());
        }
        let next = self.retired.values().map(|at| *at + linger).min();
        let csi_drivers = self
            .drivers
            .iter()
            .map(|(name, (_, d))| (name.clone(), d.clone()))
            .collect();
        (
            Inventory {
                resources,
                csi_drivers,
            },
            next,
        )
    }

    /// Number of resources and drivers desired now.
    pub(crate) fn sizes(&self) -> (usize, usize) {
        (
            self.resources.len() + self.retired.len(),
            self.drivers.len(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(capacity: u64, allocatable: u64) -> Counts {
        Counts {
            capacity,
            allocatable,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_resource_that_leaves_stays_at_zero_for_the_linger_then_goes() {
        let mut d = Desired::new(Duration::from_secs(10));
        let t0 = Instant::now();
        d.set_resources([("v/gpu".to_owned(), counts(2, 1))].into(), t0);
        d.set_resources(BTreeMap::new(), t0);
        let (inv, next) = d.inventory(t0 + Duration::from_secs(3));
        assert_eq!(inv.resources["v/gpu"], counts(0, 0));
        assert_eq!(next, Some(t0 + Duration::from_secs(10)));
        let (inv, next) = d.inventory(t0 + Duration::from_secs(10));
        assert!(inv.resources.is_empty());
        assert_eq!(next, None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_resource_that_comes_back_is_no_longer_retired() {
        let mut d = Desired::new(Duration::from_secs(10));
        let t0 = Instant::now();
        d.set_resources([("v/gpu".to_owned(), counts(2, 1))].into(), t0);
        d.set_resources(BTreeMap::new(), t0);
        d.set_resources([("v/gpu".to_owned(), counts(3, 3))].into(), t0);
        let (inv, next) = d.inventory(t0 + Duration::from_secs(30));
        assert_eq!(inv.resources["v/gpu"], counts(3, 3));
        assert_eq!(next, None);
    }

    #[test]
    fn only_changes_bump_the_generation() {
        let mut d = Desired::new(Duration::ZERO);
        let now = Instant::now();
        assert!(d.set_resources([("v/a".to_owned(), counts(1, 1))].into(), now));
        assert!(!d.set_resources([("v/a".to_owned(), counts(1, 1))].into(), now));
        let g = d.generation();
        let driver = CsiDriver {
            node_id: "n1".into(),
            ..Default::default()
        };
        d.install_driver("csi.example.com", 7, driver.clone());
        assert_eq!(d.generation(), g + 1);
        d.install_driver("csi.example.com", 8, driver);
        assert_eq!(d.generation(), g + 1, "same driver, newer registration");
        d.remove_driver("csi.example.com", 7);
        assert_eq!(
            d.generation(),
            g + 1,
            "an older registration's end is ignored"
        );
        d.remove_driver("csi.example.com", 8);
        assert_eq!(d.generation(), g + 2);
        assert!(d.inventory(now).0.csi_drivers.is_empty());
    }
}
