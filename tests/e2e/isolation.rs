//! Story: one slow or hanging plugin never delays another.

use std::time::Instant;

use crate::support::{CsiPlugin, Daemon, TestRoot};

/// A deadline far longer than the test may wait, so a serialised pipeline would be caught.
const LONG: &str = "60s";

#[test]
fn hanging_getinfo_does_not_hold_up_another_plugin() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &["--getinfo-timeout", LONG]);
    let side = root.side(".");
    let hang_reg = root.registry().join("hang-reg.sock");
    let hanging = CsiPlugin::start(
        &side,
        &hang_reg,
        &["--name", "hang.example.com", "--hang-getinfo"],
    );
    crate::support::wait_for(
        "GetInfo reached the hanging plugin",
        crate::support::DEADLINE,
        || (!hanging.events().is_empty()).then_some(()),
    );

    let start = Instant::now();
    let ok = CsiPlugin::start(
        &side,
        &root.registry().join("ok-reg.sock"),
        &["--name", "ok.example.com"],
    );
    ok.wait_registered();
    assert!(start.elapsed().as_secs() < 30, "took {:?}", start.elapsed());
    daemon.wait_plugin("ok.example.com");
    assert_eq!(daemon.socket(&hang_reg).unwrap()["state"], "in_progress");
    assert!(hanging.notifications().is_empty());
}

#[test]
fn hanging_nodegetinfo_does_not_hold_up_another_plugin() {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &["--nodegetinfo-timeout", LONG]);
    let side = root.side(".");
    let hang_reg = root.registry().join("hang-reg.sock");
    let hanging = CsiPlugin::start(
        &side,
        &hang_reg,
        &["--name", "hang.example.com", "--hang-nodegetinfo"],
    );
    crate::support::wait_for(
        "NodeGetInfo reached the hanging plugin",
        crate::support::DEADLINE,
        || {
            hanging
                .events()
                .iter()
                .any(|e| e["event"] == "node_get_info")
                .then_some(())
        },
    );

    let start = Instant::now();
    let ok = CsiPlugin::start(
        &side,
        &root.registry().join("ok-reg.sock"),
        &["--name", "ok.example.com"],
    );
    ok.wait_registered();
    assert!(start.elapsed().as_secs() < 30, "took {:?}", start.elapsed());
    daemon.wait_plugin("ok.example.com");
    assert_eq!(daemon.socket(&hang_reg).unwrap()["state"], "in_progress");
}
