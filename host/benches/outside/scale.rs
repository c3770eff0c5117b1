//! The scale of one node (`PLUGLET_BENCH_ROWS=scale`, Rust peer only): a thousand device
//! plugins registering at once, a plugin of 100,000 devices, allocations among them, and a
//! restart with 10,000 allocations held.
//!
//! - "1,000 plugins at once → all visible": the peer serves `PLUGINS` device plugins of 8
//!   devices and sends their `Register` calls together, each on its own connection; from the
//!   first `Register` sent to the checkpoint rename that carries a device of every one of them;
//! - memory per plugin: `VmRSS` after the settle, before and after them;
//! - memory per 10,000 devices: a plugin of `BIG` devices on a fresh daemon, `VmRSS` before and
//!   after it is visible (settled);
//! - allocate 1 of 100,000: admin `Allocate` + `Release` of one device on that plugin;
//! - restart with 10,000 held: `HELD` pods hold one device each; the daemon is stopped
//!   (SIGTERM) and started again on the same root; from the spawn to the admin API answering
//!   `ListAllocations` with all of them, and to the plugin's devices being allocatable again
//!   (the peer registers again, as a device plugin does when `kubelet.sock` comes back).

use std::time::Instant;

use pluglet_proto::admin::v1 as admin;

use crate::floors::ns_between;
use crate::node::{Node, fresh_root, mb};
use crate::peer_handle::{Peer, python};
use crate::report::pct;

/// Device plugins registering at once.
const PLUGINS: usize = 1000;
/// Devices of the big plugin.
const BIG: usize = 100_000;
/// Allocations held across the restart.
const HELD: usize = 10_000;

pub fn scale_rows(iters: usize) {
    assert!(
        python().is_none(),
        "the scale rows run with the Rust peer: unset PLUGLET_BENCH_PEER"
    );
    // A thousand plugins at once.
    let root = fresh_root(None);
    let mut node = Node::start(root.path());
    let mut peer = Peer::start(&node.dp_dir.join("kubelet.sock"));
    node.register(&mut peer, "bench.com/first", "first.sock", "f", 8);
    let (before, _) = node.settle_and_read();
    node.events.drain();
    let sent = peer.device_plugins(PLUGINS, &node.dp_dir, "bench.com/many", "m", 8);
    let markers: Vec<String> = (0..PLUGINS).map(|i| format!("\"m{i}-0\"")).collect();
    let visible = node.events.checkpoint(&node.dp_dir, sent, |text| {
        markers.iter().all(|m| text.contains(m.as_str()))
    });
    let took = ns_between(sent, visible);
    let (after, hwm) = node.settle_and_read();
    println!(
        "{PLUGINS} device plugins of 8 devices registering at once → all visible: {:.0} ms (goal ≤ 2,000 ms)",
        took.as_secs_f64() * 1e3
    );
    println!(
        "memory with {PLUGINS} more plugins: RSS {} → {} (HWM {}), {:+.1} kB per plugin",
        mb(before),
        mb(after),
        mb(hwm),
        (after as f64 - before as f64) / PLUGINS as f64
    );
    drop(peer);
    node.daemon.stop();

    // 100,000 devices, allocations among them, a restart with 10,000 held.
    let root = fresh_root(None);
    let mut node = Node::start(root.path());
    let mut peer = Peer::start(&node.dp_dir.join("kubelet.sock"));
    node.register(&mut peer, "bench.com/first", "first.sock", "f", 8);
    let (before, _) = node.settle_and_read();
    let (sent, visible) = node.register(&mut peer, "bench.com/big", "big.sock", "b", BIG);
    let (after, hwm) = node.settle_and_read();
    println!(
        "a plugin of {BIG} devices: visible in {:.0} ms; RSS {} → {} (HWM {}), {:+.2} MB per 10,000 devices (goal ≤ 1 MB)",
        ns_between(sent, visible).as_secs_f64() * 1e3,
        mb(before),
        mb(after),
        mb(hwm),
        (after as f64 - before as f64) / 1000.0 / (BIG as f64 / 10_000.0)
    );
    let mut samples = Vec::with_capacity(iters);
    for k in 0..iters {
        let pod_uid = format!("one-{k}");
        let t = Instant::now();
        allocate(&mut node, &pod_uid, "bench.com/big");
        samples.push(t.elapsed());
        node.rt
            .block_on(node.admin.release(admin::ReleaseRequest {
                pod_uid,
                container: String::new(),
            }))
            .expect("admin Release");
    }
    samples.sort();
    println!(
        "allocate 1 of {BIG}: p50 {:.3} ms, p99 {:.3} ms over {iters} (goal p50 ≤ 5 ms)",
        pct(&samples, 0.5),
        pct(&samples, 0.99)
    );

    for k in 0..HELD {
        allocate(&mut node, &format!("held-{k}"), "bench.com/big");
    }
    let (held_rss, _) = node.settle_and_read();
    println!(
        "{HELD} allocations held among {BIG} devices: RSS {}",
        mb(held_rss)
    );
    drop(peer);
    node.daemon.stop();
    let (t0, spawned) = (Instant::now(), crate::now_ns());
    let mut node = Node::start(root.path());
    let listed = node
        .rt
        .block_on(
            node.admin
                .list_allocations(admin::ListAllocationsRequest {}),
        )
        .expect("ListAllocations")
        .into_inner();
    let ready = t0.elapsed();
    let held = listed
        .allocations
        .iter()
        .filter(|a| a.pod_uid.starts_with("held-"))
        .count();
    assert_eq!(held, HELD, "every allocation held across the restart");
    let mut peer = Peer::start(&node.dp_dir.join("kubelet.sock"));
    let (_, visible) = node.register(&mut peer, "bench.com/big", "big-2.sock", "b", BIG);
    let allocatable = ns_between(spawned, visible);
    println!(
        "restart with {HELD} held and {BIG} devices: admin answers with every allocation {:.0} ms after the spawn (start to ready; goal ≤ 1 s); the plugin's devices visible again {:.0} ms after the spawn; RSS {}",
        ready.as_secs_f64() * 1e3,
        allocatable.as_secs_f64() * 1e3,
        mb(node.memory().0)
    );
    drop(peer);
    node.daemon.stop();
}

fn allocate(node: &mut Node, pod_uid: &str, resource: &str) {
    let answer = node
        .rt
        .block_on(node.admin.allocate(admin::AllocateRequest {
            pod_uid: pod_uid.into(),
            container: "c".into(),
            resource: resource.into(),
            count: 1,
            ..Default::default()
        }))
        .expect("admin Allocate");
    assert_eq!(answer.into_inner().device_ids.len(), 1);
}
