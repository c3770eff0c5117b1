//! The state at start as a pure function of what the files held: [`restore`]. Reading the
//! files, and keeping the corrupt ones aside, happen before it (`Persistence::open`), so every
//! combination of files is a table test here.
//!
//! The rules:
//! - the journal's allocations win over the checkpoint's only when its newest record names
//!   that very checkpoint (by kubelet checksum) as written before the record: Pluglet answered
//!   allocations and stopped before the checkpoint caught up. A checkpoint the record does not
//!   name was written later, by Pluglet (and then holds every journaled change) or by a
//!   kubelet, and wins;
//! - a missing checkpoint means an empty state (someone removed it to start afresh), unless
//!   the journal's record says no checkpoint was in place when it was written (Pluglet could
//!   not write one yet): then the record's allocations stand;
//! - a corrupt checkpoint (cut short, edited, unreadable as JSON) proves nothing. The
//!   allocations come from the journal's newest record if there is one: every allocation and
//!   release Pluglet ever answered was in the journal first, so it is the last state Pluglet
//!   acknowledged. Whatever else the checkpoint held is lost; the entries still readable in
//!   the kept copy that are not restored are named in the report ([`Recovery`]);
//! - restored devices are unhealthy until their plugin is back; the side file adds their NUMA
//!   nodes and the devices the checkpoint does not list (unhealthy ones), and gives the
//!   devices alone when the checkpoint is corrupt.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;

use pluglet_checkpoint::{CheckpointData, JournalRecord, PodDevicesEntry};
use pluglet_core::ResourceName;

use super::NO_CHECKPOINT;
use super::files::{SideState, decode_journal_record};
use crate::answer::PluginAnswer;
use crate::device_id::DeviceId;
use crate::devices::{DeviceSet, Health, IdHasher, ListedDevice};
use crate::pod_devices::{HolderKey, Holding, HoldingState, PodDevices};

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
    /// Corrupt and renamed aside, but what it holds was still read from it (a journal cut
    /// short that kept an intact record).
    Salvaged(T, SetAside),
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
            Found::Salvaged(value, aside) => {
                report.set_aside.push(aside);
                report.journal_salvaged = true;
                Some(value)
            }
        }
    }
}

/// Everything the files held.
#[derive(Clone, Debug, PartialEq)]
pub struct Files {
    /// `kubelet_internal_checkpoint`.
    pub checkpoint: Found<CheckpointData>,
    /// The entries still readable in a corrupt checkpoint (unverified; only to say what is
    /// lost).
    pub checkpoint_readable: Vec<PodDevicesEntry>,
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
    /// stopped between answering an allocation and writing the checkpoint; or the checkpoint
    /// is corrupt or could not be written yet).
    pub from_journal: bool,
    /// What became of the allocations of a corrupt checkpoint.
    pub recovery: Option<Recovery>,
    /// True when the journal set aside still held an intact record, which was used.
    pub journal_salvaged: bool,
}

/// What became of the allocations of a corrupt checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// Allocations recovered from the journal's newest record; `None` when there was no record
    /// to recover from.
    pub from_journal: Option<usize>,
    /// Entries still readable in the kept copy that are not restored, each as
    /// `pod/container resource [ids]`.
    pub not_restored: Vec<String>,
}

impl Recovery {
    /// One sentence for the log and the event: what was recovered, what is lost.
    pub fn summary(&self) -> String {
        let recovered = match self.from_journal {
            Some(n) => format!(
                "recovered {n} allocation{} from the journal (the last state Pluglet acknowledged)",
                plural(n)
            ),
            None => "no journal record to recover allocations from: none are restored".to_owned(),
        };
        let lost = if self.not_restored.is_empty() {
            "the checkpoint's other entries, if it held any, are lost (none is readable in the copy)"
                .to_owned()
        } else {
            format!(
                "the checkpoint's other entries are lost; {} still readable in the copy {} not restored: {}",
                self.not_restored.len(),
                if self.not_restored.len() == 1 {
                    "is"
                } else {
                    "are"
                },
                self.not_restored.join("; ")
            )
        };
        format!("{recovered}; {lost}")
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// `pod/container resource [ids]`.
fn entry_text(entry: &PodDevicesEntry) -> String {
    let mut ids: Vec<&str> = entry
        .device_ids
        .iter()
        .flat_map(|m| m.values())
        .flatten()
        .flatten()
        .map(String::as_str)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    format!(
        "{}/{} {} [{}]",
        entry.pod_uid,
        entry.container_name,
        entry.resource_name,
        ids.join(",")
    )
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
    /// Whether the journal's newest record and its changes hold exactly the allocations
    /// restored, so that a change can be written after them as what it changed (otherwise the
    /// journal needs a whole record of the state first).
    pub journal_current: bool,
}

/// The state `files` describe (see the module doc for the rules).
pub fn restore(files: Files) -> Restored {
    let mut report = RestoreReport::default();
    let checkpoint_corrupt = matches!(files.checkpoint, Found::SetAside(_));
    let checkpoint_missing = matches!(files.checkpoint, Found::Missing);
    let data = files.checkpoint.into_loaded(&mut report);
    let side = files.side.into_loaded(&mut report).unwrap_or_default();
    let journal = files
        .journal
        .into_loaded(&mut report)
        .flatten()
        .and_then(|r| decode_journal_record(&r));
    // A pod's name never changes, and the newest record names every pod Pluglet's own
    // checkpoint holds (each record holds every allocation, and no checkpoint holds a change
    // the journal did not hold first): names come from it whichever file wins.
    let (journal, pod_names) = match journal {
        Some((named, data, pod_names)) => (Some((named, data)), pod_names),
        None => (None, Default::default()),
    };
    let mut journal_current = false;
    let (registered, entries) = match data {
        Some(data) => {
            let entries = match journal {
                Some((_, journaled)) if journaled.pod_device_entries == data.pod_device_entries => {
                    journal_current = true;
                    data.pod_device_entries
                }
                Some((named, journaled)) if named.contains(&data.checksum()) => {
                    report.from_journal = true;
                    journal_current = true;
                    journaled.pod_device_entries
                }
                _ => data.pod_device_entries,
            };
            (data.registered_devices, entries.unwrap_or_default())
        }
        None if checkpoint_corrupt => {
            let entries = match journal {
                Some((_, journaled)) => {
                    report.from_journal = true;
                    journal_current = true;
                    journaled.pod_device_entries.unwrap_or_default()
                }
                None => Vec::new(),
            };
            let restored: BTreeSet<String> = entries.iter().map(entry_text).collect();
            report.recovery = Some(Recovery {
                from_journal: report.from_journal.then_some(entries.len()),
                not_restored: files
                    .checkpoint_readable
                    .iter()
                    .map(entry_text)
                    .filter(|text| !restored.contains(text))
                    .collect(),
            });
            (BTreeMap::new(), entries)
        }
        None => match journal {
            Some((named, journaled)) if checkpoint_missing && named.contains(&NO_CHECKPOINT) => {
                report.from_journal = true;
                journal_current = true;
                (
                    BTreeMap::new(),
                    journaled.pod_device_entries.unwrap_or_default(),
                )
            }
            // Removed to start afresh (or a new node): the side file's devices go too.
            _ => {
                return Restored {
                    report,
                    ..Restored::default()
                };
            }
        },
    };

    let names: BTreeSet<ResourceName> = registered
        .keys()
        .map(|k| ResourceName::from(k.as_str()))
        .chain(side.resources.keys().cloned())
        .collect();
    let mut resources = BTreeMap::new();
    for name in names {
        let mut devices: Vec<ListedDevice> = side
            .resources
            .get(&name)
            .map(|r| {
                r.devices()
                    .into_iter()
                    .map(|d| ListedDevice {
                        health: Health::Unhealthy,
                        ..d
                    })
                    .collect()
            })
            .unwrap_or_default();
        if let Some(Some(healthy)) = registered.get(name.as_str()) {
            let mut known: HashSet<DeviceId, IdHasher> =
                devices.iter().map(|d| d.id.clone()).collect();
            for id in healthy {
                if known.insert(DeviceId::from(id.as_str())) {
                    devices.push(ListedDevice {
                        id: DeviceId::from(id.as_str()),
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
    for entry in entries {
        let numa: BTreeMap<i64, Vec<DeviceId>> = entry
            .device_ids
            .unwrap_or_default()
            .into_iter()
            .map(|(node, ids)| (node, DeviceId::from_wire(ids.unwrap_or_default())))
            .collect();
        let mut devices: Vec<DeviceId> = Vec::new();
        for id in numa.values().flatten() {
            if !devices.contains(id) {
                devices.push(id.clone());
            }
        }
        let answer = match PluginAnswer::decode(entry.alloc_resp.unwrap_or_default().into()) {
            Ok(answer) => answer,
            Err(err) => {
                tracing::warn!(
                    pod_uid = %entry.pod_uid,
                    container = %entry.container_name,
                    resource = %entry.resource_name,
                    %err,
                    "checkpointed Allocate answer does not decode; keeping the devices with an empty answer"
                );
                PluginAnswer::default()
            }
        };
        let pod = pod_names.get(&entry.pod_uid).cloned();
        pods.insert(
            HolderKey::new(entry.pod_uid, entry.container_name, entry.resource_name),
            Holding {
                devices: devices.into(),
                numa: numa.into(),
                state: HoldingState::Allocated { answer },
                pod,
            },
        );
        report.allocations += 1;
    }
    Restored {
        resources,
        pods,
        report,
        journal_current,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persistence::NO_CHECKPOINT;
    use crate::persistence::files::tests::gpu_set;
    use crate::persistence::files::tests::kubelet_data;
    use crate::persistence::files::{SideResource, encode_journal};
    use crate::pod_devices::{PodName, group_by_numa};
    use pluglet_proto::v1beta1::ContainerAllocateResponse;

    const GPU: &str = "vendor.com/gpu";

    fn pods(holders: &[(&str, &str)]) -> PodDevices {
        let mut pods = PodDevices::default();
        for (pod, device) in holders {
            pods.insert(
                HolderKey::new(*pod, "ctr", GPU),
                Holding {
                    devices: vec![(*device).into()].into(),
                    numa: group_by_numa([(*device, &[0][..])]).into(),
                    state: HoldingState::Allocated {
                        answer: PluginAnswer::of(&ContainerAllocateResponse {
                            envs: [("POD".to_string(), pod.to_string())].into(),
                            ..Default::default()
                        }),
                    },
                    pod: None,
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
        journal_naming(&sums, holders)
    }

    /// A journal record of `holders` naming the checksums `sums`.
    fn journal_naming(sums: &[u64], holders: &[(&str, &str)]) -> Found<Option<JournalRecord>> {
        Found::Loaded(Some(JournalRecord {
            seq: 3,
            payload: encode_journal(sums, &pods(holders)),
            changes: Vec::new(),
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
                    checkpoint_readable: Vec::new(),
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
                    checkpoint_readable: Vec::new(),
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
                    checkpoint_readable: Vec::new(),
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
                    checkpoint_readable: Vec::new(),
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
                    checkpoint_readable: Vec::new(),
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
                    checkpoint_readable: Vec::new(),
                    journal: journal(&[&one], &[("pod-1", "d0")]),
                },
                holders: &[],
                from_journal: false,
                set_aside: 0,
                resources: 0,
            },
            Case {
                name: "checkpoint corrupt: the journal's allocations, the side file's devices",
                files: Files {
                    checkpoint: Found::SetAside(aside("kubelet_internal_checkpoint")),
                    side: Found::Loaded(side()),
                    checkpoint_readable: Vec::new(),
                    journal: journal(&[&one], &[("pod-1", "d0")]),
                },
                holders: &["pod-1:d0"],
                from_journal: true,
                set_aside: 1,
                resources: 1,
            },
            Case {
                name: "checkpoint corrupt, no journal record: devices only",
                files: Files {
                    checkpoint: Found::SetAside(aside("kubelet_internal_checkpoint")),
                    side: Found::Loaded(side()),
                    checkpoint_readable: Vec::new(),
                    journal: Found::Loaded(None),
                },
                holders: &[],
                from_journal: false,
                set_aside: 1,
                resources: 1,
            },
            Case {
                name: "checkpoint corrupt, side file corrupt too: the journal's allocations",
                files: Files {
                    checkpoint: Found::SetAside(aside("kubelet_internal_checkpoint")),
                    side: Found::SetAside(aside("device-manager.json")),
                    checkpoint_readable: Vec::new(),
                    journal: journal(&[], &[("pod-1", "d0"), ("pod-2", "d1")]),
                },
                holders: &["pod-1:d0", "pod-2:d1"],
                from_journal: true,
                set_aside: 2,
                resources: 0,
            },
            Case {
                name: "checkpoint missing, the journal written when there was none: it stands",
                files: Files {
                    checkpoint: Found::Missing,
                    side: Found::Loaded(side()),
                    checkpoint_readable: Vec::new(),
                    journal: journal_naming(&[NO_CHECKPOINT], &[("pod-1", "d0")]),
                },
                holders: &["pod-1:d0"],
                from_journal: true,
                set_aside: 0,
                resources: 1,
            },
            Case {
                name: "journal corrupt: set aside, the checkpoint stands",
                files: Files {
                    checkpoint: Found::Loaded(one.clone()),
                    side: Found::Loaded(side()),
                    checkpoint_readable: Vec::new(),
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
                    checkpoint_readable: Vec::new(),
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
                    checkpoint_readable: Vec::new(),
                    journal: journal(&[&one], &[("pod-1", "d0")]),
                },
                holders: &["pod-9:d1"],
                from_journal: false,
                set_aside: 0,
                resources: 1,
            },
        ];
        for case in cases {
            // The allocations the journal's newest record and its changes hold, if any.
            let journaled: Option<Vec<String>> = match &case.files.journal {
                Found::Loaded(Some(record)) | Found::Salvaged(Some(record), _) => {
                    decode_journal_record(record).map(|(_, data, _)| {
                        data.pod_device_entries
                            .unwrap_or_default()
                            .iter()
                            .map(|e| {
                                let ids: Vec<&str> = e
                                    .device_ids
                                    .iter()
                                    .flatten()
                                    .flat_map(|(_, ids)| ids.iter().flatten())
                                    .map(String::as_str)
                                    .collect();
                                format!("{}:{}", e.pod_uid, ids.join(","))
                            })
                            .collect()
                    })
                }
                _ => None,
            };
            let restored = restore(case.files);
            assert_eq!(holders(&restored), case.holders, "{}", case.name);
            assert_eq!(
                restored.journal_current,
                journaled.as_deref() == Some(holders(&restored).as_slice()),
                "{}: whether changes may follow the journal's record",
                case.name
            );
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
            checkpoint_readable: Vec::new(),
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
        let HoldingState::Allocated { answer } = &entry.state else {
            panic!("restored entries are allocated");
        };
        assert_eq!(
            answer.response().envs["POD"],
            "pod-1",
            "the Allocate answer survives"
        );

        let without_side = restore(Files {
            checkpoint: Found::Loaded(checkpoint(&[])),
            side: Found::Missing,
            checkpoint_readable: Vec::new(),
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

    #[test]
    fn pod_names_come_from_the_journal_whichever_file_wins() {
        let name = PodName {
            name: "train-0".into(),
            namespace: "ml".into(),
        };
        let mut named = pods(&[("pod-a", "d0"), ("pod-b", "d1")]);
        let key = HolderKey::new("pod-a", "ctr", GPU);
        let entry = Holding {
            pod: Some(name.clone()),
            ..named.get(&key).unwrap().clone()
        };
        named.insert(key, entry);
        let record = || {
            Found::Loaded(Some(JournalRecord {
                seq: 3,
                payload: encode_journal(&[NO_CHECKPOINT], &named),
                changes: Vec::new(),
            }))
        };
        let written_later = checkpoint(&[("pod-a", "d0"), ("pod-b", "d1")]);
        for (what, checkpoint) in [
            (
                "checkpoint written after the record",
                Found::Loaded(written_later),
            ),
            ("no checkpoint yet", Found::Missing),
        ] {
            let restored = restore(Files {
                checkpoint,
                side: Found::Loaded(side()),
                checkpoint_readable: Vec::new(),
                journal: record(),
            });
            let names: Vec<(String, Option<PodName>)> = restored
                .pods
                .iter()
                .map(|(k, e)| (k.pod_uid.to_string(), e.pod.clone()))
                .collect();
            assert_eq!(
                names,
                [("pod-a".into(), Some(name.clone())), ("pod-b".into(), None)],
                "{what}"
            );
        }
    }
}
