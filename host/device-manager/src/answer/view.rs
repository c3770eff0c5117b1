//! [`AnswerView`]: a plugin's `ContainerAllocateResponse` read in place, its strings borrowed
//! from the protobuf bytes.
//!
//! What the device manager reads of an answer (the edits a CDI spec is made of, the plugin's
//! own CDI names) it reads from the bytes it keeps: an answer for 1,024 devices holds thousands
//! of strings, which prost would copy out one allocation each only for them to be read once and
//! freed. Hand-written because prost (and every maintained protobuf crate that generates from
//! `.proto` files) decodes strings into owned `String`s; the wire reading itself (keys,
//! varints, lengths, skipping unknown fields) is prost's. The view accepts what prost's decoding
//! of the message accepts and reads the same values: the tests hold the two side by side.

use prost::DecodeError;
use prost::encoding::{DecodeContext, WireType, check_wire_type, decode_key, decode_varint};

use pluglet_proto::v1beta1::ContainerAllocateResponse;

/// A `ContainerAllocateResponse` whose strings borrow the bytes it was read from (see the
/// module doc), or a decoded message ([`AnswerView::of`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AnswerView<'a> {
    /// `envs`, sorted by key, each key once (a map keeps the last entry given for a key).
    pub envs: Vec<(&'a str, &'a str)>,
    /// `mounts`, in order.
    pub mounts: Vec<AnswerMount<'a>>,
    /// `devices`, in order.
    pub devices: Vec<AnswerDevice<'a>>,
    /// `annotations`, as `envs`.
    pub annotations: Vec<(&'a str, &'a str)>,
    /// The names of `cdi_devices`, in order.
    pub cdi_devices: Vec<&'a str>,
}

/// A `Mount` of an [`AnswerView`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnswerMount<'a> {
    /// Path in the container.
    pub container_path: &'a str,
    /// Path on the host.
    pub host_path: &'a str,
    /// Mounted read-only.
    pub read_only: bool,
}

/// A `DeviceSpec` of an [`AnswerView`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnswerDevice<'a> {
    /// Path in the container.
    pub container_path: &'a str,
    /// Path on the host.
    pub host_path: &'a str,
    /// Cgroup permissions.
    pub permissions: &'a str,
}

/// Why bytes are not a `ContainerAllocateResponse`.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// The wire form is broken (prost's own error: a length past the end, a bad key or varint,
    /// a field of the wrong wire type).
    #[error(transparent)]
    Wire(#[from] DecodeError),
    /// A length runs past the end of the bytes (or of the message holding the field).
    #[error("a length runs past the end of the message")]
    PastTheEnd,
    /// A string field holds bytes that are not UTF-8.
    #[error("the field {0} is not UTF-8")]
    NotUtf8(&'static str),
}

impl<'a> AnswerView<'a> {
    /// Reads the protobuf bytes of a `ContainerAllocateResponse`.
    pub fn read(mut bytes: &'a [u8]) -> Result<AnswerView<'a>, ViewError> {
        let mut view = AnswerView::default();
        while !bytes.is_empty() {
            let (tag, wire_type) = decode_key(&mut bytes)?;
            match tag {
                1 => view.envs.push(entry(wire_type, &mut bytes, "envs")?),
                2 => view.mounts.push(mount(delimited(wire_type, &mut bytes)?)?),
                3 => view
                    .devices
                    .push(device(delimited(wire_type, &mut bytes)?)?),
                4 => view
                    .annotations
                    .push(entry(wire_type, &mut bytes, "annotations")?),
                5 => view
                    .cdi_devices
                    .push(cdi_name(delimited(wire_type, &mut bytes)?)?),
                _ => skip(tag, wire_type, &mut bytes)?,
            }
        }
        last_of_each_key(&mut view.envs);
        last_of_each_key(&mut view.annotations);
        Ok(view)
    }

    /// The view of a decoded message (its strings borrowed from it).
    pub fn of(response: &'a ContainerAllocateResponse) -> AnswerView<'a> {
        let pairs = |map: &'a std::collections::HashMap<String, String>| {
            let mut pairs: Vec<_> = map.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            pairs.sort_unstable();
            pairs
        };
        AnswerView {
            envs: pairs(&response.envs),
            mounts: response
                .mounts
                .iter()
                .map(|m| AnswerMount {
                    container_path: &m.container_path,
                    host_path: &m.host_path,
                    read_only: m.read_only,
                })
                .collect(),
            devices: response
                .devices
                .iter()
                .map(|d| AnswerDevice {
                    container_path: &d.container_path,
                    host_path: &d.host_path,
                    permissions: &d.permissions,
                })
                .collect(),
            annotations: pairs(&response.annotations),
            cdi_devices: response
                .cdi_devices
                .iter()
                .map(|c| c.name.as_str())
                .collect(),
        }
    }

    /// Whether the answer has envs, device specs or mounts: something a runtime applies.
    pub fn has_edits(&self) -> bool {
        !self.envs.is_empty() || !self.devices.is_empty() || !self.mounts.is_empty()
    }
}

/// Calls `field` with each field's tag, wire type and the bytes from its value on, which it
/// reads past.
fn for_each_field<'a>(
    mut bytes: &'a [u8],
    mut field: impl FnMut(u32, WireType, &mut &'a [u8]) -> Result<(), ViewError>,
) -> Result<(), ViewError> {
    while !bytes.is_empty() {
        let (tag, wire_type) = decode_key(&mut bytes)?;
        field(tag, wire_type, &mut bytes)?;
    }
    Ok(())
}

/// A `Mount` message.
fn mount(bytes: &[u8]) -> Result<AnswerMount<'_>, ViewError> {
    let mut m = AnswerMount::default();
    for_each_field(bytes, |tag, wire_type, b| {
        match tag {
            1 => m.container_path = string(wire_type, b, "mounts.container_path")?,
            2 => m.host_path = string(wire_type, b, "mounts.host_path")?,
            3 => {
                check_wire_type(WireType::Varint, wire_type)?;
                m.read_only = decode_varint(b)? != 0;
            }
            _ => skip(tag, wire_type, b)?,
        }
        Ok(())
    })?;
    Ok(m)
}

/// A `DeviceSpec` message.
fn device(bytes: &[u8]) -> Result<AnswerDevice<'_>, ViewError> {
    let mut d = AnswerDevice::default();
    for_each_field(bytes, |tag, wire_type, b| {
        match tag {
            1 => d.container_path = string(wire_type, b, "devices.container_path")?,
            2 => d.host_path = string(wire_type, b, "devices.host_path")?,
            3 => d.permissions = string(wire_type, b, "devices.permissions")?,
            _ => skip(tag, wire_type, b)?,
        }
        Ok(())
    })?;
    Ok(d)
}

/// A `CDIDevice` message's name.
fn cdi_name(bytes: &[u8]) -> Result<&str, ViewError> {
    let mut name = "";
    for_each_field(bytes, |tag, wire_type, b| {
        match tag {
            1 => name = string(wire_type, b, "cdi_devices.name")?,
            _ => skip(tag, wire_type, b)?,
        }
        Ok(())
    })?;
    Ok(name)
}

/// A map entry (`key` = 1, `value` = 2, either missing empty).
fn entry<'a>(
    wire_type: WireType,
    bytes: &mut &'a [u8],
    map: &'static str,
) -> Result<(&'a str, &'a str), ViewError> {
    let (mut key, mut value) = ("", "");
    for_each_field(delimited(wire_type, bytes)?, |tag, wire_type, b| {
        match tag {
            1 => key = string(wire_type, b, map)?,
            2 => value = string(wire_type, b, map)?,
            _ => skip(tag, wire_type, b)?,
        }
        Ok(())
    })?;
    Ok((key, value))
}

/// A length-delimited value, read past.
fn delimited<'a>(wire_type: WireType, bytes: &mut &'a [u8]) -> Result<&'a [u8], ViewError> {
    check_wire_type(WireType::LengthDelimited, wire_type)?;
    let len = decode_varint(bytes)?;
    if len > bytes.len() as u64 {
        return Err(ViewError::PastTheEnd);
    }
    let (value, rest) = bytes.split_at(len as usize);
    *bytes = rest;
    Ok(value)
}

fn string<'a>(
    wire_type: WireType,
    bytes: &mut &'a [u8],
    field: &'static str,
) -> Result<&'a str, ViewError> {
    std::str::from_utf8(delimited(wire_type, bytes)?).map_err(|_| ViewError::NotUtf8(field))
}

/// Reads past a field the message does not define.
fn skip(tag: u32, wire_type: WireType, bytes: &mut &[u8]) -> Result<(), ViewError> {
    Ok(prost::encoding::skip_field(
        wire_type,
        tag,
        bytes,
        DecodeContext::default(),
    )?)
}

/// Sorts `pairs` by key and keeps, of the pairs sharing a key, the last one given.
fn last_of_each_key(pairs: &mut Vec<(&str, &str)>) {
    pairs.reverse();
    // Stable: of a key's pairs, the one given last comes first, and is the one kept.
    pairs.sort_by_key(|&(key, _)| key);
    pairs.dedup_by_key(|&mut (key, _)| key);
}

#[cfg(test)]
mod tests {
    use super::*;
    use pluglet_proto::v1beta1::{CdiDevice, DeviceSpec, Mount};
    use proptest::prelude::*;
    use prost::Message;
    use prost::encoding::{encode_key, encode_varint};

    fn text() -> impl Strategy<Value = String> {
        "[a-c/=é]{0,4}"
    }

    fn response() -> impl Strategy<Value = ContainerAllocateResponse> {
        (
            prop::collection::hash_map(text(), text(), 0..4),
            prop::collection::vec((text(), text(), any::<bool>()), 0..4),
            prop::collection::vec((text(), text(), text()), 0..4),
            prop::collection::hash_map(text(), text(), 0..3),
            prop::collection::vec(text(), 0..3),
        )
            .prop_map(|(envs, mounts, devices, annotations, cdi)| {
                ContainerAllocateResponse {
                    envs,
                    mounts: mounts
                        .into_iter()
                        .map(|(container_path, host_path, read_only)| Mount {
                            container_path,
                            host_path,
                            read_only,
                        })
                        .collect(),
                    devices: devices
                        .into_iter()
                        .map(|(container_path, host_path, permissions)| DeviceSpec {
                            container_path,
                            host_path,
                            permissions,
                        })
                        .collect(),
                    annotations,
                    cdi_devices: cdi.into_iter().map(|name| CdiDevice { name }).collect(),
                }
            })
    }

    /// A change made to encoded bytes: a byte replaced, a byte inserted, the end cut off.
    #[derive(Clone, Debug)]
    enum Edit {
        Replace(prop::sample::Index, u8),
        Insert(prop::sample::Index, u8),
        Cut(prop::sample::Index),
    }

    fn edit() -> impl Strategy<Value = Edit> {
        prop_oneof![
            (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, b)| Edit::Replace(at, b)),
            (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, b)| Edit::Insert(at, b)),
            any::<prop::sample::Index>().prop_map(Edit::Cut),
        ]
    }

    proptest! {
        #[test]
        fn reads_what_prost_decodes(response in response()) {
            let bytes = response.encode_to_vec();
            prop_assert_eq!(AnswerView::read(&bytes).unwrap(), AnswerView::of(&response));
        }

        #[test]
        fn accepts_and_refuses_what_prost_does(
            response in response(),
            edits in prop::collection::vec(edit(), 1..4),
        ) {
            let mut bytes = response.encode_to_vec();
            for edit in edits {
                match edit {
                    Edit::Replace(at, b) if !bytes.is_empty() => {
                        let at = at.index(bytes.len());
                        bytes[at] = b;
                    }
                    Edit::Replace(..) => {}
                    Edit::Insert(at, b) => bytes.insert(at.index(bytes.len() + 1), b),
                    Edit::Cut(at) => bytes.truncate(at.index(bytes.len() + 1)),
                }
            }
            let decoded = ContainerAllocateResponse::decode(bytes.as_slice());
            let read = AnswerView::read(&bytes);
            prop_assert_eq!(read.is_ok(), decoded.is_ok(), "{:?} / {:?}", read, decoded);
            if let (Ok(read), Ok(decoded)) = (read, decoded) {
                prop_assert_eq!(read, AnswerView::of(&decoded));
            }
        }
    }

    fn field(tag: u32, wire_type: WireType, value: &[u8], out: &mut Vec<u8>) {
        encode_key(tag, wire_type, out);
        if wire_type == WireType::LengthDelimited {
            encode_varint(value.len() as u64, out);
        }
        out.extend_from_slice(value);
    }

    fn env(key: &str, value: &str) -> Vec<u8> {
        let mut entry = Vec::new();
        field(1, WireType::LengthDelimited, key.as_bytes(), &mut entry);
        field(2, WireType::LengthDelimited, value.as_bytes(), &mut entry);
        entry
    }

    #[test]
    fn a_key_given_twice_keeps_its_last_value_and_unknown_fields_are_skipped() {
        let mut bytes = Vec::new();
        field(1, WireType::LengthDelimited, &env("B", "1"), &mut bytes);
        field(1, WireType::LengthDelimited, &env("A", "x"), &mut bytes);
        field(1, WireType::LengthDelimited, &env("B", "2"), &mut bytes);
        field(9, WireType::Varint, &[0x96, 0x01], &mut bytes);
        field(10, WireType::ThirtyTwoBit, &[1, 2, 3, 4], &mut bytes);
        field(11, WireType::LengthDelimited, b"newer", &mut bytes);
        let view = AnswerView::read(&bytes).unwrap();
        assert_eq!(view.envs, [("A", "x"), ("B", "2")]);
        assert!(view.has_edits());
        assert_eq!(
            view,
            AnswerView::of(&ContainerAllocateResponse::decode(bytes.as_slice()).unwrap())
        );
    }

    #[test]
    fn what_is_refused_says_why() {
        let mut not_utf8 = Vec::new();
        let mut spec = Vec::new();
        field(1, WireType::LengthDelimited, &[0xff, 0xfe], &mut spec);
        field(3, WireType::LengthDelimited, &spec, &mut not_utf8);
        let err = AnswerView::read(&not_utf8).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the field devices.container_path is not UTF-8"
        );

        let mut past_the_end = Vec::new();
        encode_key(3, WireType::LengthDelimited, &mut past_the_end);
        encode_varint(9, &mut past_the_end);
        past_the_end.push(0x0a);
        assert!(matches!(
            AnswerView::read(&past_the_end),
            Err(ViewError::PastTheEnd)
        ));

        let mut wrong_type = Vec::new();
        field(2, WireType::Varint, &[1], &mut wrong_type);
        assert!(matches!(
            AnswerView::read(&wrong_type),
            Err(ViewError::Wire(_))
        ));
        assert!(ContainerAllocateResponse::decode(wrong_type.as_slice()).is_err());
    }
}
