//! The ListAndWatch stream read straight into [`ListedDevice`]s.
//!
//! Every update is the plugin's whole device list, so a plugin of 10,000 devices sends a
//! message of 10,000 `Device`s on each health change. Decoded by the generated prost types and
//! then converted, each device costs three allocations (id, health string, NUMA node list) plus
//! the conversion, and the decoder steps through tonic's `BytesMut`-backed buffer one field at
//! a time; that was half the daemon's CPU time for such an update. [`DeviceListCodec`] decodes
//! the message from one contiguous slice into the device manager's own columns ([`DeviceList`]:
//! health read in place, no allocation per device) and makes the [`DeviceSet`] of it, with
//! prost's own varint, key and skip functions, and the same rules as the generated code: the last value of
//! a scalar or string field wins, repeated embedded messages merge, unknown fields are skipped,
//! strings must be UTF-8. Field numbers: `docs/kubelet-compatibility.md`, "Device plugin API
//! v1beta1".
//!
//! Most updates change one device's health and repeat every other device as it was. The decoder
//! of a stream keeps the last set it made (when it refused no id; a copy sharing the set's
//! columns, so the ids are held once) and compares the next message with it in place: when the
//! ids are the same in the same order, the update is [`DeviceUpdate::Changed`], only the devices
//! that differ, and nothing else is allocated.

use pluglet_proto::v1beta1::Empty;
use prost::Message as _;
use prost::bytes::Buf;
use prost::encoding::{DecodeContext, WireType, decode_key, decode_varint, skip_field};
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

use crate::device_id::DeviceId;
use crate::devices::{DeviceList, DeviceSet, Health, ListedDevice, Replaced};

/// `ListAndWatchResponse.devices`.
const RESPONSE_DEVICES: u32 = 1;
/// `Device.ID`.
const DEVICE_ID: u32 = 1;
/// `Device.health`.
const DEVICE_HEALTH: u32 = 2;
/// `Device.topology`.
const DEVICE_TOPOLOGY: u32 = 3;
/// `TopologyInfo.nodes`.
const TOPOLOGY_NODES: u32 = 1;
/// `NUMANode.ID`.
const NUMA_NODE_ID: u32 = 1;

/// Why a ListAndWatch update cannot be read: which field breaks which rule of the encoding.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DeviceListError {
    /// A key, a varint or a skipped field prost refuses.
    #[error(transparent)]
    Encoding(#[from] prost::DecodeError),
    /// A field of another wire type than its own.
    #[error("{field} has wire type {wire_type:?}")]
    WireType {
        /// The field, as `Message.field`.
        field: &'static str,
        /// The wire type found.
        wire_type: WireType,
    },
    /// A length-delimited field that runs past the end of its message.
    #[error("{field} is longer than the message")]
    TooLong {
        /// The field.
        field: &'static str,
    },
    /// A string field that is not UTF-8.
    #[error("{field} is not UTF-8")]
    NotUtf8 {
        /// The field.
        field: &'static str,
    },
}

/// One ListAndWatch update as read.
#[derive(Clone, Debug)]
pub(crate) enum DeviceUpdate {
    /// The whole list: the stream's first update, or one whose ids differ from the last one's.
    List {
        /// The devices served.
        devices: DeviceSet,
        /// The ids refused ([`DeviceSet::from_list`]).
        refused: Replaced,
    },
    /// The same `len` ids in the same order as the last update; these devices (by position)
    /// differ from it, every other is as it was.
    Changed {
        /// How many devices the update lists.
        len: usize,
        /// Position and new value of each device that changed.
        changes: Vec<(usize, ListedDevice)>,
    },
}

/// The codec of a ListAndWatch call: `Empty` out, each update in as a [`DeviceUpdate`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct DeviceListCodec;

impl Codec for DeviceListCodec {
    type Encode = Empty;
    type Decode = DeviceUpdate;
    type Encoder = DeviceListCodec;
    type Decoder = DeviceListDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        DeviceListCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        DeviceListDecoder::default()
    }
}

/// The decoder of one stream: remembers the last set made.
#[derive(Debug, Default)]
pub(crate) struct DeviceListDecoder {
    /// The last set, when it refused no id (so positions in the list name its devices).
    previous: Option<DeviceSet>,
}

impl DeviceListDecoder {
    /// Reads one `ListAndWatchResponse` message.
    pub(crate) fn read(&mut self, buf: &[u8]) -> Result<DeviceUpdate, DeviceListError> {
        if let Some(previous) = self.previous.as_mut() {
            let mut changes = Vec::new();
            if diff_devices(buf, previous, &mut changes)? {
                let len = previous.capacity();
                previous.apply_changes(len, &changes);
                return Ok(DeviceUpdate::Changed { len, changes });
            }
        }
        // The last set goes before the next is made, not after.
        self.previous = None;
        let (devices, refused) = DeviceSet::from_list(decode_devices(buf)?);
        // An empty or repeated id is not served, so positions in such a list would not name
        // the set's devices: the next update is read as a whole list again.
        self.previous = (!refused.refused_any()).then(|| devices.clone());
        Ok(DeviceUpdate::List { devices, refused })
    }
}

impl Encoder for DeviceListCodec {
    type Item = Empty;
    type Error = Status;

    fn encode(&mut self, item: Empty, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|e| Status::internal(format!("cannot encode the ListAndWatch request: {e}")))
    }
}

impl Decoder for DeviceListDecoder {
    type Item = DeviceUpdate;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<DeviceUpdate>, Status> {
        let len = buf.remaining();
        let decoded = if buf.chunk().len() >= len {
            let decoded = self.read(&buf.chunk()[..len]);
            buf.advance(len);
            decoded
        } else {
            self.read(&buf.copy_to_bytes(len))
        };
        decoded
            .map(Some)
            .map_err(|why| Status::internal(format!("ListAndWatch update is not valid: {why}")))
    }
}

/// Decodes a `ListAndWatchResponse` message into its devices, as listed.
pub(crate) fn decode_devices(mut buf: &[u8]) -> Result<DeviceList, DeviceListError> {
    let mut devices = DeviceList::default();
    let mut numa = Vec::new();
    while !buf.is_empty() {
        let (tag, wire_type) = key(&mut buf)?;
        if tag == RESPONSE_DEVICES {
            let device = embedded(wire_type, &mut buf, "devices")?;
            numa.clear();
            let (id, health) = read_device(device, &mut numa)?;
            let id = std::str::from_utf8(id)
                .map_err(|_| DeviceListError::NotUtf8 { field: "Device.ID" })?;
            if devices.is_empty() {
                // Devices of one plugin are alike in size: room for as many as would fit.
                let fit = 1 + buf.len() / (device.len() + 2);
                devices = DeviceList::with_capacity(fit, fit * id.len());
            }
            devices.push(id, health, &numa);
        } else {
            skip(wire_type, tag, &mut buf)?;
        }
    }
    Ok(devices)
}

/// Compares a `ListAndWatchResponse` message with `previous` in place: `Ok(false)` as soon as
/// an id or the count differs; otherwise `Ok(true)` with the devices that differ in `changes`.
/// A malformed message is an error either way.
fn diff_devices(
    mut buf: &[u8],
    previous: &DeviceSet,
    changes: &mut Vec<(usize, ListedDevice)>,
) -> Result<bool, DeviceListError> {
    let mut at = 0;
    let mut numa = Vec::new();
    while !buf.is_empty() {
        let (tag, wire_type) = key(&mut buf)?;
        if tag != RESPONSE_DEVICES {
            skip(wire_type, tag, &mut buf)?;
            continue;
        }
        let bytes = embedded(wire_type, &mut buf, "devices")?;
        numa.clear();
        let (id, health) = read_device(bytes, &mut numa)?;
        let Some(before) = previous.at(at).filter(|d| d.id.as_bytes() == id) else {
            return Ok(false);
        };
        if before.health != health || before.numa != numa.as_slice() {
            changes.push((
                at,
                ListedDevice {
                    id: DeviceId::from(before.id),
                    health,
                    numa: numa.clone(),
                },
            ));
        }
        at += 1;
    }
    Ok(at == previous.capacity())
}

/// Reads one `Device` message: its id's bytes (not yet checked for UTF-8) and health; its NUMA
/// nodes are appended to `numa`.
fn read_device<'a>(
    mut buf: &'a [u8],
    numa: &mut Vec<i64>,
) -> Result<(&'a [u8], Health), DeviceListError> {
    let mut id: &[u8] = &[];
    // An absent health is the empty string, which is not healthy.
    let mut health = Health::Unhealthy;
    while !buf.is_empty() {
        let (tag, wire_type) = key(&mut buf)?;
        match tag {
            DEVICE_ID => id = embedded(wire_type, &mut buf, "Device.ID")?,
            DEVICE_HEALTH => {
                let bytes = embedded(wire_type, &mut buf, "Device.health")?;
                let text = std::str::from_utf8(bytes).map_err(|_| DeviceListError::NotUtf8 {
                    field: "Device.health",
                })?;
                health = Health::from_wire(text);
            }
            DEVICE_TOPOLOGY => {
                let topology = embedded(wire_type, &mut buf, "Device.topology")?;
                decode_topology(topology, numa)?;
            }
            _ => skip(wire_type, tag, &mut buf)?,
        }
    }
    Ok((id, health))
}

fn decode_topology(mut buf: &[u8], numa: &mut Vec<i64>) -> Result<(), DeviceListError> {
    while !buf.is_empty() {
        let (tag, wire_type) = key(&mut buf)?;
        if tag == TOPOLOGY_NODES {
            let mut node = embedded(wire_type, &mut buf, "TopologyInfo.nodes")?;
            let mut id = 0i64;
            while !node.is_empty() {
                let (tag, wire_type) = key(&mut node)?;
                if tag == NUMA_NODE_ID {
                    if wire_type != WireType::Varint {
                        return Err(DeviceListError::WireType {
                            field: "NUMANode.ID",
                            wire_type,
                        });
                    }
                    // int64 on the wire: the two's complement bits as a varint.
                    id = decode_varint(&mut node)? as i64;
                } else {
                    skip(wire_type, tag, &mut node)?;
                }
            }
            numa.push(id);
        } else {
            skip(wire_type, tag, &mut buf)?;
        }
    }
    Ok(())
}

fn key(buf: &mut &[u8]) -> Result<(u32, WireType), DeviceListError> {
    Ok(decode_key(buf)?)
}

/// The bytes of a length-delimited field, split off the front of `buf`.
fn embedded<'a>(
    wire_type: WireType,
    buf: &mut &'a [u8],
    field: &'static str,
) -> Result<&'a [u8], DeviceListError> {
    if wire_type != WireType::LengthDelimited {
        return Err(DeviceListError::WireType { field, wire_type });
    }
    let len = decode_varint(buf)?;
    let len = usize::try_from(len)
        .ok()
        .filter(|&len| len <= buf.len())
        .ok_or(DeviceListError::TooLong { field })?;
    let (field, rest) = buf.split_at(len);
    *buf = rest;
    Ok(field)
}

fn skip(wire_type: WireType, tag: u32, buf: &mut &[u8]) -> Result<(), DeviceListError> {
    Ok(skip_field(wire_type, tag, buf, DecodeContext::default())?)
}

#[cfg(test)]
mod tests {
    use pluglet_proto::v1beta1::{self, ListAndWatchResponse, NumaNode, TopologyInfo};
    use proptest::prelude::*;

    use super::*;
    use crate::devices::Device;

    fn wire(id: &str, health: &str, numa: Option<Vec<i64>>) -> v1beta1::Device {
        v1beta1::Device {
            id: id.into(),
            health: health.into(),
            topology: numa.map(|ids| TopologyInfo {
                nodes: ids.into_iter().map(|id| NumaNode { id }).collect(),
            }),
        }
    }

    /// What the generated types and [`ListedDevice::from_wire`] make of the same bytes.
    fn reference(bytes: &[u8]) -> Result<Vec<ListedDevice>, prost::DecodeError> {
        ListAndWatchResponse::decode(bytes)
            .map(|r| r.devices.into_iter().map(ListedDevice::from_wire).collect())
    }

    /// What [`decode_devices`] makes of the bytes, as listed devices.
    fn decoded(bytes: &[u8]) -> Result<Vec<ListedDevice>, DeviceListError> {
        decode_devices(bytes).map(|list| list.iter().map(Device::to_listed).collect())
    }

    fn listed(set: &DeviceSet) -> Vec<ListedDevice> {
        set.devices().map(Device::to_listed).collect()
    }

    /// The devices of a whole-list update.
    fn whole(update: DeviceUpdate) -> Vec<ListedDevice> {
        match update {
            DeviceUpdate::List { devices, .. } => listed(&devices),
            other => panic!("not a whole list: {other:?}"),
        }
    }

    /// The count and changes of an update that kept the ids.
    fn changed(update: DeviceUpdate) -> (usize, Vec<(usize, ListedDevice)>) {
        match update {
            DeviceUpdate::Changed { len, changes } => (len, changes),
            other => panic!("not a change: {other:?}"),
        }
    }

    proptest! {
        #[test]
        fn decodes_what_the_generated_types_decode(
            devices in prop::collection::vec(
                (
                    "[a-z0-9-]{0,12}",
                    prop::sample::select(vec!["Healthy", "Unhealthy", "", "healthy"]),
                    prop::option::of(prop::collection::vec(-2i64..70, 0..4)),
                ),
                0..20,
            )
        ) {
            let message = ListAndWatchResponse {
                devices: devices
                    .iter()
                    .map(|(id, health, numa)| wire(id, health, numa.clone()))
                    .collect(),
            };
            let bytes = message.encode_to_vec();
            prop_assert_eq!(decoded(&bytes).unwrap(), reference(&bytes).unwrap());
        }

        #[test]
        fn changes_applied_to_the_last_list_give_the_next_list(
            first in prop::collection::vec(
                (0u8..6, prop::bool::ANY, prop::option::of(prop::collection::vec(0i64..3, 0..3))),
                0..8,
            ),
            second in prop::collection::vec(
                (0u8..6, prop::bool::ANY, prop::option::of(prop::collection::vec(0i64..3, 0..3))),
                0..8,
            ),
        ) {
            let encode = |devices: &[(u8, bool, Option<Vec<i64>>)]| {
                ListAndWatchResponse {
                    devices: devices
                        .iter()
                        .map(|(id, healthy, numa)| {
                            wire(&format!("d{id}"), if *healthy { "Healthy" } else { "" }, numa.clone())
                        })
                        .collect(),
                }
                .encode_to_vec()
            };
            let (first, second) = (encode(&first), encode(&second));
            let mut decoder = DeviceListDecoder::default();
            let DeviceUpdate::List { devices: mut set, .. } = decoder.read(&first).unwrap() else {
                panic!("the first update is a list");
            };
            match decoder.read(&second).unwrap() {
                DeviceUpdate::List { devices, .. } => set = devices,
                DeviceUpdate::Changed { len, changes } => {
                    prop_assert_eq!(set.apply_changes(len, &changes), Some(!changes.is_empty()));
                }
            }
            prop_assert_eq!(listed(&set), listed(&DeviceSet::new(reference(&second).unwrap())));
        }

        #[test]
        fn garbage_is_refused_where_the_generated_types_refuse_it(
            bytes in prop::collection::vec(any::<u8>(), 0..64)
        ) {
            match (decoded(&bytes), reference(&bytes)) {
                (Ok(ours), Ok(theirs)) => prop_assert_eq!(ours, theirs),
                (Err(_), Err(_)) => {}
                (ours, theirs) => prop_assert!(false, "ours {:?}, generated {:?}", ours, theirs),
            }
        }
    }

    fn list(devices: &[(&str, &str, Option<Vec<i64>>)]) -> Vec<u8> {
        ListAndWatchResponse {
            devices: devices
                .iter()
                .map(|(id, health, numa)| wire(id, health, numa.clone()))
                .collect(),
        }
        .encode_to_vec()
    }

    fn device(id: &str, health: Health, numa: &[i64]) -> ListedDevice {
        ListedDevice {
            id: id.into(),
            health,
            numa: numa.to_vec(),
        }
    }

    #[test]
    fn an_update_with_the_same_ids_carries_only_what_changed() {
        let mut decoder = DeviceListDecoder::default();
        let first = list(&[
            ("a", "Healthy", Some(vec![0])),
            ("b", "Healthy", None),
            ("c", "Healthy", None),
        ]);
        assert_eq!(whole(decoder.read(&first).unwrap()).len(), 3);
        let flipped = list(&[
            ("a", "Healthy", Some(vec![0])),
            ("b", "Unhealthy", None),
            ("c", "Healthy", Some(vec![1])),
        ]);
        assert_eq!(
            changed(decoder.read(&flipped).unwrap()),
            (
                3,
                vec![
                    (1, device("b", Health::Unhealthy, &[])),
                    (2, device("c", Health::Healthy, &[1])),
                ]
            )
        );
        assert_eq!(
            changed(decoder.read(&flipped).unwrap()),
            (3, vec![]),
            "compared with the update before, not the first"
        );
    }

    #[test]
    fn other_ids_another_count_or_duplicates_give_the_whole_list() {
        let mut decoder = DeviceListDecoder::default();
        let two = list(&[("a", "Healthy", None), ("b", "Healthy", None)]);
        decoder.read(&two).unwrap();
        for other in [
            list(&[("a", "Healthy", None)]),
            list(&[
                ("a", "Healthy", None),
                ("b", "Healthy", None),
                ("c", "", None),
            ]),
            list(&[("b", "Healthy", None), ("a", "Healthy", None)]),
        ] {
            let mut fresh = DeviceListDecoder::default();
            let expected = whole(fresh.read(&other).unwrap());
            assert_eq!(whole(decoder.read(&other).unwrap()), expected);
            decoder.read(&two).unwrap();
        }
        let duplicated = list(&[("a", "Healthy", None), ("a", "Unhealthy", None)]);
        decoder.read(&duplicated).unwrap();
        assert!(
            matches!(
                decoder.read(&duplicated).unwrap(),
                DeviceUpdate::List { .. }
            ),
            "positions do not name devices when ids repeat"
        );
        let bad_health = [0x0a, 0x06, 0x0a, 0x01, b'a', 0x12, 0x01, 0xff];
        decoder.read(&list(&[("a", "Healthy", None)])).unwrap();
        assert_eq!(
            decoder.read(&bad_health).unwrap_err().to_string(),
            "Device.health is not UTF-8"
        );
    }

    #[test]
    fn repeated_fields_merge_and_the_last_scalar_wins() {
        let mut bytes = ListAndWatchResponse {
            devices: vec![wire("a", "Unhealthy", Some(vec![0]))],
        }
        .encode_to_vec();
        // The same device message continued: a second ID, health and topology.
        let more = wire("b", "Healthy", Some(vec![1, -1])).encode_to_vec();
        let first_len = bytes[1] as usize;
        bytes[1] = (first_len + more.len()) as u8;
        bytes.extend_from_slice(&more);
        assert_eq!(decoded(&bytes).unwrap(), reference(&bytes).unwrap());
        assert_eq!(
            decoded(&bytes).unwrap(),
            [ListedDevice {
                id: "b".into(),
                health: Health::Healthy,
                numa: vec![0, 1, -1],
            }]
        );
    }

    #[test]
    fn unknown_fields_are_skipped_and_bad_strings_refused() {
        let mut device = wire("gpu-0", "Healthy", None).encode_to_vec();
        device.extend_from_slice(&[0x78, 0x05]); // field 15, varint 5
        let mut bytes = vec![0x0a, device.len() as u8];
        bytes.extend_from_slice(&device);
        bytes.extend_from_slice(&[0x10, 0x01]); // response field 2, varint 1
        assert_eq!(decoded(&bytes).unwrap(), reference(&bytes).unwrap());

        let bad = [0x0a, 0x03, 0x0a, 0x01, 0xff];
        assert!(reference(&bad).is_err());
        assert_eq!(
            decoded(&bad).unwrap_err().to_string(),
            "Device.ID is not UTF-8"
        );
    }
}
