//! Story: one slow or hanging plugin never delays another.

use crate::support::{CsiPlugin, DEADLINE, Daemon, TestRoot, wait_for};

/// A deadline no test outlives: the hanging call is still stuck when the test ends, so only a
/// daemon that works on other sockets meanwhile can register the second plugin.
const FOREVER: &str = "24h";

/// Starts a plugin that never answers the call recorded as `hang_event` (with the daemon's
/// deadline for that call, `timeout_flag`, set to [`FOREVER`]), waits until it is stuck there,
/// then registers a second plugin and checks that this happened while the first was still
/// stuck: its socket in progress, no answer of any kind sent to it.
fn hanging_call_does_not_hold_up_another_plugin(
    timeout_flag: &str,
    hang_flag: &str,
    hang_event: &str,
) {
    let root = TestRoot::new();
    let daemon = Daemon::start(&root.path(), &[timeout_flag, FOREVER]);
    let side = root.side(".");
    let hang_reg = root.registry().join("hang-reg.sock");
    let hanging = CsiPlugin::start(&side, &hang_reg, &["--name", "hang.example.com", hang_flag]);
    wait_for(
        &format!("{hang_event} to reach the hanging plugin"),
        DEADLINE,
        || {
            hanging
                .events()
                .iter()
                .any(|e| e["event"] == hang_event)
                .then_some(())
        },
    );

    let ok = CsiPlugin::start(
        &side,
        &root.registry().join("ok-reg.sock"),
        &["--name", "ok.example.com"],
    );
    ok.wait_registered();
    daemon.wait_plugin("ok.example.com");

    // The first plugin is still stuck in the same call: the second registered meanwhile.
    assert_eq!(daemon.socket(&hang_reg).unwrap()["state"], "in_progress");
    assert!(
        hanging.notifications().is_empty(),
        "the hanging plugin was answered: {:?}",
        hanging.notifications()
    );
    assert!(daemon.plugin("hang.example.com").is_none());
    let events: Vec<_> = hanging.events();
    assert_eq!(
        events.last().map(|e| e["event"].clone()),
        Some(hang_event.into()),
        "the hanging plugin moved on: {events:?}"
    );
}

#[test]
fn hanging_getinfo_does_not_hold_up_another_plugin() {
    hanging_call_does_not_hold_up_another_plugin("--getinfo-timeout", "--hang-getinfo", "get_info");
}

#[test]
fn hanging_nodegetinfo_does_not_hold_up_another_plugin() {
    hanging_call_does_not_hold_up_another_plugin(
        "--nodegetinfo-timeout",
        "--hang-nodegetinfo",
        "node_get_info",
    );
}
