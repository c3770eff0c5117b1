//! The CSINode object: one driver entry per registered CSI driver, as the kubelet writes it
//! (node id, topology keys sorted, `allocatable.count` = max volumes per node when given).
//!
//! A driver entry cannot be changed in place (the API server refuses a changed entry of the
//! same name as immutable), so a changed driver is replaced in two writes: the object without
//! the old entry, then with the new one. Entries of drivers Pluglet did not publish are kept.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::{CSINode, CSINodeDriver, CSINodeSpec, VolumeNodeResources};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use crate::inventory::CsiDriver;

/// One write to the CSINode.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// The object does not exist: create it with these drivers (owned by the Node, so it goes
    /// when the Node goes).
    Create(Box<CSINode>),
    /// Replace the object's driver list with this one.
    Replace(Vec<CSINodeDriver>),
}

/// The driver entry the kubelet would write for `driver`.
pub fn entry(name: &str, driver: &CsiDriver) -> CSINodeDriver {
    let keys: Vec<String> = driver.topology.keys().cloned().collect();
    CSINodeDriver {
        name: name.to_owned(),
        node_id: driver.node_id.clone(),
        topology_keys: (!keys.is_empty()).then_some(keys),
        allocatable: (driver.max_volumes_per_node > 0).then(|| VolumeNodeResources {
            count: Some(driver.max_volumes_per_node.min(i64::from(i32::MAX)) as i32),
        }),
    }
}

fn same(a: &CSINodeDriver, b: &CSINodeDriver) -> bool {
    let keys = |d: &CSINodeDriver| -> BTreeSet<String> {
        d.topology_keys.iter().flatten().cloned().collect()
    };
    let count = |d: &CSINodeDriver| d.allocatable.as_ref().and_then(|a| a.count);
    a.name == b.name && a.node_id == b.node_id && keys(a) == keys(b) && count(a) == count(b)
}

/// The writes that bring `existing` (`None`: no such object) to `want`, removing the drivers
/// in `published` that are no longer wanted.
pub fn plan(
    node: &Node,
    existing: Option<&CSINode>,
    published: &BTreeSet<String>,
    want: &BTreeMap<String, CsiDriver>,
) -> Vec<Step> {
    let wanted: Vec<CSINodeDriver> = want.iter().map(|(n, d)| entry(n, d)).collect();
    let Some(existing) = existing else {
        if wanted.is_empty() {
            return Vec::new();
        }
        return vec![Step::Create(Box::new(new_object(node, wanted)))];
    };
    let current = &existing.spec.drivers;
    let kept: Vec<CSINodeDriver> = current
        .iter()
        .filter(|d| match wanted.iter().find(|w| w.name == d.name) {
            Some(w) => same(w, d),
            None => !published.contains(&d.name),
        })
        .cloned()
        .collect();
    let mut full = kept.clone();
    for w in &wanted {
        if !full.iter().any(|d| d.name == w.name) {
            full.push(w.clone());
        }
    }
    let mut steps = Vec::new();
    if kept.len() != current.len() {
        steps.push(Step::Replace(kept.clone()));
    }
    if full.len() != kept.len() {
        steps.push(Step::Replace(full));
    }
    steps
}

/// A CSINode named for `node`, owned by it, with `drivers`.
fn new_object(node: &Node, drivers: Vec<CSINodeDriver>) -> CSINode {
    let name = node.metadata.name.clone().unwrap_or_default();
    CSINode {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            owner_references: node.metadata.uid.clone().map(|uid| {
                vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Node".into(),
                    name,
                    uid,
                    ..Default::default()
                }]
            }),
            ..Default::default()
        },
        spec: CSINodeSpec { drivers },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                uid: Some("u-1".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn driver(id: &str, max: i64) -> CsiDriver {
        CsiDriver {
            node_id: id.into(),
            topology: [
                ("b/zone".to_owned(), "z".to_owned()),
                ("a/node".to_owned(), id.to_owned()),
            ]
            .into(),
            max_volumes_per_node: max,
        }
    }

    fn object(drivers: Vec<CSINodeDriver>) -> CSINode {
        CSINode {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                ..Default::default()
            },
            spec: CSINodeSpec { drivers },
        }
    }

    fn other() -> CSINodeDriver {
        CSINodeDriver {
            name: "other.csi".into(),
            node_id: "x".into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_entry_is_the_kubelets() {
        let e = entry("d.csi", &driver("n1", 1i64 << 40));
        assert_eq!(e.topology_keys.unwrap(), ["a/node", "b/zone"]);
        assert_eq!(e.allocatable.unwrap().count, Some(i32::MAX));
        let e = entry(
            "d.csi",
            &CsiDriver {
                node_id: "n".into(),
                ..Default::default()
            },
        );
        assert_eq!((e.topology_keys, e.allocatable), (None, None));
    }

    #[test]
    fn created_owned_by_the_node_when_missing() {
        let want = [("d.csi".to_owned(), driver("n1", 4))].into();
        let steps = plan(&node(), None, &BTreeSet::new(), &want);
        let [Step::Create(o)] = steps.as_slice() else {
            panic!("{steps:?}")
        };
        assert_eq!(o.metadata.owner_references.as_ref().unwrap()[0].uid, "u-1");
        assert_eq!(o.spec.drivers.len(), 1);
        assert!(plan(&node(), None, &BTreeSet::new(), &BTreeMap::new()).is_empty());
    }

    #[test]
    fn unchanged_means_no_write_and_others_are_kept() {
        let want: BTreeMap<_, _> = [("d.csi".to_owned(), driver("n1", 4))].into();
        let o = object(vec![other(), entry("d.csi", &driver("n1", 4))]);
        assert!(plan(&node(), Some(&o), &BTreeSet::new(), &want).is_empty());
        let o = object(vec![other()]);
        assert_eq!(
            plan(&node(), Some(&o), &BTreeSet::new(), &want),
            vec![Step::Replace(vec![
                other(),
                entry("d.csi", &driver("n1", 4))
            ])]
        );
    }

    #[test]
    fn a_changed_driver_is_removed_then_added() {
        let want: BTreeMap<_, _> = [("d.csi".to_owned(), driver("n2", 4))].into();
        let o = object(vec![entry("d.csi", &driver("n1", 4)), other()]);
        assert_eq!(
            plan(&node(), Some(&o), &BTreeSet::new(), &want),
            vec![
                Step::Replace(vec![other()]),
                Step::Replace(vec![other(), entry("d.csi", &driver("n2", 4))]),
            ]
        );
    }

    #[test]
    fn only_published_drivers_are_removed() {
        let o = object(vec![entry("d.csi", &driver("n1", 0)), other()]);
        let published = ["d.csi".to_owned()].into();
        assert_eq!(
            plan(&node(), Some(&o), &published, &BTreeMap::new()),
            vec![Step::Replace(vec![other()])]
        );
        assert!(plan(&node(), Some(&o), &BTreeSet::new(), &BTreeMap::new()).is_empty());
    }
}
