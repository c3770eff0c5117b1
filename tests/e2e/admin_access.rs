//! Who may talk to the admin API, and what a request with bad input gets: other users are
//! refused by the socket's mode unless they are in its group, and every malformed request is
//! answered with a status that says what was wrong, while the daemon keeps serving.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use pluglet_proto::admin::v1 as pb;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_uds::Channel;
use tonic::Code;

use crate::device_support::{DevicePluginProcess, Flow, wait_allocatable};
use crate::support::{Daemon, TestRoot, grpcio};

/// The unprivileged user and group the refusal tests run a client as (`nobody`/`nogroup`).
const NOBODY: u32 = 65534;

/// One `ListAllocations` call by a stock gRPC client (Debian's `python3-grpcio`) as `uid:gid`
/// with no supplementary groups: `answered`, or `refused <code> <details>`.
fn call_as(socket: &std::path::Path, uid: u32, gid: u32) -> String {
    const SCRIPT: &str = r#"
call = channel.unary_unary("/pluglet.admin.v1.Admin/ListAllocations")
try:
    call(b"", timeout=30)
    print("answered")
except grpc.RpcError as e:
    print("refused", e.code().name, e.details())
"#;
    grpcio::run(socket, Some((uid, gid)), SCRIPT)
}

/// Fails unless the test runs as root: it switches users to be refused.
fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test runs clients as other users and must run as root (CI does; run \
         `sudo bash scripts/test.sh`)"
    );
}

/// Lets every user reach the root directory, so that only the socket's own mode decides.
fn open_root(root: &TestRoot) {
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A group other than root's and `nogroup`, by name and id.
fn some_group() -> (String, u32) {
    std::fs::read_to_string("/etc/group")
        .unwrap()
        .lines()
        .find_map(|line| {
            let mut fields = line.split(':');
            let name = fields.next()?;
            let gid: u32 = fields.nth(1)?.parse().ok()?;
            (gid != 0 && gid != NOBODY).then(|| (name.to_string(), gid))
        })
        .expect("/etc/group lists a group besides root and nogroup")
}

#[test]
fn other_users_are_refused_by_the_default_mode() {
    require_root();
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    open_root(&root);
    let answer = call_as(&root.admin_socket(), NOBODY, NOBODY);
    assert!(
        answer.starts_with("refused UNAVAILABLE") && answer.contains("Permission denied"),
        "nobody is refused: {answer}"
    );
    assert_eq!(call_as(&root.admin_socket(), 0, 0), "answered");
    assert!(daemon.terminate().success());
}

#[test]
fn members_of_the_admin_group_get_in_and_others_do_not() {
    require_root();
    let root = TestRoot::new();
    let (group, gid) = some_group();
    let daemon = Daemon::start(
        &root.path(),
        &[
            "--admin-socket-mode",
            "0660",
            "--admin-socket-group",
            &group,
        ],
    );
    open_root(&root);
    assert_eq!(
        call_as(&root.admin_socket(), NOBODY, gid),
        "answered",
        "a member of {group} gets in"
    );
    let answer = call_as(&root.admin_socket(), NOBODY, NOBODY);
    assert!(
        answer.starts_with("refused UNAVAILABLE") && answer.contains("Permission denied"),
        "a user outside {group} is refused: {answer}"
    );
    assert!(daemon.terminate().success());
}

const GPU: &str = "vendor.com/gpu";

fn allocate(pod: &str, container: &str, resource: &str, count: u32) -> pb::AllocateRequest {
    pb::AllocateRequest {
        pod_uid: pod.into(),
        container: container.into(),
        resource: resource.into(),
        count,
        ..Default::default()
    }
}

/// Asserts that `result` failed with `code` and a message containing `says`.
fn refused<T: std::fmt::Debug>(
    what: &str,
    result: Result<T, tonic::Status>,
    code: Code,
    says: &str,
) {
    let status = result.expect_err(what);
    assert_eq!(status.code(), code, "{what}: {status:?}");
    assert!(
        status.message().contains(says),
        "{what}: the message says {says:?}: {}",
        status.message()
    );
    assert!(
        status.message().len() < 1024,
        "{what}: the message is short ({} bytes)",
        status.message().len()
    );
}

#[test]
fn bad_admin_requests_get_clear_errors_and_the_daemon_keeps_serving() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[]);
    let _plugin = DevicePluginProcess::start(&root, Flow::Classic, GPU, &["--devices", "4"]);
    wait_allocatable(&daemon, GPU, 4);
    let huge = "p".repeat(10 << 20);
    let long = "p".repeat(100 << 10);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let channel = pluglet_uds::connect(&root.admin_socket(), Duration::from_secs(10))
            .await
            .expect("dial the admin socket");
        let mut admin: AdminClient<Channel> = AdminClient::new(channel);
        for (what, request, code, says) in [
            (
                "empty pod",
                allocate("", "c", GPU, 1),
                Code::InvalidArgument,
                "pod_uid must not be empty",
            ),
            (
                "empty container",
                allocate("p", "", GPU, 1),
                Code::InvalidArgument,
                "container must not be empty",
            ),
            (
                "empty resource",
                allocate("p", "c", "", 1),
                Code::InvalidArgument,
                "resource must not be empty",
            ),
            (
                "long pod",
                allocate(&long, "c", GPU, 1),
                Code::InvalidArgument,
                "pod_uid is 102400 bytes long",
            ),
            (
                "long resource",
                allocate("p", "c", &long, 1),
                Code::InvalidArgument,
                "resource is 102400 bytes long",
            ),
            (
                "control character",
                allocate("p\n1", "c", GPU, 1),
                Code::InvalidArgument,
                "control character",
            ),
            (
                "zero count",
                allocate("p", "c", GPU, 0),
                Code::InvalidArgument,
                "0",
            ),
            (
                "huge count",
                allocate("p", "c", GPU, u32::MAX),
                Code::ResourceExhausted,
                "4294967295",
            ),
            (
                "unknown resource",
                allocate("p", "c", "vendor.com/none", 1),
                Code::NotFound,
                "vendor.com/none",
            ),
        ] {
            refused(what, admin.allocate(request).await, code, says);
        }
        refused(
            "a 10 MiB request",
            admin.allocate(allocate(&huge, "c", GPU, 1)).await,
            Code::OutOfRange,
            "the limit is: 4194304 bytes",
        );
        for (what, pod, container, says) in [
            (
                "release of an empty pod",
                "",
                "",
                "pod_uid must not be empty",
            ),
            (
                "release of a long pod",
                long.as_str(),
                "",
                "pod_uid is 102400 bytes long",
            ),
            (
                "release of a long container",
                "p",
                long.as_str(),
                "container is 102400 bytes long",
            ),
        ] {
            let request = pb::ReleaseRequest {
                pod_uid: pod.into(),
                container: container.into(),
            };
            refused(
                what,
                admin.release(request).await,
                Code::InvalidArgument,
                says,
            );
        }
        let unknown = pb::ReleaseRequest {
            pod_uid: "no-such-pod".into(),
            container: String::new(),
        };
        assert_eq!(
            admin
                .release(unknown)
                .await
                .expect("release of an unknown pod")
                .into_inner()
                .released,
            0
        );
        for (what, plugin_type, resource, code, says) in [
            (
                "rollback of nothing",
                "",
                "",
                Code::InvalidArgument,
                "exactly one",
            ),
            (
                "rollback of both",
                "CSIPlugin",
                GPU,
                Code::InvalidArgument,
                "exactly one",
            ),
            (
                "rollback of an unknown type",
                "NoSuchPlugin",
                "",
                Code::NotFound,
                "NoSuchPlugin",
            ),
            (
                "rollback of a long name",
                long.as_str(),
                "",
                Code::InvalidArgument,
                "plugin_type is 102400 bytes long",
            ),
        ] {
            let request = pb::RollbackHandlerRequest {
                plugin_type: plugin_type.into(),
                resource: resource.into(),
            };
            refused(what, admin.rollback_handler(request).await, code, says);
        }
        for (what, keep, says) in [
            (
                "sync keeping an empty pod",
                vec![String::new()],
                "empty pod UID",
            ),
            (
                "sync keeping a long pod",
                vec![long.clone()],
                "keep_pod_uids is 102400 bytes long",
            ),
            ("sync of everything without all", vec![], "set all"),
        ] {
            let request = pb::SyncPodsRequest {
                keep_pod_uids: keep,
                dry_run: false,
                all: false,
            };
            refused(
                what,
                admin.sync_pods(request).await,
                Code::InvalidArgument,
                says,
            );
        }
        let resources = admin
            .list_resources(pb::ListResourcesRequest {})
            .await
            .expect("still serving");
        assert_eq!(
            resources.into_inner().resources[0].allocatable,
            4,
            "nothing was allocated"
        );
        let held = admin
            .list_allocations(pb::ListAllocationsRequest {})
            .await
            .unwrap();
        assert!(held.into_inner().allocations.is_empty());
    });
    let out = daemon.ctl(&[
        "allocate",
        "--pod",
        "p",
        "--container",
        "c",
        "--resource",
        GPU,
        "--count",
        "-1",
    ]);
    assert_eq!(
        out.status.code(),
        Some(64),
        "a negative count is a usage error"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("-1"));
    assert!(daemon.terminate().success());
}
