//! Story: plugins that misbehave at the registration door (the `plugins_registry` directory).
//! Whatever a peer does — hang, answer garbage, close at once, lie about itself, be no socket at
//! all, flood the directory, or hide behind symlinks — the daemon stays up, other plugins are
//! not held up, `ctl sockets` and the log say what is wrong, and a good plugin registers after.
//! The peers are real processes (the example plugins) or small servers written here. The
//! device-plugin door is in `misbehaving_device_plugins.rs`.

use std::os::unix::fs::{MetadataExt, symlink};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use pluglet_proto::csi::v1 as csi;
use pluglet_proto::csi::v1::node_server::{Node, NodeServer};
use pluglet_proto::pluginregistration as reg;
use pluglet_proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::{Request, Response, Status};

use crate::support::{CsiPlugin, DEADLINE, Daemon, TestRoot, wait_for};

/// A runtime for the peers written here; the test body stays blocking, like the harness.
pub fn peer_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("peer runtime")
}

/// Waits until `ctl sockets` shows `path` with a `last_error` and returns its status.
fn failing(daemon: &Daemon, path: &Path) -> Value {
    daemon.wait_socket(path, "with an error", |s| s["last_error"].is_string())
}

/// A good plugin registers, and the daemon is still the one that started (a barrier for the
/// end of every case).
fn a_good_plugin_still_registers(daemon: &Daemon, root: &TestRoot, name: &str) {
    let reg = root.registry().join(format!("{name}-reg.sock"));
    let good = CsiPlugin::start(&root.side("."), &reg, &["--name", name]);
    good.wait_registered();
    daemon.wait_plugin(name);
}

#[test]
fn a_getinfo_that_hangs_times_out_and_holds_up_no_one() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let hang_reg = root.registry().join("hang-reg.sock");
    let _hang = CsiPlugin::start(
        &root.side("."),
        &hang_reg,
        &["--name", "hang.example.com", "--hang-getinfo"],
    );
    // While the hanging GetInfo is outstanding, another plugin registers.
    a_good_plugin_still_registers(&daemon, &root, "good.example.com");
    let s = failing(&daemon, &hang_reg);
    let error = s["last_error"].as_str().unwrap();
    assert!(error.contains("GetInfo"), "{s}");
    assert!(error.contains("no answer within 1s"), "{s}");
    daemon.wait_socket(&hang_reg, "retried", |s| {
        s["attempts"].as_u64().unwrap() >= 2
    });
    assert!(daemon.plugin("hang.example.com").is_none());
    assert!(daemon.log_text().contains("hang-reg.sock"));
}

/// What a raw peer does with each connection.
#[derive(Clone, Copy, Debug)]
enum Raw {
    /// Writes bytes that are not HTTP/2, then reads until the daemon hangs up.
    Garbage,
    /// Closes the connection at once.
    Close,
    /// Speaks HTTP/2 and gRPC, but answers GetInfo with bytes that are no protobuf message.
    NotProtobuf,
}

/// Serves `listener` the `raw` way until the runtime stops.
async fn raw_peer(listener: tokio::net::UnixListener, raw: Raw) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            return;
        };
        tokio::spawn(async move {
            match raw {
                Raw::Close => drop(stream),
                Raw::Garbage => {
                    let _ = stream
                        .write_all(b"220 this is an SMTP server, not HTTP/2\r\n\x00\xff\xfe")
                        .await;
                    let mut sink = Vec::new();
                    let _ = stream.read_to_end(&mut sink).await;
                }
                Raw::NotProtobuf => {
                    let _ = not_protobuf(stream).await;
                }
            }
        });
    }
}

/// An HTTP/2 server whose every gRPC answer is a well-framed message of bytes that do not
/// decode (a field of wire type 7, which does not exist), with `grpc-status: 0`.
async fn not_protobuf(stream: tokio::net::UnixStream) -> Result<(), h2::Error> {
    let mut conn = h2::server::handshake(stream).await?;
    while let Some(request) = conn.accept().await {
        let (_request, mut respond) = request?;
        let response = http::Response::builder()
            .status(200)
            .header("content-type", "application/grpc")
            .body(())
            .expect("response head");
        let mut send = respond.send_response(response, false)?;
        let garbage: &[u8] = &[0x0f, 0xff, 0xff, 0xff, 0xff];
        let mut frame = vec![0u8];
        frame.extend_from_slice(&(garbage.len() as u32).to_be_bytes());
        frame.extend_from_slice(garbage);
        send.send_data(Bytes::from(frame), false)?;
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        send.send_trailers(trailers)?;
    }
    Ok(())
}

#[test]
fn garbage_bytes_a_closed_connection_and_a_non_protobuf_answer_are_clear_errors() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let rt = peer_runtime();
    let cases = [
        (Raw::Garbage, "garbage-reg.sock"),
        (Raw::Close, "close-reg.sock"),
        (Raw::NotProtobuf, "not-protobuf-reg.sock"),
    ];
    for (raw, name) in cases {
        let path = root.registry().join(name);
        let _guard = rt.enter();
        let listener = pluglet_uds::bind(&path, None).expect("bind the peer");
        rt.spawn(raw_peer(listener, raw));
    }
    for (raw, name) in cases {
        let path = root.registry().join(name);
        let s = failing(&daemon, &path);
        let error = s["last_error"].as_str().unwrap().to_owned();
        println!("{raw:?}: {error}");
        // A peer that closes at once may do so before the HTTP/2 handshake or right after.
        assert!(
            error.contains("GetInfo") || error.contains("failed to dial"),
            "{raw:?}: {s}"
        );
        match raw {
            Raw::NotProtobuf => {
                assert!(error.contains("decode"), "{s}");
                assert!(error.contains("does not answer as a plugin"), "{s}");
            }
            Raw::Garbage => assert!(error.contains("does not answer as a plugin"), "{s}"),
            Raw::Close => {}
        }
        assert_eq!(s["plugin_type"], Value::Null, "{s}");
        daemon.wait_socket(&path, "retried with backoff", |s| {
            s["attempts"].as_u64().unwrap() >= 2 && s["state"] != "registered"
        });
        assert!(daemon.log_text().contains(name), "the log names {name}");
    }
    a_good_plugin_still_registers(&daemon, &root, "after-garbage.example.com");

    // The misbehaving peer goes; a good plugin at the same path registers.
    let path = root.registry().join("close-reg.sock");
    std::fs::remove_file(&path).unwrap();
    wait_for("the closed socket forgotten", DEADLINE, || {
        daemon.socket(&path).is_none().then_some(())
    });
    let good = CsiPlugin::start(&root.side("."), &path, &["--name", "same-path.example.com"]);
    good.wait_registered();
    daemon.wait_plugin("same-path.example.com");
}

#[test]
fn an_empty_name_or_type_in_getinfo_is_refused_with_the_reason() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let side = root.side(".");
    let no_name_reg = root.registry().join("no-name-reg.sock");
    let no_name = CsiPlugin::start(&side, &no_name_reg, &["--name", ""]);
    let no_type_reg = root.registry().join("no-type-reg.sock");
    let no_type = CsiPlugin::start(
        &side,
        &no_type_reg,
        &["--type", "", "--name", "t.example.com"],
    );
    for (plugin, reg, word) in [
        (&no_name, &no_name_reg, "name"),
        (&no_type, &no_type_reg, "type"),
    ] {
        let n = plugin.wait_notification("a refusal", |n| n["plugin_registered"] == false);
        let reason = n["error"].as_str().unwrap().to_owned();
        println!("empty {word}: {reason}");
        assert!(reason.contains(word), "{reason}");
        let s = daemon.wait_socket(reg, "shows the reason", |s| {
            s["last_error"] == reason.as_str()
        });
        assert_ne!(s["state"], "registered", "{s}");
    }
    assert!(daemon.ctl_json("plugins").is_empty());
    a_good_plugin_still_registers(&daemon, &root, "after-empty.example.com");
}

#[test]
fn a_file_named_sock_that_is_not_a_socket_is_shown_with_the_reason() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let registry = root.registry();
    let plain = registry.join("plain.sock");
    std::fs::write(&plain, b"not a socket").unwrap();
    let fifo = registry.join("fifo.sock");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let dangling = registry.join("dangling.sock");
    symlink(registry.join("nowhere"), &dangling).unwrap();
    let readme = registry.join("README");
    std::fs::write(&readme, b"not named like a socket: not listed").unwrap();

    for (path, words) in [
        (&plain, "a regular file, not a unix socket"),
        (&fifo, "a FIFO, not a unix socket"),
        (&dangling, "a symlink that cannot be resolved"),
    ] {
        let s = daemon.wait_socket(path, "ignored", |s| s["state"] == "ignored");
        let error = s["last_error"].as_str().unwrap();
        assert!(error.contains(words), "{s}");
        assert_eq!(s["attempts"], 0, "never dialed: {s}");
    }
    assert!(daemon.socket(&readme).is_none());
    let table = String::from_utf8(daemon.ctl(&["sockets"]).stdout).unwrap();
    assert!(
        table.contains("plain.sock") && table.contains("ignored") && table.contains("regular file"),
        "{table}"
    );
    let log = daemon.log_text();
    assert!(
        log.contains("plain.sock") && log.contains("not registered"),
        "{log}"
    );
    assert!(daemon.ctl_json("plugins").is_empty());

    // Removed: forgotten. Replaced by a real socket: registered.
    std::fs::remove_file(&fifo).unwrap();
    wait_for("the FIFO forgotten", DEADLINE, || {
        daemon.socket(&fifo).is_none().then_some(())
    });
    std::fs::remove_file(&plain).unwrap();
    let good = CsiPlugin::start(
        &root.side("."),
        &plain,
        &["--name", "was-plain.example.com"],
    );
    good.wait_registered();
    let s = daemon.wait_socket(&plain, "registered", |s| s["state"] == "registered");
    assert_eq!(s["last_error"], Value::Null, "{s}");
}

#[test]
fn a_socket_owned_by_another_user_registers_as_with_the_kubelet() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test changes a socket's owner and must run as root (scripts/test.sh in CI does)"
    );
    let root = TestRoot::new();
    let reg = root.registry().join("nobody-reg.sock");
    std::fs::create_dir_all(root.registry()).unwrap();
    let plugin = CsiPlugin::start(&root.side("."), &reg, &["--name", "nobody.example.com"]);
    wait_for("the socket bound", DEADLINE, || reg.exists().then_some(()));
    // Owned by nobody, and only its owner may connect: root connects anyway, as the kubelet
    // (root) does; Pluglet checks no ownership either.
    let nobody = nix::unistd::Uid::from_raw(65534);
    nix::unistd::chown(&reg, Some(nobody), Some(nix::unistd::Gid::from_raw(65534))).unwrap();
    std::fs::set_permissions(&reg, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let daemon = Daemon::start(&root.path(), &[]);
    plugin.wait_registered();
    daemon.wait_plugin("nobody.example.com");
    assert_eq!(std::fs::metadata(&reg).unwrap().uid(), 65534);
}

#[test]
fn symlinks_in_the_registry_neither_crash_nor_spin_the_watcher() {
    let root = TestRoot::new();
    // No periodic rescan during the test: each link must be handled exactly once, by its event.
    let daemon = Daemon::start(&root.path(), &["--resync-period", "1h"]);
    let registry = root.registry();
    let side = root.side(".");
    // A socket outside the registry, linked in: a socket, under the link's path.
    let target = side.join("linked-target.sock");
    let linked = CsiPlugin::start(&side, &target, &["--name", "linked.example.com"]);
    wait_for("the target bound", DEADLINE, || {
        target.exists().then_some(())
    });
    let link = registry.join("link-reg.sock");
    symlink(&target, &link).unwrap();
    // A link to a directory (with a socket in it), a loop, and a link to the registry itself.
    let outside_dir = root.path().join("outside");
    std::fs::create_dir_all(&outside_dir).unwrap();
    let rt = peer_runtime();
    let _inside_dir = {
        let _guard = rt.enter();
        pluglet_uds::bind(&outside_dir.join("hidden-by-dir-link.sock"), None).unwrap()
    };
    symlink(&outside_dir, registry.join("dir-link")).unwrap();
    symlink(registry.join("loop-b.sock"), registry.join("loop-a.sock")).unwrap();
    symlink(registry.join("loop-a.sock"), registry.join("loop-b.sock")).unwrap();
    symlink(&registry, registry.join("self")).unwrap();

    // New sockets are still seen right after.
    a_good_plugin_still_registers(&daemon, &root, "after-links.example.com");
    linked.wait_registered();
    let p = daemon.wait_plugin("linked.example.com");
    assert_eq!(p["socket_path"], link.display().to_string());
    for looped in ["loop-a.sock", "loop-b.sock"] {
        let s = daemon.wait_socket(&registry.join(looped), "ignored", |s| {
            s["state"] == "ignored"
        });
        assert!(
            s["last_error"]
                .as_str()
                .unwrap()
                .contains("cannot be resolved"),
            "{s}"
        );
    }
    let sockets = daemon.ctl_json("sockets");
    assert!(
        sockets
            .iter()
            .all(|s| !s["path"].as_str().unwrap().contains("dir-link")
                && !s["path"].as_str().unwrap().contains("/self/")),
        "links to directories are not followed: {sockets:?}"
    );
    // Each link to a directory was handled once (no walk down self/self/...).
    let log = daemon.log_text();
    assert_eq!(
        log.matches("symlink to a directory in the registry; not followed")
            .count(),
        2,
        "{log}"
    );
    // Removing the link deregisters the plugin behind it.
    std::fs::remove_file(&link).unwrap();
    wait_for("the linked plugin deregistered", DEADLINE, || {
        daemon.plugin("linked.example.com").is_none().then_some(())
    });
}

/// A plugin behind each of many sockets: GetInfo says CSI driver `<prefix>-<i>`, NodeGetInfo
/// is served on the same socket.
#[derive(Clone)]
struct FloodPeer {
    name: String,
}

#[tonic::async_trait]
impl Registration for FloodPeer {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: "CSIPlugin".into(),
            name: self.name.clone(),
            endpoint: String::new(),
            supported_versions: vec!["1.0.0".into()],
        }))
    }

    async fn notify_registration_status(
        &self,
        _: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

#[tonic::async_trait]
impl Node for FloodPeer {
    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: "node-1".into(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}

/// The flood's events of `kind` in `ctl events`, by subject.
fn flood_events(daemon: &Daemon, kind: &str) -> Vec<String> {
    daemon
        .ctl_json("events")
        .into_iter()
        .filter(|e| e["type"] == kind)
        .filter_map(|e| e["subject"].as_str().map(str::to_owned))
        .filter(|s| s.contains("flood-"))
        .collect()
}

#[test]
fn a_thousand_sockets_at_once_register_then_all_deregister() {
    const N: usize = 1000;
    // This process holds a listener and a connection per socket: raise its soft limit on open
    // files to the hard one, as the daemon does for itself.
    let (_, hard) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .expect("read the open files limit");
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard)
        .expect("raise the open files limit");
    assert!(
        hard >= 4 * N as u64,
        "the hard limit on open files ({hard}) is too low for {N} plugins; raise it (ulimit -Hn)"
    );
    let root = TestRoot::new();
    // The kubelet's NodeGetInfo deadline: on a busy 2-core machine a thousand drivers asked at
    // once may take longer than the fast test timings allow.
    let daemon = Daemon::start(&root.path(), &["--nodegetinfo-timeout", "2m"]);
    let dir = root.registry().join("flood");
    std::fs::create_dir_all(&dir).unwrap();
    let rt = peer_runtime();
    let paths: Vec<PathBuf> = (0..N).map(|i| dir.join(format!("f{i}.sock"))).collect();
    let start = Instant::now();
    {
        let _guard = rt.enter();
        for (i, path) in paths.iter().enumerate() {
            let listener = pluglet_uds::bind(path, None).expect("bind a flood socket");
            let peer = FloodPeer {
                name: format!("flood-{i}.example.com"),
            };
            let router = tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(peer.clone()))
                .add_service(NodeServer::new(peer));
            rt.spawn(router.serve_with_incoming(pluglet_uds::incoming(listener)));
        }
    }
    wait_for("1000 plugins registered", Duration::from_secs(120), || {
        (daemon.ctl_json("plugins").len() == N).then_some(())
    });
    let registered = start.elapsed();
    let sockets = daemon.ctl_json("sockets");
    assert_eq!(sockets.len(), N);
    assert!(sockets.iter().all(|s| s["state"] == "registered"));
    let mut events = flood_events(&daemon, "registered");
    events.sort();
    events.dedup();
    assert_eq!(events.len(), N, "one registered event per plugin");

    let start = Instant::now();
    for path in &paths {
        std::fs::remove_file(path).unwrap();
    }
    wait_for(
        "every plugin deregistered",
        Duration::from_secs(120),
        || {
            (daemon.ctl_json("plugins").is_empty() && daemon.ctl_json("sockets").is_empty())
                .then_some(())
        },
    );
    let gone = start.elapsed();
    // The caches drop a plugin as its deregistration starts; the deregister hooks' events follow.
    wait_for(
        "a deregistered event per plugin",
        Duration::from_secs(120),
        || {
            let mut events = flood_events(&daemon, "deregistered");
            events.sort();
            events.dedup();
            (events.len() == N).then_some(())
        },
    );
    let deregistered = start.elapsed();
    println!(
        "{N} sockets: all registered after {registered:?}; once removed, gone from the caches \
         after {gone:?}, every deregister hook run after {deregistered:?}"
    );
    a_good_plugin_still_registers(&daemon, &root, "after-flood.example.com");
}
