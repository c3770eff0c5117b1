//! What the `:authority` rewriting layer adds to a new connection.
//!
//! `cargo bench -p pluglet-uds --bench connection`. Prints:
//! 1. in-memory cost of pushing one connection's client bytes through [`AuthorityRewrite`]:
//!    - the bytes a tonic client sends for one Register (Huffman-coded, table references),
//!      passed through (decode only);
//!    - the same bytes after a path-`:authority` block, so every block is re-encoded;
//!    - a grpc-go-style Register with a raw socket path (plain literals), rewritten;
//! 2. end to end: new connection + one Register from a tonic client, served with `incoming`
//!    and with `incoming_any_authority`.
#![allow(missing_docs)]

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pluglet_proto::v1beta1::registration_client::RegistrationClient;
use pluglet_proto::v1beta1::registration_server::{Registration, RegistrationServer};
use pluglet_proto::v1beta1::{Empty, RegisterRequest};
use pluglet_uds::{AuthorityRewrite, bind, connect, incoming, incoming_any_authority};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tonic::transport::Server;

struct Nop;

#[tonic::async_trait]
impl Registration for Nop {
    async fn register(
        &self,
        _: tonic::Request<RegisterRequest>,
    ) -> Result<tonic::Response<Empty>, tonic::Status> {
        Ok(tonic::Response::new(Empty {}))
    }
}

fn request() -> RegisterRequest {
    RegisterRequest {
        version: "v1beta1".into(),
        endpoint: "vendor-gpu.sock".into(),
        resource_name: "vendor.com/gpu".into(),
        options: None,
    }
}

fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut frame = vec![len[1], len[2], len[3], kind, flags];
    frame.extend_from_slice(&stream_id.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

fn literal(name: &str, value: &str) -> Vec<u8> {
    let mut out = vec![0x00, u8::try_from(name.len()).unwrap()];
    out.extend_from_slice(name.as_bytes());
    out.push(u8::try_from(value.len()).unwrap());
    out.extend_from_slice(value.as_bytes());
    out
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Records what a tonic client sends for one Register, through a copying proxy.
async fn record_tonic_client(dir: &Path) -> Vec<u8> {
    let server_path = dir.join("server.sock");
    let proxy_path = dir.join("proxy.sock");
    let listener = bind(&server_path, None).unwrap();
    tokio::spawn(
        Server::builder()
            .add_service(RegistrationServer::new(Nop))
            .serve_with_incoming(incoming(listener)),
    );
    let proxy = bind(&proxy_path, None).unwrap();
    let recorded = Arc::new(Mutex::new(Vec::new()));
    let sink = recorded.clone();
    tokio::spawn(async move {
        let (client, _) = proxy.accept().await.unwrap();
        let server = UnixStream::connect(&server_path).await.unwrap();
        let (mut client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = server.into_split();
        tokio::spawn(async move { tokio::io::copy(&mut server_read, &mut client_write).await });
        let mut buf = vec![0; 8192];
        loop {
            let n = client_read.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&buf[..n]);
            if server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    });
    let channel = connect(&proxy_path, Duration::from_secs(5)).await.unwrap();
    RegistrationClient::new(channel)
        .register(request())
        .await
        .unwrap();
    recorded.lock().unwrap().clone()
}

async fn through_layer(input: &[u8], out: &mut Vec<u8>) {
    out.clear();
    AuthorityRewrite::new(input).read_to_end(out).await.unwrap();
}

async fn per_connection(input: &[u8], rounds: u32) -> Duration {
    let mut out = Vec::with_capacity(input.len() * 2);
    for _ in 0..rounds / 10 {
        through_layer(input, &mut out).await;
    }
    let started = Instant::now();
    for _ in 0..rounds {
        through_layer(input, &mut out).await;
    }
    started.elapsed() / rounds
}

async fn end_to_end(dir: &Path, rewrite: bool, rounds: u32) -> Duration {
    let path = dir.join(if rewrite { "any.sock" } else { "plain.sock" });
    let listener = bind(&path, None).unwrap();
    let router = Server::builder().add_service(RegistrationServer::new(Nop));
    let server = if rewrite {
        tokio::spawn(router.serve_with_incoming(incoming_any_authority(listener)))
    } else {
        tokio::spawn(router.serve_with_incoming(incoming(listener)))
    };
    let one = async || {
        let channel = connect(&path, Duration::from_secs(5)).await.unwrap();
        RegistrationClient::new(channel)
            .register(request())
            .await
            .unwrap();
    };
    for _ in 0..rounds / 10 {
        one().await;
    }
    let started = Instant::now();
    for _ in 0..rounds {
        one().await;
    }
    let elapsed = started.elapsed() / rounds;
    server.abort();
    elapsed
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument is accepted and ignored.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let recorded = record_tonic_client(dir.path()).await;
        assert!(recorded.starts_with(PREFACE));

        let mut forced = PREFACE.to_vec();
        let block = literal(":authority", "/var/lib/kubelet/device-plugins/kubelet.sock");
        forced.extend(frame(0x1, 0x4 | 0x1, 101, &block));
        forced.extend_from_slice(&recorded[PREFACE.len()..]);

        let mut grpc_go = PREFACE.to_vec();
        grpc_go.extend(frame(0x4, 0, 0, &[]));
        let block: Vec<u8> = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/v1beta1.Registration/Register"),
            (":authority", "/var/lib/kubelet/device-plugins/kubelet.sock"),
            ("content-type", "application/grpc"),
            ("user-agent", "grpc-go/1.40.0"),
            ("te", "trailers"),
        ]
        .iter()
        .flat_map(|(n, v)| literal(n, v))
        .collect();
        grpc_go.extend(frame(0x1, 0x4, 1, &block));
        grpc_go.extend(frame(0x0, 0x1, 1, &[0; 60]));

        let rounds = 20_000;
        println!(
            "layer, tonic client bytes ({} B), passthrough: {:?} per connection",
            recorded.len(),
            per_connection(&recorded, rounds).await
        );
        println!(
            "layer, tonic client bytes, every block re-encoded: {:?} per connection",
            per_connection(&forced, rounds).await
        );
        println!(
            "layer, grpc-go style Register ({} B), rewritten: {:?} per connection",
            grpc_go.len(),
            per_connection(&grpc_go, rounds).await
        );

        let rounds = 500;
        let plain = end_to_end(dir.path(), false, rounds).await;
        let layered = end_to_end(dir.path(), true, rounds).await;
        println!(
            "end to end, new connection + Register: incoming {plain:?}, incoming_any_authority {layered:?}"
        );
    });
}
