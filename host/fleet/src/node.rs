//! The Node object: which changes bring its metadata and status to the inventory, touching only
//! what Pluglet published (recorded in [`PUBLISHED_ANNOTATION`] on the Node itself).
//!
//! One round's Node writes, each a JSON merge patch carrying the `resourceVersion` read (a
//! stale read is refused with 409 and the round starts again from a fresh read):
//! 1. metadata: the ownership record grown to cover everything about to be written, the CSI
//!    node id annotation and the topology labels;
//! 2. status: `capacity` and `allocatable` of the extended resources (through the status
//!    subresource; the main object ignores status);
//! 3. (after the CSINode) the ownership record narrowed to what is published now.
//!
//! The record grows before and shrinks after the writes it covers, so a daemon stopped between
//! two writes still knows at its next start what it must remove.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Map, Value, json};

use crate::inventory::Inventory;

/// Annotation recording what Pluglet published on the Node (JSON: `resources`, `csiDrivers`,
/// `labels`).
pub const PUBLISHED_ANNOTATION: &str = "pluglet.io/published";

/// Annotation mapping CSI driver names to their node ids, as the kubelet writes it.
pub const CSI_NODE_ID_ANNOTATION: &str = "csi.volume.kubernetes.io/nodeid";

/// What Pluglet published on a Node.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Published {
    /// Extended resources in `status.capacity` / `status.allocatable`.
    #[serde(default)]
    pub resources: BTreeSet<String>,
    /// CSI drivers (node id annotation entries and CSINode driver entries).
    #[serde(default)]
    pub csi_drivers: BTreeSet<String>,
    /// Topology labels.
    #[serde(default)]
    pub labels: BTreeSet<String>,
}

impl Published {
    /// The record on `node`; an unreadable one counts as empty (with a warning).
    pub fn read(node: &Node) -> (Published, Option<String>) {
        match annotation(node, PUBLISHED_ANNOTATION) {
            None => (Published::default(), None),
            Some(text) => match serde_json::from_str(text) {
                Ok(p) => (p, None),
                Err(e) => (
                    Published::default(),
                    Some(format!(
                        "annotation {PUBLISHED_ANNOTATION} is not Pluglet's record ({e}): \
                         what an earlier run published is not removed"
                    )),
                ),
            },
        }
    }

    fn union(&self, other: &Published) -> Published {
        Published {
            resources: self.resources.union(&other.resources).cloned().collect(),
            csi_drivers: self
                .csi_drivers
                .union(&other.csi_drivers)
                .cloned()
                .collect(),
            labels: self.labels.union(&other.labels).cloned().collect(),
        }
    }

    fn is_empty(&self) -> bool {
        self.resources.is_empty() && self.csi_drivers.is_empty() && self.labels.is_empty()
    }

    fn to_value(&self) -> Value {
        if self.is_empty() {
            Value::Null
        } else {
            Value::String(serde_json::to_string(self).expect("a record serialises"))
        }
    }
}

/// The Node writes one round needs (merge patches without `resourceVersion`), and what could
/// not be published.
#[derive(Debug, Default, PartialEq)]
pub struct NodePlan {
    /// Step 1: metadata (record grown, node id annotation, labels).
    pub metadata: Option<Value>,
    /// Step 2: status (extended resources).
    pub status: Option<Value>,
    /// Step 3: the record narrowed.
    pub narrow: Option<Value>,
    /// What Pluglet published before (the CSINode step removes its drivers no longer wanted).
    pub published: Published,
    /// Conflicts with what others wrote, left as they are.
    pub warnings: Vec<String>,
}

/// Plans the writes that bring `node` to `want`.
pub fn plan(node: &Node, want: &Inventory) -> NodePlan {
    let (published, warning) = Published::read(node);
    let mut warnings: Vec<String> = warning.into_iter().collect();

    // Labels: every topology segment of every driver, unless another writer's label holds the
    // key with another value (the kubelet refuses the driver then; here the rest is published
    // and the conflict reported).
    let current_labels = node.metadata.labels.clone().unwrap_or_default();
    let mut labels: BTreeMap<String, String> = BTreeMap::new();
    for (driver, d) in &want.csi_drivers {
        for (key, value) in &d.topology {
            match labels.get(key) {
                Some(v) if v != value => {
                    warnings.push(format!(
                        "CSI drivers disagree on topology label {key}: {v:?} is kept, \
                         {driver}'s {value:?} is not published"
                    ));
                    continue;
                }
                Some(_) => continue,
                None => {}
            }
            match current_labels.get(key) {
                Some(v) if v != value && !published.labels.contains(key) => {
                    warnings.push(format!(
                        "Node label {key} is {v:?}, not set by Pluglet: {driver}'s topology \
                         {key}={value:?} is not published"
                    ));
                }
                Some(v) if v == value && !published.labels.contains(key) => {
                    // Already there, written by someone else: left theirs.
                }
                _ => {
                    labels.insert(key.clone(), value.clone());
                }
            }
        }
    }

    let target = Published {
        resources: want.resources.keys().cloned().collect(),
        csi_drivers: want.csi_drivers.keys().cloned().collect(),
        labels: labels.keys().cloned().collect(),
    };
    let grown = published.union(&target);

    // Step 1: metadata.
    let mut annotations = Map::new();
    if grown != published {
        annotations.insert(PUBLISHED_ANNOTATION.into(), grown.to_value());
    }
    match node_ids(node) {
        Ok(current) => {
            let mut ids = current.clone();
            for gone in published.csi_drivers.difference(&target.csi_drivers) {
                ids.remove(gone);
            }
            for (name, d) in &want.csi_drivers {
                ids.insert(name.clone(), d.node_id.clone());
            }
            if ids != current {
                let value = if ids.is_empty() {
                    Value::Null
                } else {
                    Value::String(serde_json::to_string(&ids).expect("a map serialises"))
                };
                annotations.insert(CSI_NODE_ID_ANNOTATION.into(), value);
            }
        }
        Err(e) => warnings.push(e.to_string()),
    }
    let mut label_patch = Map::new();
    for (key, value) in &labels {
        if current_labels.get(key) != Some(value) {
            label_patch.insert(key.clone(), Value::String(value.clone()));
        }
    }
    for gone in published.labels.difference(&target.labels) {
        if current_labels.contains_key(gone) {
            label_patch.insert(gone.clone(), Value::Null);
        }
    }
    let mut metadata = Map::new();
    if !annotations.is_empty() {
        metadata.insert("annotations".into(), Value::Object(annotations));
    }
    if !label_patch.is_empty() {
        metadata.insert("labels".into(), Value::Object(label_patch));
    }

    // Step 2: status.
    let status = node.status.as_ref();
    let capacity = status.and_then(|s| s.capacity.as_ref());
    let allocatable = status.and_then(|s| s.allocatable.as_ref());
    let mut cap_patch = Map::new();
    let mut alloc_patch = Map::new();
    for (name, counts) in &want.resources {
        if quantity(capacity, name) != Some(counts.capacity) {
            cap_patch.insert(name.clone(), Value::String(counts.capacity.to_string()));
        }
        if quantity(allocatable, name) != Some(counts.allocatable) {
            alloc_patch.insert(name.clone(), Value::String(counts.allocatable.to_string()));
        }
    }
    for gone in published.resources.difference(&target.resources) {
        if capacity.is_some_and(|c| c.contains_key(gone)) {
            cap_patch.insert(gone.clone(), Value::Null);
        }
        if allocatable.is_some_and(|a| a.contains_key(gone)) {
            alloc_patch.insert(gone.clone(), Value::Null);
        }
    }
    let mut status_patch = Map::new();
    if !cap_patch.is_empty() {
        status_patch.insert("capacity".into(), Value::Object(cap_patch));
    }
    if !alloc_patch.is_empty() {
        status_patch.insert("allocatable".into(), Value::Object(alloc_patch));
    }

    NodePlan {
        metadata: (!metadata.is_empty()).then(|| json!({ "metadata": metadata })),
        status: (!status_patch.is_empty()).then(|| json!({ "status": status_patch })),
        narrow: (grown != target).then(|| {
            json!({ "metadata": { "annotations": { PUBLISHED_ANNOTATION: target.to_value() } } })
        }),
        published,
        warnings,
    }
}

/// `patch` with `metadata.resourceVersion` set to `node`'s: the write is refused (409) if the
/// Node changed since it was read.
pub fn with_resource_version(mut patch: Value, resource_version: Option<&str>) -> Value {
    if let (Some(rv), Some(object)) = (resource_version, patch.as_object_mut()) {
        let metadata = object
            .entry("metadata")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Some(metadata) = metadata.as_object_mut() {
            metadata.insert("resourceVersion".into(), Value::String(rv.to_owned()));
        }
    }
    patch
}

fn annotation<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// The node id annotation is not a JSON object of driver names to node ids.
#[derive(Debug, thiserror::Error)]
#[error(
    "annotation {CSI_NODE_ID_ANNOTATION} is not a JSON object of driver names to node ids \
     ({source}): left as it is, CSI node ids not published"
)]
pub struct NodeIdsError {
    /// Why it does not parse.
    #[source]
    source: serde_json::Error,
}

/// The node id annotation's map, or why it cannot be read (then it is left alone).
fn node_ids(node: &Node) -> Result<BTreeMap<String, String>, NodeIdsError> {
    match annotation(node, CSI_NODE_ID_ANNOTATION) {
        None => Ok(BTreeMap::new()),
        Some(text) => serde_json::from_str(text).map_err(|source| NodeIdsError { source }),
    }
}

/// The integer value of `name` in a resource list, if it has one. The API server writes
/// quantities in canonical form, so 1000 reads back as `1k`; a value that is not a whole
/// number of units reads as `None` (and is rewritten).
fn quantity(list: Option<&BTreeMap<String, Quantity>>, name: &str) -> Option<u64> {
    let text = list?.get(name)?.0.as_str();
    let (digits, scale) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        None => (text, 1u64),
        Some((at, _)) => {
            let scale = match &text[at..] {
                "k" => 1_000,
                "M" => 1_000_000,
                "G" => 1_000_000_000,
                "T" => 1_000_000_000_000,
                "P" => 1_000_000_000_000_000,
                "E" => 1_000_000_000_000_000_000,
                "Ki" => 1 << 10,
                "Mi" => 1 << 20,
                "Gi" => 1 << 30,
                "Ti" => 1 << 40,
                _ => return None,
            };
            (&text[..at], scale)
        }
    };
    digits.parse::<u64>().ok()?.checked_mul(scale)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::{Counts, CsiDriver};
    use k8s_openapi::api::core::v1::NodeStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn node(
        annotations: &[(&str, &str)],
        labels: &[(&str, &str)],
        capacity: &[(&str, &str)],
    ) -> Node {
        let map = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        let quantities = capacity
            .iter()
            .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
            .collect::<BTreeMap<_, _>>();
        Node {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                annotations: Some(map(annotations)),
                labels: Some(map(labels)),
                ..Default::default()
            },
            status: Some(NodeStatus {
                capacity: Some(quantities.clone()),
                allocatable: Some(quantities),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// A driver: name, node id, topology.
    type Driver<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);

    fn want(resources: &[(&str, u64, u64)], drivers: &[Driver<'_>]) -> Inventory {
        Inventory {
            resources: resources
                .iter()
                .map(|(n, c, a)| {
                    (
                        n.to_string(),
                        Counts {
                            capacity: *c,
                            allocatable: *a,
                        },
                    )
                })
                .collect(),
            csi_drivers: drivers
                .iter()
                .map(|(n, id, topo)| {
                    (
                        n.to_string(),
                        CsiDriver {
                            node_id: id.to_string(),
                            topology: topo
                                .iter()
                                .map(|(k, v)| (k.to_string(), v.to_string()))
                                .collect(),
                            max_volumes_per_node: 0,
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn a_new_resource_grows_the_record_and_sets_both_lists() {
        let n = node(&[], &[], &[("cpu", "2"), ("memory", "1Gi")]);
        let p = plan(&n, &want(&[("vendor.com/gpu", 2, 1)], &[]));
        assert_eq!(
            p.metadata.unwrap(),
            json!({"metadata": {"annotations": {PUBLISHED_ANNOTATION: r#"{"resources":["vendor.com/gpu"],"csiDrivers":[],"labels":[]}"#}}})
        );
        assert_eq!(
            p.status.unwrap(),
            json!({"status": {"capacity": {"vendor.com/gpu": "2"}, "allocatable": {"vendor.com/gpu": "1"}}})
        );
        assert_eq!(p.narrow, None);
    }

    #[test]
    fn nothing_to_write_when_the_node_already_shows_the_inventory() {
        let record = r#"{"resources":["vendor.com/gpu"]}"#;
        let n = node(
            &[(PUBLISHED_ANNOTATION, record)],
            &[],
            &[("cpu", "2"), ("vendor.com/gpu", "2")],
        );
        let p = plan(&n, &want(&[("vendor.com/gpu", 2, 2)], &[]));
        assert_eq!(
            p,
            NodePlan {
                published: p.published.clone(),
                ..Default::default()
            }
        );
    }

    #[test]
    fn canonical_quantities_read_as_their_value() {
        let record = r#"{"resources":["v/a","v/b"]}"#;
        let n = node(
            &[(PUBLISHED_ANNOTATION, record)],
            &[],
            &[("v/a", "10k"), ("v/b", "1024")],
        );
        let p = plan(
            &n,
            &want(&[("v/a", 10_000, 10_000), ("v/b", 1024, 1024)], &[]),
        );
        assert_eq!(p.status, None);
    }

    #[test]
    fn a_resource_no_longer_wanted_is_removed_and_only_then_the_record_narrows() {
        let record = r#"{"resources":["v/a","v/b"]}"#;
        let n = node(
            &[(PUBLISHED_ANNOTATION, record)],
            &[],
            &[
                ("cpu", "2"),
                ("v/a", "1"),
                ("v/b", "1"),
                ("other.io/x", "4"),
            ],
        );
        let p = plan(&n, &want(&[("v/a", 1, 1)], &[]));
        assert_eq!(p.metadata, None);
        assert_eq!(
            p.status.unwrap(),
            json!({"status": {"capacity": {"v/b": null}, "allocatable": {"v/b": null}}})
        );
        assert_eq!(
            p.narrow.unwrap(),
            json!({"metadata": {"annotations": {PUBLISHED_ANNOTATION: r#"{"resources":["v/a"],"csiDrivers":[],"labels":[]}"#}}})
        );
    }

    #[test]
    fn the_last_resource_gone_removes_the_record() {
        let record = r#"{"resources":["v/a"]}"#;
        let n = node(&[(PUBLISHED_ANNOTATION, record)], &[], &[("v/a", "0")]);
        let p = plan(&n, &want(&[], &[]));
        assert_eq!(
            p.narrow.unwrap(),
            json!({"metadata": {"annotations": {PUBLISHED_ANNOTATION: null}}})
        );
    }

    #[test]
    fn csi_drivers_set_node_ids_and_topology_labels_and_leave_others_alone() {
        let n = node(
            &[(CSI_NODE_ID_ANNOTATION, r#"{"other.csi":"x"}"#)],
            &[("zone", "z1"), ("kubernetes.io/hostname", "n1")],
            &[],
        );
        let p = plan(
            &n,
            &want(
                &[],
                &[(
                    "hostpath.csi.k8s.io",
                    "n1",
                    &[("topology.hostpath.csi/node", "n1"), ("zone", "z2")],
                )],
            ),
        );
        let m = p.metadata.unwrap();
        assert_eq!(
            m["metadata"]["annotations"][CSI_NODE_ID_ANNOTATION],
            r#"{"hostpath.csi.k8s.io":"n1","other.csi":"x"}"#
        );
        assert_eq!(
            m["metadata"]["labels"],
            json!({"topology.hostpath.csi/node": "n1"})
        );
        assert_eq!(p.warnings.len(), 1, "{:?}", p.warnings);
        assert!(p.warnings[0].contains("zone"), "{:?}", p.warnings);
    }

    #[test]
    fn a_removed_driver_takes_its_node_id_and_labels_with_it() {
        let record = r#"{"csiDrivers":["d.csi"],"labels":["topo/node"]}"#;
        let n = node(
            &[
                (PUBLISHED_ANNOTATION, record),
                (CSI_NODE_ID_ANNOTATION, r#"{"d.csi":"n1"}"#),
            ],
            &[("topo/node", "n1"), ("zone", "z1")],
            &[],
        );
        let p = plan(&n, &want(&[], &[]));
        assert_eq!(
            p.metadata.unwrap(),
            json!({"metadata": {"annotations": {CSI_NODE_ID_ANNOTATION: null}, "labels": {"topo/node": null}}})
        );
        assert!(p.narrow.is_some());
        assert!(p.published.csi_drivers.contains("d.csi"));
    }

    #[test]
    fn the_resource_version_is_carried() {
        let p = with_resource_version(json!({"status": {}}), Some("42"));
        assert_eq!(
            p,
            json!({"status": {}, "metadata": {"resourceVersion": "42"}})
        );
    }
}
