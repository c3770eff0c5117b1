//! Allocations in parallel: `CLIENTS` clients over `RESOURCES` resources (one device plugin of
//! `DEVICES` devices each), every client running allocate 1 + release in a loop on an admin
//! connection of its own, against one client alone on the same daemon.
//!
//! Prints the allocations per second, the allocate p50 / p99 of each, the journal syncs per
//! allocation and per operation (from `/metrics`: `pluglet_journal_syncs_total` against the
//! allocations and releases made), and the CPU time per allocation of the daemon, the peer and
//! this process (the clients), from `/proc/<pid>/stat`: what is left of the limit shows where
//! the time goes.

use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use pluglet_proto::admin::v1 as admin;
use pluglet_proto::admin::v1::admin_client::AdminClient;

use crate::TIMEOUT;
use crate::node::Node;
use crate::peer_handle::Peer;
use crate::report::pct;
use crate::stages::{counter, scrape};

/// Concurrent clients.
const CLIENTS: usize = 16;
/// Resources they share (client `i` uses resource `i % RESOURCES`).
const RESOURCES: usize = 4;
/// Devices per resource.
const DEVICES: usize = 64;
/// The kubelet's rate with one client (allocations per second, side by side, Python peer).
const KUBELET_ONE_CLIENT_RATE: f64 = 570.0;

/// One phase's outcome: allocations made, how long, each allocate's latency.
struct Phase {
    allocations: usize,
    wall: Duration,
    latencies: Vec<Duration>,
    syncs: f64,
    /// CPU seconds of the daemon, the peer and the clients.
    cpu: [f64; 3],
    /// Of the daemon's, the seconds spent in the kernel.
    daemon_sys: f64,
}

/// Registers the plugins and runs one client alone, then `CLIENTS` together, each making
/// `per_client` allocations (the lone client makes as many as one of the parallel ones).
pub fn parallel_rows(node: &mut Node, peer: &mut Peer, per_client: usize) {
    let addr = node
        .metrics_addr
        .clone()
        .expect("the parallel rows read /metrics: start the daemon with Node::start_timed");
    for r in 0..RESOURCES {
        node.register(
            peer,
            &format!("bench.com/p{r}"),
            &format!("p{r}.sock"),
            &format!("p{r}"),
            DEVICES,
        );
    }
    let sock = node
        .state
        .parent()
        .expect("the state dir is under the root")
        .join("pluglet.sock");
    let pids = [node.daemon.pid(), peer.child.id(), std::process::id()];
    // Warm-up: every client's connection and resource once, not counted.
    run_phase(&sock, &addr, pids, CLIENTS, 2, "warm");
    let one = run_phase(&sock, &addr, pids, 1, per_client, "one");
    let many = run_phase(&sock, &addr, pids, CLIENTS, per_client, "many");

    println!(
        "\nallocations in parallel ({RESOURCES} device plugins of {DEVICES} devices; each client: allocate 1 + release in a loop, its own admin connection)"
    );
    println!(
        "{:<22} {:>7} {:>10} {:>9} {:>9} {:>11} {:>11}   CPU ms per allocation: {:>7} {:>10} {:>7} {:>7}",
        "clients",
        "allocs",
        "allocs/s",
        "p50 ms",
        "p99 ms",
        "syncs/alloc",
        "syncs/op",
        "daemon",
        "(of it sys)",
        "peer",
        "clients"
    );
    for (name, phase) in [("1", &one), (&*format!("{CLIENTS}"), &many)] {
        let mut sorted = phase.latencies.clone();
        sorted.sort();
        let n = phase.allocations as f64;
        println!(
            "{:<22} {:>7} {:>10.0} {:>9.3} {:>9.3} {:>11.3} {:>11.3}   {:>29.3} {:>10.3} {:>7.3} {:>7.3}",
            name,
            phase.allocations,
            n / phase.wall.as_secs_f64(),
            pct(&sorted, 0.5),
            pct(&sorted, 0.99),
            phase.syncs / n,
            phase.syncs / (2.0 * n),
            phase.cpu[0] * 1e3 / n,
            phase.daemon_sys * 1e3 / n,
            phase.cpu[1] * 1e3 / n,
            phase.cpu[2] * 1e3 / n,
        );
    }
    let rate = many.allocations as f64 / many.wall.as_secs_f64();
    let mut sorted = one.latencies.clone();
    sorted.sort();
    let one_p50 = pct(&sorted, 0.5);
    let mut sorted = many.latencies.clone();
    sorted.sort();
    let many_p99 = pct(&sorted, 0.99);
    let busy = many.cpu.iter().sum::<f64>() / many.wall.as_secs_f64();
    println!(
        "{CLIENTS} clients: {:.2}× the kubelet's one-client rate ({KUBELET_ONE_CLIENT_RATE}/s; goal ≥ 3×), p99 {:.2}× one client's p50 (goal ≤ 3×); CPU busy {:.2} of {} cores (daemon + peer + clients)",
        rate / KUBELET_ONE_CLIENT_RATE,
        many_p99 / one_p50,
        busy,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
}

/// `clients` clients making `per_client` allocations each, started together.
fn run_phase(
    sock: &Path,
    addr: &str,
    pids: [u32; 3],
    clients: usize,
    per_client: usize,
    tag: &str,
) -> Phase {
    let barrier = Arc::new(Barrier::new(clients + 1));
    let threads: Vec<_> = (0..clients)
        .map(|client| {
            let (sock, barrier, tag) = (sock.to_owned(), barrier.clone(), tag.to_owned());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let mut admin = AdminClient::new(
                    rt.block_on(pluglet_uds::connect(&sock, TIMEOUT))
                        .expect("dial the admin socket"),
                );
                let resource = format!("bench.com/p{}", client % RESOURCES);
                let mut latencies = Vec::with_capacity(per_client);
                barrier.wait();
                for k in 0..per_client {
                    let pod_uid = format!("par-{tag}-{client}-{k}");
                    let t = Instant::now();
                    let answer = rt
                        .block_on(admin.allocate(admin::AllocateRequest {
                            pod_uid: pod_uid.clone(),
                            container: "c".into(),
                            resource: resource.clone(),
                            count: 1,
                            ..Default::default()
                        }))
                        .expect("admin Allocate");
                    latencies.push(t.elapsed());
                    assert_eq!(answer.into_inner().device_ids.len(), 1);
                    rt.block_on(admin.release(admin::ReleaseRequest {
                        pod_uid,
                        container: String::new(),
                    }))
                    .expect("admin Release");
                }
                latencies
            })
        })
        .collect();
    let syncs_before = counter(&scrape(addr), "pluglet_journal_syncs_total");
    let cpu_before = pids.map(cpu_seconds);
    let sys_before = cpu_seconds_split(pids[0]).1;
    barrier.wait();
    let started = Instant::now();
    let latencies: Vec<Duration> = threads
        .into_iter()
        .flat_map(|t| t.join().expect("a client panicked"))
        .collect();
    let wall = started.elapsed();
    let cpu_after = pids.map(cpu_seconds);
    let sys_after = cpu_seconds_split(pids[0]).1;
    let syncs = counter(&scrape(addr), "pluglet_journal_syncs_total") - syncs_before;
    Phase {
        allocations: latencies.len(),
        wall,
        latencies,
        syncs,
        cpu: [0, 1, 2].map(|i| cpu_after[i] - cpu_before[i]),
        daemon_sys: sys_after - sys_before,
    }
}

/// User + system CPU time of process `pid` so far, seconds (`/proc/<pid>/stat`, every thread).
fn cpu_seconds(pid: u32) -> f64 {
    let (user, sys) = cpu_seconds_split(pid);
    user + sys
}

/// User and system CPU time of process `pid` so far, seconds, apart.
fn cpu_seconds_split(pid: u32) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/PID/stat");
    // The fields after the command name (in parentheses, which may hold spaces): utime and
    // stime are the 12th and 13th of them, in clock ticks.
    let rest = &stat[stat.rfind(')').expect("a stat line") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let user: f64 = fields[11].parse().expect("utime");
    let sys: f64 = fields[12].parse().expect("stime");
    (user / clock_ticks(), sys / clock_ticks())
}

/// Clock ticks per second of `/proc/<pid>/stat` (the kernel's `USER_HZ`, 100 on Linux
/// whatever the kernel's own tick rate).
fn clock_ticks() -> f64 {
    100.0
}
