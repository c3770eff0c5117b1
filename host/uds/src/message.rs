//! The gRPC message framing on both sides of a unary call: a message is a flag byte (0: not
//! compressed) and a big-endian 32-bit length before its bytes, carried in one or more DATA
//! frames.

use bytes::{Buf as _, BufMut as _, Bytes, BytesMut};
use tonic::Status;

/// The largest message a unary call or route reads (4 MiB, tonic's default).
pub const MAX_UNARY_MESSAGE: usize = 4 << 20;

/// The gRPC message prefix: a compression flag and a big-endian length.
pub(crate) const PREFIX: usize = 5;

/// The message `encode` writes, framed.
pub(crate) fn framed(encode: impl FnOnce(&mut BytesMut)) -> Result<Bytes, Status> {
    let mut body = BytesMut::with_capacity(PREFIX + 128);
    body.put_bytes(0, PREFIX);
    encode(&mut body);
    let len = u32::try_from(body.len() - PREFIX)
        .map_err(|_| Status::internal("the message is larger than 4 GiB"))?;
    body[1..PREFIX].copy_from_slice(&len.to_be_bytes());
    Ok(body.freeze())
}

/// The status of a call whose answer (or request) carried no message.
pub(crate) fn missing_message() -> Status {
    Status::internal("Missing response message.")
}

/// The first message of a request or an answer, as its DATA frames bring it.
#[derive(Debug, Default)]
pub(crate) struct Message {
    /// What has come so far when the message spans frames (prefix included).
    pending: BytesMut,
    /// The whole message, once read.
    whole: Option<Bytes>,
}

impl Message {
    /// Takes one DATA frame.
    pub(crate) fn read(&mut self, data: Bytes) -> Result<(), Status> {
        if self.whole.is_some() {
            return Ok(());
        }
        if self.pending.is_empty() {
            // The usual case: the whole message in one frame, kept as a slice of it.
            if let Some(len) = whole_len(&data)?
                && data.len() >= PREFIX + len
            {
                self.whole = Some(data.slice(PREFIX..PREFIX + len));
                return Ok(());
            }
        }
        self.pending.extend_from_slice(&data);
        if let Some(len) = whole_len(&self.pending)?
            && self.pending.len() >= PREFIX + len
        {
            self.pending.advance(PREFIX);
            self.whole = Some(self.pending.split_to(len).freeze());
            self.pending = BytesMut::new();
        }
        Ok(())
    }

    /// The message, once the data has ended.
    pub(crate) fn done(self) -> Result<Bytes, Status> {
        match self.whole {
            Some(message) => Ok(message),
            None if self.pending.is_empty() => Err(missing_message()),
            None => Err(Status::internal("Unexpected EOF decoding stream.")),
        }
    }
}

/// The length of the message whose prefix starts `data`, once the prefix is there; refuses a
/// compressed message and one over [`MAX_UNARY_MESSAGE`].
fn whole_len(data: &[u8]) -> Result<Option<usize>, Status> {
    let Some(prefix) = data.get(..PREFIX) else {
        return Ok(None);
    };
    match prefix[0] {
        0 => {}
        1 => {
            return Err(Status::internal(
                "protocol error: received message with compressed-flag but no grpc-encoding was specified",
            ));
        }
        flag => {
            return Err(Status::internal(format!(
                "protocol error: received message with invalid compression flag: {flag} (valid flags are 0 and 1)"
            )));
        }
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if len > MAX_UNARY_MESSAGE {
        return Err(Status::out_of_range(format!(
            "Error, decoded message length too large: found {len} bytes, the limit is: {MAX_UNARY_MESSAGE} bytes"
        )));
    }
    Ok(Some(len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn framed(message: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    #[test]
    fn a_message_in_one_frame_is_a_slice_of_it() {
        let mut message = Message::default();
        let data = Bytes::from(framed(b"hello"));
        message.read(data.clone()).unwrap();
        let whole = message.done().unwrap();
        assert_eq!(&whole[..], b"hello");
        assert_eq!(whole.as_ptr(), data[PREFIX..].as_ptr(), "not copied");
    }

    #[test]
    fn a_message_split_anywhere_is_joined() {
        let whole = framed(b"a message split over frames");
        for cut in 1..whole.len() {
            let mut message = Message::default();
            message.read(Bytes::copy_from_slice(&whole[..cut])).unwrap();
            message.read(Bytes::copy_from_slice(&whole[cut..])).unwrap();
            assert_eq!(&message.done().unwrap()[..], b"a message split over frames");
        }
    }

    #[test]
    fn a_second_message_is_ignored() {
        let mut message = Message::default();
        let mut two = framed(b"first");
        two.extend(framed(b"second"));
        message.read(Bytes::from(two)).unwrap();
        message.read(Bytes::from(framed(b"third"))).unwrap();
        assert_eq!(&message.done().unwrap()[..], b"first");
    }

    #[test]
    fn an_empty_message_is_a_message() {
        let mut message = Message::default();
        message.read(Bytes::from(framed(b""))).unwrap();
        assert_eq!(message.done().unwrap().len(), 0);
    }

    #[test]
    fn no_message_and_a_cut_message_are_refused() {
        assert_eq!(
            Message::default().done().unwrap_err().message(),
            "Missing response message."
        );
        let mut message = Message::default();
        message
            .read(Bytes::from(framed(b"cut")[..6].to_vec()))
            .unwrap();
        let error = message.done().unwrap_err();
        assert_eq!(error.code(), Code::Internal);
        assert_eq!(error.message(), "Unexpected EOF decoding stream.");
    }

    #[test]
    fn compressed_and_oversized_messages_are_refused() {
        let mut compressed = framed(b"x");
        compressed[0] = 1;
        let error = Message::default()
            .read(Bytes::from(compressed))
            .unwrap_err();
        assert_eq!(error.code(), Code::Internal);
        assert!(error.message().contains("compressed-flag"), "{error}");

        let mut oversized = vec![0];
        oversized.extend_from_slice(&(MAX_UNARY_MESSAGE as u32 + 1).to_be_bytes());
        let error = Message::default().read(Bytes::from(oversized)).unwrap_err();
        assert_eq!(error.code(), Code::OutOfRange);
    }
}
