//! The rows timed on one daemon, each iteration with a sample of its floor.

use std::time::Instant;

use pluglet_proto::admin::v1 as admin;
use pluglet_proto::v1beta1::device_plugin_client::DevicePluginClient;

use crate::floors::{SyncFloor, bare_watch, ns_between, peer_allocate, peer_rt};
use crate::kubelet::{
    KUBELET_ADMIN_RT, KUBELET_ALLOC_1_OF_8, KUBELET_ALLOC_1_OF_1024, KUBELET_ALLOC_1024_OF_1024,
    KUBELET_GETINFO_NOTIFY, KUBELET_REGISTER, KUBELET_RELEASE, KUBELET_SOCKET_NOTIFY,
    KUBELET_UPDATE_10K,
};
use crate::node::Node;
use crate::peer_handle::Peer;
use crate::report::Row;
use crate::stages::{stage_sums, take_stages};
use crate::{CHECKPOINT, TIMEOUT, now_ns};

/// Every row timed on one daemon.
pub fn timed_rows(node: &mut Node, peer: &mut Peer, iters: usize) -> Vec<Row> {
    let mut admin_row = Row::new("admin bare round trip", Some(KUBELET_ADMIN_RT));
    let mut register = Row::new("Register → devices visible", Some(KUBELET_REGISTER));
    let mut update = Row::new(
        "ListAndWatch update of 10k → visible",
        Some(KUBELET_UPDATE_10K),
    );
    let mut a1_8 = Row::new("allocate 1 of 8", Some(KUBELET_ALLOC_1_OF_8));
    let mut a1_1024 = Row::new("allocate 1 of 1,024", Some(KUBELET_ALLOC_1_OF_1024));
    let mut a1024 = Row::new("allocate 1,024 of 1,024", Some(KUBELET_ALLOC_1024_OF_1024));
    let mut release = Row::new("release", Some(KUBELET_RELEASE));
    let mut get_info = Row::new("watcher: GetInfo → Notify", Some(KUBELET_GETINFO_NOTIFY));
    let mut created = Row::new(
        "watcher: socket created → Notify",
        Some(KUBELET_SOCKET_NOTIFY),
    );

    // The plugins the allocation rows use, and one for the floors' peer round trips.
    node.register(peer, "bench.com/a8", "a8.sock", "e", 8);
    node.register(peer, "bench.com/a1024", "a1024.sock", "k", 1024);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dial = |socket: &str| {
        DevicePluginClient::new(
            rt.block_on(pluglet_uds::connect(&node.dp_dir.join(socket), TIMEOUT))
                .expect("dial the peer"),
        )
    };
    let mut floor_client = dial("a8.sock");
    let mut a1024_client = dial("a1024.sock");
    let mut dp_sync = SyncFloor::new(&node.dp_dir, 64);
    // The floors' parts, printed as rows of their own.
    let mut part_peer = Row::new("  part: peer RT (GetDevicePluginOptions)", None);
    let mut part_dp_sync = Row::new("  part: fsync 64 B, device plugins dir", None);
    let mut part_state_sync = Row::new("  part: fsync 64 B, state dir", None);
    let mut part_big_sync = Row::new("  part: fsync checkpoint-size file", None);
    let mut part_alloc_1 = Row::new("  part: peer Allocate RT, 1 id", None);
    let mut part_alloc_1024 = Row::new("  part: peer Allocate RT, 1,024 ids", None);
    let mut part_alloc_1_after = Row::new("    of which right after the daemon's call", None);
    let mut part_delivery = Row::new("  part: peer delivers a 10k update", None);
    let mut state_sync = SyncFloor::new(&node.state, 64);
    let mut part_sync_after_peer = Row::new("  part: fsync 64 B, after a peer Allocate", None);

    // Warm-up, not counted.
    for _ in 0..20 {
        node.admin_rt();
        peer_rt(&rt, &mut floor_client);
    }

    // Admin bare round trip (no allocations).
    for _ in 0..iters {
        admin_row.samples.push(node.admin_rt());
        let part = peer_rt(&rt, &mut floor_client);
        part_peer.samples.push(part);
        admin_row.floor.push(part);
    }

    // Register → visible: one resource, re-registered on a new socket with new ids.
    for i in 0..iters {
        let (sent, visible) = node.register(
            peer,
            "bench.com/reg",
            &format!("reg{i}.sock"),
            &format!("r{i}"),
            8,
        );
        register.samples.push(ns_between(sent, visible));
        let sync = dp_sync.sample();
        part_dp_sync.samples.push(sync);
        register
            .floor
            .push(peer_rt(&rt, &mut floor_client) + peer_rt(&rt, &mut floor_client) + sync);
    }

    // Allocations and releases: one new pod each time, released right after.
    let ids_1: Vec<String> = vec!["k-0".into()];
    let ids_1024: Vec<String> = (0..1024).map(|k| format!("k-{k}")).collect();
    let mut pod = 0usize;
    let metrics_addr = node.metrics_addr.clone();
    let mut sums = metrics_addr.as_deref().map(stage_sums);
    for iteration in 0..iters {
        // The peer's Allocate is sampled after the daemon's call in even iterations and
        // before it in odd ones, so that the floor meets the peer as often just woken from
        // a wait as the daemon's call does (a peer that has just answered answers faster).
        let floor_first = iteration % 2 == 1;
        for (row, resource, count) in [
            (&mut a1_8, "bench.com/a8", 1u32),
            (&mut a1_1024, "bench.com/a1024", 1),
            (&mut a1024, "bench.com/a1024", 1024),
        ] {
            pod += 1;
            let uid = format!("pod-{pod}");
            let (client, ids) = if resource == "bench.com/a8" {
                (&mut floor_client, &ids_1)
            } else if count == 1 {
                (&mut a1024_client, &ids_1)
            } else {
                (&mut a1024_client, &ids_1024)
            };
            let before = floor_first.then(|| peer_allocate(&rt, client, ids));
            let t = Instant::now();
            let answer = node
                .rt
                .block_on(node.admin.allocate(admin::AllocateRequest {
                    pod_uid: uid.clone(),
                    container: "c".into(),
                    resource: resource.into(),
                    count,
                    ..Default::default()
                }))
                .expect("admin Allocate");
            row.samples.push(t.elapsed());
            assert_eq!(answer.into_inner().device_ids.len(), count as usize);
            let peer_part = match before {
                Some(before) => before,
                None => {
                    let after = peer_allocate(&rt, client, ids);
                    if count == 1 {
                        part_sync_after_peer.samples.push(state_sync.sample());
                        part_alloc_1_after.samples.push(after);
                    }
                    after
                }
            };
            if count == 1 {
                part_alloc_1.samples.push(peer_part);
            } else {
                part_alloc_1024.samples.push(peer_part);
            }

            let t = Instant::now();
            node.rt
                .block_on(node.admin.release(admin::ReleaseRequest {
                    pod_uid: uid,
                    container: String::new(),
                }))
                .expect("admin Release");
            release.samples.push(t.elapsed());

            let admin_part = node.admin_rt();
            let sync_part = state_sync.sample();
            part_state_sync.samples.push(sync_part);
            row.floor.push(admin_part + peer_part + sync_part);
            release.floor.push(admin_part + state_sync.sample());
            if let (Some(addr), Some(before)) = (metrics_addr.as_deref(), sums.as_ref()) {
                sums = Some(take_stages(addr, before, row, &mut release));
            }
        }
    }

    // One ListAndWatch update of 10,000 devices: device 0's health flipped each time.
    node.register(peer, "bench.com/u10k", "u10k.sock", "u", 10_000);
    let size = std::fs::metadata(node.dp_dir.join(CHECKPOINT))
        .map(|m| m.len() as usize)
        .unwrap_or(1);
    let mut big_sync = SyncFloor::new(&node.dp_dir, size);
    let socket = node.dp_dir.join("u10k.sock");
    // The floor's delivery part: the same 10,000 devices served by the peer on a socket the
    // daemon does not know, read by a bare receiver of the bench's own.
    let bare_socket = node.dp_dir.join("f10k.sock");
    peer.send(&format!("serve {} f 10000", bare_socket.display()));
    peer.expect("SERVING");
    let mut bare = bare_watch(&rt, &bare_socket);
    for i in 0..iters {
        let unhealthy = i % 2 == 0;
        node.events.drain();
        peer.send(&format!("flip {}", socket.display()));
        let sent: u64 = peer.expect("SENT")[1].parse().expect("SENT time");
        let visible = node.events.checkpoint(&node.dp_dir, sent, |t| {
            t.contains("\"u-1\"") && t.contains("\"u-0\"") != unhealthy
        });
        update.samples.push(ns_between(sent, visible));
        let sync = big_sync.sample();
        part_big_sync.samples.push(sync);
        peer.send(&format!("flip {}", bare_socket.display()));
        let sent: u64 = peer.expect("SENT")[1].parse().expect("SENT time");
        rt.block_on(bare.message())
            .expect("the bare receiver's update")
            .expect("an update");
        let delivered = ns_between(sent, now_ns());
        part_delivery.samples.push(delivered);
        update.floor.push(delivered + sync);
    }
    drop(bare);

    // The watcher: one new CSI driver socket each time.
    for i in 0..iters {
        let name = format!("csi{i}.bench.com");
        let socket = node.registry.join(format!("csi{i}.sock"));
        node.events.drain();
        peer.send(&format!("csi {} {name}", socket.display()));
        peer.expect("BOUND");
        let made = node.events.wait_for(&socket, 0, || true);
        let words = peer.expect("NOTIFY");
        assert_eq!(words[1], name);
        assert_eq!(words[4], "true", "CSI registration refused");
        let got: u64 = words[2].parse().expect("GetInfo time");
        let notified: u64 = words[3].parse().expect("Notify time");
        get_info.samples.push(ns_between(got, notified));
        created.samples.push(ns_between(made, notified));
        let (a, b, c) = (
            peer_rt(&rt, &mut floor_client),
            peer_rt(&rt, &mut floor_client),
            peer_rt(&rt, &mut floor_client),
        );
        get_info.floor.push(a + b);
        created.floor.push(a + b + c);
    }

    vec![
        register,
        update,
        a1_8,
        a1_1024,
        a1024,
        release,
        admin_row,
        get_info,
        created,
        part_peer,
        part_alloc_1,
        part_alloc_1_after,
        part_alloc_1024,
        part_dp_sync,
        part_state_sync,
        part_sync_after_peer,
        part_big_sync,
        part_delivery,
    ]
}
