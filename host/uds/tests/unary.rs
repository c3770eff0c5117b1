//! Unary calls without tonic on real unix sockets: `Channel::unary` against a tonic server served
//! by `pluglet_uds::serve` and against a hand-driven `h2` server (for the answers a tonic server
//! does not give: a message split over frames, an HTTP error status, a reset stream, no
//! trailers); `Routes` answering a method in front of a tonic server, called by tonic's client
//! and by `Channel::unary`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{BufMut as _, Bytes};
use http::uri::PathAndQuery;
use pluglet_proto::v1beta1::registration_client::RegistrationClient;
use pluglet_proto::v1beta1::registration_server::{Registration, RegistrationServer};
use pluglet_proto::v1beta1::{Empty, RegisterRequest};
use pluglet_uds::{Channel, Routes, bind, connect, incoming, serve};
use prost::Message as _;
use tonic::Code;

const DEADLINE: Duration = Duration::from_secs(10);
const REGISTER: &str = "/v1beta1.Registration/Register";

/// Accepts every resource but `refused.com/x`, which it refuses as a plugin would.
struct Refuser;

#[tonic::async_trait]
impl Registration for Refuser {
    async fn register(
        &self,
        request: tonic::Request<RegisterRequest>,
    ) -> Result<tonic::Response<Empty>, tonic::Status> {
        if request.get_ref().resource_name == "refused.com/x" {
            return Err(tonic::Status::failed_precondition("refused: x is busy"));
        }
        Ok(tonic::Response::new(Empty {}))
    }
}

/// Register of `resource` through `Channel::unary`.
async fn register(channel: &Channel, resource: &str) -> Result<Bytes, tonic::Status> {
    channel
        .unary(PathAndQuery::from_static(REGISTER), |buf| {
            request(resource).encode(buf).unwrap()
        })
        .await
}

/// A method the Registration service does not have, through `Channel::unary`: its status.
async fn unknown_method(channel: &Channel) -> tonic::Status {
    channel
        .unary(
            PathAndQuery::from_static("/v1beta1.Registration/Nothing"),
            |_| {},
        )
        .await
        .unwrap_err()
}

/// Register sent through the channel as a raw HTTP/2 request with the framed `body` and the
/// `extra` headers; the answer.
async fn by_hand(
    mut channel: Channel,
    body: Vec<u8>,
    extra: &[(&'static str, &'static str)],
) -> http::Response<pluglet_uds::ResponseBody> {
    let mut request = http::Request::new(tonic::body::Body::new(http_body_util::Full::new(
        Bytes::from(body),
    )));
    *request.method_mut() = http::Method::POST;
    *request.uri_mut() = http::Uri::from_static(REGISTER);
    let headers = request.headers_mut();
    headers.insert(
        "content-type",
        http::HeaderValue::from_static("application/grpc"),
    );
    headers.insert("te", http::HeaderValue::from_static("trailers"));
    for (name, value) in extra {
        headers.insert(*name, http::HeaderValue::from_static(value));
    }
    tower::ServiceExt::oneshot(&mut channel, request)
        .await
        .unwrap()
}

fn request(resource: &str) -> RegisterRequest {
    RegisterRequest {
        version: "v1beta1".into(),
        endpoint: "x.sock".into(),
        resource_name: resource.into(),
        options: None,
    }
}

#[tokio::test]
async fn unary_calls_a_tonic_server_and_reads_its_statuses() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubelet.sock");
    let listener = bind(&path, Some(0o600)).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(
        incoming(listener),
        RegistrationServer::new(Refuser),
        async {
            let _ = stopped.await;
        },
    ));
    let channel = connect(&path, DEADLINE).await.unwrap();

    let answer = register(&channel, "fine.com/x").await.unwrap();
    assert_eq!(Empty::decode(answer).unwrap(), Empty {});

    let refused = register(&channel, "refused.com/x").await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert_eq!(refused.message(), "refused: x is busy");

    // tonic answers an unknown method with headers only.
    let unknown = unknown_method(&channel).await;
    assert_eq!(unknown.code(), Code::Unimplemented);

    // The connection stays usable after errors.
    register(&channel, "again.com/x").await.unwrap();
    stop.send(()).unwrap();
    drop(channel);
    server.await.unwrap();
}

/// How the hand-driven server answers a call.
#[derive(Clone, Copy, Debug)]
enum Answer {
    /// The message `ok` in two DATA frames cut inside the prefix, then `grpc-status: 0`.
    Split,
    /// HTTP 404 and no gRPC status.
    NotFound,
    /// The stream reset with `REFUSED_STREAM`.
    Reset,
    /// The message, then the end of the stream without trailers.
    NoTrailers,
    /// Only `grpc-status: 0` in the trailers: no message.
    NoMessage,
}

/// Serves one connection on a fresh socket, answering every call with `answer`; returns the
/// socket's directory (keep it) and path.
async fn h2_server(answer: Answer) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raw.sock");
    let listener = bind(&path, None).unwrap();
    tokio::spawn(async move {
        let (io, _) = listener.accept().await.unwrap();
        let mut connection = h2::server::handshake(io).await.unwrap();
        while let Some(call) = connection.accept().await {
            let (mut request, mut respond) = call.unwrap();
            // Read the whole request first, as a server does.
            while let Some(data) = request.body_mut().data().await {
                let data = data.unwrap();
                let _ = request
                    .body_mut()
                    .flow_control()
                    .release_capacity(data.len());
            }
            let ok = || {
                http::Response::builder()
                    .header("content-type", "application/grpc")
                    .body(())
                    .unwrap()
            };
            let grpc_ok = || {
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", "0".parse().unwrap());
                trailers
            };
            let mut message = bytes::BytesMut::new();
            message.put_u8(0);
            message.put_u32(2);
            message.put_slice(b"ok");
            let message = message.freeze();
            match answer {
                Answer::Split => {
                    let mut stream = respond.send_response(ok(), false).unwrap();
                    stream.send_data(message.slice(..3), false).unwrap();
                    stream.send_data(message.slice(3..), false).unwrap();
                    stream.send_trailers(grpc_ok()).unwrap();
                }
                Answer::NotFound => {
                    let response = http::Response::builder().status(404).body(()).unwrap();
                    respond.send_response(response, true).unwrap();
                }
                Answer::Reset => respond.send_reset(h2::Reason::REFUSED_STREAM),
                Answer::NoTrailers => {
                    let mut stream = respond.send_response(ok(), false).unwrap();
                    stream.send_data(message, true).unwrap();
                }
                Answer::NoMessage => {
                    let mut stream = respond.send_response(ok(), false).unwrap();
                    stream.send_trailers(grpc_ok()).unwrap();
                }
            }
        }
    });
    (dir, path)
}

async fn call(answer: Answer) -> Result<Bytes, tonic::Status> {
    let (_dir, path) = h2_server(answer).await;
    let channel = connect(&path, DEADLINE).await.unwrap();
    channel
        .unary(PathAndQuery::from_static("/test.Raw/Call"), |buf| {
            buf.put_slice(b"request")
        })
        .await
}

#[tokio::test]
async fn a_message_split_over_frames_is_read_whole() {
    assert_eq!(&call(Answer::Split).await.unwrap()[..], b"ok");
}

#[tokio::test]
async fn an_http_error_without_grpc_status_maps_to_its_grpc_code() {
    assert_eq!(
        call(Answer::NotFound).await.unwrap_err().code(),
        Code::Unimplemented
    );
}

#[tokio::test]
async fn a_reset_stream_maps_as_tonic_maps_it() {
    assert_eq!(
        call(Answer::Reset).await.unwrap_err().code(),
        Code::Unavailable
    );
}

#[tokio::test]
async fn an_answer_without_trailers_or_without_message_is_an_internal_error() {
    let error = call(Answer::NoTrailers).await.unwrap_err();
    assert_eq!(error.code(), Code::Internal);
    assert!(error.message().contains("grpc-status"), "{error}");
    let error = call(Answer::NoMessage).await.unwrap_err();
    assert_eq!(error.code(), Code::Internal);
    assert_eq!(error.message(), "Missing response message.");
}

/// Serves `Refuser` with Register answered by a route that calls it and counts its calls.
async fn routed() -> (
    tempfile::TempDir,
    std::path::PathBuf,
    Arc<AtomicUsize>,
    tokio::sync::oneshot::Sender<()>,
) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routed.sock");
    let listener = bind(&path, None).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&calls);
    let server = Routes::new(RegistrationServer::new(Refuser)).unary(
        REGISTER,
        move |request: RegisterRequest| {
            counted.fetch_add(1, Ordering::SeqCst);
            async move {
                let answer = Refuser.register(tonic::Request::new(request)).await?;
                Ok::<_, tonic::Status>(answer.into_inner())
            }
        },
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(incoming(listener), server, async {
        let _ = stopped.await;
    }));
    (dir, path, calls, stop)
}

#[tokio::test]
async fn a_route_answers_tonic_clients_as_the_generated_server_does() {
    let (_dir, path, calls, _stop) = routed().await;
    let channel = connect(&path, DEADLINE).await.unwrap();
    let mut client = RegistrationClient::new(channel.clone());
    client.register(request("fine.com/x")).await.unwrap();
    let refused = client.register(request("refused.com/x")).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert_eq!(refused.message(), "refused: x is busy");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "both answered by the route"
    );

    // And Channel::unary reads the route's answers too.
    let answer = register(&channel, "fine.com/y").await.unwrap();
    assert_eq!(Empty::decode(answer).unwrap(), Empty {});
    assert_eq!(calls.load(Ordering::SeqCst), 3);

    // The answer's headers are gRPC's, and no more.
    let mut framed = vec![0, 0, 0, 0, 0];
    let message = request("fine.com/z").encode_to_vec();
    framed[1..5].copy_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend(message);
    let answer = by_hand(channel.clone(), framed, &[]).await;
    assert_eq!(answer.status(), http::StatusCode::OK);
    assert_eq!(answer.headers()["content-type"], "application/grpc");
    assert!(
        !answer.headers().contains_key("content-length") && !answer.headers().contains_key("date"),
        "{:?}",
        answer.headers()
    );
    assert_eq!(calls.load(Ordering::SeqCst), 4);

    // Other methods still reach the generated server.
    let unknown = unknown_method(&channel).await;
    assert_eq!(unknown.code(), Code::Unimplemented);
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn a_route_refuses_what_tonic_refuses() {
    let (_dir, path, calls, _stop) = routed().await;
    let channel = connect(&path, DEADLINE).await.unwrap();
    // Not a RegisterRequest: field 1 says 9 bytes follow, and 2 do.
    let undecodable = channel
        .unary(PathAndQuery::from_static(REGISTER), |buf| {
            buf.put_slice(&[0x0a, 0x09, b'v', b'1'])
        })
        .await
        .unwrap_err();
    assert_eq!(undecodable.code(), Code::Internal);
    assert!(undecodable.message().contains("decode"), "{undecodable}");
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the method never ran");

    // A request compressed with gzip: this server takes none.
    let answer = by_hand(channel, vec![1, 0, 0, 0, 0], &[("grpc-encoding", "gzip")]).await;
    let status = tonic::Status::from_header_map(answer.headers()).expect("a status in the headers");
    assert_eq!(status.code(), Code::Unimplemented, "{status}");
    assert!(status.message().contains("gzip"), "{status}");
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the method never ran");
}
