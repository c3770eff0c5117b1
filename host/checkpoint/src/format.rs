//! The data of `kubelet_internal_checkpoint` and its exact Go `encoding/json` form
//! (docs/kubelet-compatibility.md, "Checkpoint format").
//!
//! The kubelet's types (`pkg/kubelet/cm/devicemanager/checkpoint/checkpoint.go`):
//!
//! ```go
//! type DevicesPerNUMA map[int64][]string
//! type PodDevicesEntry struct {
//!     PodUID, ContainerName, ResourceName string
//!     DeviceIDs DevicesPerNUMA
//!     AllocResp []byte
//! }
//! type checkpointData struct {
//!     PodDeviceEntries  []PodDevicesEntry
//!     RegisteredDevices map[string][]string
//! }
//! type Data struct { Data checkpointData; Checksum checksum.Checksum /* uint64 */ }
//! ```
//!
//! Go distinguishes nil from empty slices and maps, both in JSON (`null` vs `[]`/`{}`/`""`) and
//! in the checksum (`<nil>` vs `[]`), so every slice and map that can be nil is an `Option` here.
//!
//! Encoding is written by hand to match `json.Marshal` byte for byte: fields in declaration
//! order, map keys sorted as *strings* (so NUMA node `-1` < `0` < `10` < `2`), `[]byte` as padded
//! standard base64, HTML-sensitive characters escaped (`<` → `\u003c`), no whitespace. Decoding
//! follows `json.Unmarshal` into the value the kubelet pre-fills (`getCheckpoint`: an empty entry
//! list and an empty map), so a missing key keeps that empty value while `null` makes it nil.

use std::collections::BTreeMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Deserializer};

use crate::checksum;
use crate::error::FormatError;

/// Go's `checkpoint.DevicesPerNUMA`: NUMA node id → device ids (`-1` = no topology).
///
/// A `None` value is a nil `[]string` (JSON `null`), distinct from an empty list.
pub type DevicesPerNuma = BTreeMap<i64, Option<Vec<String>>>;

/// What one container holds of one resource (Go's `checkpoint.PodDevicesEntry`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodDevicesEntry {
    /// The pod's UID (`PodUID`).
    pub pod_uid: String,
    /// The container's name (`ContainerName`).
    pub container_name: String,
    /// The extended resource name, e.g. `vendor.com/gpu` (`ResourceName`).
    pub resource_name: String,
    /// Device ids per NUMA node (`DeviceIDs`); `None` is a nil map (JSON `null`).
    pub device_ids: Option<DevicesPerNuma>,
    /// Protobuf bytes of the plugin's `v1beta1.ContainerAllocateResponse` (`AllocResp`), opaque
    /// here; `None` is a nil slice (JSON `null`), `Some(vec![])` an empty one (JSON `""`).
    pub alloc_resp: Option<Vec<u8>>,
}

impl PodDevicesEntry {
    /// This entry as the file lists it (one element of `PodDeviceEntries`).
    pub fn encode(&self) -> Vec<u8> {
        self.parts().encode()
    }

    pub(crate) fn parts(&self) -> EntryParts<'_, String> {
        EntryParts {
            pod_uid: &self.pod_uid,
            container_name: &self.container_name,
            resource_name: &self.resource_name,
            device_ids: self.device_ids.as_ref().map(|map| {
                map.iter()
                    .map(|(node, ids)| (*node, ids.as_deref()))
                    .collect()
            }),
            alloc_resp: self.alloc_resp.as_deref(),
        }
    }
}

/// A NUMA node and its device ids in [`EntryParts`] (`None`: a nil list).
pub type NodeIds<'a, S> = (i64, Option<&'a [S]>);

/// The fields of a [`PodDevicesEntry`] borrowed from wherever their owner keeps them, so that an
/// entry can be written without copying its strings into one first. [`EntryParts::encode`]
/// writes exactly what [`PodDevicesEntry::encode`] writes for the same values.
pub struct EntryParts<'a, S> {
    /// `PodUID`.
    pub pod_uid: &'a str,
    /// `ContainerName`.
    pub container_name: &'a str,
    /// `ResourceName`.
    pub resource_name: &'a str,
    /// `DeviceIDs`: each NUMA node once, in any order; `None`: a nil map.
    pub device_ids: Option<Vec<NodeIds<'a, S>>>,
    /// `AllocResp`: the response's protobuf bytes (`None`: a nil slice).
    pub alloc_resp: Option<&'a [u8]>,
}

impl<S: AsRef<str>> EntryParts<'_, S> {
    /// The entry as the file lists it (one element of `PodDeviceEntries`), in a buffer sized for
    /// it once.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.size_hint());
        self.put(&mut out);
        out
    }

    /// About the encoded size, at least: the framing, each id with its quotes and comma, and the
    /// response's base64 text.
    pub fn size_hint(&self) -> usize {
        let strings = self.pod_uid.len() + self.container_name.len() + self.resource_name.len();
        let ids: usize = self
            .device_ids
            .iter()
            .flatten()
            .flat_map(|(_, ids)| ids.iter().copied().flatten())
            .map(|id| id.as_ref().len() + 3)
            .sum();
        let numa = 24 * self.device_ids.as_ref().map_or(0, Vec::len);
        let response = self.alloc_resp.map_or(0, |r| r.len().div_ceil(3) * 4);
        96 + strings + ids + numa + response
    }

    /// [`EntryParts::encode`] appended to `out`.
    pub fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"PodUID\":");
        put_json_string(out, self.pod_uid);
        out.extend_from_slice(b",\"ContainerName\":");
        put_json_string(out, self.container_name);
        out.extend_from_slice(b",\"ResourceName\":");
        put_json_string(out, self.resource_name);
        out.extend_from_slice(b",\"DeviceIDs\":");
        match &self.device_ids {
            None => out.extend_from_slice(b"null"),
            Some(nodes) => {
                // Go encodes int64 keys as decimal strings and sorts them as strings.
                let mut keyed: Vec<(String, Option<&[S]>)> = nodes
                    .iter()
                    .map(|(node, ids)| (node.to_string(), *ids))
                    .collect();
                keyed.sort_unstable_by(|a, b| a.0.cmp(&b.0));
                out.push(b'{');
                for (i, (key, ids)) in keyed.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    out.push(b'"');
                    out.extend_from_slice(key.as_bytes());
                    out.extend_from_slice(b"\":");
                    put_json_strings(out, *ids);
                }
                out.push(b'}');
            }
        }
        out.extend_from_slice(b",\"AllocResp\":");
        match self.alloc_resp {
            None => out.extend_from_slice(b"null"),
            Some(bytes) => {
                // SIMD, appended to `out` with no zero-fill first: the same text as `BASE64`
                // writes, in a fraction of its instructions.
                out.push(b'"');
                base64_simd::STANDARD.encode_append(bytes, out);
                out.push(b'"');
            }
        }
        out.push(b'}');
    }
}

/// The content of `kubelet_internal_checkpoint` (Go's `checkpoint.checkpointData`).
///
/// The file also carries a checksum over this data; it is computed by [`CheckpointData::encode`]
/// and verified by [`CheckpointData::decode`], never stored here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckpointData {
    /// Allocations (`PodDeviceEntries`); `None` is a nil slice, which the kubelet writes (as
    /// `null`) when no pod holds devices.
    pub pod_device_entries: Option<Vec<PodDevicesEntry>>,
    /// Healthy device ids per resource at write time (`RegisteredDevices`); a `None` value is a
    /// nil list. The kubelet always writes an object here; a file with `null` is read as empty.
    pub registered_devices: BTreeMap<String, Option<Vec<String>>>,
}

impl CheckpointData {
    /// The checksum the kubelet stores for this data: `uint64(FNV-1a-32(spew))`.
    pub fn checksum(&self) -> u64 {
        checksum::checksum(
            self.pod_device_entries.as_deref(),
            Some(&self.registered_devices),
        )
    }

    /// go-spew's `%#v` rendering of this data, the text the checksum is taken over (for
    /// diagnostics and tests; [`CheckpointData::checksum`] does not build it).
    pub fn spew(&self) -> String {
        checksum::spew(
            self.pod_device_entries.as_deref(),
            Some(&self.registered_devices),
        )
    }

    /// The whole file, byte for byte as the kubelet's `json.Marshal` writes it, checksum included.
    pub fn encode(&self) -> Vec<u8> {
        self.encode_with_checksum().0
    }

    /// [`CheckpointData::encode`], and the checksum it wrote.
    pub fn encode_with_checksum(&self) -> (Vec<u8>, u64) {
        let checksum = self.checksum();
        (self.encode_stamped(checksum), checksum)
    }

    /// The file as [`CheckpointData::encode`] writes it, but with `0` where the checksum goes:
    /// for a copy whose integrity something else guards (a journal record carries its own
    /// CRC), so that writing it costs no checksum. Read it back with
    /// [`CheckpointData::decode_unverified`]; the kubelet refuses it.
    pub fn encode_without_checksum(&self) -> Vec<u8> {
        self.encode_stamped(0)
    }

    /// [`CheckpointData::encode_without_checksum`] of data whose `RegisteredDevices` is empty and
    /// whose entries are given already encoded, each as [`PodDevicesEntry::encode`] makes it: a
    /// writer that keeps each entry's bytes from one write to the next encodes only what changed.
    pub fn encode_entries_without_checksum<'a>(
        entries: impl IntoIterator<Item = &'a [u8]>,
    ) -> Vec<u8> {
        let mut out = Vec::with_capacity(128);
        Self::put_entries_without_checksum(&mut out, entries);
        out
    }

    /// [`CheckpointData::encode_entries_without_checksum`] appended to `out`, so that a caller
    /// that sizes `out` once (and writes its own header first) copies each entry's bytes once.
    pub fn put_entries_without_checksum<'a>(
        out: &mut Vec<u8>,
        entries: impl IntoIterator<Item = &'a [u8]>,
    ) {
        let mut entries = entries.into_iter().peekable();
        // The kubelet writes a nil slice (`null`) when no pod holds devices.
        let listed = entries.peek().is_some().then_some(entries);
        put_entries(out, listed, |out, entry| out.extend_from_slice(entry));
        out.extend_from_slice(b",\"RegisteredDevices\":{}},\"Checksum\":0}");
    }

    fn encode_stamped(&self, checksum: u64) -> Vec<u8> {
        Self::encode_parts(
            self.size_hint(),
            self.pod_device_entries.as_deref().map(<[_]>::iter),
            encode_entry,
            // BTreeMap<String, _> iterates in byte order, which is Go's string order.
            self.registered_devices
                .iter()
                .map(|(resource, ids)| (resource.as_str(), ids.as_deref())),
            checksum,
        )
    }

    /// [`CheckpointData::checksum`] of data its caller keeps in its own types: the entries as
    /// borrowed parts (`None`: a nil list), the registered devices as (resource, ids) sorted by
    /// resource name byte-wise (ids `None`: a nil list). Equal to the checksum of the
    /// `CheckpointData` holding the same values.
    pub fn checksum_of_parts<'a, S, R>(
        entries: Option<impl Iterator<Item = EntryParts<'a, S>>>,
        registered: impl Iterator<Item = (&'a str, Option<&'a [R]>)>,
    ) -> u64
    where
        S: AsRef<str> + 'a,
        R: AsRef<str> + 'a,
    {
        checksum::checksum_of_parts(entries, Some(registered))
    }

    /// The whole file, as [`CheckpointData::encode`] writes it, from data its caller keeps in
    /// its own types: `put_entry` writes each entry of `entries` (`None`: a nil list) as
    /// [`PodDevicesEntry::encode`] would, `registered` and `checksum` as in
    /// [`CheckpointData::checksum_of_parts`]. `capacity` sizes the buffer once.
    pub fn encode_parts<'a, T, R>(
        capacity: usize,
        entries: Option<impl Iterator<Item = T>>,
        put_entry: impl FnMut(&mut Vec<u8>, T),
        registered: impl Iterator<Item = (&'a str, Option<&'a [R]>)>,
        checksum: u64,
    ) -> Vec<u8>
    where
        R: AsRef<str> + 'a,
    {
        let mut out = Vec::with_capacity(capacity);
        put_entries(&mut out, entries, put_entry);
        out.extend_from_slice(b",\"RegisteredDevices\":{");
        for (i, (resource, ids)) in registered.enumerate() {
            if i > 0 {
                out.push(b',');
            }
            put_json_string(&mut out, resource);
            out.push(b':');
            put_json_strings(&mut out, ids);
        }
        out.extend_from_slice(b"}},\"Checksum\":");
        out.extend_from_slice(checksum.to_string().as_bytes());
        out.push(b'}');
        out
    }

    /// Parses a whole file and verifies its checksum, as the kubelet's `GetCheckpoint` does.
    ///
    /// Fails with [`FormatError::Json`] or [`FormatError::AllocResp`] when it does not parse, and
    /// with [`FormatError::ChecksumMismatch`] when the stored checksum is not the one of the data.
    pub fn decode(bytes: &[u8]) -> Result<CheckpointData, FormatError> {
        let (data, parsed) = Self::parse(bytes)?;
        // A `null` map and an empty one render differently in the checksum.
        let registered = (!parsed.nil_registered).then_some(&data.registered_devices);
        let computed = checksum::checksum(data.pod_device_entries.as_deref(), registered);
        if parsed.stored != computed {
            return Err(FormatError::ChecksumMismatch {
                stored: parsed.stored.to_string(),
                computed: computed.to_string(),
            });
        }
        Ok(data)
    }

    /// Parses a whole file without looking at its checksum: for what
    /// [`CheckpointData::encode_without_checksum`] wrote, or any copy whose integrity
    /// something else has checked.
    pub fn decode_unverified(bytes: &[u8]) -> Result<CheckpointData, FormatError> {
        Self::parse(bytes).map(|(data, _)| data)
    }

    /// The data, and what its checksum needs from the file.
    fn parse(bytes: &[u8]) -> Result<(CheckpointData, Parsed), FormatError> {
        let raw: RawFile = serde_json::from_slice(bytes).map_err(FormatError::Json)?;
        let raw_data = raw.data.unwrap_or_default();
        let entries = match raw_data.pod_device_entries {
            // Missing key: the kubelet's pre-filled empty (non-nil) slice stays.
            None => Some(Vec::new()),
            Some(None) => None,
            Some(Some(list)) => Some(
                list.into_iter()
                    .map(RawEntry::into_entry)
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let registered = match raw_data.registered_devices {
            None => Some(BTreeMap::new()),
            Some(map) => map,
        };
        let parsed = Parsed {
            stored: raw.checksum.unwrap_or(0),
            nil_registered: registered.is_none(),
        };
        let data = CheckpointData {
            pod_device_entries: entries,
            registered_devices: registered.unwrap_or_default(),
        };
        Ok((data, parsed))
    }

    /// The entries that can still be read at the start of a damaged file's `PodDeviceEntries`
    /// (a file cut short, or one whose checksum fails), in file order. They are *not* verified:
    /// use them to say what a corrupt checkpoint held, never as allocations.
    ///
    /// Reading stops at the first entry that is incomplete or does not parse.
    pub fn readable_entries(bytes: &[u8]) -> Vec<PodDevicesEntry> {
        const KEY: &[u8] = b"\"PodDeviceEntries\":";
        let Some(at) = bytes.windows(KEY.len()).position(|w| w == KEY) else {
            return Vec::new();
        };
        let mut rest = bytes[at + KEY.len()..].trim_ascii_start();
        let Some(after) = rest.strip_prefix(b"[") else {
            return Vec::new();
        };
        rest = after;
        let mut out = Vec::new();
        loop {
            rest = rest.trim_ascii_start();
            let mut stream = serde_json::Deserializer::from_slice(rest).into_iter::<RawEntry>();
            let Some(Ok(raw)) = stream.next() else {
                break;
            };
            let used = stream.byte_offset();
            let Ok(entry) = raw.into_entry() else {
                break;
            };
            out.push(entry);
            rest = rest[used..].trim_ascii_start();
            match rest.split_first() {
                Some((b',', after)) => rest = after,
                _ => break,
            }
        }
        out
    }

    /// A capacity guess for the encoded file, to write it with one allocation in most cases.
    fn size_hint(&self) -> usize {
        let ids = |list: &Option<Vec<String>>| {
            list.as_ref()
                .map_or(4, |l| l.iter().map(|s| s.len() + 3).sum::<usize>() + 2)
        };
        let entries: usize = self.pod_device_entries.as_ref().map_or(0, |entries| {
            entries
                .iter()
                .map(|e| {
                    120 + e.pod_uid.len()
                        + e.container_name.len()
                        + e.resource_name.len()
                        + e.alloc_resp.as_ref().map_or(0, |b| b.len() * 4 / 3 + 4)
                        + e.device_ids
                            .as_ref()
                            .map_or(0, |m| m.values().map(|v| ids(v) + 24).sum::<usize>())
                })
                .sum()
        });
        let registered: usize = self
            .registered_devices
            .iter()
            .map(|(k, v)| k.len() + 4 + ids(v))
            .sum();
        96 + entries + registered
    }
}

/// The file's opening up to and including `PodDeviceEntries`: `null` for no list, else the
/// entries, each written by `put`, as a JSON array.
fn put_entries<T>(
    out: &mut Vec<u8>,
    entries: Option<impl Iterator<Item = T>>,
    mut put: impl FnMut(&mut Vec<u8>, T),
) {
    out.extend_from_slice(b"{\"Data\":{\"PodDeviceEntries\":");
    let Some(entries) = entries else {
        out.extend_from_slice(b"null");
        return;
    };
    out.push(b'[');
    for (i, entry) in entries.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        put(out, entry);
    }
    out.push(b']');
}

fn encode_entry(out: &mut Vec<u8>, entry: &PodDevicesEntry) {
    entry.parts().put(out);
}

/// A `[]string` as Go encodes it: `null` when nil.
fn put_json_strings<S: AsRef<str>>(out: &mut Vec<u8>, list: Option<&[S]>) {
    match list {
        None => out.extend_from_slice(b"null"),
        Some(list) => {
            out.push(b'[');
            for (i, s) in list.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                put_json_string(out, s.as_ref());
            }
            out.push(b']');
        }
    }
}

/// A string as Go's `encoding/json` (1.22 and later, `SetEscapeHTML(true)`, the default) writes
/// it: `"` and `\` backslashed; `\b \f \n \r \t` short; other bytes below 0x20 and `< > &` as
/// `\u00XX` (lower-case hex); U+2028 and U+2029 as `\u2028`/`\u2029`; everything else raw.
pub(crate) fn put_json_string(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = s.as_bytes();
    out.push(b'"');
    // Device ids are plain ASCII as a rule: copy them whole when nothing needs escaping.
    if bytes
        .iter()
        .all(|&b| (0x20..0x80).contains(&b) && !matches!(b, b'"' | b'\\' | b'<' | b'>' | b'&'))
    {
        out.extend_from_slice(bytes);
        out.push(b'"');
        return;
    }
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b >= 0x80 {
            // U+2028 is E2 80 A8 and U+2029 is E2 80 A9 in UTF-8.
            if b == 0xE2
                && bytes.get(i + 1) == Some(&0x80)
                && matches!(bytes.get(i + 2), Some(0xA8 | 0xA9))
            {
                out.extend_from_slice(&bytes[start..i]);
                out.extend_from_slice(b"\\u202");
                out.push(HEX[usize::from(bytes[i + 2] & 0x0F)]);
                i += 3;
                start = i;
                continue;
            }
            i += 1;
            continue;
        }
        let short: Option<u8> = match b {
            b'"' => Some(b'"'),
            b'\\' => Some(b'\\'),
            0x08 => Some(b'b'),
            0x0C => Some(b'f'),
            b'\n' => Some(b'n'),
            b'\r' => Some(b'r'),
            b'\t' => Some(b't'),
            _ => None,
        };
        let needs_escape = short.is_some() || b < 0x20 || matches!(b, b'<' | b'>' | b'&');
        if needs_escape {
            out.extend_from_slice(&bytes[start..i]);
            match short {
                Some(c) => out.extend_from_slice(&[b'\\', c]),
                None => out.extend_from_slice(&[
                    b'\\',
                    b'u',
                    b'0',
                    b'0',
                    HEX[usize::from(b >> 4)],
                    HEX[usize::from(b & 0x0F)],
                ]),
            }
            start = i + 1;
        }
        i += 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// `Some(value)` when the key is present (with `value` possibly `None` for `null`), so that
/// `Option<Option<T>>` with `#[serde(default)]` tells a missing key from `null`.
fn present<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(deserializer).map(Some)
}

/// Go ignores `null` for a string field: it keeps its (here zero) value.
fn null_as_empty<'de, D>(deserializer: D) -> Result<String, D::Error>
where
    D: Deserializer<'de>,
{
    Ok(Option::<String>::deserialize(deserializer)?.unwrap_or_default())
}

/// What [`CheckpointData::decode`] needs from a parsed file besides the data.
struct Parsed {
    /// The stored checksum (`0` when there is none).
    stored: u64,
    /// `RegisteredDevices` was `null` (read as empty, but checksummed as nil).
    nil_registered: bool,
}

/// Go's `checkpoint.Data` as parsed.
#[derive(Deserialize)]
struct RawFile {
    /// `null` for a struct is ignored by Go, like a missing key.
    #[serde(rename = "Data", default)]
    data: Option<RawData>,
    #[serde(rename = "Checksum", default)]
    checksum: Option<u64>,
}

/// Go's `checkpointData` as parsed: outer `None` = key missing, inner `None` = `null`.
#[derive(Deserialize, Default)]
struct RawData {
    #[serde(rename = "PodDeviceEntries", default, deserialize_with = "present")]
    pod_device_entries: Option<Option<Vec<RawEntry>>>,
    #[serde(rename = "RegisteredDevices", default, deserialize_with = "present")]
    registered_devices: Option<Option<BTreeMap<String, Option<Vec<String>>>>>,
}

/// Go's `PodDevicesEntry` as parsed; each element starts as Go's zero value.
#[derive(Deserialize)]
struct RawEntry {
    #[serde(rename = "PodUID", default, deserialize_with = "null_as_empty")]
    pod_uid: String,
    #[serde(rename = "ContainerName", default, deserialize_with = "null_as_empty")]
    container_name: String,
    #[serde(rename = "ResourceName", default, deserialize_with = "null_as_empty")]
    resource_name: String,
    #[serde(rename = "DeviceIDs", default)]
    device_ids: Option<DevicesPerNuma>,
    #[serde(rename = "AllocResp", default)]
    alloc_resp: Option<String>,
}

impl RawEntry {
    fn into_entry(self) -> Result<PodDevicesEntry, FormatError> {
        let alloc_resp =
            match self.alloc_resp {
                None => None,
                Some(text) => Some(BASE64.decode(text.as_bytes()).map_err(|source| {
                    FormatError::AllocResp {
                        pod_uid: self.pod_uid.clone(),
                        container_name: self.container_name.clone(),
                        source,
                    }
                })?),
            };
        Ok(PodDevicesEntry {
            pod_uid: self.pod_uid,
            container_name: self.container_name,
            resource_name: self.resource_name,
            device_ids: self.device_ids,
            alloc_resp,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(ids: &[&str]) -> Option<Vec<String>> {
        Some(ids.iter().map(|s| (*s).to_owned()).collect())
    }

    /// Every strict prefix of a file is corrupt, and what can still be read of it is a prefix
    /// of its entries, each exactly as written.
    #[test]
    fn a_file_cut_at_every_byte_is_corrupt_and_its_readable_entries_are_exact() {
        let mut data = sample();
        let list = data.pod_device_entries.as_mut().unwrap();
        let mut second = list[0].clone();
        second.pod_uid = "pod-uid-2".into();
        second.alloc_resp = None;
        list.push(second);
        let file = data.encode();
        let entries = data.pod_device_entries.clone().unwrap();
        let mut readable_before = 0;
        for cut in 0..file.len() {
            assert!(
                CheckpointData::decode(&file[..cut]).is_err(),
                "cut at {cut}"
            );
            let readable = CheckpointData::readable_entries(&file[..cut]);
            assert_eq!(readable, entries[..readable.len()], "cut at {cut}");
            assert!(readable.len() >= readable_before, "cut at {cut}");
            readable_before = readable.len();
        }
        assert_eq!(CheckpointData::readable_entries(&file), entries);
        assert_eq!(CheckpointData::decode(&file).unwrap(), data);
        assert!(CheckpointData::readable_entries(b"not a checkpoint").is_empty());
    }

    /// Test vector 1 (docs/kubelet-compatibility.md, "Checkpoint test vectors"): the empty state the kubelet writes when nothing is allocated.
    #[test]
    fn vector_empty_state() {
        let data = CheckpointData::default();
        let spew = "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)<nil> RegisteredDevices:(map[string][]string)map[]}";
        let file =
            r#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":3467439661}"#;
        assert_eq!(data.spew(), spew);
        assert_eq!(data.checksum(), 3_467_439_661);
        assert_eq!(String::from_utf8(data.encode()).unwrap(), file);
        assert_eq!(CheckpointData::decode(file.as_bytes()).unwrap(), data);
    }

    /// Test vector 2: the same with an empty, non-nil entry list.
    #[test]
    fn vector_empty_entry_list() {
        let data = CheckpointData {
            pod_device_entries: Some(Vec::new()),
            registered_devices: BTreeMap::new(),
        };
        let spew = "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)[] RegisteredDevices:(map[string][]string)map[]}";
        let file =
            r#"{"Data":{"PodDeviceEntries":[],"RegisteredDevices":{}},"Checksum":2932075448}"#;
        assert_eq!(data.spew(), spew);
        assert_eq!(data.checksum(), 2_932_075_448);
        assert_eq!(String::from_utf8(data.encode()).unwrap(), file);
        assert_eq!(CheckpointData::decode(file.as_bytes()).unwrap(), data);
    }

    fn sample() -> CheckpointData {
        CheckpointData {
            pod_device_entries: Some(vec![PodDevicesEntry {
                pod_uid: "pod-uid-1".into(),
                container_name: "ctr".into(),
                resource_name: "example.com/gpu".into(),
                device_ids: Some(BTreeMap::from([
                    (0, strings(&["dev0", "dev1"])),
                    (-1, strings(&["dev9"])),
                ])),
                alloc_resp: Some(vec![0x0a, 0x06, 0x0a, 0x01, 0x41, 0x12, 0x01, 0x42]),
            }]),
            registered_devices: BTreeMap::from([
                ("example.com/gpu".into(), strings(&["dev0", "dev1", "dev2"])),
                ("example.com/nic".into(), Some(Vec::new())),
            ]),
        }
    }

    #[test]
    fn entries_encoded_one_by_one_make_the_same_file() {
        for data in [sample(), edge(), CheckpointData::default()] {
            let unregistered = CheckpointData {
                registered_devices: BTreeMap::new(),
                ..data.clone()
            };
            let entries: Vec<Vec<u8>> = data
                .pod_device_entries
                .iter()
                .flatten()
                .map(PodDevicesEntry::encode)
                .collect();
            assert_eq!(
                CheckpointData::encode_entries_without_checksum(entries.iter().map(Vec::as_slice)),
                unregistered.encode_without_checksum(),
            );
        }
    }

    /// Test vector 3: one allocation with two NUMA nodes and an AllocResp.
    #[test]
    fn vector_sample() {
        let data = sample();
        let spew = "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)[{PodUID:(string)pod-uid-1 ContainerName:(string)ctr ResourceName:(string)example.com/gpu DeviceIDs:(checkpoint.DevicesPerNUMA)map[-1:[dev9] 0:[dev0 dev1]] AllocResp:([]uint8)[10 6 10 1 65 18 1 66]}] RegisteredDevices:(map[string][]string)map[example.com/gpu:[dev0 dev1 dev2] example.com/nic:[]]}";
        let file = r#"{"Data":{"PodDeviceEntries":[{"PodUID":"pod-uid-1","ContainerName":"ctr","ResourceName":"example.com/gpu","DeviceIDs":{"-1":["dev9"],"0":["dev0","dev1"]},"AllocResp":"CgYKAUESAUI="}],"RegisteredDevices":{"example.com/gpu":["dev0","dev1","dev2"],"example.com/nic":[]}},"Checksum":1819730228}"#;
        assert_eq!(data.spew(), spew);
        assert_eq!(data.checksum(), 1_819_730_228);
        assert_eq!(String::from_utf8(data.encode()).unwrap(), file);
        assert_eq!(CheckpointData::decode(file.as_bytes()).unwrap(), data);
    }

    fn edge() -> CheckpointData {
        CheckpointData {
            pod_device_entries: Some(vec![
                PodDevicesEntry {
                    pod_uid: "u".into(),
                    container_name: "c d".into(),
                    resource_name: "x.io/y".into(),
                    device_ids: None,
                    alloc_resp: None,
                },
                PodDevicesEntry {
                    pod_uid: "u".into(),
                    container_name: "c2".into(),
                    resource_name: "x.io/y".into(),
                    device_ids: Some(BTreeMap::from([(1, None)])),
                    alloc_resp: Some(Vec::new()),
                },
            ]),
            registered_devices: BTreeMap::from([("x.io/y".into(), None)]),
        }
    }

    /// Test vector 4: nil map, nil map value, nil and empty bytes, a space in a name.
    #[test]
    fn vector_edge_cases() {
        let data = edge();
        let spew = "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)[{PodUID:(string)u ContainerName:(string)c d ResourceName:(string)x.io/y DeviceIDs:(checkpoint.DevicesPerNUMA)<nil> AllocResp:([]uint8)<nil>} {PodUID:(string)u ContainerName:(string)c2 ResourceName:(string)x.io/y DeviceIDs:(checkpoint.DevicesPerNUMA)map[1:<nil>] AllocResp:([]uint8)[]}] RegisteredDevices:(map[string][]string)map[x.io/y:<nil>]}";
        let file = r#"{"Data":{"PodDeviceEntries":[{"PodUID":"u","ContainerName":"c d","ResourceName":"x.io/y","DeviceIDs":null,"AllocResp":null},{"PodUID":"u","ContainerName":"c2","ResourceName":"x.io/y","DeviceIDs":{"1":null},"AllocResp":""}],"RegisteredDevices":{"x.io/y":null}},"Checksum":3030002773}"#;
        assert_eq!(data.spew(), spew);
        assert_eq!(data.checksum(), 3_030_002_773);
        assert_eq!(String::from_utf8(data.encode()).unwrap(), file);
        assert_eq!(CheckpointData::decode(file.as_bytes()).unwrap(), data);
    }

    /// Parse → write gives the identical bytes for every vector.
    #[test]
    fn round_trip_is_byte_identical() {
        for data in [
            CheckpointData::default(),
            CheckpointData {
                pod_device_entries: Some(Vec::new()),
                ..Default::default()
            },
            sample(),
            edge(),
        ] {
            let bytes = data.encode();
            let again = CheckpointData::decode(&bytes).unwrap().encode();
            assert_eq!(again, bytes);
        }
    }

    #[test]
    fn numa_keys_sort_as_strings_in_json_and_as_numbers_in_spew() {
        let data = CheckpointData {
            pod_device_entries: Some(vec![PodDevicesEntry {
                pod_uid: "p".into(),
                container_name: "c".into(),
                resource_name: "r".into(),
                device_ids: Some(BTreeMap::from([
                    (2, strings(&["a"])),
                    (10, strings(&["b"])),
                    (-1, strings(&["c"])),
                    (-10, strings(&["d"])),
                    (0, strings(&[])),
                ])),
                alloc_resp: None,
            }]),
            registered_devices: BTreeMap::new(),
        };
        let json = String::from_utf8(data.encode()).unwrap();
        assert!(
            json.contains(r#""DeviceIDs":{"-1":["c"],"-10":["d"],"0":[],"10":["b"],"2":["a"]}"#),
            "{json}"
        );
        assert!(
            data.spew()
                .contains("map[-10:[d] -1:[c] 0:[] 2:[a] 10:[b]]"),
            "{}",
            data.spew()
        );
        assert_eq!(CheckpointData::decode(json.as_bytes()).unwrap(), data);
    }

    #[test]
    fn strings_are_escaped_as_go_does() {
        let mut out = Vec::new();
        put_json_string(
            &mut out,
            "a<b>&\"\\\u{8}\u{c}\n\r\t\u{1}\u{1f}\u{7f}é\u{2028}\u{2029}\u{2027}/",
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "\"a\\u003cb\\u003e\\u0026\\\"\\\\\\b\\f\\n\\r\\t\\u0001\\u001f\u{7f}é\\u2028\\u2029\u{2027}/\""
        );
    }

    #[test]
    fn escaped_strings_round_trip_and_spew_raw() {
        let data = CheckpointData {
            pod_device_entries: None,
            registered_devices: BTreeMap::from([("a<&>b".into(), strings(&["x\"y", "é\n"]))]),
        };
        let bytes = data.encode();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(
            text.contains(r#""a\u003c\u0026\u003eb":["x\"y","é\n"]"#),
            "{text}"
        );
        assert!(data.spew().contains("map[a<&>b:[x\"y é\n]]"));
        let back = CheckpointData::decode(&bytes).unwrap();
        assert_eq!(back, data);
        assert_eq!(back.encode(), bytes);
    }

    #[test]
    fn checksum_mismatch_is_reported_with_both_values() {
        let file = br#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":1}"#;
        match CheckpointData::decode(file) {
            Err(FormatError::ChecksumMismatch { stored, computed }) => {
                assert_eq!(stored, "1");
                assert_eq!(computed, "3467439661");
            }
            other => panic!("expected a checksum mismatch, got {other:?}"),
        }
    }

    #[test]
    fn a_file_without_checksum_reads_back_only_unverified() {
        for data in [CheckpointData::default(), sample(), edge()] {
            let bytes = data.encode_without_checksum();
            assert!(bytes.ends_with(b",\"Checksum\":0}"));
            assert_eq!(CheckpointData::decode_unverified(&bytes).unwrap(), data);
            assert!(matches!(
                CheckpointData::decode(&bytes),
                Err(FormatError::ChecksumMismatch { .. })
            ));
            // A whole file reads the same either way.
            assert_eq!(
                CheckpointData::decode_unverified(&data.encode()).unwrap(),
                data
            );
        }
    }

    #[test]
    fn nil_versus_empty_changes_the_checksum() {
        // Vector 1's checksum with vector 2's data must fail: `[]` is not `null`.
        let file =
            br#"{"Data":{"PodDeviceEntries":[],"RegisteredDevices":{}},"Checksum":3467439661}"#;
        assert!(matches!(
            CheckpointData::decode(file),
            Err(FormatError::ChecksumMismatch { .. })
        ));
    }

    #[test]
    fn missing_keys_keep_the_kubelets_prefilled_empty_values() {
        // The kubelet unmarshals into an empty (non-nil) slice and map, so a missing key means
        // `[]` / `map[]` in the checksum, and `null` means nil.
        let empty_list = CheckpointData {
            pod_device_entries: Some(Vec::new()),
            ..Default::default()
        };
        let file = format!(r#"{{"Data":{{}},"Checksum":{}}}"#, empty_list.checksum());
        assert_eq!(CheckpointData::decode(file.as_bytes()).unwrap(), empty_list);
        let file = format!(r#"{{"Checksum":{}}}"#, empty_list.checksum());
        assert_eq!(CheckpointData::decode(file.as_bytes()).unwrap(), empty_list);

        // `"RegisteredDevices":null` is a nil map for the checksum; read back as empty.
        let nil_map = checksum::checksum(None, None);
        let file = format!(
            r#"{{"Data":{{"PodDeviceEntries":null,"RegisteredDevices":null}},"Checksum":{nil_map}}}"#
        );
        assert_eq!(
            CheckpointData::decode(file.as_bytes()).unwrap(),
            CheckpointData::default()
        );
    }

    #[test]
    fn unknown_fields_are_ignored_like_go() {
        let file = br#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{},"AllDevices":{}},"Checksum":3467439661,"Extra":1}"#;
        assert_eq!(
            CheckpointData::decode(file).unwrap(),
            CheckpointData::default()
        );
    }

    #[test]
    fn garbage_and_bad_base64_do_not_parse() {
        assert!(matches!(
            CheckpointData::decode(b"{\"Data\":"),
            Err(FormatError::Json(_))
        ));
        assert!(matches!(
            CheckpointData::decode(b"\x00\x01garbage"),
            Err(FormatError::Json(_))
        ));
        let file = br#"{"Data":{"PodDeviceEntries":[{"PodUID":"p","ContainerName":"c","AllocResp":"!!"}],"RegisteredDevices":{}},"Checksum":0}"#;
        match CheckpointData::decode(file) {
            Err(FormatError::AllocResp {
                pod_uid,
                container_name,
                ..
            }) => {
                assert_eq!((pod_uid.as_str(), container_name.as_str()), ("p", "c"));
            }
            other => panic!("expected an AllocResp error, got {other:?}"),
        }
    }

    /// A small deterministic generator (xorshift64), enough to vary shapes without proptest.
    struct Gen(u64);

    impl Gen {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn string(&mut self) -> String {
            const PIECES: &[&str] = &[
                "a", "Z", "0", "-", "/", ".", " ", "<", ">", "&", "\"", "\\", "\n", "\u{1}",
                "\u{7f}", "é", "\u{2028}", "\u{2029}", "😀", "dev",
            ];
            (0..self.below(6))
                .map(|_| PIECES[usize::try_from(self.below(PIECES.len() as u64)).unwrap()])
                .collect()
        }
        fn strings(&mut self) -> Option<Vec<String>> {
            match self.below(4) {
                0 => None,
                _ => Some((0..self.below(4)).map(|_| self.string()).collect()),
            }
        }
        fn data(&mut self) -> CheckpointData {
            let entries = match self.below(4) {
                0 => None,
                _ => Some(
                    (0..self.below(4))
                        .map(|_| PodDevicesEntry {
                            pod_uid: self.string(),
                            container_name: self.string(),
                            resource_name: self.string(),
                            device_ids: match self.below(4) {
                                0 => None,
                                _ => Some(
                                    (0..self.below(5))
                                        .map(|_| {
                                            let numa = i64::try_from(self.below(25)).unwrap() - 2;
                                            (numa, self.strings())
                                        })
                                        .collect(),
                                ),
                            },
                            alloc_resp: match self.below(3) {
                                0 => None,
                                _ => Some(
                                    (0..self.below(12))
                                        .map(|_| u8::try_from(self.below(256)).unwrap())
                                        .collect(),
                                ),
                            },
                        })
                        .collect(),
                ),
            };
            let registered = (0..self.below(4))
                .map(|_| (self.string(), self.strings()))
                .collect();
            CheckpointData {
                pod_device_entries: entries,
                registered_devices: registered,
            }
        }
    }

    #[test]
    fn generated_data_round_trips_byte_for_byte() {
        let mut generator = Gen(0x9e37_79b9_7f4a_7c15);
        for _ in 0..2000 {
            let data = generator.data();
            let bytes = data.encode();
            let back = CheckpointData::decode(&bytes)
                .unwrap_or_else(|e| panic!("{e:?} for {}", String::from_utf8_lossy(&bytes)));
            assert_eq!(back, data);
            assert_eq!(back.encode(), bytes);
            assert_eq!(
                data.checksum(),
                u64::from(crate::fnv1a_32(data.spew().as_bytes()))
            );
            // The output is valid JSON that serde_json reads the same way.
            let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(value["Checksum"].as_u64(), Some(data.checksum()));
        }
    }

    /// `AllocResp` is written as `BASE64` (what decoding reads) writes it, at every length
    /// around the SIMD block sizes and at the size of a 1,024-device answer.
    #[test]
    fn alloc_resp_is_written_as_the_base64_engine_writes_it() {
        let mut generator = Gen(0x2545_f491_4f6c_dd1d);
        let lengths = (0..=200).chain([1023, 1024, 1025, 60_000, 60_001, 60_002]);
        for len in lengths {
            let bytes: Vec<u8> = (0..len)
                .map(|_| u8::try_from(generator.below(256)).unwrap())
                .collect();
            let entry = PodDevicesEntry {
                alloc_resp: Some(bytes.clone()),
                ..PodDevicesEntry::default()
            };
            let expected = format!(
                r#"{{"PodUID":"","ContainerName":"","ResourceName":"","DeviceIDs":null,"AllocResp":"{}"}}"#,
                BASE64.encode(&bytes)
            );
            assert_eq!(
                String::from_utf8(entry.encode()).unwrap(),
                expected,
                "{len}"
            );
        }
    }

    #[test]
    fn size_hint_covers_typical_files() {
        for data in [CheckpointData::default(), sample(), edge()] {
            assert!(data.size_hint() >= data.encode().len());
        }
    }
}
