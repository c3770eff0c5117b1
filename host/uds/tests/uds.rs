//! Integration tests of pluglet-uds on real unix sockets: dialing, binding, Pluglet's server
//! loop (`serve`), and a real tonic server behind the `:authority` rewriting layer, driven by tonic
//! clients and by a hand-written HTTP/2 client that sends what grpc-go and grpc-python send (a
//! socket path as `:authority`).

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pluglet_proto::v1beta1::registration_client::RegistrationClient;
use pluglet_proto::v1beta1::registration_server::{Registration, RegistrationServer};
use pluglet_proto::v1beta1::{Empty, RegisterRequest};
use pluglet_uds::{UdsError, bind, connect, incoming, incoming_any_authority};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tonic::transport::Server;
use tonic::transport::server::UdsConnectInfo;

const KUBELET_SOCK: &str = "/var/lib/kubelet/device-plugins/kubelet.sock";
const KUBELET_SOCK_ENCODED: &str = "%2Fvar%2Flib%2Fkubelet%2Fdevice-plugins%2Fkubelet.sock";
const DEADLINE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// The server: a Registration service that records what it was asked.

/// One Register call as the service saw it.
#[derive(Clone, Debug)]
struct Seen {
    request: RegisterRequest,
    x_trace: Option<String>,
    has_peer_cred: bool,
}

#[derive(Clone, Default)]
struct Recorder {
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Recorder {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

#[tonic::async_trait]
impl Registration for Recorder {
    async fn register(
        &self,
        request: tonic::Request<RegisterRequest>,
    ) -> Result<tonic::Response<Empty>, tonic::Status> {
        let x_trace = request
            .metadata()
            .get("x-trace")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let has_peer_cred = request
            .extensions()
            .get::<UdsConnectInfo>()
            .is_some_and(|info| info.peer_cred.is_some());
        self.seen.lock().unwrap().push(Seen {
            request: request.into_inner(),
            x_trace,
            has_peer_cred,
        });
        Ok(tonic::Response::new(Empty {}))
    }
}

struct TestServer {
    _dir: tempfile::TempDir,
    path: PathBuf,
    recorder: Recorder,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves the recorder on a fresh socket, with or without the rewriting layer.
fn serve(rewrite: bool) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubelet.sock");
    let listener = bind(&path, Some(0o600)).unwrap();
    let recorder = Recorder::default();
    let service = RegistrationServer::new(recorder.clone());
    let task = tokio::spawn(async move {
        let router = Server::builder().add_service(service);
        let result = if rewrite {
            router
                .serve_with_incoming(incoming_any_authority(listener))
                .await
        } else {
            router.serve_with_incoming(incoming(listener)).await
        };
        result.unwrap();
    });
    TestServer {
        _dir: dir,
        path,
        recorder,
        task,
    }
}

fn register_request(resource: &str) -> RegisterRequest {
    RegisterRequest {
        version: "v1beta1".into(),
        endpoint: "vendor-gpu.sock".into(),
        resource_name: resource.into(),
        options: None,
    }
}

// ---------------------------------------------------------------------------------------------
// A hand-written HTTP/2 client.

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
const PROTOCOL_ERROR: u32 = 0x1;

struct Frame {
    kind: u8,
    flags: u8,
    stream_id: u32,
    payload: Vec<u8>,
}

/// How one stream ended, as the raw client saw it.
#[derive(Debug, Default)]
struct Outcome {
    /// Decoded header blocks on the stream, in order (response headers, then trailers).
    blocks: Vec<Vec<(String, String)>>,
    data: Vec<u8>,
    reset: Option<u32>,
    goaway: Option<u32>,
    closed: bool,
}

impl Outcome {
    fn header(&self, name: &str) -> Option<&str> {
        self.blocks
            .iter()
            .flatten()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

struct RawClient {
    stream: UnixStream,
    decoder: loona_hpack::Decoder<'static>,
}

impl RawClient {
    async fn open(path: &Path) -> RawClient {
        let mut stream = UnixStream::connect(path).await.unwrap();
        stream.write_all(PREFACE).await.unwrap();
        let mut client = RawClient {
            stream,
            decoder: loona_hpack::Decoder::new(),
        };
        client.send(SETTINGS, 0, 0, &[]).await;
        client
    }

    async fn send(&mut self, kind: u8, flags: u8, stream_id: u32, payload: &[u8]) {
        self.try_send(kind, flags, stream_id, payload)
            .await
            .unwrap();
    }

    async fn try_send(
        &mut self,
        kind: u8,
        flags: u8,
        stream_id: u32,
        payload: &[u8],
    ) -> std::io::Result<()> {
        let frame = frame(kind, flags, stream_id, payload);
        self.stream.write_all(&frame).await
    }

    async fn read_frame(&mut self) -> Option<Frame> {
        read_frame_from(&mut self.stream).await
    }

    /// Reads until `stream_id` ends (END_STREAM, RST_STREAM), the server sends GOAWAY or closes.
    async fn outcome(&mut self, stream_id: u32) -> Outcome {
        tokio::time::timeout(DEADLINE, self.outcome_inner(stream_id))
            .await
            .expect("the server answered in time")
    }

    async fn outcome_inner(&mut self, stream_id: u32) -> Outcome {
        let mut outcome = Outcome::default();
        let mut block: Vec<u8> = Vec::new();
        loop {
            let Some(f) = self.read_frame().await else {
                outcome.closed = true;
                return outcome;
            };
            match f.kind {
                SETTINGS if f.flags & ACK == 0 => {
                    // The server may already be closing; the outcome says so.
                    let _ = self.try_send(SETTINGS, ACK, 0, &[]).await;
                }
                PING if f.flags & ACK == 0 => {
                    let _ = self.try_send(PING, ACK, 0, &f.payload).await;
                }
                GOAWAY => {
                    outcome.goaway = Some(u32::from_be_bytes(f.payload[4..8].try_into().unwrap()));
                    return outcome;
                }
                RST_STREAM if f.stream_id == stream_id => {
                    outcome.reset = Some(u32::from_be_bytes(f.payload[..4].try_into().unwrap()));
                    return outcome;
                }
                HEADERS | CONTINUATION => {
                    // The server sends neither padding nor priority.
                    block.extend_from_slice(&f.payload);
                    if f.flags & END_HEADERS != 0 {
                        let fields = self
                            .decoder
                            .decode(&block)
                            .unwrap()
                            .into_iter()
                            .map(|(n, v)| {
                                (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap())
                            })
                            .collect();
                        block.clear();
                        if f.stream_id == stream_id {
                            outcome.blocks.push(fields);
                        }
                    }
                    if f.stream_id == stream_id && f.flags & END_STREAM != 0 {
                        return outcome;
                    }
                }
                DATA if f.stream_id == stream_id => {
                    outcome.data.extend_from_slice(&f.payload);
                    if f.flags & END_STREAM != 0 {
                        return outcome;
                    }
                }
                _ => {}
            }
        }
    }
}

/// Reads one HTTP/2 frame; `None` once the connection ends.
async fn read_frame_from(stream: &mut UnixStream) -> Option<Frame> {
    let mut header = [0u8; 9];
    stream.read_exact(&mut header).await.ok()?;
    let len = usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
    let mut payload = vec![0; len];
    stream.read_exact(&mut payload).await.ok()?;
    Some(Frame {
        kind: header[3],
        flags: header[4],
        stream_id: u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff,
        payload,
    })
}

fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut frame = vec![len[1], len[2], len[3], kind, flags];
    frame.extend_from_slice(&stream_id.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// A plain (non-Huffman) HPACK string; all strings here are shorter than 127 bytes.
fn hpack_string(s: &str, out: &mut Vec<u8>) {
    let len = u8::try_from(s.len()).unwrap();
    assert!(len < 0x7f);
    out.push(len);
    out.extend_from_slice(s.as_bytes());
}

/// Literal header field without indexing, new name (RFC 7541 §6.2.2).
fn literal(name: &str, value: &str) -> Vec<u8> {
    let mut out = vec![0x00];
    hpack_string(name, &mut out);
    hpack_string(value, &mut out);
    out
}

/// Literal header field with incremental indexing, new name (RFC 7541 §6.2.1).
fn literal_indexed(name: &str, value: &str) -> Vec<u8> {
    let mut out = vec![0x40];
    hpack_string(name, &mut out);
    hpack_string(value, &mut out);
    out
}

/// Indexed header field (RFC 7541 §6.1); dynamic entries start at 62, newest first.
fn indexed(index: u8) -> Vec<u8> {
    assert!(index < 0x7f);
    vec![0x80 | index]
}

/// The header fields of a grpc-go Register call, each encoded by `encode`.
fn register_headers(authority: &str, encode: fn(&str, &str) -> Vec<u8>) -> Vec<u8> {
    [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/v1beta1.Registration/Register"),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    .iter()
    .flat_map(|(n, v)| encode(n, v))
    .collect()
}

/// A gRPC length-prefixed message.
fn grpc_message(request: &RegisterRequest) -> Vec<u8> {
    let body = request.encode_to_vec();
    let mut message = vec![0];
    message.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
    message.extend_from_slice(&body);
    message
}

/// Sends one Register on `stream_id` as a single HEADERS frame plus one DATA frame.
async fn raw_register(client: &mut RawClient, stream_id: u32, block: &[u8], resource: &str) {
    client.send(HEADERS, END_HEADERS, stream_id, block).await;
    let message = grpc_message(&register_request(resource));
    client.send(DATA, END_STREAM, stream_id, &message).await;
}

fn assert_ok(outcome: &Outcome) {
    assert_eq!(outcome.reset, None, "stream reset: {outcome:?}");
    assert_eq!(outcome.header(":status"), Some("200"), "{outcome:?}");
    assert_eq!(outcome.header("grpc-status"), Some("0"), "{outcome:?}");
}

// ---------------------------------------------------------------------------------------------
// The rewriting layer.

#[tokio::test]
async fn path_authority_is_served_through_the_layer() {
    let server = serve(true);
    let mut client = RawClient::open(&server.path).await;
    raw_register(
        &mut client,
        1,
        &register_headers(KUBELET_SOCK, literal),
        "vendor.com/gpu",
    )
    .await;
    let outcome = client.outcome(1).await;
    assert_ok(&outcome);
    // A gRPC response message carrying an empty `Empty`.
    assert_eq!(outcome.data, [0, 0, 0, 0, 0]);

    let seen = server.recorder.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].request, register_request("vendor.com/gpu"));
    assert!(seen[0].has_peer_cred, "connection info reaches the handler");
}

#[tokio::test]
async fn percent_encoded_authority_is_served_through_the_layer() {
    let server = serve(true);
    let mut client = RawClient::open(&server.path).await;
    let block = register_headers(KUBELET_SOCK_ENCODED, literal);
    raw_register(&mut client, 1, &block, "vendor.com/fpga").await;
    assert_ok(&client.outcome(1).await);
    assert_eq!(
        server.recorder.seen()[0].request,
        register_request("vendor.com/fpga")
    );
}

#[tokio::test]
async fn without_the_layer_path_authorities_are_refused() {
    let server = serve(false);
    let mut client = RawClient::open(&server.path).await;
    raw_register(
        &mut client,
        1,
        &register_headers(KUBELET_SOCK, literal),
        "a.com/x",
    )
    .await;
    assert_eq!(client.outcome(1).await.reset, Some(PROTOCOL_ERROR));

    let block = register_headers(KUBELET_SOCK_ENCODED, literal);
    raw_register(&mut client, 3, &block, "a.com/x").await;
    assert_eq!(client.outcome(3).await.reset, Some(PROTOCOL_ERROR));

    // The same client with a valid authority is served: the refusal is about :authority alone.
    raw_register(
        &mut client,
        5,
        &register_headers("localhost", literal),
        "a.com/x",
    )
    .await;
    assert_ok(&client.outcome(5).await);
    assert_eq!(server.recorder.seen().len(), 1);
}

#[tokio::test]
async fn header_block_split_with_padding_and_priority() {
    let server = serve(true);
    let mut client = RawClient::open(&server.path).await;
    let block = register_headers(KUBELET_SOCK, literal);
    let (first, rest) = block.split_at(10);
    let (second, third) = rest.split_at(40);

    // HEADERS: pad length 7, priority (exclusive=0, depends on 0, weight 16), fragment, padding.
    let mut payload = vec![7];
    payload.extend_from_slice(&[0, 0, 0, 0, 15]);
    payload.extend_from_slice(first);
    payload.extend_from_slice(&[0; 7]);
    client.send(HEADERS, PADDED | PRIORITY, 1, &payload).await;
    client.send(CONTINUATION, 0, 1, second).await;
    client.send(CONTINUATION, END_HEADERS, 1, third).await;
    // A padded DATA frame goes through untouched.
    let mut data = vec![3];
    data.extend_from_slice(&grpc_message(&register_request("split.com/dev")));
    data.extend_from_slice(&[0; 3]);
    client.send(DATA, END_STREAM | PADDED, 1, &data).await;

    assert_ok(&client.outcome(1).await);
    assert_eq!(
        server.recorder.seen()[0].request,
        register_request("split.com/dev")
    );
}

#[tokio::test]
async fn dynamic_table_references_decode_in_later_blocks() {
    let server = serve(true);
    let mut client = RawClient::open(&server.path).await;
    // Block 1 adds its six fields to the table (newest first: te = 62 ... :method = 67).
    let first = register_headers(KUBELET_SOCK, literal_indexed);
    raw_register(&mut client, 1, &first, "first.com/a").await;
    assert_ok(&client.outcome(1).await);

    // Block 2 is nothing but references to entries h2 never saw (block 1 was re-encoded).
    let second: Vec<u8> = (62..=67).rev().flat_map(indexed).collect();
    assert_eq!(second.len(), 6);
    raw_register(&mut client, 3, &second, "second.com/b").await;
    assert_ok(&client.outcome(3).await);

    let seen = server.recorder.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].request, register_request("second.com/b"));
}

#[tokio::test]
async fn blocks_after_a_rewrite_are_re_encoded_too() {
    let server = serve(true);
    let mut client = RawClient::open(&server.path).await;
    // Block 1 needs no rewrite: it reaches h2 as sent, and h2's table holds its six fields.
    let first = register_headers("localhost", literal_indexed);
    raw_register(&mut client, 1, &first, "one.com/a").await;
    assert_ok(&client.outcome(1).await);

    // Block 2 needs a rewrite and adds `x-trace: two` to the client's table (at 62), which h2
    // never sees; its other fields are references to block 1's entries (62..67 until then).
    let mut second: Vec<u8> = [67, 66, 65].into_iter().flat_map(indexed).collect();
    second.extend(literal(":authority", KUBELET_SOCK));
    second.extend(indexed(63));
    second.extend(indexed(62));
    second.extend(literal_indexed("x-trace", "two"));
    raw_register(&mut client, 3, &second, "two.com/b").await;
    assert_ok(&client.outcome(3).await);

    // Block 3 needs no rewrite itself, but to h2 (whose table still holds block 1 only) index 62
    // is `te: trailers` and 68 does not exist: it must be re-encoded, not passed through.
    let mut third: Vec<u8> = [68, 67, 66].into_iter().flat_map(indexed).collect();
    third.extend(literal(":authority", "localhost"));
    third.extend([64, 63, 62].into_iter().flat_map(indexed));
    raw_register(&mut client, 5, &third, "three.com/c").await;
    assert_ok(&client.outcome(5).await);

    let seen = server.recorder.seen();
    assert_eq!(seen.len(), 3);
    assert_eq!(seen[1].x_trace.as_deref(), Some("two"));
    assert_eq!(seen[2].x_trace.as_deref(), Some("two"));
    assert_eq!(seen[2].request, register_request("three.com/c"));
}

#[tokio::test]
async fn tonic_clients_work_through_the_layer() {
    let server = serve(true);
    let channel = connect(&server.path, DEADLINE).await.unwrap();
    let mut client = RegistrationClient::new(channel);
    for resource in ["tonic.com/a", "tonic.com/b"] {
        client.register(register_request(resource)).await.unwrap();
    }
    let seen = server.recorder.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].request, register_request("tonic.com/b"));
    assert!(seen[0].has_peer_cred);
}

#[tokio::test]
async fn a_unary_call_is_one_headers_frame_and_one_data_frame_that_ends_the_stream() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raw.sock");
    let listener = bind(&path, None).unwrap();
    let client = tokio::spawn({
        let path = path.clone();
        async move {
            let channel = connect(&path, DEADLINE).await.unwrap();
            // The raw server never answers; the call ends when the test ends.
            let _ = RegistrationClient::new(channel)
                .register(register_request("raw.com/a"))
                .await;
        }
    });
    let (mut server, _) = tokio::time::timeout(DEADLINE, listener.accept())
        .await
        .unwrap()
        .unwrap();
    let mut preface = [0u8; 24];
    server.read_exact(&mut preface).await.unwrap();
    assert_eq!(&preface[..], PREFACE);
    server.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    let mut on_stream = Vec::new();
    tokio::time::timeout(DEADLINE, async {
        loop {
            let f = read_frame_from(&mut server)
                .await
                .expect("the client keeps the connection open");
            if f.kind == SETTINGS && f.flags & ACK == 0 {
                server
                    .write_all(&frame(SETTINGS, ACK, 0, &[]))
                    .await
                    .unwrap();
            }
            if f.stream_id == 1 {
                let ends = f.flags & END_STREAM != 0;
                on_stream.push(f);
                if ends {
                    return;
                }
            }
        }
    })
    .await
    .expect("the request's stream ends");
    let kinds: Vec<(u8, u8)> = on_stream.iter().map(|f| (f.kind, f.flags)).collect();
    assert_eq!(
        kinds,
        [(HEADERS, END_HEADERS), (DATA, END_STREAM)],
        "HEADERS, then the whole message in one DATA frame ending the stream (no empty DATA after it)"
    );
    let fields = loona_hpack::Decoder::new()
        .decode(&on_stream[0].payload)
        .unwrap();
    assert!(
        fields
            .iter()
            .any(|(n, v)| n.as_slice() == b":authority" && v.as_slice() == b"localhost"),
        "{fields:?}"
    );
    assert_eq!(
        on_stream[1].payload,
        grpc_message(&register_request("raw.com/a"))
    );
    client.abort();
}

#[tokio::test]
async fn a_request_larger_than_the_servers_window_is_sent_whole() {
    // The server keeps HTTP/2's default 64 KiB windows; the body is sent as they open.
    let server = serve(false);
    let channel = connect(&server.path, DEADLINE).await.unwrap();
    let mut big = register_request("big.com/a");
    big.endpoint = "e".repeat(300_000);
    let mut client = RegistrationClient::new(channel);
    for _ in 0..2 {
        client.register(big.clone()).await.unwrap();
    }
    let seen = server.recorder.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].request, big);
}

#[tokio::test]
async fn continuation_flood_closes_the_connection() {
    let server = serve(true);
    let mut client = RawClient::open(&server.path).await;
    client
        .send(HEADERS, 0, 1, &literal(":method", "POST"))
        .await;
    let filler = vec![0u8; 16 * 1024];
    // 5 × 16 KiB > 64 KiB. The server may close before all of it is written.
    for _ in 0..5 {
        let frame = frame(CONTINUATION, 0, 1, &filler);
        if client.stream.write_all(&frame).await.is_err() {
            break;
        }
    }
    let outcome = client.outcome(1).await;
    assert!(outcome.closed, "{outcome:?}");
    assert!(server.recorder.seen().is_empty());
}

#[tokio::test]
async fn framing_violations_are_left_to_h2() {
    let server = serve(true);
    let mut client = RawClient::open(&server.path).await;
    // A DATA frame inside an open header block: h2 must answer with GOAWAY(PROTOCOL_ERROR).
    client
        .send(HEADERS, 0, 1, &literal(":method", "POST"))
        .await;
    client.send(DATA, 0, 1, b"x").await;
    let outcome = client.outcome(1).await;
    assert_eq!(outcome.goaway, Some(PROTOCOL_ERROR), "{outcome:?}");
}

#[tokio::test]
async fn not_http2_is_passed_through_for_h2_to_refuse() {
    let server = serve(true);
    let mut stream = UnixStream::connect(&server.path).await.unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(DEADLINE, stream.read_to_end(&mut answer))
        .await
        .expect("the server closes the connection")
        .ok();
    // h2 may send a GOAWAY before closing; it must not process anything as a request.
    assert!(server.recorder.seen().is_empty());
}

// ---------------------------------------------------------------------------------------------
// connect

#[tokio::test]
async fn connect_waits_for_a_socket_that_appears_later() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("late.sock");
    let recorder = Recorder::default();
    let service = RegistrationServer::new(recorder.clone());
    let serve_path = path.clone();
    let task = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let listener = bind(&serve_path, None).unwrap();
        Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming_any_authority(listener))
            .await
            .unwrap();
    });
    let channel = connect(&path, DEADLINE).await.unwrap();
    RegistrationClient::new(channel)
        .register(register_request("late.com/x"))
        .await
        .unwrap();
    assert_eq!(recorder.seen().len(), 1);
    task.abort();
}

#[tokio::test]
async fn connect_retries_a_socket_that_is_bound_but_not_listening() {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind as bind_fd, listen, socket,
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bound.sock");
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    bind_fd(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &UnixAddr::new(&path).unwrap(),
    )
    .unwrap();
    // The socket file exists, but connecting is refused until listen().
    let refused = UnixStream::connect(&path).await.unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);

    let recorder = Recorder::default();
    let service = RegistrationServer::new(recorder.clone());
    let task = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        listen(&fd, Backlog::new(16).unwrap()).unwrap();
        let std_listener = std::os::unix::net::UnixListener::from(fd);
        std_listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::UnixListener::from_std(std_listener).unwrap();
        Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming(listener))
            .await
            .unwrap();
    });
    let channel = connect(&path, DEADLINE).await.unwrap();
    RegistrationClient::new(channel)
        .register(register_request("bound.com/x"))
        .await
        .unwrap();
    assert_eq!(recorder.seen().len(), 1);
    task.abort();
}

/// On tokio's paused clock the retry pauses take no real time and the clock moves only by them,
/// so the time `connect` spent is exactly its retry schedule.
#[tokio::test(start_paused = true)]
async fn connect_gives_up_at_the_deadline_naming_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nobody.sock");
    let timeout = Duration::from_millis(100);
    let started = tokio::time::Instant::now();
    let error = connect(&path, timeout).await.unwrap_err();
    let retried_for = started.elapsed();
    // It kept retrying until the deadline, and gave up there rather than after another pause
    // (pauses grow to 50 ms).
    assert!(retried_for >= timeout, "{retried_for:?}");
    assert!(
        retried_for < timeout + Duration::from_millis(50),
        "{retried_for:?}"
    );
    let UdsError::Connect { source, .. } = &error else {
        panic!("unexpected error {error:?}");
    };
    assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
    assert!(
        error.to_string().contains(path.to_str().unwrap()),
        "{error}"
    );
}

// ---------------------------------------------------------------------------------------------
// with_deadline

/// A peer told the deadline (`grpc-timeout`) gives up when the caller does: its `Cancelled`
/// answer arriving at the deadline is reported as the deadline, as the caller's timer would
/// have been (tokio's timeout polls the call before its timer, so here the answer comes first).
#[tokio::test(start_paused = true)]
async fn a_peer_giving_up_at_the_deadline_is_the_deadline() {
    let deadline = Duration::from_secs(1);
    for code in [tonic::Code::Cancelled, tonic::Code::DeadlineExceeded] {
        let error = pluglet_uds::with_deadline(deadline, async {
            tokio::time::sleep(deadline).await;
            Err::<tonic::Response<()>, _>(tonic::Status::new(code, "Timeout expired"))
        })
        .await
        .unwrap_err();
        assert_eq!(error.code(), tonic::Code::DeadlineExceeded, "{error}");
        assert_eq!(error.to_string(), "DeadlineExceeded: no answer within 1s");
    }
}

/// A peer's own error before the deadline is passed on as it is, `Cancelled` included.
#[tokio::test(start_paused = true)]
async fn a_peer_error_before_the_deadline_is_its_own() {
    let deadline = Duration::from_secs(1);
    let error = pluglet_uds::with_deadline(deadline, async {
        tokio::time::sleep(deadline / 2).await;
        Err::<tonic::Response<()>, _>(tonic::Status::cancelled("shutting down"))
    })
    .await
    .unwrap_err();
    assert_eq!(error.to_string(), "Cancelled: shutting down");
    let silent = pluglet_uds::with_deadline(
        deadline,
        std::future::pending::<Result<tonic::Response<()>, tonic::Status>>(),
    )
    .await
    .unwrap_err();
    assert_eq!(silent.to_string(), "DeadlineExceeded: no answer within 1s");
}

// ---------------------------------------------------------------------------------------------
// bind

#[tokio::test]
async fn bind_creates_the_directory_and_sets_the_mode() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a/b/plugin.sock");
    let _listener = bind(&path, Some(0o600)).unwrap();
    let metadata = std::fs::metadata(&path).unwrap();
    assert!(metadata.file_type().is_socket());
    assert_eq!(metadata.permissions().mode() & 0o777, 0o600);
}

#[tokio::test]
async fn bind_replaces_a_stale_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stale.sock");
    drop(bind(&path, None).unwrap());
    assert!(
        path.exists(),
        "a dropped listener leaves its socket file behind"
    );
    let listener = bind(&path, None).unwrap();
    let (accepted, connected) = tokio::join!(listener.accept(), UnixStream::connect(&path));
    accepted.unwrap();
    connected.unwrap();
}

#[tokio::test]
async fn bind_refuses_to_delete_a_regular_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("precious.sock");
    std::fs::write(&path, b"data").unwrap();
    let error = bind(&path, None).unwrap_err();
    assert!(matches!(error, UdsError::NotASocket { .. }), "{error:?}");
    assert!(error.to_string().contains("not a unix socket"), "{error}");
    assert_eq!(std::fs::read(&path).unwrap(), b"data");
}

#[tokio::test]
async fn bind_rejects_a_path_too_long_for_sockaddr_un() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x".repeat(120));
    let error = bind(&path, None).unwrap_err();
    assert!(matches!(error, UdsError::PathTooLong { .. }), "{error:?}");
}

// ---------------------------------------------------------------------------------------------
// `serve`: Pluglet's own server loop.

/// A Registration service that answers at once, except a request for `a.com/wait` (it says it
/// was called, then answers once `open` fires) and one for `a.com/panic` (its handler panics).
#[derive(Clone, Default)]
struct Gated {
    called: Arc<tokio::sync::Notify>,
    open: Arc<tokio::sync::Notify>,
}

#[tonic::async_trait]
impl Registration for Gated {
    async fn register(
        &self,
        request: tonic::Request<RegisterRequest>,
    ) -> Result<tonic::Response<Empty>, tonic::Status> {
        match request.get_ref().resource_name.as_str() {
            "a.com/panic" => panic!("the handler of a.com/panic panics (on purpose)"),
            "a.com/wait" => {
                self.called.notify_one();
                self.open.notified().await;
            }
            _ => {}
        }
        Ok(tonic::Response::new(Empty {}))
    }
}

#[tokio::test]
async fn serve_answers_path_authorities_through_the_layer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubelet.sock");
    let listener = bind(&path, Some(0o600)).unwrap();
    let recorder = Recorder::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(pluglet_uds::serve(
        incoming_any_authority(listener),
        RegistrationServer::new(recorder.clone()),
        async move {
            let _ = stopped.await;
        },
    ));
    let mut client = RawClient::open(&path).await;
    let block = register_headers(KUBELET_SOCK, literal);
    raw_register(&mut client, 1, &block, "vendor.com/gpu").await;
    let outcome = client.outcome(1).await;
    assert_ok(&outcome);
    assert_eq!(outcome.data, [0, 0, 0, 0, 0]);
    assert_eq!(
        recorder.seen()[0].request,
        register_request("vendor.com/gpu")
    );
    drop(client);
    stop.send(()).unwrap();
    server.await.unwrap();
}

#[tokio::test]
async fn serve_answers_an_unknown_method_unimplemented() {
    use pluglet_proto::v1beta1::device_plugin_client::DevicePluginClient;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("registration.sock");
    let listener = bind(&path, None).unwrap();
    let _server = tokio::spawn(pluglet_uds::serve(
        incoming(listener),
        RegistrationServer::new(Recorder::default()),
        std::future::pending(),
    ));
    let mut client = DevicePluginClient::new(connect(&path, DEADLINE).await.unwrap());
    let status = client
        .get_device_plugin_options(Empty {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
}

#[tokio::test]
async fn serve_stops_accepting_at_shutdown_and_returns_once_calls_in_flight_are_answered() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gated.sock");
    let listener = bind(&path, None).unwrap();
    let gated = Gated::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(pluglet_uds::serve(
        incoming(listener),
        RegistrationServer::new(gated.clone()),
        async move {
            let _ = stopped.await;
        },
    ));
    let mut client = RegistrationClient::new(connect(&path, DEADLINE).await.unwrap());
    let call = tokio::spawn(async move { client.register(register_request("a.com/wait")).await });
    gated.called.notified().await;

    stop.send(()).unwrap();
    // The listener is closed once the shutdown is taken in: new connections are refused (one
    // made just before may be reset as the listener goes).
    loop {
        match UnixStream::connect(&path).await {
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionRefused => break,
            Ok(_) => tokio::task::yield_now().await,
            Err(error) => assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset),
        }
    }
    assert!(
        !server.is_finished(),
        "serve returned with a call still in flight"
    );

    gated.open.notify_one();
    call.await.unwrap().expect("the call in flight is answered");
    server.await.unwrap();
}

#[tokio::test]
async fn serve_goes_on_accepting_after_accept_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("busy.sock");
    let listener = bind(&path, None).unwrap();
    // Two failed accepts (as when the daemon is out of file descriptors), then the listener's.
    let failing = tokio_stream::iter(
        ["too many open files", "too many open files"]
            .map(|e| Err::<UnixStream, _>(std::io::Error::other(e))),
    );
    let recorder = Recorder::default();
    let _server = tokio::spawn(pluglet_uds::serve(
        tokio_stream::StreamExt::chain(failing, incoming(listener)),
        RegistrationServer::new(recorder.clone()),
        std::future::pending(),
    ));
    let mut client = RegistrationClient::new(connect(&path, DEADLINE).await.unwrap());
    client.register(register_request("c.com/d")).await.unwrap();
    assert_eq!(recorder.seen()[0].request, register_request("c.com/d"));
}

/// A [`Gated`] service served by `pluglet_uds::serve` on a fresh socket, a client connected to
/// it, and one call on that connection held in the service (`a.com/wait`) until `service.open`.
struct OneCallWaiting {
    _dir: tempfile::TempDir,
    service: Gated,
    client: RegistrationClient<pluglet_uds::Channel>,
    server: tokio::task::JoinHandle<()>,
    waiting: tokio::task::JoinHandle<Result<tonic::Response<Empty>, tonic::Status>>,
}

async fn one_call_waiting() -> OneCallWaiting {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gated.sock");
    let listener = bind(&path, None).unwrap();
    let service = Gated::default();
    let server = tokio::spawn(pluglet_uds::serve(
        incoming(listener),
        RegistrationServer::new(service.clone()),
        std::future::pending(),
    ));
    let client = RegistrationClient::new(connect(&path, DEADLINE).await.unwrap());
    let mut waiting_client = client.clone();
    let waiting = tokio::spawn(async move {
        waiting_client
            .register(register_request("a.com/wait"))
            .await
    });
    service.called.notified().await;
    OneCallWaiting {
        _dir: dir,
        service,
        client,
        server,
        waiting,
    }
}

#[tokio::test]
async fn calls_on_one_connection_are_answered_while_another_waits() {
    let OneCallWaiting {
        _dir,
        service,
        client,
        waiting,
        ..
    } = one_call_waiting().await;

    // The same connection answers other calls meanwhile.
    for _ in 0..3 {
        client
            .clone()
            .register(register_request("a.com/b"))
            .await
            .expect("answered while another call on the connection waits");
    }
    assert!(!waiting.is_finished(), "the held call was answered early");

    service.open.notify_one();
    waiting
        .await
        .unwrap()
        .expect("the held call is answered once let go");
}

#[tokio::test]
async fn a_call_that_panics_ends_alone_and_its_connection_serves_on() {
    let OneCallWaiting {
        _dir,
        service,
        client,
        server,
        waiting,
    } = one_call_waiting().await;

    let status = client
        .clone()
        .register(register_request("a.com/panic"))
        .await
        .expect_err("a call whose handler panicked is not answered OK");
    assert_ne!(status.code(), tonic::Code::Ok, "{status:?}");

    // The other call in flight on the connection, a new call on it, and the server live on.
    client
        .clone()
        .register(register_request("a.com/b"))
        .await
        .expect("the connection serves on after a call panicked");
    service.open.notify_one();
    waiting
        .await
        .unwrap()
        .expect("the call in flight is answered after another panicked");
    assert!(!server.is_finished(), "serve ended after a call panicked");
}
