//! [`Channel::unary`]: one unary gRPC call on the `h2` connection, without tonic's client.
//!
//! Why by hand: tonic's generic client (`tonic::client::Grpc::unary`) makes a unary call a
//! stream of one. It boxes the request as a body of an encoding stream, merges and sanitizes
//! metadata, and reads the answer through its streaming decoder (a buffer and a state machine
//! per call) before it looks at the trailers. For the device plugin's Allocate, which every
//! allocation calls, that machinery cost about 5,500 instructions per call (docs/performance.md,
//! "Connections"). A unary call whose message the caller
//! encodes itself needs none of it: the request is one DATA frame written with its HEADERS,
//! and the answer's one message is most often one DATA frame, returned as a slice of it.
//!
//! What it keeps of tonic's client, so that callers see the same outcomes:
//! - the request's headers (`content-type: application/grpc`, `te: trailers`);
//! - the status from the trailers, or from the answer's headers when the peer answers with
//!   headers only (grpc-go's way for errors), read by [`Status::from_header_map`];
//! - an HTTP status other than 200 without a `grpc-status` mapped as gRPC's table maps it
//!   (404 to `UNIMPLEMENTED`, 503 to `UNAVAILABLE`, …);
//! - a broken connection or a reset stream mapped by [`Status::from_error`];
//! - the same refusals: a compressed message (none was asked for), a message over
//!   [`MAX_UNARY_MESSAGE`](crate::MAX_UNARY_MESSAGE), an answer without a message, a message
//!   cut short.
//!
//! A second message in an answer is ignored, as tonic's unary client ignores it.

use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_TYPE, HeaderValue, TE};
use http::uri::PathAndQuery;
use http_body_util::BodyExt as _;
use tonic::{Code, Status};

use crate::channel::on_localhost;
use crate::message::{Message, framed, missing_message};
use crate::{Channel, ResponseBody};

/// The header (or trailer) that carries a call's status code.
pub(crate) const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");

impl Channel {
    /// Calls the unary method `path` with the message `encode` writes, and returns the answer's
    /// message (its protobuf bytes) or the call's status. See the module doc for what is
    /// checked.
    ///
    /// A connection that cannot take the call is `UNAVAILABLE`.
    pub async fn unary(
        &self,
        path: PathAndQuery,
        encode: impl FnOnce(&mut BytesMut),
    ) -> Result<Bytes, Status> {
        let body = framed(encode)?;

        let mut sender = self.sender.clone();
        std::future::poll_fn(|cx| sender.poll_ready(cx))
            .await
            .map_err(|e| Status::unavailable(format!("the connection to the peer failed: {e}")))?;
        let (response, mut stream) = sender
            .send_request(request(path), false)
            .map_err(transport)?;
        // Handed to h2 before its connection task writes the HEADERS: both go in one write.
        stream.send_data(body, true).map_err(transport)?;
        let (head, answer) = response.await.map_err(transport)?.into_parts();

        if let Some(status) = grpc_status(&head.headers) {
            // Headers only: the call's status came with them.
            return Err(status.err().unwrap_or_else(missing_message));
        }
        if head.status != http::StatusCode::OK {
            return Err(from_http_status(head.status));
        }

        let mut message = Message::default();
        let mut trailers = None;
        let mut answer = ResponseBody::new(answer);
        while let Some(frame) = answer.frame().await {
            match frame.map_err(transport)?.into_data() {
                Ok(data) => message.read(data)?,
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        }
        match trailers.as_ref().and_then(grpc_status) {
            Some(Ok(())) => message.done(),
            Some(Err(status)) => Err(status),
            None => Err(Status::internal(
                "the peer ended the call without a grpc-status",
            )),
        }
    }
}

/// The request's head: POST `path` with gRPC's headers.
fn request(path: PathAndQuery) -> http::Request<()> {
    let mut parts = http::uri::Parts::default();
    parts.path_and_query = Some(path);
    let mut headers = http::HeaderMap::with_capacity(2);
    headers.insert(TE, HeaderValue::from_static("trailers"));
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    let mut request = http::Request::new(());
    *request.method_mut() = http::Method::POST;
    *request.headers_mut() = headers;
    if let Some(uri) = on_localhost(parts) {
        *request.uri_mut() = uri;
    }
    request
}

/// The call's status in `headers` (trailers, or the headers of an answer without a body):
/// `None` without `grpc-status`. `0`, the usual one, is read without building a status.
fn grpc_status(headers: &http::HeaderMap) -> Option<Result<(), Status>> {
    let code = headers.get(GRPC_STATUS)?;
    if code.as_bytes() == b"0" {
        return Some(Ok(()));
    }
    match Status::from_header_map(headers) {
        Some(status) if status.code() == Code::Ok => Some(Ok(())),
        Some(status) => Some(Err(status)),
        None => Some(Err(Status::unknown("the peer's grpc-status is unreadable"))),
    }
}

/// A transport error (broken connection, reset stream) as tonic's client maps it.
fn transport(error: h2::Error) -> Status {
    Status::from_error(Box::new(error))
}

/// The status of an answer whose HTTP status is not 200 and that carries no `grpc-status`, as
/// gRPC's HTTP-to-gRPC status table maps it.
fn from_http_status(status: http::StatusCode) -> Status {
    use http::StatusCode as S;
    let code = match status {
        S::BAD_REQUEST => Code::Internal,
        S::UNAUTHORIZED => Code::Unauthenticated,
        S::FORBIDDEN => Code::PermissionDenied,
        S::NOT_FOUND => Code::Unimplemented,
        S::TOO_MANY_REQUESTS | S::BAD_GATEWAY | S::SERVICE_UNAVAILABLE | S::GATEWAY_TIMEOUT => {
            Code::Unavailable
        }
        _ => Code::Unknown,
    };
    Status::new(code, format!("the peer answered HTTP status {status}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_statuses_map_as_grpc_says() {
        assert_eq!(
            from_http_status(http::StatusCode::NOT_FOUND).code(),
            Code::Unimplemented
        );
        assert_eq!(
            from_http_status(http::StatusCode::SERVICE_UNAVAILABLE).code(),
            Code::Unavailable
        );
        assert_eq!(
            from_http_status(http::StatusCode::IM_A_TEAPOT).code(),
            Code::Unknown
        );
    }
}
