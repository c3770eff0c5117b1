//! The device manager's state on disk (facts §7.7): `kubelet_internal_checkpoint` in the device
//! plugins directory, in the kubelet's exact format, plus a side file in the state directory
//! for what that format cannot hold (every device with its health and NUMA nodes, the policy in
//! force). Both are written through `pluglet-checkpoint` (temporary file, fsync, rename).
//!
//! Two ways to disk:
//! - the kubelet checkpoint and the side file are written by one writer task, coalesced: a
//!   change calls [`Checkpointer::request`] (after releasing the state lock); the writer takes
//!   one snapshot per write, so a burst of changes costs one write;
//! - allocations and releases must be durable before they are answered. Rather than wait for
//!   the checkpoint (temporary file, fsync, rename, directory fsync), they go to a journal in
//!   the state directory first ([`pluglet_checkpoint::Journal`]: one in-place write and an
//!   `fdatasync`), and the checkpoint follows.
//!
//! Which is newer after a crash: each journal record names the checkpoint files that were in
//! place or being written when it was made (by their kubelet checksums, see [`Disk`]). At start,
//! when the checkpoint is one of those, the journal's allocations are newer and win; otherwise
//! the checkpoint was written later (by Pluglet, and then holds every journaled change, or by a
//! kubelet) and wins. Only the newest files are named, so an older state that a kubelet happens
//! to write again (an empty node, say) is not mistaken for Pluglet's. After a power cut the
//! checkpoint's last renames may be undone, as with the kubelet (it never fsyncs the directory;
//! Pluglet does every fourth write): the older checkpoint then wins and the allocations made
//! since are lost, with the containers that used them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use pluglet_checkpoint::{
    CheckpointData, CheckpointError, Durability, Journal, JournalRecord, LoadOutcome,
    PodDevicesEntry,
};
use pluglet_proto::v1beta1::ContainerAllocateResponse;
use prost::Message as _;
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, watch};

use crate::devices::{Device, DeviceSet, Health};
use crate::error::error_chain;
use crate::pod_devices::{Entry, EntryState, HolderKey, PodDevices};

/// File name of the side file in the state directory.
pub const SIDE_FILE_NAME: &str = "device-manager.json";

/// File name of the allocation journal in the state directory.
pub const JOURNAL_FILE_NAME: &str = "device-manager.journal";

/// The checkpoint writer fsyncs the directory (making its renames survive a power cut) after
/// this many renames.
const DIR_SYNC_AFTER: usize = 4;

/// How many checkpoint files a journal record names at most (more only while writes keep
/// failing).
const MAX_ON_DISK: usize = 16;

/// The durable side of the state, behind one async mutex so that a journal record and the
/// checkpoint writer's snapshots are ordered: a record taken after a snapshot names that
/// snapshot's file.
#[derive(Debug)]
pub(crate) struct Disk {
    /// The allocation journal.
    pub journal: Journal,
    /// Kubelet checksums of the checkpoint files that may be in place if the process dies now:
    /// the last one written and any being written (or that failed to be) since.
    pub on_disk: Vec<u64>,
    /// [`PodDevices::version`] of the newest journal record.
    pub journaled: u64,
    /// Renames since the last directory fsync.
    pub unsynced: usize,
}

impl Disk {
    /// A snapshot with this checksum is about to be written.
    pub fn writing(&mut self, checksum: u64) {
        self.on_disk.push(checksum);
        if self.on_disk.len() > MAX_ON_DISK {
            self.on_disk.remove(0);
        }
    }

    /// The file with this checksum is in place: earlier ones are gone.
    pub fn written(&mut self, checksum: u64) {
        self.on_disk.clear();
        self.on_disk.push(checksum);
        self.unsynced += 1;
    }

    /// Whether the writer should fsync the directory now.
    pub fn needs_dir_sync(&self) -> bool {
        self.unsynced >= DIR_SYNC_AFTER
    }
}

/// A journal record: the number of named checkpoint checksums (one byte), the checksums
/// (little-endian u64 each), then the allocations as a kubelet checkpoint file whose
/// `RegisteredDevices` is empty.
pub(crate) fn encode_journal(on_disk: &[u64], pods: &PodDevices) -> Vec<u8> {
    let file = kubelet_data(std::iter::empty(), pods).encode();
    let mut out = Vec::with_capacity(1 + 8 * on_disk.len() + file.len());
    out.push(u8::try_from(on_disk.len()).unwrap_or(u8::MAX));
    for checksum in on_disk.iter().take(usize::from(u8::MAX)) {
        out.extend_from_slice(&checksum.to_le_bytes());
    }
    out.extend_from_slice(&file);
    out
}

/// Parses [`encode_journal`]'s record: the named checksums and the allocations.
pub(crate) fn decode_journal(payload: &[u8]) -> Option<(Vec<u64>, CheckpointData)> {
    let (&count, rest) = payload.split_first()?;
    let (sums, file) = rest.split_at_checked(8 * usize::from(count))?;
    let sums = sums
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8")))
        .collect();
    Some((sums, CheckpointData::decode(file).ok()?))
}

/// The side file's content.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SideState {
    /// Per resource: every device and the policy in force.
    pub resources: BTreeMap<String, SideResource>,
}

/// One resource in the side file, compact so a 10,000-device resource stays small: each id is
/// written once per NUMA node it sits on, and once more if unhealthy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SideResource {
    /// Device ids by NUMA node (`-1`: no topology), in plugin order; every device is listed at
    /// least once.
    pub numa: BTreeMap<i64, Vec<String>>,
    /// Ids of the devices that were unhealthy when written.
    pub unhealthy: Vec<String>,
    /// Module id of the allocation policy in force when written.
    pub policy_module: String,
    /// sha256 of that policy module.
    pub policy_sha256: String,
}

impl SideResource {
    /// The devices it lists, in first-seen order, with their NUMA nodes and health.
    pub fn devices(&self) -> Vec<Device> {
        let mut out: Vec<Device> = Vec::new();
        let mut at: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for (node, ids) in &self.numa {
            for id in ids {
                let i = *at.entry(id.as_str()).or_insert_with(|| {
                    out.push(Device {
                        id: id.clone(),
                        health: Health::Healthy,
                        numa: Vec::new(),
                    });
                    out.len() - 1
                });
                if *node >= 0 {
                    out[i].numa.push(*node);
                }
            }
        }
        for id in &self.unhealthy {
            if let Some(&i) = at.get(id.as_str()) {
                out[i].health = Health::Unhealthy;
            }
        }
        out
    }
}

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

/// What the start restored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Allocations restored.
    pub allocations: usize,
    /// Resources restored (waiting for their plugins).
    pub resources: Vec<String>,
    /// Corrupt files set aside (the state started empty for them).
    pub set_aside: Vec<SetAside>,
    /// True when the allocations came from the journal (newer than the checkpoint: Pluglet
    /// stopped between answering an allocation and writing the checkpoint).
    pub from_journal: bool,
}

/// State read back from disk.
pub(crate) struct Restored {
    /// Devices per resource (all unhealthy until their plugin is back).
    pub resources: BTreeMap<String, DeviceSet>,
    /// Allocations.
    pub pods: PodDevices,
    /// What happened.
    pub report: RestoreReport,
}

/// Reads the checkpoint and side file; corrupt files are set aside. The allocations of
/// `journal` (its newest record) replace the checkpoint's when the record names the checkpoint
/// as one written before it.
pub(crate) fn restore(
    checkpoint: &Path,
    side: &Path,
    journal: Option<&JournalRecord>,
) -> Result<Restored, CheckpointError> {
    let mut report = RestoreReport::default();
    let data = match pluglet_checkpoint::load_or_set_aside(checkpoint)? {
        LoadOutcome::Loaded(data) => Some(data),
        LoadOutcome::Missing => None,
        LoadOutcome::SetAside { reason, moved_to } => {
            report.set_aside.push(SetAside {
                path: checkpoint.to_path_buf(),
                moved_to,
                reason: error_chain(&reason),
            });
            None
        }
    };
    let side_state = match pluglet_checkpoint::load_side_or_set_aside::<SideState>(side)? {
        LoadOutcome::Loaded(state) => Some(state),
        LoadOutcome::Missing => None,
        LoadOutcome::SetAside { reason, moved_to } => {
            report.set_aside.push(SetAside {
                path: side.to_path_buf(),
                moved_to,
                reason: error_chain(&reason),
            });
            None
        }
    };
    // Without a valid kubelet checkpoint the state starts empty, whatever the side file says.
    let Some(data) = data else {
        return Ok(Restored {
            resources: BTreeMap::new(),
            pods: PodDevices::default(),
            report,
        });
    };
    let side_state = side_state.unwrap_or_default();
    let mut data = data;
    if let Some((named, journaled)) = journal.and_then(|r| decode_journal(&r.payload))
        && named.contains(&data.checksum())
        && journaled.pod_device_entries != data.pod_device_entries
    {
        data.pod_device_entries = journaled.pod_device_entries;
        report.from_journal = true;
    }

    let mut resources = BTreeMap::new();
    let names = data
        .registered_devices
        .keys()
        .chain(side_state.resources.keys())
        .cloned()
        .collect::<std::collections::BTreeSet<String>>();
    for name in names {
        // Restored devices are unhealthy until their plugin is back, whatever the file says.
        let mut devices: Vec<Device> = side_state
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
        if let Some(Some(healthy)) = data.registered_devices.get(&name) {
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
            HolderKey {
                pod_uid: entry.pod_uid,
                container: entry.container_name,
                resource: entry.resource_name,
            },
            Entry {
                devices,
                numa,
                state: EntryState::Allocated { response },
            },
        );
        report.allocations += 1;
    }
    Ok(Restored {
        resources,
        pods,
        report,
    })
}

/// The kubelet checkpoint for these resources and allocations.
pub(crate) fn kubelet_data<'a>(
    resources: impl Iterator<Item = (&'a String, &'a DeviceSet)>,
    pods: &PodDevices,
) -> CheckpointData {
    let entries: Vec<PodDevicesEntry> = pods
        .iter()
        .filter_map(|(key, entry)| match &entry.state {
            EntryState::Allocated { response } => Some(PodDevicesEntry {
                pod_uid: key.pod_uid.clone(),
                container_name: key.container.clone(),
                resource_name: key.resource.clone(),
                device_ids: Some(
                    entry
                        .numa
                        .iter()
                        .map(|(node, ids)| (*node, Some(ids.clone())))
                        .collect(),
                ),
                alloc_resp: Some(response.encode_to_vec()),
            }),
            EntryState::Reserved { .. } => None,
        })
        .collect();
    CheckpointData {
        // The kubelet writes a nil slice (`null`) when no pod holds devices.
        pod_device_entries: (!entries.is_empty()).then_some(entries),
        registered_devices: resources
            .map(|(name, devices)| (name.clone(), Some(devices.healthy_ids())))
            .collect(),
    }
}

/// The side file's content for this resource.
pub(crate) fn side_resource(
    devices: &DeviceSet,
    policy_module: &str,
    policy_sha256: &str,
) -> SideResource {
    SideResource {
        numa: crate::pod_devices::group_by_numa(
            devices.iter().map(|d| (d.id.as_str(), d.numa.as_slice())),
        ),
        unhealthy: devices
            .iter()
            .filter(|d| d.health == Health::Unhealthy)
            .map(|d| d.id.clone())
            .collect(),
        policy_module: policy_module.to_owned(),
        policy_sha256: policy_sha256.to_owned(),
    }
}

/// Writes the kubelet checkpoint (`data`: an encoded file), and the side file when given, each
/// as the kubelet writes its checkpoint (temporary file, fsync, rename); the directory fsyncs
/// are batched by the writer ([`Disk::needs_dir_sync`]).
pub(crate) fn write_files(
    checkpoint: &Path,
    side: &Path,
    data: &[u8],
    side_state: Option<&SideState>,
    durability: Durability,
) -> Result<(), CheckpointError> {
    let Some(side_state) = side_state else {
        return pluglet_checkpoint::replace_file(checkpoint, data, durability);
    };
    let side_bytes =
        pluglet_checkpoint::encode_side(side_state).map_err(|source| CheckpointError::Encode {
            path: side.to_path_buf(),
            source,
        })?;
    // Two files in two directories: their fsyncs overlap when written side by side.
    std::thread::scope(|scope| {
        let side_write =
            scope.spawn(|| pluglet_checkpoint::replace_file(side, &side_bytes, durability));
        let kubelet = pluglet_checkpoint::replace_file(checkpoint, data, durability);
        let side = side_write.join().unwrap_or_else(|_| {
            Err(CheckpointError::Write {
                path: side.to_path_buf(),
                step: "run the side file writer thread",
                source: std::io::Error::other("the side file writer panicked"),
            })
        });
        kubelet.and(side)
    })
}

/// The outcome of the latest write.
#[derive(Clone, Debug, Default)]
pub(crate) struct Written {
    /// Every change requested up to this number is on disk (or failed with `error`).
    pub seq: u64,
    /// The write's error, if it failed.
    pub error: Option<Arc<CheckpointError>>,
}

/// Coalesces write requests for the writer task.
#[derive(Debug)]
pub(crate) struct Checkpointer {
    requested: AtomicU64,
    /// Devices changed since the side file was last written (allocations alone leave it as is).
    devices_changed: AtomicBool,
    wake: Notify,
    written: watch::Sender<Written>,
}

impl Default for Checkpointer {
    fn default() -> Self {
        Checkpointer {
            requested: AtomicU64::new(0),
            devices_changed: AtomicBool::new(false),
            wake: Notify::new(),
            written: watch::Sender::new(Written::default()),
        }
    }
}

impl Checkpointer {
    /// Asks for a write of the current state; call after the change, with the lock released.
    pub fn request(&self) -> u64 {
        let seq = self.requested.fetch_add(1, Ordering::SeqCst) + 1;
        self.wake.notify_one();
        seq
    }

    /// Asks for a write of both files (devices or resources changed).
    pub fn request_devices(&self) -> u64 {
        self.devices_changed.store(true, Ordering::SeqCst);
        self.request()
    }

    /// Writer side: whether the side file must be written too; clears the flag.
    pub fn take_devices_changed(&self) -> bool {
        self.devices_changed.swap(false, Ordering::SeqCst)
    }

    /// The number of the latest request.
    pub fn requested(&self) -> u64 {
        self.requested.load(Ordering::SeqCst)
    }

    /// Waits until the write covering request `seq` is done.
    pub async fn flush(&self, seq: u64) -> Result<(), Arc<CheckpointError>> {
        let mut rx = self.written.subscribe();
        let written = rx
            .wait_for(|w| w.seq >= seq)
            .await
            .map(|w| w.clone())
            .unwrap_or_default();
        match written.error {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Writer side: waits for a request newer than the last write; returns its number.
    pub async fn next_request(&self) -> u64 {
        loop {
            let target = self.requested.load(Ordering::SeqCst);
            if target > self.written.borrow().seq {
                return target;
            }
            self.wake.notified().await;
        }
    }

    /// Writer side: whether requests are waiting.
    pub fn pending(&self) -> bool {
        self.requested.load(Ordering::SeqCst) > self.written.borrow().seq
    }

    /// Writer side: records the outcome of the write covering `seq`.
    pub fn done(&self, seq: u64, error: Option<CheckpointError>) {
        self.written.send_replace(Written {
            seq,
            error: error.map(Arc::new),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu_set() -> DeviceSet {
        DeviceSet::new(vec![
            Device {
                id: "d1".into(),
                health: Health::Healthy,
                numa: vec![1],
            },
            Device {
                id: "d0".into(),
                health: Health::Healthy,
                numa: vec![0],
            },
            Device {
                id: "d2".into(),
                health: Health::Unhealthy,
                numa: vec![],
            },
        ])
    }

    #[test]
    fn side_resource_round_trips_devices() {
        let side = side_resource(&gpu_set(), "m", "s");
        assert_eq!(side.unhealthy, ["d2"]);
        let mut devices = side.devices();
        devices.sort_by(|a, b| a.id.cmp(&b.id));
        let mut expected: Vec<Device> = gpu_set().iter().cloned().collect();
        expected.sort_by(|a, b| a.id.cmp(&b.id));
        assert_eq!(devices, expected);
    }

    #[test]
    fn empty_state_is_the_kubelet_empty_checkpoint() {
        let data = kubelet_data(std::iter::empty(), &PodDevices::default());
        assert_eq!(
            String::from_utf8(data.encode()).unwrap(),
            r#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":3467439661}"#
        );
    }

    #[test]
    fn state_round_trips_through_both_files() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = dir.path().join("kubelet_internal_checkpoint");
        let side = dir.path().join("state").join(SIDE_FILE_NAME);
        let resources = BTreeMap::from([("vendor.com/gpu".to_string(), gpu_set())]);
        let mut pods = PodDevices::default();
        let response = ContainerAllocateResponse {
            envs: [("A".to_string(), "B".to_string())].into(),
            ..Default::default()
        };
        pods.insert(
            HolderKey {
                pod_uid: "pod-1".into(),
                container: "ctr".into(),
                resource: "vendor.com/gpu".into(),
            },
            Entry {
                devices: vec!["d0".into(), "d1".into()],
                numa: crate::pod_devices::group_by_numa([("d0", &[0][..]), ("d1", &[1][..])]),
                state: EntryState::Allocated {
                    response: response.clone(),
                },
            },
        );
        pods.insert(
            HolderKey {
                pod_uid: "pod-2".into(),
                container: "ctr".into(),
                resource: "vendor.com/gpu".into(),
            },
            Entry {
                devices: vec!["d2".into()],
                numa: BTreeMap::new(),
                state: EntryState::Reserved { token: 1 },
            },
        );
        let data = kubelet_data(resources.iter(), &pods);
        let side_state = SideState {
            resources: resources
                .iter()
                .map(|(k, v)| (k.clone(), side_resource(v, "builtin:device-plugin", "ab")))
                .collect(),
        };
        write_files(
            &checkpoint,
            &side,
            &data.encode(),
            Some(&side_state),
            Durability::NoFsync,
        )
        .unwrap();
        let text = std::fs::read_to_string(&checkpoint).unwrap();
        assert!(
            text.contains(r#""RegisteredDevices":{"vendor.com/gpu":["d0","d1"]}"#),
            "{text}"
        );
        assert!(!text.contains("pod-2"), "reservations are not checkpointed");

        let restored = restore(&checkpoint, &side, None).unwrap();
        assert_eq!(restored.report.allocations, 1);
        assert_eq!(restored.report.resources, ["vendor.com/gpu"]);
        let set = &restored.resources["vendor.com/gpu"];
        assert_eq!(set.capacity(), 3);
        assert!(set.get("d2").unwrap().numa.is_empty());
        assert_eq!(
            set.allocatable(),
            0,
            "restored devices wait for their plugin"
        );
        assert_eq!(set.get("d1").unwrap().numa, [1]);
        let (key, entry) = restored.pods.iter().next().unwrap();
        assert_eq!(key.pod_uid, "pod-1");
        assert_eq!(entry.devices, ["d0", "d1"]);
        assert_eq!(entry.state, EntryState::Allocated { response });
        assert!(restored.pods.is_held("vendor.com/gpu", "d1"));
    }

    #[test]
    fn a_corrupt_checkpoint_is_set_aside_and_the_state_starts_empty() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = dir.path().join("kubelet_internal_checkpoint");
        let side = dir.path().join(SIDE_FILE_NAME);
        std::fs::write(
            &checkpoint,
            r#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":1}"#,
        )
        .unwrap();
        let restored = restore(&checkpoint, &side, None).unwrap();
        assert!(restored.pods.is_empty());
        assert_eq!(restored.report.set_aside.len(), 1);
        let aside = &restored.report.set_aside[0];
        assert!(aside.moved_to.exists());
        assert!(!checkpoint.exists());
        assert!(aside.reason.contains("checksum"), "{}", aside.reason);
    }

    fn allocated(pods: &mut PodDevices, pod: &str, device: &str) {
        pods.insert(
            HolderKey {
                pod_uid: pod.into(),
                container: "ctr".into(),
                resource: "vendor.com/gpu".into(),
            },
            Entry {
                devices: vec![device.into()],
                numa: crate::pod_devices::group_by_numa([(device, &[0][..])]),
                state: EntryState::Allocated {
                    response: ContainerAllocateResponse::default(),
                },
            },
        );
    }

    /// A checkpoint holding pod-1, and a journal record holding pod-1 and pod-2 that names
    /// another checkpoint file, and the checkpoint on disk too when `names_it`.
    fn crash_after_journal(names_it: bool) -> (tempfile::TempDir, Restored) {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = dir.path().join("kubelet_internal_checkpoint");
        let side = dir.path().join(SIDE_FILE_NAME);
        let resources = BTreeMap::from([("vendor.com/gpu".to_string(), gpu_set())]);
        let mut pods = PodDevices::default();
        allocated(&mut pods, "pod-1", "d0");
        let (bytes, checksum) = kubelet_data(resources.iter(), &pods).encode_with_checksum();
        pluglet_checkpoint::write_atomic(&checkpoint, &bytes, Durability::NoFsync).unwrap();
        allocated(&mut pods, "pod-2", "d1");
        let named = if names_it { vec![7, checksum] } else { vec![7] };
        let record = JournalRecord {
            seq: 3,
            payload: encode_journal(&named, &pods),
        };
        let restored = restore(&checkpoint, &side, Some(&record)).unwrap();
        (dir, restored)
    }

    #[test]
    fn a_journal_newer_than_the_checkpoint_wins() {
        let (_dir, restored) = crash_after_journal(true);
        assert!(restored.report.from_journal);
        let pods: Vec<&str> = restored
            .pods
            .iter()
            .map(|(k, _)| k.pod_uid.as_str())
            .collect();
        assert_eq!(pods, ["pod-1", "pod-2"]);
        assert!(restored.pods.is_held("vendor.com/gpu", "d1"));
    }

    #[test]
    fn a_checkpoint_the_journal_does_not_name_wins() {
        // Written after the record (by Pluglet, holding every journaled change) or by a
        // kubelet: either way the checkpoint is the newer state.
        let (_dir, restored) = crash_after_journal(false);
        assert!(!restored.report.from_journal);
        let pods: Vec<&str> = restored
            .pods
            .iter()
            .map(|(k, _)| k.pod_uid.as_str())
            .collect();
        assert_eq!(pods, ["pod-1"]);
    }

    #[test]
    fn without_a_checkpoint_the_journal_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let mut pods = PodDevices::default();
        allocated(&mut pods, "pod-1", "d0");
        let record = JournalRecord {
            seq: 1,
            payload: encode_journal(&[], &pods),
        };
        let restored = restore(
            &dir.path().join("kubelet_internal_checkpoint"),
            &dir.path().join(SIDE_FILE_NAME),
            Some(&record),
        )
        .unwrap();
        assert!(restored.pods.is_empty());
        assert!(!restored.report.from_journal);
    }

    #[test]
    fn a_record_names_the_file_in_place_and_the_one_being_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut disk = Disk {
            journal: Journal::open(&dir.path().join("j"), Durability::NoFsync)
                .unwrap()
                .journal,
            on_disk: Vec::new(),
            journaled: 0,
            unsynced: 0,
        };
        disk.writing(1);
        disk.written(1);
        disk.writing(2);
        assert_eq!(disk.on_disk, [1, 2], "a crash now leaves either in place");
        disk.written(2);
        assert_eq!(
            disk.on_disk,
            [2],
            "file 1 is gone for good once 2 is in place"
        );
        disk.writing(3);
        disk.writing(4);
        assert_eq!(disk.on_disk, [2, 3, 4], "a failed write stays named");
        assert!(!disk.needs_dir_sync());
        disk.written(4);
        disk.written(4);
        disk.written(4);
        assert!(disk.needs_dir_sync(), "every fourth rename");
    }

    #[test]
    fn journal_records_round_trip() {
        let mut pods = PodDevices::default();
        allocated(&mut pods, "pod-1", "d0");
        let (named, data) = decode_journal(&encode_journal(&[1, u64::MAX], &pods)).unwrap();
        assert_eq!(named, [1, u64::MAX]);
        assert_eq!(data.pod_device_entries.unwrap().len(), 1);
        assert!(data.registered_devices.is_empty());
        assert!(decode_journal(&[3, 0, 0]).is_none(), "truncated");
    }

    #[tokio::test]
    async fn flush_waits_for_the_covering_write() {
        let cp = Arc::new(Checkpointer::default());
        let seq = cp.request();
        let writer = {
            let cp = cp.clone();
            tokio::spawn(async move {
                let target = cp.next_request().await;
                cp.done(target, None);
            })
        };
        cp.flush(seq).await.unwrap();
        writer.await.unwrap();
        assert!(!cp.pending());
    }
}
