//! `handlers.toml` rewritten in place (`printf … > handlers.toml`: truncated, then written)
//! while module files land: the daemon never takes the file caught between its truncation and
//! its write for a decision. No event or log line reports an entry removed or a slot returned
//! to its built-in, and every allocation is decided by the configured policy.

use crate::device_support::{DevicePluginProcess, FLOWS, allocate, ids, release, wait_allocatable};
use crate::handler_swap::{GPU, POLICY_TOML, SPREAD, guest, handlers_toml, sha256, wait_gpu_row};
use crate::support::{Daemon, TestRoot};

/// Rewrites in the loop.
const REWRITES: usize = 200;

#[test]
fn in_place_rewrites_of_handlers_toml_racing_module_writes_never_remove_an_entry() {
    let root = TestRoot::new();
    let spread = sha256(&guest("spread-policy"));
    let body = format!("{POLICY_TOML}sha256 = \"{spread}\"\n");
    handlers_toml(&root, &[("spread-policy", "policy.wasm")], &body);
    let daemon = Daemon::start(&root.path(), &[]);
    let _plugin =
        DevicePluginProcess::start(&root, FLOWS[0], GPU, &["--preferred", "--reregister"]);
    wait_allocatable(&daemon, GPU, 4);
    wait_gpu_row(&daemon, "serving the pinned policy", |r| {
        r["sha256"] == spread.as_str()
    });

    let module = std::fs::read(guest("spread-policy")).unwrap();
    let other = std::fs::read(guest("misbehave")).unwrap();
    let dir = root.handlers();
    for i in 0..REWRITES {
        // A module file lands (a new one beside, and the pinned one rewritten in place), then
        // handlers.toml is rewritten in place, as a shell's `>` does.
        std::fs::write(dir.join(format!("next-{}.wasm", i % 4)), &other).unwrap();
        std::fs::write(dir.join("policy.wasm"), &module).unwrap();
        std::fs::write(dir.join("handlers.toml"), &body).unwrap();
        if i % 50 == 49 {
            let pod = format!("pod-{i}");
            let got = allocate(&daemon, &pod, "ctr", GPU, 2)
                .unwrap_or_else(|e| panic!("{e}\ndaemon log:\n{}", daemon.log_text()));
            release(&daemon, &pod, None);
            assert_eq!(
                ids(&got["device_ids"]),
                SPREAD,
                "the configured policy decides"
            );
        }
    }
    // A last change, to know every rewrite before it was seen.
    let last = format!("{body}rollback_after = 7\n");
    std::fs::write(dir.join("handlers.toml"), &last).unwrap();
    let row = wait_gpu_row(&daemon, "applying the last rewrite", |r| {
        r["rollback_after"] == 7
    });
    assert_eq!(row["sha256"], spread.as_str(), "{row}");

    let log = daemon.log_text();
    for line in log.lines() {
        assert!(
            !line.contains("entry removed") && !line.contains("builtin:device-plugin (sha256"),
            "a rewrite was taken as a decision: {line}\n\nlog:\n{log}"
        );
    }
    let events = daemon.ctl_json("events");
    for event in events.iter().filter(|e| {
        e["type"]
            .as_str()
            .is_some_and(|t| t.starts_with("handler_"))
    }) {
        let message = event["message"].as_str().unwrap_or_default();
        assert!(
            !message.contains("entry removed") && !message.contains("builtin:"),
            "a rewrite was taken as a decision: {event}"
        );
    }
}
