//! Go device plugins dial `kubelet.sock` by its bare path, so their HTTP/2 `:authority` is a
//! path (docs/kubelet-compatibility.md, "HTTP/2 authority from Go plugins"), which Rust HTTP/2
//! clients refuse to send. These stories write the frames by hand, as grpc-go does, and check
//! that the daemon accepts a Register on `kubelet.sock` and answers its admin API.

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use pluglet_proto::v1beta1::RegisterRequest;
use prost::Message as _;

use crate::device_support::{device_plugins_dir, wait_allocatable};
use crate::support::{Daemon, TestRoot, bin, grpcio};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;

fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut out = vec![len[1], len[2], len[3], kind, flags];
    out.extend_from_slice(&stream_id.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// HPACK literal header field without indexing, new name, no Huffman (RFC 7541 §6.2.2).
fn literal(name: &str, value: &str) -> Vec<u8> {
    let mut out = vec![0x00];
    for s in [name, value] {
        let len = u8::try_from(s.len()).unwrap();
        assert!(len < 0x7f, "short strings only");
        out.push(len);
        out.extend_from_slice(s.as_bytes());
    }
    out
}

/// What the server did with stream 1.
#[derive(Debug, PartialEq)]
pub(crate) enum Answer {
    /// It answered (HEADERS with END_STREAM: the gRPC trailers).
    Answered,
    /// RST_STREAM with this error code.
    Reset(u32),
    /// GOAWAY with this error code.
    GoAway(u32),
}

fn read_answer(stream: &mut UnixStream) -> Answer {
    loop {
        let mut header = [0u8; 9];
        stream.read_exact(&mut header).expect("the daemon answers");
        let len =
            usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
        let mut payload = vec![0; len];
        stream.read_exact(&mut payload).unwrap();
        let id = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
        match header[3] {
            SETTINGS if header[4] & ACK == 0 => {
                stream.write_all(&frame(SETTINGS, ACK, 0, &[])).unwrap();
            }
            RST_STREAM if id == 1 => {
                return Answer::Reset(u32::from_be_bytes(payload[..4].try_into().unwrap()));
            }
            GOAWAY => {
                return Answer::GoAway(u32::from_be_bytes(payload[4..8].try_into().unwrap()));
            }
            HEADERS if id == 1 && header[4] & END_STREAM != 0 => return Answer::Answered,
            _ => {}
        }
    }
}

#[test]
fn a_register_with_a_path_like_authority_is_accepted() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let kubelet = device_plugins_dir(&root).join("kubelet.sock");
    // A plugin serving DevicePlugin whose registration socket is outside the watched registry,
    // so only the hand-written Register below registers it.
    let side = root.side(".");
    let dp_socket = device_plugins_dir(&root).join("raw.sock");
    let _plugin = std::process::Command::new(bin("example-device-plugin"))
        .args(["--resource", "vendor.com/raw", "--devices", "3", "--socket"])
        .arg(&dp_socket)
        .arg("--reg-socket")
        .arg(side.join("unwatched-reg.sock"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map(KillOnDrop)
        .expect("spawn example-device-plugin");
    crate::support::wait_for("the plugin socket", crate::support::DEADLINE, || {
        dp_socket.exists().then_some(())
    });

    // What grpc-go 1.27–1.40 sends for a bare-path target: the raw socket path.
    let authority = kubelet.display().to_string();
    let body = RegisterRequest {
        version: "v1beta1".into(),
        endpoint: "raw.sock".into(),
        resource_name: "vendor.com/raw".into(),
        options: None,
    }
    .encode_to_vec();
    assert_eq!(
        unary(
            &kubelet,
            &authority,
            "/v1beta1.Registration/Register",
            &body
        ),
        Answer::Answered
    );
    let r = wait_allocatable(&daemon, "vendor.com/raw", 3);
    assert_eq!(r["endpoint"], dp_socket.display().to_string());
}

#[test]
fn the_admin_api_answers_clients_that_send_the_socket_path_as_authority() {
    let root = TestRoot::new();
    let _daemon = Daemon::start(&root.path(), &[]);
    let admin = root.path().join("pluglet.sock");
    // grpc-go sends the raw path, grpc-python its percent-encoded form.
    let raw = admin.display().to_string();
    let encoded = raw.replace('/', "%2F");
    for authority in [raw.as_str(), encoded.as_str(), "localhost"] {
        assert_eq!(
            unary(
                &admin,
                authority,
                "/pluglet.admin.v1.Admin/ListAllocations",
                &[]
            ),
            Answer::Answered,
            "with :authority {authority}"
        );
    }
}

/// A real grpcio client (Debian's `python3-grpcio`, installed by `scripts/test.sh`) with its
/// default channel settings: its `:authority` is the socket path, percent-encoded.
#[test]
fn the_admin_api_answers_a_grpcio_client_as_it_comes() {
    let root = TestRoot::new();
    let _daemon = Daemon::start(&root.path(), &[]);
    let admin = root.path().join("pluglet.sock");
    const SCRIPT: &str = r#"
call = channel.unary_unary("/pluglet.admin.v1.Admin/ListAllocations")
answer = call(b"", timeout=30)
print("answered", len(answer))
"#;
    assert_eq!(grpcio::run(&admin, None, SCRIPT), "answered 0");
}

/// One unary gRPC call on `socket` written frame by frame, with `authority` as `:authority`
/// (which Rust HTTP/2 clients refuse to send when it is a path), and what the server did.
pub(crate) fn unary(socket: &std::path::Path, authority: &str, path: &str, body: &[u8]) -> Answer {
    let mut stream = UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream.write_all(PREFACE).unwrap();
    stream.write_all(&frame(SETTINGS, 0, 0, &[])).unwrap();
    let block: Vec<u8> = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    .iter()
    .flat_map(|(n, v)| literal(n, v))
    .collect();
    stream
        .write_all(&frame(HEADERS, END_HEADERS, 1, &block))
        .unwrap();
    let mut message = vec![0];
    message.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
    message.extend_from_slice(body);
    stream
        .write_all(&frame(DATA, END_STREAM, 1, &message))
        .unwrap();
    read_answer(&mut stream)
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
