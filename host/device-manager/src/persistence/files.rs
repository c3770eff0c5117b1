//! What goes into each file: the kubelet checkpoint's content for a state, the side file's,
//! a journal record's, and the write of the two checkpoint files.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use pluglet_checkpoint::{
    CheckpointData, CheckpointError, Durability, EntryParts, JournalRecord, PodDevicesEntry,
};
use pluglet_core::ResourceName;
use serde::{Deserialize, Serialize};

use crate::device_id::DeviceId;
use crate::devices::{DeviceSet, Health, ListedDevice};
use crate::pod_devices::{
    Change, HolderKey, Holding, HoldingState, PodDevices, PodName, group_by_numa,
};

/// The side file's content.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SideState {
    /// Per resource: every device and the policy in force.
    pub resources: BTreeMap<ResourceName, SideResource>,
}

/// One resource in the side file, compact so a 10,000-device resource stays small: each id is
/// written once per NUMA node it sits on, and once more if unhealthy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SideResource {
    /// Device ids by NUMA node (`-1`: no topology), in plugin order; every device is listed at
    /// least once.
    pub numa: BTreeMap<i64, Vec<DeviceId>>,
    /// Ids of the devices that were unhealthy when written.
    pub unhealthy: Vec<DeviceId>,
    /// Module id of the allocation policy in force when written.
    pub policy_module: String,
    /// sha256 of that policy module.
    pub policy_sha256: String,
}

impl SideResource {
    /// The side file's record of `devices` under the policy `policy_module`.
    pub fn of(devices: &DeviceSet, policy_module: &str, policy_sha256: &str) -> SideResource {
        SideResource {
            numa: group_by_numa(devices.devices().map(|d| (d.id, d.numa))),
            unhealthy: devices
                .devices()
                .filter(|d| d.health == Health::Unhealthy)
                .map(|d| DeviceId::from(d.id))
                .collect(),
            policy_module: policy_module.to_owned(),
            policy_sha256: policy_sha256.to_owned(),
        }
    }

    /// The devices it lists, in first-seen order, with their NUMA nodes and health.
    pub fn devices(&self) -> Vec<ListedDevice> {
        let mut out: Vec<ListedDevice> = Vec::new();
        let mut at: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for (node, ids) in &self.numa {
            for id in ids {
                let i = *at.entry(id.as_str()).or_insert_with(|| {
                    out.push(ListedDevice {
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

/// The kubelet checkpoint of one snapshot of the state, written from the state's own strings
/// and each entry's kept bytes (those of the journal, [`encode_entry`]) instead of through a
/// [`CheckpointData`] copy of every entry: on a node holding 10,000 allocations the copy, its
/// encoding and its drop were more than half as much work as the checksum itself. The
/// checksum is taken apart from the bytes ([`KubeletCheckpoint::checksum`],
/// [`KubeletCheckpoint::encode`]): the journal must name it before the file is written.
/// Both equal those of a [`CheckpointData`] holding the same state (a test holds them to it).
pub struct KubeletCheckpoint {
    /// A copy of the state (without index: it is only read).
    pods: PodDevices,
    /// Each resource's devices (shared with the registry), sorted by resource name.
    resources: Vec<(ResourceName, DeviceSet)>,
}

impl KubeletCheckpoint {
    /// The checkpoint of these resources and allocations (reservations are not written: a
    /// container that never got its Allocate answer holds nothing after a restart).
    pub fn of<'a>(
        resources: impl Iterator<Item = (&'a ResourceName, &'a DeviceSet)>,
        pods: PodDevices,
    ) -> KubeletCheckpoint {
        let mut resources: Vec<(ResourceName, DeviceSet)> = resources
            .map(|(name, devices)| (name.clone(), devices.clone()))
            .collect();
        // Go's map order: keys sorted byte-wise.
        resources.sort_unstable_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        KubeletCheckpoint { pods, resources }
    }

    /// `RegisteredDevices`: each resource's healthy ids, borrowed from its set.
    fn registered(&self) -> Vec<(&str, Vec<&str>)> {
        self.resources
            .iter()
            .map(|(name, devices)| (name.as_str(), devices.healthy_id_strs().collect()))
            .collect()
    }

    /// The kubelet's checksum of this checkpoint.
    pub fn checksum(&self) -> u64 {
        let mut entries = self
            .pods
            .iter()
            .filter_map(|(key, entry)| entry_parts(key, entry))
            .peekable();
        // The kubelet writes a nil slice when no pod holds devices.
        let listed = entries.peek().is_some().then_some(entries);
        let registered = self.registered();
        CheckpointData::checksum_of_parts(
            listed,
            registered
                .iter()
                .map(|(name, ids)| (*name, Some(ids.as_slice()))),
        )
    }

    /// The file, stamped with `checksum` (this checkpoint's [`KubeletCheckpoint::checksum`]).
    /// An entry the journal has not encoded yet (restored at start, say) is written from its
    /// parts and not kept: the checkpoint alone does not make the state hold every entry's bytes.
    pub fn encode(&self, checksum: u64) -> Vec<u8> {
        let entries: Vec<Listed<'_>> = self
            .pods
            .allocated_with_bytes()
            .filter_map(|(key, entry, bytes)| match bytes {
                Some(bytes) => Some(Listed::Kept(entry, bytes)),
                None => entry_parts(key, entry).map(Listed::Parts),
            })
            .collect();
        let registered = self.registered();
        let ids: usize = registered
            .iter()
            .map(|(name, ids)| name.len() + 8 + ids.iter().map(|id| id.len() + 3).sum::<usize>())
            .sum();
        let listed: usize = entries
            .iter()
            .map(|entry| match entry {
                Listed::Kept(_, bytes) => bytes.len() + 1,
                Listed::Parts(parts) => parts.size_hint() + 1,
            })
            .sum();
        CheckpointData::encode_parts(
            128 + ids + listed,
            (!entries.is_empty()).then(|| entries.into_iter()),
            |out, entry| match entry {
                Listed::Kept(entry, bytes) => put_kubelet_entry(out, entry, bytes),
                Listed::Parts(parts) => parts.put(out),
            },
            registered
                .iter()
                .map(|(name, ids)| (*name, Some(ids.as_slice()))),
            checksum,
        )
    }
}

/// An entry of [`KubeletCheckpoint::encode`]: its kept bytes, or its parts when it has none.
enum Listed<'a> {
    Kept(&'a Holding, &'a [u8]),
    Parts(EntryParts<'a, DeviceId>),
}

/// An entry's kept bytes ([`encode_entry`]) as the kubelet's checkpoint lists it: without the
/// pod name keys that `encode_entry` appends after the kubelet's last field.
fn put_kubelet_entry(out: &mut Vec<u8>, entry: &Holding, bytes: &[u8]) {
    match entry.pod.as_ref().and_then(|_| pod_name_key(bytes)) {
        Some(at) => {
            out.extend_from_slice(&bytes[..at]);
            out.push(b'}');
        }
        None => out.extend_from_slice(bytes),
    }
}

/// Where the `PodName` key starts in an entry's kept bytes. Its text (`,"PodName":`) cannot
/// occur inside a JSON string (its quote would be escaped), so it occurs once, as the key, a
/// few commas from the end: the commas are tried from the end, not every position.
fn pod_name_key(bytes: &[u8]) -> Option<usize> {
    const KEY: &[u8] = b",\"PodName\":";
    let mut end = bytes.len();
    while let Some(at) = bytes[..end].iter().rposition(|&b| b == b',') {
        if bytes[at..].starts_with(KEY) {
            return Some(at);
        }
        end = at;
    }
    None
}

/// An allocated entry's fields as the kubelet checkpoints them, borrowed from the holding
/// (`None` for a reserved one).
fn entry_parts<'a>(key: &'a HolderKey, entry: &'a Holding) -> Option<EntryParts<'a, DeviceId>> {
    let HoldingState::Allocated { answer } = &entry.state else {
        return None;
    };
    Some(EntryParts {
        pod_uid: key.pod_uid.as_str(),
        container_name: key.container.as_str(),
        resource_name: key.resource.as_str(),
        device_ids: Some(
            entry
                .numa
                .iter()
                .map(|(node, ids)| (*node, Some(ids.as_slice())))
                .collect(),
        ),
        alloc_resp: Some(answer.encoded()),
    })
}

/// An allocated entry's bytes in a journal record ([`PodDevices::encoded`] keeps them): the
/// kubelet's entry, with the pod's name and namespace as two keys of Pluglet's own
/// (`PodName`, `PodNamespace`) when they were given. A reader of the kubelet's format ignores
/// keys it does not know, so records stay readable by versions before them.
fn encode_entry(key: &HolderKey, entry: &Holding) -> Vec<u8> {
    // Written from the holding's own strings and bytes: the kubelet's entry of the holding (a
    // test holds it to the one built through the kubelet's types).
    let Some(parts) = entry_parts(key, entry) else {
        return Vec::new();
    };
    let mut bytes = parts.encode();
    if let Some(pod) = &entry.pod
        && bytes.pop() == Some(b'}')
    {
        bytes.reserve(32 + pod.name.len() + pod.namespace.len());
        for (name, value) in [("PodName", &pod.name), ("PodNamespace", &pod.namespace)] {
            bytes.extend_from_slice(b",\"");
            bytes.extend_from_slice(name.as_bytes());
            bytes.extend_from_slice(b"\":");
            serde_json::to_writer(&mut bytes, value).expect("a string encodes");
        }
        bytes.push(b'}');
    }
    bytes
}

/// The pods' names a journal record carries, by pod UID.
pub type PodNames = HashMap<String, PodName>;

/// The `PodName` and `PodNamespace` keys of a record's entries (see [`encode_entry`]).
fn decode_pod_names(file: &[u8]) -> PodNames {
    #[derive(Deserialize)]
    struct File {
        #[serde(rename = "Data")]
        data: Option<Data>,
    }
    #[derive(Deserialize)]
    struct Data {
        #[serde(rename = "PodDeviceEntries")]
        entries: Option<Vec<Named>>,
    }
    #[derive(Deserialize)]
    struct Named {
        #[serde(rename = "PodUID")]
        pod_uid: Option<String>,
        #[serde(rename = "PodName")]
        name: Option<String>,
        #[serde(rename = "PodNamespace")]
        namespace: Option<String>,
    }
    let Ok(File { data: Some(data) }) = serde_json::from_slice::<File>(file) else {
        return PodNames::new();
    };
    data.entries
        .unwrap_or_default()
        .into_iter()
        .filter_map(|e| {
            Some((
                e.pod_uid?,
                PodName {
                    name: e.name?,
                    namespace: e.namespace?,
                },
            ))
        })
        .collect()
}

/// A journal record: the number of named checkpoint checksums (one byte), the checksums
/// (little-endian u64 each), then the allocations as a kubelet checkpoint file whose
/// `RegisteredDevices` is empty and whose own checksum is left `0`: the record's CRC guards it,
/// and the kubelet's checksum (a rendering of every allocation response byte by byte) would
/// cost an allocation of 1,024 devices milliseconds. Records of earlier versions, which carry
/// the checksum, read the same.
pub fn encode_journal(on_disk: &[u64], pods: &PodDevices) -> Vec<u8> {
    // Sized once: each entry's kept bytes are copied once, into the record.
    let entries: Vec<&[u8]> = pods.encoded(encode_entry).collect();
    let framing = 128;
    let size = 1 + 8 * on_disk.len() + entries.iter().map(|e| e.len() + 1).sum::<usize>() + framing;
    let mut out = Vec::with_capacity(size);
    out.push(u8::try_from(on_disk.len()).unwrap_or(u8::MAX));
    for checksum in on_disk.iter().take(usize::from(u8::MAX)) {
        out.extend_from_slice(&checksum.to_le_bytes());
    }
    CheckpointData::put_entries_without_checksum(&mut out, entries);
    out
}

/// A journal change record ([`pluglet_checkpoint::Journal::append_change`]): what a change
/// did to the state of the record before it, so its cost is the change's, not the state's.
/// The checksums it names as in [`encode_journal`], then the keys of `changes` left with no
/// allocated entry (released, or only reserved) as a JSON list of
/// `[pod UID, container, resource]` preceded by its length (4 bytes, little-endian), then the
/// allocated entries of the others, as in [`encode_journal`] (a kubelet checkpoint file).
pub fn encode_change(on_disk: &[u64], changes: &[Change]) -> Vec<u8> {
    let mut removed: Vec<(&str, &str, &str)> = Vec::new();
    let mut put: Vec<&[u8]> = Vec::new();
    for change in changes {
        match change.encoded(encode_entry) {
            Some(bytes) => put.push(bytes),
            None => {
                let key = change.key();
                removed.push((
                    key.pod_uid.as_str(),
                    key.container.as_str(),
                    key.resource.as_str(),
                ));
            }
        }
    }
    let removed = serde_json::to_vec(&removed).expect("strings encode");
    let size = 1
        + 8 * on_disk.len()
        + 4
        + removed.len()
        + put.iter().map(|e| e.len() + 1).sum::<usize>()
        + 128;
    let mut out = Vec::with_capacity(size);
    out.push(u8::try_from(on_disk.len()).unwrap_or(u8::MAX));
    for checksum in on_disk.iter().take(usize::from(u8::MAX)) {
        out.extend_from_slice(&checksum.to_le_bytes());
    }
    let len = u32::try_from(removed.len()).expect("far below 4 GiB");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&removed);
    CheckpointData::put_entries_without_checksum(&mut out, put);
    out
}

/// Parses [`encode_journal`]'s record: the named checksums, the allocations and the names of
/// their pods.
pub fn decode_journal(payload: &[u8]) -> Option<(Vec<u64>, CheckpointData, PodNames)> {
    let (sums, file) = split_sums(payload)?;
    let data = CheckpointData::decode_unverified(file).ok()?;
    Some((sums, data, decode_pod_names(file)))
}

/// The checksums a record or change names, and the rest of it.
fn split_sums(payload: &[u8]) -> Option<(Vec<u64>, &[u8])> {
    let (&count, rest) = payload.split_first()?;
    let (sums, rest) = rest.split_at_checked(8 * usize::from(count))?;
    let sums = sums
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8")))
        .collect();
    Some((sums, rest))
}

/// Key of an entry: pod UID, container, resource.
type EntryKey = (String, String, String);

/// Parses [`encode_change`]'s change: the named checksums, the keys removed, the entries put
/// and the names of their pods.
#[allow(clippy::type_complexity)]
fn decode_change(
    payload: &[u8],
) -> Option<(Vec<u64>, Vec<EntryKey>, Vec<PodDevicesEntry>, PodNames)> {
    let (sums, rest) = split_sums(payload)?;
    let (len, rest) = rest.split_at_checked(4)?;
    let len = u32::from_le_bytes(len.try_into().ok()?) as usize;
    let (removed, file) = rest.split_at_checked(len)?;
    let removed: Vec<EntryKey> = serde_json::from_slice(removed).ok()?;
    let data = CheckpointData::decode_unverified(file).ok()?;
    Some((
        sums,
        removed,
        data.pod_device_entries.unwrap_or_default(),
        decode_pod_names(file),
    ))
}

/// The state a journal holds: its newest record with every change after it applied, and the
/// checksums the newest of them names. A change that cannot be read ends it there (its CRC
/// held, so only a bug writes one; what came before it stands).
pub fn decode_journal_record(
    record: &JournalRecord,
) -> Option<(Vec<u64>, CheckpointData, PodNames)> {
    let (mut sums, mut data, mut names) = decode_journal(&record.payload)?;
    if record.changes.is_empty() {
        return Some((sums, data, names));
    }
    let mut entries: BTreeMap<EntryKey, PodDevicesEntry> = data
        .pod_device_entries
        .take()
        .unwrap_or_default()
        .into_iter()
        .map(|e| {
            (
                (
                    e.pod_uid.clone(),
                    e.container_name.clone(),
                    e.resource_name.clone(),
                ),
                e,
            )
        })
        .collect();
    for change in &record.changes {
        let Some((named, removed, put, put_names)) = decode_change(change) else {
            tracing::warn!("a journal change could not be read; the changes after it are ignored");
            break;
        };
        sums = named;
        for key in removed {
            entries.remove(&key);
        }
        for e in put {
            entries.insert(
                (
                    e.pod_uid.clone(),
                    e.container_name.clone(),
                    e.resource_name.clone(),
                ),
                e,
            );
        }
        names.extend(put_names);
    }
    let held: std::collections::HashSet<&str> =
        entries.keys().map(|(pod, _, _)| pod.as_str()).collect();
    names.retain(|pod, _| held.contains(pod.as_str()));
    // The kubelet writes a nil slice (`null`) when no pod holds devices.
    data.pod_device_entries = (!entries.is_empty()).then(|| entries.into_values().collect());
    Some((sums, data, names))
}

/// Writes the kubelet checkpoint (`data`: an encoded file), and the side file when given, each
/// as the kubelet writes its checkpoint (temporary file, fsync, rename); the directory fsyncs
/// are batched by the writer.
///
/// The side file is encoded before either write starts, so that the two writes end close
/// together: the writer counts the checkpoint as in place only once both have ended, and until
/// then journal records still name the checkpoint it replaces.
pub fn write_files(
    checkpoint: &Path,
    side: &Path,
    data: &[u8],
    side_source: Option<super::SideSource>,
    durability: Durability,
) -> Result<(), CheckpointError> {
    let Some(side_source) = side_source else {
        return pluglet_checkpoint::replace_file(checkpoint, data, durability);
    };
    let side_bytes = pluglet_checkpoint::encode_side(&side_source()).map_err(|source| {
        CheckpointError::Encode {
            path: side.to_path_buf(),
            source,
        }
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

#[cfg(test)]
pub(crate) mod tests {
    use pluglet_proto::v1beta1::ContainerAllocateResponse;

    use super::*;
    use crate::answer::PluginAnswer;
    use crate::devices::Device;
    use crate::pod_devices::{HolderKey, Holding};

    /// The kubelet checkpoint for these resources and allocations through the kubelet's own types:
    /// the reference [`KubeletCheckpoint`] is held to.
    pub(crate) fn kubelet_data<'a>(
        resources: impl Iterator<Item = (&'a ResourceName, &'a DeviceSet)>,
        pods: &PodDevices,
    ) -> CheckpointData {
        let entries: Vec<PodDevicesEntry> = pods
            .iter()
            .filter_map(|(key, entry)| kubelet_entry(key, entry))
            .collect();
        CheckpointData {
            // The kubelet writes a nil slice (`null`) when no pod holds devices.
            pod_device_entries: (!entries.is_empty()).then_some(entries),
            registered_devices: resources
                .map(|(name, devices)| {
                    (
                        name.to_string(),
                        Some(DeviceId::into_wire(devices.healthy_ids())),
                    )
                })
                .collect(),
        }
    }

    /// An allocated entry as the kubelet checkpoints it (`None` for a reserved one).
    pub(crate) fn kubelet_entry(key: &HolderKey, entry: &Holding) -> Option<PodDevicesEntry> {
        match &entry.state {
            HoldingState::Allocated { answer } => Some(PodDevicesEntry {
                pod_uid: key.pod_uid.to_string(),
                container_name: key.container.to_string(),
                resource_name: key.resource.to_string(),
                device_ids: Some(
                    entry
                        .numa
                        .iter()
                        .map(|(node, ids)| (*node, Some(DeviceId::to_wire(ids))))
                        .collect(),
                ),
                alloc_resp: Some(answer.encoded().to_vec()),
            }),
            HoldingState::Reserved { .. } => None,
        }
    }

    /// A reservation of device `id`.
    fn reserved(id: &str, token: u64) -> Holding {
        Holding {
            devices: vec![id.into()].into(),
            numa: Default::default(),
            state: HoldingState::Reserved { token },
            pod: None,
        }
    }

    pub(crate) fn gpu_set() -> DeviceSet {
        DeviceSet::new(vec![
            ListedDevice {
                id: "d1".into(),
                health: Health::Healthy,
                numa: vec![1],
            },
            ListedDevice {
                id: "d0".into(),
                health: Health::Healthy,
                numa: vec![0],
            },
            ListedDevice {
                id: "d2".into(),
                health: Health::Unhealthy,
                numa: vec![],
            },
        ])
    }

    #[test]
    fn side_resource_round_trips_devices() {
        let side = SideResource::of(&gpu_set(), "m", "s");
        assert_eq!(side.unhealthy, ["d2"]);
        let mut devices = side.devices();
        devices.sort_by(|a, b| a.id.cmp(&b.id));
        let mut expected: Vec<ListedDevice> = gpu_set().devices().map(Device::to_listed).collect();
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

    /// The checkpoint written from the state's own strings and kept bytes is the one written
    /// through a `CheckpointData` copy, byte for byte and checksum for checksum: pod names kept
    /// (whose text may look like their own key) or not, several NUMA nodes in the kubelet's
    /// orders, reservations, resources given in any order, and the empty node.
    #[test]
    fn the_checkpoint_from_kept_bytes_is_the_kubelet_s() {
        let answer = |env: &str| {
            PluginAnswer::of(&ContainerAllocateResponse {
                envs: [("E".to_owned(), env.to_owned())].into(),
                annotations: [("a".to_owned(), "<b&>".to_owned())].into(),
                ..Default::default()
            })
        };
        let allocated = |ids: &[(&str, &[i64])], env: &str, pod: Option<(&str, &str)>| Holding {
            devices: ids
                .iter()
                .map(|(id, _)| DeviceId::from(*id))
                .collect::<Vec<_>>()
                .into(),
            numa: group_by_numa(ids.iter().copied()).into(),
            state: HoldingState::Allocated {
                answer: answer(env),
            },
            pod: pod.map(|(name, namespace)| PodName {
                name: name.to_owned(),
                namespace: namespace.to_owned(),
            }),
        };
        let same = |resources: &[(ResourceName, DeviceSet)], pods: &PodDevices| {
            let data = kubelet_data(resources.iter().map(|(k, d)| (k, d)), pods);
            let kept = KubeletCheckpoint::of(resources.iter().map(|(k, d)| (k, d)), pods.clone());
            let checksum = kept.checksum();
            assert_eq!(checksum, data.checksum());
            assert_eq!(
                String::from_utf8(kept.encode(checksum)).unwrap(),
                String::from_utf8(data.encode()).unwrap()
            );
        };
        let mut pods = PodDevices::default();
        same(&[], &pods);
        let resources = vec![
            (ResourceName::from("vendor.com/nic"), gpu_set()),
            (ResourceName::from("vendor.com/gpu"), gpu_set()),
        ];
        same(&resources, &pods);
        pods.insert(
            HolderKey::new("pod-a", "ctr", "vendor.com/gpu"),
            allocated(&[("d0", &[0]), ("d1", &[10, 2]), ("d2", &[])], "x", None),
        );
        pods.insert(
            HolderKey::new("pod-b", "ctr", "vendor.com/gpu"),
            allocated(&[("d3", &[-1])], "y", Some(("b", "default"))),
        );
        pods.insert(
            HolderKey::new("pod-c", "c\"1", "vendor.com/nic"),
            allocated(&[], "", Some(("c\",\"PodName\":", ",\"PodName\":\"x"))),
        );
        pods.insert(
            HolderKey::new("pod-r", "ctr", "vendor.com/gpu"),
            reserved("d9", 1),
        );
        // Once before the journal keeps each entry's bytes (the checkpoint keeps none), once
        // after.
        same(&resources, &pods);
        assert!(
            pods.allocated_with_bytes()
                .all(|(_, _, bytes)| bytes.is_none())
        );
        encode_journal(&[], &pods);
        assert!(
            pods.allocated_with_bytes()
                .all(|(_, _, bytes)| bytes.is_some())
        );
        same(&resources, &pods);
    }

    #[test]
    fn reservations_are_not_checkpointed() {
        let mut pods = PodDevices::default();
        pods.insert(
            HolderKey::new("pod-2", "ctr", "vendor.com/gpu"),
            reserved("d2", 1),
        );
        pods.insert(
            HolderKey::new("pod-1", "ctr", "vendor.com/gpu"),
            Holding {
                devices: vec!["d0".into()].into(),
                numa: group_by_numa([("d0", &[0][..])]).into(),
                state: HoldingState::Allocated {
                    answer: PluginAnswer::of(&ContainerAllocateResponse::default()),
                },
                pod: None,
            },
        );
        let resources = BTreeMap::from([(ResourceName::from("vendor.com/gpu"), gpu_set())]);
        let text = String::from_utf8(kubelet_data(resources.iter(), &pods).encode()).unwrap();
        assert!(
            text.contains(r#""RegisteredDevices":{"vendor.com/gpu":["d0","d1"]}"#),
            "{text}"
        );
        assert!(text.contains("pod-1") && !text.contains("pod-2"), "{text}");
    }

    #[test]
    fn a_journal_record_encodes_each_entry_once_and_follows_every_change() {
        let allocated = |id: &str, env: &str| Holding {
            devices: vec![id.into()].into(),
            numa: group_by_numa([(id, &[0][..])]).into(),
            state: HoldingState::Allocated {
                answer: PluginAnswer::of(&ContainerAllocateResponse {
                    envs: [("E".to_owned(), env.to_owned())].into(),
                    ..Default::default()
                }),
            },
            pod: None,
        };
        let whole = |pods: &PodDevices| {
            let mut out = vec![0];
            out.extend_from_slice(
                &kubelet_data(std::iter::empty(), pods).encode_without_checksum(),
            );
            out
        };
        let mut pods = PodDevices::default();
        assert_eq!(encode_journal(&[], &pods), whole(&pods));
        for i in 0..5 {
            pods.insert(
                HolderKey::new(format!("pod-{i}"), "ctr", "vendor.com/gpu"),
                allocated(&format!("d{i}"), "a"),
            );
        }
        pods.insert(
            HolderKey::new("pod-r", "ctr", "vendor.com/gpu"),
            reserved("d9", 3),
        );
        assert_eq!(encode_journal(&[], &pods), whole(&pods));
        // A copy shares the entries' bytes; its changes are its own.
        let mut next = pods.without_index();
        assert!(next.commit(
            &HolderKey::new("pod-r", "ctr", "vendor.com/gpu"),
            3,
            PluginAnswer::default()
        ));
        next.release("pod-2", None);
        next.insert(
            HolderKey::new("pod-1", "ctr", "vendor.com/gpu"),
            allocated("d1", "b"),
        );
        assert_eq!(encode_journal(&[], &next), whole(&next));
        assert_eq!(encode_journal(&[], &pods), whole(&pods));
        assert_ne!(encode_journal(&[], &next), encode_journal(&[], &pods));
    }

    /// A journal entry is written from the holding's own strings; it is byte for byte the
    /// kubelet's entry of the same allocation (NUMA nodes in Go's string order, ids that need
    /// escaping, a response of some size).
    #[test]
    fn a_journal_entry_is_the_kubelet_entry_of_the_holding() {
        let ids: Vec<String> = (0..40).map(|i| format!("gpu-<{i}>&\"q\"")).collect();
        let nodes = [-1i64, 2, 10, 0];
        let response = ContainerAllocateResponse {
            envs: [("VISIBLE".to_owned(), ids.join(","))].into(),
            devices: ids
                .iter()
                .map(|id| pluglet_proto::v1beta1::DeviceSpec {
                    container_path: format!("/dev/{id}"),
                    host_path: format!("/dev/{id}"),
                    permissions: "rw".into(),
                })
                .collect(),
            ..Default::default()
        };
        let key = HolderKey::new("pod-1", "ctr", "vendor.com/gpu");
        let holding = Holding {
            devices: ids.iter().map(DeviceId::new).collect::<Vec<_>>().into(),
            numa: group_by_numa(
                ids.iter()
                    .enumerate()
                    .map(|(i, id)| (id.as_str(), &nodes[i % 4..i % 4 + 1])),
            )
            .into(),
            state: HoldingState::Allocated {
                answer: PluginAnswer::of(&response),
            },
            pod: None,
        };
        let kubelet = kubelet_entry(&key, &holding).unwrap().encode();
        assert_eq!(
            String::from_utf8(encode_entry(&key, &holding)).unwrap(),
            String::from_utf8(kubelet).unwrap()
        );
    }

    #[test]
    fn journal_records_round_trip() {
        let mut pods = PodDevices::default();
        pods.insert(
            HolderKey::new("pod-1", "ctr", "vendor.com/gpu"),
            Holding {
                devices: vec!["d0".into()].into(),
                numa: group_by_numa([("d0", &[0][..])]).into(),
                state: HoldingState::Allocated {
                    answer: PluginAnswer::of(&ContainerAllocateResponse::default()),
                },
                pod: None,
            },
        );
        let (named, data, names) = decode_journal(&encode_journal(&[1, u64::MAX], &pods)).unwrap();
        assert_eq!(named, [1, u64::MAX]);
        assert_eq!(data.pod_device_entries.unwrap().len(), 1);
        assert!(names.is_empty(), "no name given");
        assert!(data.registered_devices.is_empty());
        assert!(decode_journal(&[3, 0, 0]).is_none(), "truncated");

        // A record of an earlier version carries the kubelet checksum; it reads the same.
        let mut earlier = vec![1];
        earlier.extend_from_slice(&7u64.to_le_bytes());
        earlier.extend_from_slice(&kubelet_data(std::iter::empty(), &pods).encode());
        let (named, old, _) = decode_journal(&earlier).unwrap();
        assert_eq!(named, [7]);
        assert_eq!(
            old.pod_device_entries,
            decode_journal(&encode_journal(&[], &pods))
                .unwrap()
                .1
                .pod_device_entries
        );
    }

    #[test]
    fn a_pods_name_is_in_its_journal_entries_and_nowhere_in_the_checkpoint() {
        let named = |pod: Option<PodName>| Holding {
            devices: vec!["d0".into()].into(),
            numa: group_by_numa([("d0", &[0][..])]).into(),
            state: HoldingState::Allocated {
                answer: PluginAnswer::of(&ContainerAllocateResponse::default()),
            },
            pod,
        };
        let train = PodName {
            name: "train-0".into(),
            namespace: "ml \"quoted\"".into(),
        };
        let mut pods = PodDevices::default();
        pods.insert(
            HolderKey::new("uid-a", "ctr", "vendor.com/gpu"),
            named(Some(train.clone())),
        );
        pods.insert(
            HolderKey::new("uid-b", "ctr", "vendor.com/gpu"),
            named(None),
        );
        let record = encode_journal(&[], &pods);
        let (_, data, names) = decode_journal(&record).unwrap();
        assert_eq!(names, PodNames::from([("uid-a".to_owned(), train)]));
        // The kubelet's reader sees the same entries as without the names.
        let mut plain = PodDevices::default();
        for (key, entry) in pods.iter() {
            plain.insert(
                key.clone(),
                Holding {
                    pod: None,
                    ..entry.clone()
                },
            );
        }
        let (_, without, _) = decode_journal(&encode_journal(&[], &plain)).unwrap();
        assert_eq!(data.pod_device_entries, without.pod_device_entries);
        let checkpoint =
            String::from_utf8(kubelet_data(std::iter::empty(), &pods).encode()).unwrap();
        assert!(!checkpoint.contains("PodName"), "{checkpoint}");
    }
}
