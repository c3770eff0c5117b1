//! [`Routes`]: a few unary methods answered without tonic's server, in front of a
//! tonic-generated server that answers the rest.
//!
//! Why: tonic's generated server runs a unary method as a stream of one. It decodes the request
//! through its streaming decoder, wraps the answer in an encoding stream, and writes its status
//! through `MetadataMap`. On the admin API's Allocate and Release, which every allocation calls,
//! that is several thousand instructions per call (docs/performance.md, "Connections"). A route
//! here reads the request's one message (most often a slice of one DATA frame), calls the same
//! method of the same service, and answers with one DATA frame and `grpc-status: 0`, or with
//! headers only for an error, as tonic does.
//!
//! What a route keeps of tonic's server: requests with a `grpc-encoding` other than `identity`
//! are `UNIMPLEMENTED`; a compressed message, one over
//! [`MAX_UNARY_MESSAGE`](crate::MAX_UNARY_MESSAGE), a request without a message or with one
//! that does not decode are `INTERNAL`; a status is written by [`Status::into_http`]. Metadata
//! and extensions do not reach the method: register a route only for methods that read neither.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http_body::{Body, Frame};
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use tonic::Status;

use crate::GrpcServer;
use crate::message::{Message, framed};
use crate::unary::GRPC_STATUS;

/// What a route runs on a request's message: the answer's message, encoded, or the status.
type Handler =
    Arc<dyn Fn(Bytes) -> Pin<Box<dyn Future<Output = Result<Bytes, Status>> + Send>> + Send + Sync>;

/// A boxed answer future.
type Answering =
    Pin<Box<dyn Future<Output = Result<http::Response<tonic::body::Body>, Infallible>> + Send>>;

/// A tonic-generated server with some of its unary methods answered by routes of their own
/// ([`Routes::unary`]); hand it to [`crate::serve`]. Cheap to clone.
#[derive(Clone)]
pub struct Routes<S> {
    server: S,
    /// Each route's path and handler (a few: found by comparing paths).
    routes: Arc<Vec<(&'static str, Handler)>>,
}

impl<S> Routes<S> {
    /// `server` (a tonic-generated server) answering every method.
    pub fn new(server: S) -> Routes<S> {
        Routes {
            server,
            routes: Arc::default(),
        }
    }

    /// Answers the unary method at `path` (`/package.Service/Method`) with `method`, which
    /// should be the one the server would call. See the module doc for what the route checks.
    pub fn unary<Req, Resp, F, Fut>(mut self, path: &'static str, method: F) -> Routes<S>
    where
        Req: prost::Message + Default + 'static,
        Resp: prost::Message + 'static,
        F: Fn(Req) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Resp, Status>> + Send + 'static,
    {
        // The method's future is made inside the boxed one, where it is awaited: made outside,
        // it would be copied whole into the box and again into its slot there.
        let method = Arc::new(method);
        let handler: Handler = Arc::new(move |message: Bytes| {
            let method = Arc::clone(&method);
            Box::pin(async move {
                let request = Req::decode(message).map_err(|error| {
                    Status::internal(format!("failed to decode Protobuf message: {error}"))
                })?;
                let answer = method(request).await?;
                framed(|buf| answer.encode_raw(buf))
            })
        });
        let routes = Arc::make_mut(&mut self.routes);
        routes.retain(|(taken, _)| *taken != path);
        routes.push((path, handler));
        self
    }
}

impl<S: GrpcServer> tower::Service<http::Request<Incoming>> for Routes<S> {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Answering;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.server.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Incoming>) -> Answering {
        let path = request.uri().path();
        match self.routes.iter().find(|(route, _)| *route == path) {
            Some((_, handler)) => Box::pin(answer(Arc::clone(handler), request)),
            None => Box::pin(self.server.call(request)),
        }
    }
}

/// The header that names a request's compression. A constant: a name given as a string is
/// parsed again on every lookup.
const GRPC_ENCODING: http::HeaderName = http::HeaderName::from_static("grpc-encoding");

/// Runs `handler` on the request's message and writes its answer.
async fn answer(
    handler: Handler,
    request: http::Request<Incoming>,
) -> Result<http::Response<tonic::body::Body>, Infallible> {
    let outcome = async {
        if let Some(encoding) = request.headers().get(GRPC_ENCODING)
            && encoding.as_bytes() != b"identity"
        {
            return Err(Status::unimplemented(format!(
                "Content is compressed with `{}` which isn't supported",
                String::from_utf8_lossy(encoding.as_bytes())
            )));
        }
        let mut body = request.into_body();
        let mut message = Message::default();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|error| Status::from_error(Box::new(error)))?;
            if let Ok(data) = frame.into_data() {
                message.read(data)?;
            }
        }
        handler(message.done()?).await
    };
    Ok(match outcome.await {
        Ok(message) => {
            let mut response = http::Response::new(tonic::body::Body::new(Unary {
                message: Some(message),
                trailers: true,
            }));
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
            response
        }
        Err(status) => status.into_http(),
    })
}

/// An answer's body: its one message, then `grpc-status: 0`. Its size is not given as a hint,
/// as tonic's is not: hyper would turn an exact one into a `content-length` header.
struct Unary {
    message: Option<Bytes>,
    trailers: bool,
}

impl Body for Unary {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(message) = self.message.take() {
            return Poll::Ready(Some(Ok(Frame::data(message))));
        }
        if std::mem::take(&mut self.trailers) {
            let mut trailers = http::HeaderMap::with_capacity(1);
            trailers.insert(GRPC_STATUS, HeaderValue::from_static("0"));
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.message.is_none() && !self.trailers
    }
}
