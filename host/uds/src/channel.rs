//! [`Channel`]: the gRPC client side of one HTTP/2 connection, on the `h2` crate directly.
//!
//! Why not hyper's HTTP/2 client (which Pluglet used before): for a request with a body, hyper
//! sends the HEADERS frame, then waits for stream send capacity (which HTTP/2 only assigns once
//! the HEADERS are out) in a task of its own, and sends the DATA frame from there. A unary gRPC
//! call, whose whole body is ready at once, then costs two socket writes (the peer wakes up for
//! each) and often a hop to another thread between them; a syscall trace of the daemon showed
//! the DATA frame leaving 30–180 µs after the HEADERS. Here the body's frames that are ready
//! are handed to `h2` right after the HEADERS (`h2` buffers them until the stream has
//! capacity), so the connection task writes HEADERS and DATA in one write, unless it runs on
//! another thread at that very moment. Nothing else of hyper's client is needed: no pooling, no
//! redialing, no HTTP/1.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::BodyExt as _;

/// A gRPC client connection on one unix socket, made by [`crate::connect`]; give it to any
/// tonic-generated client (`FooClient::new(channel)`). Cheap to clone: clones share the
/// connection.
///
/// Requests go straight to the HTTP/2 connection. (tonic's own `Channel` queues every request
/// through a buffer task first: one thread hop more per RPC, a sixth of an Allocate's time on a
/// two-core node.)
#[derive(Clone, Debug)]
pub struct Channel {
    pub(crate) sender: h2::client::SendRequest<Bytes>,
}

impl Channel {
    pub(crate) fn new(sender: h2::client::SendRequest<Bytes>) -> Channel {
        Channel { sender }
    }
}

impl tower::Service<http::Request<tonic::body::Body>> for Channel {
    type Response = http::Response<ResponseBody>;
    type Error = h2::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, h2::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), h2::Error>> {
        self.sender.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let mut sender = self.sender.clone();
        Box::pin(async move {
            let (mut head, body) = request.into_parts();
            // tonic sends the bare path; HTTP/2 wants :scheme and :authority too.
            if let Some(uri) = on_localhost(std::mem::take(&mut head.uri).into_parts()) {
                head.uri = uri;
            }
            // A clone may not have been polled ready: wait for room for one more stream.
            std::future::poll_fn(|cx| sender.poll_ready(cx)).await?;
            let end = body.is_end_stream();
            let (response, stream) =
                sender.send_request(http::Request::from_parts(head, ()), end)?;
            if !end {
                // What of the body is ready goes now, before the connection task writes: all of
                // a unary body. A body still streaming goes on in a task of its own.
                let mut rest = Box::pin(send_body(body, stream));
                let now = std::future::poll_fn(|cx| Poll::Ready(rest.as_mut().poll(cx))).await;
                match now {
                    Poll::Ready(result) => log_unsent(result),
                    Poll::Pending => {
                        tokio::spawn(async move { log_unsent(rest.await) });
                    }
                }
            }
            Ok(response.await?.map(ResponseBody::new))
        })
    }
}

/// The URI of `parts` with `http` as its scheme and `localhost` as its authority (what every
/// request on a [`Channel`] carries); `None` when `parts` has no path.
pub(crate) fn on_localhost(mut parts: http::uri::Parts) -> Option<http::Uri> {
    parts.scheme = Some(http::uri::Scheme::HTTP);
    parts.authority = Some(http::uri::Authority::from_static("localhost"));
    http::Uri::from_parts(parts).ok()
}

/// A body that could not be sent in full shows in the response (the peer resets the stream or
/// answers with an error); this only says so at debug level.
fn log_unsent(result: Result<(), h2::Error>) {
    if let Err(error) = result {
        tracing::debug!(%error, "the request body was not sent in full");
    }
}

/// Sends every frame of `body` on `stream`, the last one marked as the end of the stream. A
/// data frame is held until the body says what comes next when that is known at once, so that
/// a unary body goes as one DATA frame that ends the stream.
async fn send_body(
    mut body: tonic::body::Body,
    mut stream: h2::SendStream<Bytes>,
) -> Result<(), h2::Error> {
    let mut next = body.frame().await;
    loop {
        let frame = match next {
            None => return stream.send_data(Bytes::new(), true),
            Some(Ok(frame)) => frame,
            Some(Err(status)) => {
                tracing::debug!(%status, "the request body failed; resetting the stream");
                stream.send_reset(h2::Reason::CANCEL);
                return Ok(());
            }
        };
        let data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    return stream.send_trailers(trailers);
                }
                next = body.frame().await;
                continue;
            }
        };
        if body.is_end_stream() {
            return stream.send_data(data, true);
        }
        let peeked =
            std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await;
        match peeked {
            Poll::Ready(None) => return stream.send_data(data, true),
            Poll::Ready(Some(frame)) => {
                stream.send_data(data, false)?;
                next = Some(frame);
            }
            Poll::Pending => {
                stream.send_data(data, false)?;
                next = body.frame().await;
            }
        }
    }
}

/// The body of a response: its DATA frames (their flow-control window given back as each is
/// read), then its trailers (where gRPC puts the call's status).
#[derive(Debug)]
pub struct ResponseBody {
    stream: h2::RecvStream,
    data_done: bool,
}

impl ResponseBody {
    pub(crate) fn new(stream: h2::RecvStream) -> ResponseBody {
        ResponseBody {
            stream,
            data_done: false,
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        if !self.data_done {
            match ready!(self.stream.poll_data(cx)) {
                Some(Ok(data)) => {
                    // Read: the peer may send that much more.
                    let _ = self.stream.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(error)) => return Poll::Ready(Some(Err(error))),
                None => self.data_done = true,
            }
        }
        match ready!(self.stream.poll_trailers(cx)) {
            Ok(Some(trailers)) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Ok(None) => Poll::Ready(None),
            Err(error) => Poll::Ready(Some(Err(error))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.stream.is_end_stream()
    }
}
