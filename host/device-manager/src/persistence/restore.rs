//! The state at start as a pure function of what the files held: [`restore`]. Reading the
//! files, and renaming the corrupt ones aside, happen before it (`Persistence::open`), so every
//! combination of files is a table test here.
//!
//! The rules:
//! - without a valid kubelet checkpoint the state starts empty, whatever the side file and the
//!   journal say (the checkpoint is the shared truth a kubelet would also read);
//! - the journal's allocations win over the checkpoint's only when its newest record names
//!   that very checkpoint (by kubelet checksum) as written before the record: Pluglet answered
//!   allocations and stopped before the checkpoint caught up. A checkpoint the record does not
//!   name was written later, by Pluglet (and then holds every journaled change) or by a
//!   kubelet, and wins;
//! - restored devices are unhealthy until their plugin is back; the side file adds their NUMA
//!   nodes and the devices the checkpoint does not list (unhealthy ones).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use pluglet_checkpoint::{CheckpointData, JournalRecord};
use pluglet_core::ResourceName;
use pluglet_proto::v1beta1::ContainerAllocateResponse;
use prost::Message as _;

use super::files::{SideState, decode_journal};
use crate::devices::{Device, DeviceSet, Health};
use crate::pod_devices::{Entry, EntryState, HolderKey, PodDevices};

/// A file found corrupt at start and renamed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetAside {
    /// Where it was.
    pub path: PathBuf,
    /// Where it is now.
    pub moved_to: PathBuf,
    /// Why it was refused.
    pub reason: String,
}

/// What one file held when the daemon started.
#[derive(Clone, Debug, PartialEq)]
pub enum Found<T> {
    /// No such file.
    Missing,
    /// Read and verified.
    Loaded(T),
    /// Corrupt, and renamed aside.
    SetAside(SetAside),
}

impl<T> Found<T> {
    fn into_loaded(self, report: &mut RestoreReport) -> Option<T> {
        match self {
            Found::Missing => None,
            Found::Loaded(value) => Some(value),
            Found::SetAside(aside) => {
                report.set_aside.push(aside);
                None
            }
        }
    }
}

/// Everything the files held.
#[derive(Clone, Debug, PartialEq)]
pub struct Files {
    /// `kubelet_internal_checkpoint`.
    pub checkpoint: Found<CheckpointData>,
    /// The side file.
    pub side: Found<SideState>,
    /// The journal's newest record.
    pub journal: Found<Option<JournalRecord>>,
}

/// What the start restored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Allocations restored.
    pub allocations: usize,
    /// Resources restored (waiting for their plugins).
    pub resources: Vec<ResourceName>,
    /// Corrupt files set aside (the state started empty for them).
    pub set_aside: Vec<SetAside>,
    /// True when the allocations came from the journal (newer than the checkpoint: Pluglet
    /// stopped between answering an allocation and writing the checkpoint).
    pub from_journal: bool,
}

/// The state the files describe.
#[derive(Debug, Default)]
pub struct Restored {
    /// Devices per resource (all unhealthy until their plugin is back).
    pub resources: BTreeMap<ResourceName, DeviceSet>,
    /// Allocations.
    pub pods: PodDevices,
    /// What happened.
    pub report: RestoreReport,
}

/// The state `files` describe (see the module doc for the rules).
pub fn restore(files: Files) -> Restored {
    let mut report = RestoreReport::default();
    let data = files.checkpoint.into_loaded(&mut report);
    let side = files.side.into_loaded(&mut report).unwrap_or_default();
    let journal = files.journal.into_loaded(&mut report).flatten();
    let Some(mut data) = data else {
        return Restored {
            report,
            ..Restored::default()
        };
    };
    if let Some((named, journaled)) = journal.and_then(|r| decode_journal(&r.payload))
        && named.contains(&data.checksum())
        && journaled.pod_device_entries != data.pod_device_entries
    {
        data.pod_device_entries = journaled.pod_device_entries;
        report.from_journal = true;
    }

    let names: BTreeSet<ResourceName> = data
        .registered_devices
        .keys()
        .map(|k| ResourceName::from(k.as_str()))
        .chain(side.resources.keys().cloned())
        .collect();
    let mut resources = BTreeMap::new();
    for name in names {
        let mut devices: Vec<Device> = side
            .resources
            .get(&name)
            .map(|r| {
                r.devices()
                    .into_iter()
                    .map(|d| Device {
                        health: Health::Unhealthy,
                        ..d
                    })
                    .collect()
            })
            .unwrap_or_default();
        if let Some(Some(healthy)) = data.registered_devices.get(name.as_str()) {
            for id in healthy {
                if !devices.iter().any(|d| &d.id == id) {
                    devices.push(Device {
                        id: id.clone(),
                        health: Health::Unhealthy,
                        numa: Vec::new(),
                    });
                }
            }
        }
        report.resources.push(name.clone());
        resources.insert(name, DeviceSet::new(devices));
    }

    let mut pods = PodDevices::default();
    for entry in data.pod_device_entries.unwrap_or_default() {
        let numa: BTreeMap<i64, Vec<String>> = entry
            .device_ids
            .unwrap_or_default()
            .into_iter()
            .map(|(node, ids)| (node, ids.unwrap_or_default()))
            .collect();
        let mut devices: Vec<String> = Vec::new();
        for id in numa.values().flatten() {
            if !devices.contains(id) {
                devices.push(id.clone());
            }
        }
        let response = match ContainerAllocateResponse::decode(
            entry.alloc_resp.as_deref().unwrap_or_default(),
        ) {
            Ok(response) => response,
            Err(err) => {
                tracing::warn!(
                    pod_uid = %entry.pod_uid,
                    container = %entry.container_name,
                    resource = %entry.resource_name,
                    %err,
                    "checkpointed Allocate answer does not decode; keeping the devices with an empty answer"
                );
                ContainerAllocateResponse::default()
            }
        };
        pods.insert(
            HolderKey::new(entry.pod_uid, entry.container_name, entry.resource_name),
            Entry {
                devices,
                numa,
                state: EntryState::Allocated { response },
            },
        );
        report.allocations += 1;
    }
    Restored {
        resources,
        pods,
        report,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persistence::files::tests::gpu_set;
    use crate::persistence::files::{SideResource, encode_journal, kubelet_data};
    use crate::pod_devices::group_by_numa;

    const GPU: &str = "vendor.com/gpu";

    fn pods(holders: &[(&str, &str)]) -> PodDevices {
        let mut pods = PodDevices::default();
        for (pod, device) in holders {
            pods.insert(
                HolderKey::new(*pod, "ctr", GPU),
                Entry {
                    devices: vec![(*device).into()],
                    numa: group_by_numa([(*device, &[0][..])]),
                    state: EntryState::Allocated {
                        response: ContainerAllocateResponse {
                            envs: [("POD".to_string(), pod.to_string())].into(),
                            ..Default::default()
                        },
                    },
                },
            );
        }
        pods
    }

    fn checkpoint(holders: &[(&str, &str)]) -> CheckpointData {
        let resources = BTreeMap::from([(ResourceName::from(GPU), gpu_set())]);
        kubelet_data(resources.iter(), &pods(holders))
    }

    fn side() -> SideState {
        SideState {
            resources: BTreeMap::from([(
                ResourceName::from(GPU),
                SideResource::of(&gpu_set(), "builtin:device-plugin", "ab"),
            )]),
        }
    }

    /// A journal record of `holders` naming the checkpoints `named`.
    fn journal(
        named: &[&CheckpointData],
        holders: &[(&str, &str)],
    ) -> Found<Option<JournalRecord>> {
        let sums: Vec<u64> = named.iter().map(|d| d.checksum()).collect();
        Found::Loaded(Some(JournalRecord {
            seq: 3,
            payload: encode_journal(&sums, &pods(holders)),
        }))
    }

    fn aside(name: &str) -> SetAside {
        SetAside {
            path: PathBuf::from(name),
            moved_to: PathBuf::from(format!("{name}.corrupt-1")),
            reason: "checksum mismatch".into(),
        }
    }

    fn holders(restored: &Restored) -> Vec<String> {
        restored
            .pods
            .iter()
            .map(|(k, e)| format!("{}:{}", k.pod_uid, e.devices.join(",")))
            .collect()
    }

    #[test]
    fn every_combination_of_files() {
        let one = checkpoint(&[("pod-1", "d0")]);
        let by_kubelet = checkpoint(&[("pod-9", "d1")]);
        struct Case {
            name: &'static str,
            files: Files,
            holders: &'static [&'static str],
            from_journal: bool,
            set_aside: usize,
            resources: usize,
        }
        let cases = [
            Case {
                name: "nothing on disk: a new node",
                files: Files {
                    checkpoint: Found::Missing,
                    side: Found::Missing,
                    journal: Found::Loaded(None),
                },
                holders: &[],
                from_journal: false,
                set_aside: 0,
                resources: 0,
            },
            Case {
                name: "checkpoint newer than the journal (the record does not name it)",
                files: Files {
                    checkpoint: Found::Loaded(one.clone()),
                    side: Found::Loaded(side()),
                    journal: journal(&[&by_kubelet], &[("pod-1", "d0"), ("pod-2", "d1")]),
                },
                holders: &["pod-1:d0"],
                from_journal: false,
                set_aside: 0,
                resources: 1,
            },
            Case {
                name: "journal newer than the checkpoint (the record names it)",
                files: Files {
                    checkpoint: Found::Loaded(one.clone()),
                    side: Found::Loaded(side()),
                    journal: journal(&[&one], &[("pod-1", "d0"), ("pod-2", "d1")]),
                },
                holders: &["pod-1:d0", "pod-2:d1"],
                from_journal: true,
                set_aside: 0,
                resources: 1,
            },
            Case {
                name: "a release journaled after the checkpoint",
                files: Files {
                    checkpoint: Found::Loaded(one.clone()),
                    side: Found::Loaded(side()),
                    journal: journal(&[&one], &[]),
                },
                holders: &[],
                from_journal: true,
                set_aside: 0,
                resources: 1,
            },
            Case {
                name: "journal missing",
                files: Files {
                    checkpoint: Found::Loaded(one.clone()),
                    side: Found::Loaded(side()),
                    journal: Found::Missing,
                },
                holders: &["pod-1:d0"],
                from_journal: false,
                set_aside: 0,
                resources: 1,
            },
            Case {
                name: "checkpoint missing: the journal alone is not trusted",
                files: Files {
                    checkpoint: Found::Missing,
                    side: Found::Loaded(side()),
                    journal: journal(&[&one], &[("pod-1", "d0")]),
                },
                holders: &[],
                from_journal: false,
                set_aside: 0,
                resources: 0,
            },
            Case {
                name: "checkpoint corrupt: set aside, start empty",
                files: Files {
                    checkpoint: Found::SetAside(aside("kubelet_internal_checkpoint")),
                    side: Found::Loaded(side()),
                    journal: journal(&[&one], &[("pod-1", "d0")]),
                },
                holders: &[],
                from_journal: false,
                set_aside: 1,
                resources: 0,
            },
            Case {
                name: "journal corrupt: set aside, the checkpoint stands",
                files: Files {
                    checkpoint: Found::Loaded(one.clone()),
                    side: Found::Loaded(side()),
                    journal: Found::SetAside(aside("device-manager.journal")),
                },
                holders: &["pod-1:d0"],
                from_journal: false,
                set_aside: 1,
                resources: 1,
            },
            Case {
                name: "side file corrupt: devices from the checkpoint alone",
                files: Files {
                    checkpoint: Found::Loaded(one.clone()),
                    side: Found::SetAside(aside("device-manager.json")),
                    journal: Found::Loaded(None),
                },
                holders: &["pod-1:d0"],
                from_journal: false,
                set_aside: 1,
                resources: 1,
            },
            Case {
                name: "written by a kubelet: no side file, a journal naming another file",
                files: Files {
                    checkpoint: Found::Loaded(by_kubelet.clone()),
                    side: Found::Missing,
                    journal: journal(&[&one], &[("pod-1", "d0")]),
                },
                holders: &["pod-9:d1"],
                from_journal: false,
                set_aside: 0,
                resources: 1,
            },
        ];
        for case in cases {
            let restored = restore(case.files);
            assert_eq!(holders(&restored), case.holders, "{}", case.name);
            assert_eq!(
                restored.report.from_journal, case.from_journal,
                "{}",
                case.name
            );
            assert_eq!(
                restored.report.set_aside.len(),
                case.set_aside,
                "{}",
                case.name
            );
            assert_eq!(restored.resources.len(), case.resources, "{}", case.name);
            assert_eq!(
                restored.report.allocations,
                case.holders.len(),
                "{}",
                case.name
            );
        }
    }

    #[test]
    fn restored_devices_wait_for_their_plugin_and_keep_numa_from_the_side_file() {
        let restored = restore(Files {
            checkpoint: Found::Loaded(checkpoint(&[("pod-1", "d0")])),
            side: Found::Loaded(side()),
            journal: Found::Missing,
        });
        let set = &restored.resources[GPU];
        assert_eq!(
            set.capacity(),
            3,
            "the unhealthy d2 comes from the side file"
        );
        assert_eq!(set.allocatable(), 0);
        assert_eq!(set.get("d1").unwrap().numa, [1]);
        assert!(restored.pods.is_held(GPU, "d0"));
        let (_, entry) = restored.pods.iter().next().unwrap();
        let EntryState::Allocated { response } = &entry.state else {
            panic!("restored entries are allocated");
        };
        assert_eq!(
            response.envs["POD"], "pod-1",
            "the Allocate answer survives"
        );

        let without_side = restore(Files {
            checkpoint: Found::Loaded(checkpoint(&[])),
            side: Found::Missing,
            journal: Found::Missing,
        });
        let set = &without_side.resources[GPU];
        assert_eq!(
            set.capacity(),
            2,
            "only the healthy ids the checkpoint lists"
        );
        assert!(set.get("d0").unwrap().numa.is_empty());
    }
}
