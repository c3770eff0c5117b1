//! A plugin's Allocate answer for one container: read off the wire as the bytes it came in
//! ([`ContainerAnswers::read`]), read in place ([`AnswerView`]), and kept in the state as
//! those bytes ([`PluginAnswer`]).
//!
//! The state keeps the answer's protobuf bytes, not a decoded message. The bytes are what the
//! journal record and the checkpoint carry (the kubelet's `AllocResp`) and what the admin API
//! sends whoever asked for the allocation, so keeping them costs neither a copy of every string
//! in the answer (an allocation of 1,024 devices answers thousands) nor an encoding when its
//! record is written: they are the plugin's own, copied out of the message at their size. What
//! the device manager reads of an answer (its CDI spec's edits, the plugin's own CDI names) it
//! reads through a view whose strings borrow those bytes; what listings read is kept beside
//! the bytes.

mod view;

use std::sync::Arc;

use bytes::{BufMut, Bytes};
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
use tonic::Status;

use crate::device_id::DeviceId;
use pluglet_proto::v1beta1::ContainerAllocateResponse;
pub use view::{AnswerDevice, AnswerMount, AnswerView, ViewError};

/// What Allocate answered for one container, as the bytes it came in; [`ReadAnswer::view`]
/// reads them.
#[derive(Debug)]
pub(crate) struct ReadAnswer {
    /// The answer's protobuf bytes as the plugin sent them.
    pub encoded: Bytes,
}

impl ReadAnswer {
    /// The answer, read in place; a status naming what is wrong when it does not decode.
    pub fn view(&self) -> Result<AnswerView<'_>, Status> {
        AnswerView::read(&self.encoded).map_err(undecodable)
    }

    /// The answer as the state keeps it; `view` is [`ReadAnswer::view`].
    pub fn kept(&self, view: &AnswerView<'_>) -> PluginAnswer {
        PluginAnswer::with_encoding(view, self.encoded.clone())
    }
}

/// `AllocateResponse` with its container answers left as bytes: a `bytes` field has the wire
/// form of a message field. Each is copied out at its own size, so what the state keeps does
/// not hold on to the connection's read buffer.
#[derive(Clone, PartialEq, prost::Message)]
struct AllocateResponseBytes {
    #[prost(bytes = "vec", repeated, tag = "1")]
    container_responses: Vec<Vec<u8>>,
}

/// The devices of an Allocate request for one container, encoded from the ids the allocation
/// shares with its holding (the generated request would need a copy of each as a `String`).
#[derive(Clone, Debug)]
pub(crate) struct AllocateIds(pub Arc<[DeviceId]>);

impl AllocateIds {
    /// The length of the encoded `ContainerAllocateRequest { devices_ids }`.
    fn encoded_len(&self) -> usize {
        // Field 1: each id a length-delimited string.
        self.0
            .iter()
            .map(|id| {
                let len = id.as_str().len();
                key_len(1) + encoded_len_varint(len as u64) + len
            })
            .sum()
    }

    /// Encodes this container as field 1 of `AllocateRequest`.
    fn encode(&self, buf: &mut impl BufMut) {
        encode_key(1, WireType::LengthDelimited, buf);
        encode_varint(self.encoded_len() as u64, buf);
        for id in self.0.iter() {
            encode_key(1, WireType::LengthDelimited, buf);
            encode_varint(id.as_str().len() as u64, buf);
            buf.put_slice(id.as_str().as_bytes());
        }
    }
}

/// An Allocate request: one `ContainerAllocateRequest` per allocation, in order (a lone
/// allocation's without a list of its own: this is made per allocation).
#[derive(Clone, Debug)]
pub(crate) enum AllocateRequestIds {
    /// One container.
    One(AllocateIds),
    /// Several, in order.
    Several(Vec<AllocateIds>),
}

impl AllocateRequestIds {
    /// Encodes `AllocateRequest { container_requests: [{ devices_ids }, ...] }`.
    pub fn encode(&self, buf: &mut impl BufMut) {
        match self {
            AllocateRequestIds::One(container) => container.encode(buf),
            AllocateRequestIds::Several(containers) => {
                for container in containers {
                    container.encode(buf);
                }
            }
        }
    }
}

/// The container answers of an Allocate call, in the plugin's order, each as its bytes.
#[derive(Debug, Default)]
pub(crate) struct ContainerAnswers(Vec<Vec<u8>>);

impl ContainerAnswers {
    /// The container answers of an `AllocateResponse` message, each as its bytes (read by
    /// [`ReadAnswer::view`]); a status naming what is wrong when it does not decode.
    pub fn read(message: Bytes) -> Result<ContainerAnswers, Status> {
        let message = AllocateResponseBytes::decode(message).map_err(undecodable)?;
        Ok(ContainerAnswers(message.container_responses))
    }

    /// How many containers were answered.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The first container's answer (`None`: none was answered).
    pub fn first(self) -> Option<ReadAnswer> {
        self.into_iter().next()
    }
}

impl IntoIterator for ContainerAnswers {
    type Item = ReadAnswer;
    type IntoIter = std::iter::Map<std::vec::IntoIter<Vec<u8>>, fn(Vec<u8>) -> ReadAnswer>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter().map(|encoded| ReadAnswer {
            encoded: encoded.into(),
        })
    }
}

/// The status of an Allocate answer that does not decode, whichever part of it failed.
fn undecodable(error: impl std::fmt::Display) -> Status {
    Status::internal(format!("the Allocate answer does not decode: {error}"))
}

/// A plugin's Allocate answer for one container: its protobuf bytes and what listings read of
/// it. Cheap to clone (the bytes are shared).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginAnswer {
    encoded: Bytes,
    cdi_devices: Vec<String>,
    has_edits: bool,
}

impl PluginAnswer {
    /// The answer `view` reads, whose protobuf encoding is `encoded`.
    pub fn with_encoding(view: &AnswerView<'_>, encoded: Bytes) -> PluginAnswer {
        PluginAnswer {
            encoded,
            cdi_devices: crate::cdi::passed_through(view),
            has_edits: view.has_edits(),
        }
    }

    /// `response`, encoded here.
    pub fn of(response: &ContainerAllocateResponse) -> PluginAnswer {
        PluginAnswer::with_encoding(&AnswerView::of(response), response.encode_to_vec().into())
    }

    /// An answer read back from its protobuf bytes (a checkpoint's `AllocResp`).
    pub fn decode(encoded: Bytes) -> Result<PluginAnswer, ViewError> {
        let view = AnswerView::read(&encoded)?;
        Ok(PluginAnswer::with_encoding(&view, encoded.clone()))
    }

    /// The answer, read in place. Its bytes were read when it was made, or were encoded from a
    /// message, so they read again; the empty answer stands in should they not.
    pub fn view(&self) -> AnswerView<'_> {
        AnswerView::read(&self.encoded).unwrap_or_default()
    }

    /// The answer, decoded. Its bytes decoded when it was made, or were encoded from a message,
    /// so they decode again; the empty answer stands in should they not.
    pub fn response(&self) -> ContainerAllocateResponse {
        ContainerAllocateResponse::decode(self.encoded.clone()).unwrap_or_default()
    }

    /// The protobuf bytes.
    pub fn encoded(&self) -> &[u8] {
        &self.encoded
    }

    /// The protobuf bytes, shared.
    pub fn bytes(&self) -> Bytes {
        self.encoded.clone()
    }

    /// The plugin's own CDI device names (`cdi_devices`), in its order.
    pub fn cdi_devices(&self) -> &[String] {
        &self.cdi_devices
    }

    /// Whether the answer has envs, device specs or mounts: something a runtime applies.
    pub fn has_edits(&self) -> bool {
        self.has_edits
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pluglet_proto::v1beta1::{CdiDevice, DeviceSpec};

    #[test]
    fn an_answer_keeps_its_bytes_and_what_listings_read() {
        let response = ContainerAllocateResponse {
            devices: vec![DeviceSpec {
                container_path: "/dev/d0".into(),
                host_path: "/dev/d0".into(),
                permissions: "rw".into(),
            }],
            cdi_devices: vec![CdiDevice {
                name: "vendor.com/gpu=d0".into(),
            }],
            ..Default::default()
        };
        let answer = PluginAnswer::of(&response);
        assert_eq!(answer.response(), response);
        assert_eq!(answer.encoded(), response.encode_to_vec());
        assert_eq!(answer.cdi_devices(), ["vendor.com/gpu=d0"]);
        assert!(answer.has_edits());
        assert_eq!(
            PluginAnswer::decode(Bytes::copy_from_slice(answer.encoded())).unwrap(),
            answer
        );

        let names_only = PluginAnswer::of(&ContainerAllocateResponse {
            cdi_devices: response.cdi_devices.clone(),
            ..Default::default()
        });
        assert!(!names_only.has_edits());
        assert!(PluginAnswer::decode(Bytes::from_static(&[0x0a, 0x05, 0x01])).is_err());
    }

    #[test]
    fn the_request_is_encoded_as_the_generated_message_is() {
        use pluglet_proto::v1beta1::{AllocateRequest, ContainerAllocateRequest};
        let lists: [Vec<String>; 3] = [
            vec![],
            vec!["d0".to_owned()],
            (0..300).map(|i| format!("dev-{i}")).collect(),
        ];
        let ours = |containers: &[Vec<String>]| {
            let mut buf = Vec::new();
            let mut each = containers
                .iter()
                .map(|ids| AllocateIds(DeviceId::from_wire(ids.clone()).into()));
            let request = if containers.len() == 1 {
                AllocateRequestIds::One(each.next().unwrap())
            } else {
                AllocateRequestIds::Several(each.collect())
            };
            request.encode(&mut buf);
            buf
        };
        let generated = |containers: &[Vec<String>]| {
            AllocateRequest {
                container_requests: containers
                    .iter()
                    .map(|ids| ContainerAllocateRequest {
                        devices_ids: ids.clone(),
                    })
                    .collect(),
            }
            .encode_to_vec()
        };
        for ids in &lists {
            let one = std::slice::from_ref(ids);
            assert_eq!(ours(one), generated(one));
        }
        assert_eq!(ours(&lists), generated(&lists), "several containers");
    }

    #[test]
    fn each_container_answer_is_read_with_the_bytes_it_came_in() {
        let first = ContainerAllocateResponse {
            envs: [("E".to_owned(), "1".to_owned())].into(),
            ..Default::default()
        };
        let second = ContainerAllocateResponse {
            envs: [("E".to_owned(), "2".to_owned())].into(),
            ..Default::default()
        };
        let message = pluglet_proto::v1beta1::AllocateResponse {
            container_responses: vec![first.clone(), second.clone()],
        }
        .encode_to_vec();
        let read = |message: &[u8]| ContainerAnswers::read(Bytes::copy_from_slice(message));
        let answers = read(message.as_slice()).unwrap();
        assert_eq!(answers.len(), 2);
        let answers: Vec<ReadAnswer> = answers.into_iter().collect();
        assert_eq!(answers[0].encoded, first.encode_to_vec());
        assert_eq!(answers[1].encoded, second.encode_to_vec());
        let view = answers[0].view().unwrap();
        assert_eq!(view, AnswerView::of(&first));
        assert_eq!(answers[0].kept(&view), PluginAnswer::of(&first));

        // A field the message does not define (from a newer plugin) is skipped.
        let mut newer = vec![0x12, 0x02, b'h', b'i'];
        newer.extend_from_slice(&message);
        assert_eq!(
            read(newer.as_slice()).unwrap().first().unwrap().encoded,
            first.encode_to_vec()
        );

        let none = pluglet_proto::v1beta1::AllocateResponse::default().encode_to_vec();
        assert!(
            read(none.as_slice()).unwrap().first().is_none(),
            "no container answered"
        );
        assert!(read(&[0x0a, 0x05, 0x01][..]).is_err(), "cut short");
        let cut = read(&[0x0a, 0x02, 0x0a, 0x07][..])
            .unwrap()
            .first()
            .unwrap();
        let refused = cut.view().unwrap_err();
        assert!(
            refused.message().contains("does not decode"),
            "the container answer itself cut short: {refused}"
        );
    }
}
