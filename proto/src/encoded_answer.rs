//! [`EncodedAnswer`]: a device plugin's `ContainerAllocateResponse` carried as its protobuf
//! bytes in the admin API's `AllocateResponse`.
//!
//! An embedded message and a `bytes` field share one wire form (a tag, a length, the bytes), so
//! the daemon writes the plugin's own bytes where the message goes: an answer for 1,024 devices
//! is not decoded into thousands of strings and encoded again on its way out. The proto file is
//! unchanged, and so is what any client in any language reads. A Rust client gets the message
//! with [`EncodedAnswer::decode`].
//!
//! Hand-written because prost has no field kind for "a message kept as its bytes"; the
//! [`prost::Message`] implementation is the small part prost's derive would make, over bytes.

use prost::bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::encoding::{self, DecodeContext, WireType, decode_varint, encode_key, encode_varint};
use prost::{DecodeError, Message};

use crate::v1beta1::ContainerAllocateResponse;

/// A `v1beta1.ContainerAllocateResponse` as its protobuf bytes. Cheap to clone (the bytes are
/// shared).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EncodedAnswer(Bytes);

impl EncodedAnswer {
    /// The answer whose protobuf encoding is `encoded` (the bytes are sent as they are; what
    /// the receiver reads of them is what they decode to).
    pub fn from_bytes(encoded: Bytes) -> EncodedAnswer {
        EncodedAnswer(encoded)
    }

    /// `answer`, encoded.
    pub fn encode(answer: &ContainerAllocateResponse) -> EncodedAnswer {
        EncodedAnswer(answer.encode_to_vec().into())
    }

    /// The answer, decoded.
    pub fn decode(&self) -> Result<ContainerAllocateResponse, DecodeError> {
        ContainerAllocateResponse::decode(self.0.clone())
    }

    /// The protobuf bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl From<&ContainerAllocateResponse> for EncodedAnswer {
    fn from(answer: &ContainerAllocateResponse) -> EncodedAnswer {
        EncodedAnswer::encode(answer)
    }
}

impl Message for EncodedAnswer {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.0);
    }

    /// Appends the field as it was read (its key and value; a varint in its shortest form):
    /// fields read in turn make the message's bytes again, and a message field read twice is
    /// merged as protobuf merges it, by its bytes following one another. A group (proto2 only;
    /// the answer, a proto3 message, defines none) is skipped, as decoding the answer would
    /// skip it.
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        let mut out = BytesMut::from(std::mem::take(&mut self.0));
        match wire_type {
            WireType::Varint => {
                let value = decode_varint(buf)?;
                encode_key(tag, wire_type, &mut out);
                encode_varint(value, &mut out);
            }
            WireType::SixtyFourBit => {
                let mut value = 0;
                encoding::fixed64::merge(wire_type, &mut value, buf, ctx)?;
                encode_key(tag, wire_type, &mut out);
                out.put_u64_le(value);
            }
            WireType::ThirtyTwoBit => {
                let mut value = 0;
                encoding::fixed32::merge(wire_type, &mut value, buf, ctx)?;
                encode_key(tag, wire_type, &mut out);
                out.put_u32_le(value);
            }
            WireType::LengthDelimited => {
                let mut value = Bytes::new();
                encoding::bytes::merge(wire_type, &mut value, buf, ctx)?;
                encode_key(tag, wire_type, &mut out);
                encode_varint(value.len() as u64, &mut out);
                out.put(value);
            }
            WireType::StartGroup | WireType::EndGroup => {
                encoding::skip_field(wire_type, tag, buf, ctx)?;
            }
        }
        self.0 = out.freeze();
        Ok(())
    }

    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0 = Bytes::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::v1::AllocateResponse;
    use crate::v1beta1::{CdiDevice, DeviceSpec, Mount};

    fn answer() -> ContainerAllocateResponse {
        ContainerAllocateResponse {
            envs: [("A".to_owned(), "1".to_owned())].into(),
            mounts: vec![Mount {
                container_path: "/m".into(),
                host_path: "/h".into(),
                read_only: true,
            }],
            devices: vec![DeviceSpec {
                container_path: "/dev/d0".into(),
                host_path: "/dev/d0".into(),
                permissions: "rw".into(),
            }],
            annotations: [("k".to_owned(), "v".to_owned())].into(),
            cdi_devices: vec![CdiDevice {
                name: "vendor.com/gpu=d0".into(),
            }],
        }
    }

    /// The admin answer as the proto file declares it: what any other client decodes.
    #[derive(Clone, PartialEq, prost::Message)]
    struct Declared {
        #[prost(string, repeated, tag = "1")]
        device_ids: Vec<String>,
        #[prost(message, optional, tag = "2")]
        response: Option<ContainerAllocateResponse>,
        #[prost(string, repeated, tag = "3")]
        cdi_names: Vec<String>,
    }

    #[test]
    fn the_bytes_are_sent_as_the_message_and_read_back_as_it() {
        let sent = AllocateResponse {
            device_ids: vec!["d0".into()],
            response: Some(EncodedAnswer::encode(&answer())),
            cdi_names: vec!["pluglet.io/r=x".into()],
        };
        let wire = sent.encode_to_vec();
        let declared = Declared::decode(wire.as_slice()).unwrap();
        assert_eq!(declared.response, Some(answer()));
        assert_eq!(declared.device_ids, ["d0"]);
        assert_eq!(declared.cdi_names, ["pluglet.io/r=x"]);
        assert_eq!(declared.encode_to_vec().len(), wire.len());

        let read = AllocateResponse::decode(wire.as_slice()).unwrap();
        assert_eq!(read, sent, "fields read in turn make the same bytes");
        assert_eq!(read.response.unwrap().decode().unwrap(), answer());
    }

    #[test]
    fn fields_of_every_wire_type_are_kept_and_a_message_given_twice_merges() {
        let mut unknown = Vec::new();
        encode_key(20, WireType::Varint, &mut unknown);
        encode_varint(300, &mut unknown);
        encode_key(21, WireType::ThirtyTwoBit, &mut unknown);
        unknown.put_u32_le(7);
        encode_key(22, WireType::SixtyFourBit, &mut unknown);
        unknown.put_u64_le(9);
        let mut body = answer().encode_to_vec();
        body.extend_from_slice(&unknown);
        let mut wire = Vec::new();
        encode_key(2, WireType::LengthDelimited, &mut wire);
        encode_varint(body.len() as u64, &mut wire);
        wire.extend_from_slice(&body);
        let read = AllocateResponse::decode(wire.as_slice()).unwrap();
        assert_eq!(read.response.as_ref().unwrap().as_bytes(), body);
        assert_eq!(read.encode_to_vec(), wire);

        // The field twice: protobuf merges the two messages (lists appended, maps joined).
        let second = ContainerAllocateResponse {
            envs: [("B".to_owned(), "2".to_owned())].into(),
            ..Default::default()
        };
        let mut twice = Declared {
            response: Some(answer()),
            ..Default::default()
        }
        .encode_to_vec();
        twice.extend(
            Declared {
                response: Some(second),
                ..Default::default()
            }
            .encode_to_vec(),
        );
        let merged = AllocateResponse::decode(twice.as_slice())
            .unwrap()
            .response
            .unwrap()
            .decode()
            .unwrap();
        assert_eq!(
            merged,
            Declared::decode(twice.as_slice())
                .unwrap()
                .response
                .unwrap()
        );
        assert_eq!(merged.envs.len(), 2);
    }

    #[test]
    fn a_field_cut_short_is_refused() {
        let mut wire = Vec::new();
        encode_key(2, WireType::LengthDelimited, &mut wire);
        encode_varint(6, &mut wire);
        encode_key(3, WireType::LengthDelimited, &mut wire);
        encode_varint(10, &mut wire);
        wire.extend_from_slice(b"/dev");
        assert!(AllocateResponse::decode(wire.as_slice()).is_err());
        assert!(
            Declared::decode(wire.as_slice()).is_err(),
            "refused as the message is"
        );
    }
}
