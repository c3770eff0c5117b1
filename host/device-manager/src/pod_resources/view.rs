//! What the pod-resources API answers, computed from a snapshot: the acknowledged allocations
//! ([`PodDevices`]) and the registry's device sets. Pure functions, so every answer is the one a
//! kubelet gives for the same pods and devices (`docs/kubelet-compatibility.md`, "Pod
//! resources API"):
//!
//! - one `ContainerDevices` per device and NUMA node, with that node as its topology; a device
//!   without topology (NUMA node `-1` in the checkpoint) has none;
//! - `List` has every pod holding devices, each with the containers that hold them; only
//!   allocations the plugin answered and the journal made durable (no reservation in flight);
//! - `GetAllocatableResources` lists every healthy device, held or not;
//! - CPUs, memory and dynamic resources are not Pluglet's: always empty.
//!
//! Order, which the kubelet leaves to Go's map iteration: pods by UID, containers by name, then
//! resource, NUMA node and the order the devices were chosen in.

use std::collections::BTreeMap;

use pluglet_proto::podresources::v1 as pb;

use crate::devices::{DeviceSet, Health};
use crate::pod_devices::{HoldingState, PodDevices, PodName};
use pluglet_core::ResourceName;

/// The NUMA node the kubelet checkpoints devices without topology under.
const NO_TOPOLOGY: i64 = -1;

/// `List`: every pod holding acknowledged allocations.
pub fn list(pods: &PodDevices) -> pb::ListPodResourcesResponse {
    pb::ListPodResourcesResponse {
        pod_resources: by_pod(pods).into_values().collect(),
    }
}

/// `Get`: the pod named `name` in `namespace`, if it holds acknowledged allocations.
pub fn get(pods: &PodDevices, name: &str, namespace: &str) -> Option<pb::PodResources> {
    by_pod(pods)
        .into_values()
        .find(|p| p.name == name && p.namespace == namespace)
}

/// `GetAllocatableResources`: every healthy device of every resource.
pub fn allocatable<'a>(
    resources: impl IntoIterator<Item = (&'a ResourceName, &'a DeviceSet)>,
) -> pb::AllocatableResourcesResponse {
    let mut devices = Vec::new();
    for (resource, set) in resources {
        for device in set.devices().filter(|d| d.health == Health::Healthy) {
            if device.numa.is_empty() {
                devices.push(container_devices(resource.as_str(), device.id, NO_TOPOLOGY));
            }
            for node in device.numa {
                devices.push(container_devices(resource.as_str(), device.id, *node));
            }
        }
    }
    pb::AllocatableResourcesResponse {
        devices,
        cpu_ids: Vec::new(),
        memory: Vec::new(),
    }
}

/// The pods of the acknowledged allocations by UID, each with its containers sorted by name.
fn by_pod(pods: &PodDevices) -> BTreeMap<&str, pb::PodResources> {
    let mut out: BTreeMap<&str, pb::PodResources> = BTreeMap::new();
    // Entries come sorted by pod, container and resource.
    for (key, entry) in pods.iter() {
        if !matches!(entry.state, HoldingState::Allocated { .. }) {
            continue;
        }
        let pod = out.entry(key.pod_uid.as_str()).or_insert_with(|| {
            let shown = PodName::shown(pods.pod_name(key.pod_uid.as_str()), key.pod_uid.as_str());
            pb::PodResources {
                name: shown.name,
                namespace: shown.namespace,
                containers: Vec::new(),
            }
        });
        let container = match pod.containers.last_mut() {
            Some(last) if last.name == key.container.as_str() => last,
            _ => {
                pod.containers.push(pb::ContainerResources {
                    name: key.container.to_string(),
                    ..Default::default()
                });
                pod.containers.last_mut().expect("just pushed")
            }
        };
        for (node, ids) in entry.numa.iter() {
            for id in ids {
                container.devices.push(container_devices(
                    key.resource.as_str(),
                    id.as_str(),
                    *node,
                ));
            }
        }
    }
    out
}

/// One device on one NUMA node (none for [`NO_TOPOLOGY`]), as the kubelet lists it.
fn container_devices(resource: &str, id: &str, node: i64) -> pb::ContainerDevices {
    pb::ContainerDevices {
        resource_name: resource.to_owned(),
        device_ids: vec![id.to_owned()],
        topology: (node != NO_TOPOLOGY).then(|| pb::TopologyInfo {
            nodes: vec![pb::NumaNode { id: node }],
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::PluginAnswer;
    use crate::devices::ListedDevice;
    use crate::pod_devices::{HolderKey, Holding, group_by_numa};

    fn allocated(ids: &[(&str, &[i64])], pod: Option<PodName>) -> Holding {
        Holding {
            devices: ids
                .iter()
                .map(|&(id, _)| id.into())
                .collect::<Vec<_>>()
                .into(),
            numa: group_by_numa(ids.iter().map(|(id, numa)| (*id, *numa))).into(),
            state: HoldingState::Allocated {
                answer: PluginAnswer::default(),
            },
            pod,
        }
    }

    fn named(name: &str, namespace: &str) -> Option<PodName> {
        Some(PodName {
            name: name.into(),
            namespace: namespace.into(),
        })
    }

    fn devices(list: &[pb::ContainerDevices]) -> Vec<(String, String, Option<i64>)> {
        list.iter()
            .map(|d| {
                assert_eq!(d.device_ids.len(), 1, "one device per entry");
                (
                    d.resource_name.clone(),
                    d.device_ids[0].clone(),
                    d.topology.as_ref().map(|t| {
                        assert_eq!(t.nodes.len(), 1);
                        t.nodes[0].id
                    }),
                )
            })
            .collect()
    }

    fn state() -> PodDevices {
        let mut pods = PodDevices::default();
        pods.insert(
            HolderKey::new("uid-a", "main", "vendor.com/gpu"),
            allocated(&[("g1", &[1]), ("g0", &[0])], named("train", "ml")),
        );
        pods.insert(
            HolderKey::new("uid-a", "main", "vendor.com/nic"),
            allocated(&[("n0", &[]), ("n1", &[0, 1])], None),
        );
        pods.insert(
            HolderKey::new("uid-a", "side", "vendor.com/gpu"),
            allocated(&[("g2", &[0])], named("train", "ml")),
        );
        pods.insert(
            HolderKey::new("uid-b", "c", "vendor.com/gpu"),
            allocated(&[("g3", &[1])], None),
        );
        pods.insert(
            HolderKey::new("uid-c", "c", "vendor.com/gpu"),
            Holding {
                state: HoldingState::Reserved { token: 1 },
                ..allocated(&[("g4", &[1])], None)
            },
        );
        pods
    }

    #[test]
    fn list_is_one_entry_per_device_and_numa_node_under_each_pods_name() {
        let listed = list(&state());
        let names: Vec<(&str, &str)> = listed
            .pod_resources
            .iter()
            .map(|p| (p.name.as_str(), p.namespace.as_str()))
            .collect();
        assert_eq!(
            names,
            [("train", "ml"), ("uid-b", "default")],
            "a reservation in flight is not listed; a pod without a name shows its UID"
        );
        let a = &listed.pod_resources[0];
        let containers: Vec<&str> = a.containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(containers, ["main", "side"]);
        let s = |r: &str, id: &str, n: Option<i64>| (r.to_owned(), id.to_owned(), n);
        assert_eq!(
            devices(&a.containers[0].devices),
            [
                s("vendor.com/gpu", "g0", Some(0)),
                s("vendor.com/gpu", "g1", Some(1)),
                s("vendor.com/nic", "n0", None),
                s("vendor.com/nic", "n1", Some(0)),
                s("vendor.com/nic", "n1", Some(1)),
            ]
        );
        assert!(a.containers[0].cpu_ids.is_empty() && a.containers[0].memory.is_empty());
        assert_eq!(
            devices(&a.containers[1].devices),
            [s("vendor.com/gpu", "g2", Some(0))]
        );
    }

    #[test]
    fn get_finds_a_pod_by_name_and_namespace() {
        let pods = state();
        let found = get(&pods, "train", "ml").unwrap();
        assert_eq!(found.containers.len(), 2);
        assert!(get(&pods, "train", "default").is_none());
        assert_eq!(get(&pods, "uid-b", "default").unwrap().containers.len(), 1);
        assert!(get(&pods, "uid-c", "default").is_none(), "only reserved");
    }

    #[test]
    fn allocatable_lists_every_healthy_device_held_or_not() {
        let set = DeviceSet::new(vec![
            ListedDevice {
                id: "g0".into(),
                health: Health::Healthy,
                numa: vec![0],
            },
            ListedDevice {
                id: "g1".into(),
                health: Health::Unhealthy,
                numa: vec![1],
            },
            ListedDevice {
                id: "g2".into(),
                health: Health::Healthy,
                numa: vec![],
            },
            ListedDevice {
                id: "g3".into(),
                health: Health::Healthy,
                numa: vec![0, 1],
            },
        ]);
        let name = ResourceName::from("vendor.com/gpu");
        let answer = allocatable([(&name, &set)]);
        let s = |id: &str, n: Option<i64>| ("vendor.com/gpu".to_owned(), id.to_owned(), n);
        assert_eq!(
            devices(&answer.devices),
            [
                s("g0", Some(0)),
                s("g2", None),
                s("g3", Some(0)),
                s("g3", Some(1))
            ]
        );
        assert!(answer.cpu_ids.is_empty() && answer.memory.is_empty());
    }
}
