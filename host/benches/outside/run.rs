//! The whole run: memory at start and at rest, the timed rows on one daemon, and the first
//! registration of 10,000 devices on fresh daemons.

use crate::floors::{SyncFloor, ns_between, peer_rt};
use crate::kubelet::{KUBELET_FIRST_10K, KUBELET_IDLE_RSS_MB};
use crate::node::{Node, fresh_root, mb};
use crate::parallel::parallel_rows;
use crate::peer_handle::{Peer, python};
use crate::report::{Row, print_rows};
use crate::scale::scale_rows;
use crate::stages::print_stages;
use crate::timed_rows::timed_rows;
use crate::{CHECKPOINT, SETTLE, env_count};

pub fn run() {
    let iters = env_count("PLUGLET_BENCH_ITERS", 200);
    let first_runs = env_count("PLUGLET_BENCH_FIRST_RUNS", 10);
    println!(
        "pluglet measured from outside: {iters} iterations per row, {first_runs} first-registration daemons, {} peer, CDI specs {}",
        if python().is_some() { "Python" } else { "Rust" },
        if std::env::var("PLUGLET_BENCH_CDI_DIR").is_ok_and(|v| v == "root") {
            "under --root (PLUGLET_BENCH_CDI_DIR=root)"
        } else {
            "in /dev/shm (a tmpfs, as /var/run/cdi on a systemd node)"
        }
    );
    if std::env::var("PLUGLET_BENCH_ROWS").is_ok_and(|v| v == "parallel") {
        let root = fresh_root(None);
        let mut node = Node::start_timed(root.path());
        let mut peer = Peer::start(&node.dp_dir.join("kubelet.sock"));
        parallel_rows(&mut node, &mut peer, iters);
        drop(peer);
        node.daemon.stop();
        return;
    }
    if std::env::var("PLUGLET_BENCH_ROWS").is_ok_and(|v| v == "scale") {
        scale_rows(iters);
        return;
    }
    let mut memory_lines: Vec<String> = Vec::new();
    let mut note = |line: String| {
        println!("{line}");
        memory_lines.push(line);
    };

    // Cold start (fresh root), then warm start (same root, compile cache filled).
    let cache_root = fresh_root(None);
    let cold = Node::start(cache_root.path());
    let (rss, hwm) = cold.memory();
    let ready = cold.start_to_ready;
    std::thread::sleep(SETTLE);
    let (rss_s, hwm_s) = cold.memory();
    note(format!(
        "start, cold cache: ready in {:.0} ms; at ready RSS {} HWM {}; after settle RSS {} peak (HWM) {}",
        ready.as_secs_f64() * 1e3,
        mb(rss),
        mb(hwm),
        mb(rss_s),
        mb(hwm_s)
    ));
    cold.daemon.stop();

    let mut node = Node::start(cache_root.path());
    let (rss, hwm) = node.memory();
    let (rss_s, hwm_s) = node.settle_and_read();
    note(format!(
        "start, warm cache: ready in {:.0} ms; at ready RSS {} HWM {}; after settle RSS {} peak (HWM) {}",
        node.start_to_ready.as_secs_f64() * 1e3,
        mb(rss),
        mb(hwm),
        mb(rss_s),
        mb(hwm_s)
    ));
    note(format!(
        "idle, no plugin (`pluglet run --root`): RSS {} (HWM {})",
        mb(rss_s),
        mb(hwm_s)
    ));

    let mut peer = Peer::start(&node.dp_dir.join("kubelet.sock"));
    node.register(&mut peer, "bench.com/idle", "idle.sock", "i", 8);
    let (rss_one, hwm_one) = node.settle_and_read();
    note(format!(
        "idle, one plugin of 8 devices: RSS {} (HWM {}); kubelet device manager alone {KUBELET_IDLE_RSS_MB} MB",
        mb(rss_one),
        mb(hwm_one)
    ));
    let more = 10;
    for j in 0..more {
        node.register(
            &mut peer,
            &format!("bench.com/m{j}"),
            &format!("m{j}.sock"),
            &format!("m{j}"),
            8,
        );
    }
    let (rss_more, hwm_more) = node.settle_and_read();
    note(format!(
        "per device plugin (10 more of 8 devices): +{:.0} kB each (RSS {}, HWM {})",
        (rss_more as f64 - rss_one as f64) / more as f64,
        mb(rss_more),
        mb(hwm_more)
    ));
    node.register(&mut peer, "bench.com/m10k", "m10k.sock", "n", 10_000);
    let (rss_10k, hwm_10k) = node.settle_and_read();
    note(format!(
        "one more plugin of 10,000 devices on that daemon: +{:.1} MB (RSS {}, HWM {})",
        (rss_10k as f64 - rss_more as f64) / 1000.0,
        mb(rss_10k),
        mb(hwm_10k)
    ));
    let handler_cache = cache_root.path().join("state");
    drop(peer);
    node.daemon.stop();
    drop(node.events);

    // The timed rows, on a fresh root with the warm compile cache copied in.
    let root = fresh_root(Some(&handler_cache));
    let mut node = Node::start_timed(root.path());
    let mut peer = Peer::start(&node.dp_dir.join("kubelet.sock"));
    let mut rows = timed_rows(&mut node, &mut peer, iters);
    parallel_rows(&mut node, &mut peer, iters);
    drop(peer);
    node.daemon.stop();
    drop(node.events);

    // First registration of 10,000 devices: one fresh daemon each (warm cache).
    let mut first = Row::new(
        "first registration of 10k → visible",
        Some(KUBELET_FIRST_10K),
    );
    let mut per_10k = Vec::new();
    for run in 0..first_runs {
        let root = fresh_root(Some(&handler_cache));
        let mut node = Node::start(root.path());
        let mut peer = Peer::start(&node.dp_dir.join("kubelet.sock"));
        node.register(&mut peer, "bench.com/warm", "warm.sock", "w", 1);
        let (before, _) = node.settle_and_read();
        let (sent, visible) =
            node.register(&mut peer, "bench.com/first", "first.sock", "f", 10_000);
        first.samples.push(ns_between(sent, visible));
        let size = std::fs::metadata(node.dp_dir.join(CHECKPOINT))
            .map(|m| m.len() as usize)
            .unwrap_or(1);
        let (after, _) = node.settle_and_read();
        per_10k.push(after as i64 - before as i64);
        let mut client = node.dial_plugin("first.sock");
        let mut sync = SyncFloor::new(&node.dp_dir, size);
        let floor = peer_rt(&node.rt, &mut client) + peer_rt(&node.rt, &mut client) + sync.sample();
        first.floor.push(floor);
        println!(
            "first registration daemon {run}: ready in {:.0} ms, checkpoint with 10,001 devices {size} bytes, RSS before {} after {}",
            node.start_to_ready.as_secs_f64() * 1e3,
            mb(before),
            mb(after)
        );
        drop(peer);
        node.daemon.stop();
    }
    per_10k.sort();
    if !per_10k.is_empty() {
        note(format!(
            "per 10,000 devices on a fresh daemon (one plugin, settled, median of {}): {:+.1} MB (range {:+.1} to {:+.1})",
            per_10k.len(),
            per_10k[per_10k.len() / 2] as f64 / 1000.0,
            per_10k[0] as f64 / 1000.0,
            per_10k[per_10k.len() - 1] as f64 / 1000.0
        ));
    }
    rows.insert(2, first);

    println!("\nmemory (VmRSS / VmHWM of the daemon):");
    for line in &memory_lines {
        println!("  {line}");
    }
    print_rows(&mut rows);
    print_stages(&mut rows);
}
