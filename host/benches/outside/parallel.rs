//! Allocations in parallel: `CLIENTS` clients over `RESOURCES` resources (one device plugin of
//! `DEVICES` devices each), every client running allocate 1 + release in a loop on an admin
//! connection of its own, against one client alone on the same daemon. The bench's one peer
//! process serves every plugin, as when the goals were set; `PLUGLET_BENCH_PEERS=each` starts a
//! peer process per plugin instead, as on a node where every vendor's plugin runs apart (with
//! the Python peer: four interpreters, each with its own lock).
//!
//! Prints the allocations per second, the allocate p50 / p99 of each, the journal syncs per
//! allocation and per operation (from `/metrics`: `pluglet_journal_syncs_total` against the
//! allocations and releases made), the allocations per Allocate call the plugins saw
//! (`pluglet_device_plugin_allocate_calls_total`), and the CPU time per allocation of the
//! daemon, the peer and this process (the clients), from `/proc/<pid>/stat`: what is left of
//! the limit shows where the time goes. Then the mean time per allocation of each step inside
//! the daemon (from `pluglet_device_stage_duration_seconds`), one client against all of them:
//! the steps that grow are where the clients wait.
//!
//! Then the floor the machine sets, measured in the same run: a client's cycle (allocate,
//! release, and its own work between) cannot be shorter on average than Little's law allows
//! when the cores run nothing but the peer's and the clients' share of each allocation, as if
//! the daemon cost nothing: `CLIENTS × (peer + clients CPU per allocation) / cores`. Beside it,
//! the allocate p99 that the goal asks for, read two ways: 3× this daemon's one-client p50, and
//! 3× the kubelet's one-client time per allocation (`1 / KUBELET_ONE_CLIENT_RATE`).

use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use pluglet_proto::admin::v1 as admin;
use pluglet_proto::admin::v1::admin_client::AdminClient;

use crate::TIMEOUT;
use crate::node::Node;
use crate::peer_handle::Peer;
use crate::report::pct;
use crate::stages::{STAGES, StageSums, counter, scrape, stage_sums, stages_since};

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
    /// Each client's whole cycles (allocate + release + its own work), as measured.
    cycles: Vec<Duration>,
    syncs: f64,
    /// The plugins' Allocate calls.
    calls: f64,
    /// CPU seconds of the daemon, the peer and the clients.
    cpu: [f64; 3],
    /// Of the daemon's, the seconds spent in the kernel.
    daemon_sys: f64,
    /// Seconds in each step of the daemon's allocations and releases.
    stages: StageSums,
}

/// Registers the plugins and runs one client alone, then `CLIENTS` together, each making
/// `per_client` allocations (the lone client makes as many as one of the parallel ones).
pub fn parallel_rows(node: &mut Node, peer: &mut Peer, per_client: usize) {
    let addr = node
        .metrics_addr
        .clone()
        .expect("the parallel rows read /metrics: start the daemon with Node::start_timed");
    let each = std::env::var("PLUGLET_BENCH_PEERS").is_ok_and(|v| v == "each");
    let mut own: Vec<Peer> = if each {
        (0..RESOURCES)
            .map(|_| Peer::start(&node.dp_dir.join("kubelet.sock")))
            .collect()
    } else {
        Vec::new()
    };
    for r in 0..RESOURCES {
        let serving = match own.get_mut(r) {
            Some(own) => own,
            None => &mut *peer,
        };
        node.register(
            serving,
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
    let peers: Vec<u32> = if own.is_empty() {
        vec![peer.child.id()]
    } else {
        own.iter().map(|p| p.child.id()).collect()
    };
    let pids = Pids {
        daemon: node.daemon.pid(),
        peers: &peers,
    };
    // Warm-up: every client's connection and resource once, not counted.
    run_phase(&sock, &addr, &pids, CLIENTS, 2, "warm");
    let one = run_phase(&sock, &addr, &pids, 1, per_client, "one");
    let many = run_phase(&sock, &addr, &pids, CLIENTS, per_client, "many");

    println!(
        "\nallocations in parallel ({RESOURCES} device plugins of {DEVICES} devices, {} peer process(es); each client: allocate 1 + release in a loop, its own admin connection)",
        peers.len()
    );
    println!(
        "{:<22} {:>7} {:>10} {:>9} {:>9} {:>11} {:>11} {:>11}   CPU ms per allocation: {:>7} {:>10} {:>7} {:>7}",
        "clients",
        "allocs",
        "allocs/s",
        "p50 ms",
        "p99 ms",
        "syncs/alloc",
        "syncs/op",
        "allocs/call",
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
            "{:<22} {:>7} {:>10.0} {:>9.3} {:>9.3} {:>11.3} {:>11.3} {:>11.2}   {:>29.3} {:>10.3} {:>7.3} {:>7.3}",
            name,
            phase.allocations,
            n / phase.wall.as_secs_f64(),
            pct(&sorted, 0.5),
            pct(&sorted, 0.99),
            phase.syncs / n,
            phase.syncs / (2.0 * n),
            n / phase.calls,
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
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "{CLIENTS} clients: {:.2}× the kubelet's one-client rate ({KUBELET_ONE_CLIENT_RATE}/s; goal ≥ 3×), p99 {:.2}× one client's p50 (goal ≤ 3×); CPU busy {:.2} of {cores} cores (daemon + peer + clients)",
        rate / KUBELET_ONE_CLIENT_RATE,
        many_p99 / one_p50,
        busy,
    );
    print_steps(&one, &many);
    print_floor(&many, one_p50, many_p99, cores);
}

/// The mean time per allocation of each step inside the daemon, one client against many.
fn print_steps(one: &Phase, many: &Phase) {
    println!("inside the daemon, mean µs per allocation of each step (1 client → {CLIENTS})");
    for operation in ["allocate", "release"] {
        let mut line = format!("  {operation:<9}");
        for stage in STAGES {
            let key = (operation.to_owned(), stage.to_owned());
            let (Some(a), Some(b)) = (one.stages.get(&key), many.stages.get(&key)) else {
                continue;
            };
            let per = |total: f64, phase: &Phase| total * 1e6 / phase.allocations as f64;
            line += &format!(" {stage} {:.0} → {:.0};", per(*a, one), per(*b, many));
        }
        println!("{line}");
    }
}

/// The floor the cores set on the `CLIENTS` clients' cycle (see the module doc), against the
/// cycle and the allocate measured, and the p99 goal read both ways.
fn print_floor(many: &Phase, one_p50: f64, many_p99: f64, cores: usize) {
    let n = many.allocations as f64;
    let others_ms = (many.cpu[1] + many.cpu[2]) * 1e3 / n;
    let cycle_floor = CLIENTS as f64 * others_ms / cores as f64;
    let mean_ms = |d: &[Duration]| d.iter().sum::<Duration>().as_secs_f64() * 1e3 / d.len() as f64;
    let goal_here = 3.0 * one_p50;
    let goal_kubelet = 3.0 * 1e3 / KUBELET_ONE_CLIENT_RATE;
    println!(
        "floor: the peer and the clients took {others_ms:.3} ms of CPU per allocation, so on {cores} cores {CLIENTS} clients' cycles average at least {cycle_floor:.2} ms even with a daemon that costs nothing (measured: cycle mean {:.2} ms, allocate mean {:.2} ms, {:.0} % of it; p99 {many_p99:.2} ms)",
        mean_ms(&many.cycles),
        mean_ms(&many.latencies),
        100.0 * mean_ms(&many.latencies) / mean_ms(&many.cycles),
    );
    for (reading, goal) in [
        ("3× one client's p50 here", goal_here),
        (
            "3× the kubelet's one-client time per allocation",
            goal_kubelet,
        ),
    ] {
        println!(
            "  allocate p99 goal, {reading}: {goal:.2} ms; the cycle's floor is {:.2}× it",
            cycle_floor / goal,
        );
    }
}

/// The processes whose CPU time a phase reads (the clients are this process).
struct Pids<'a> {
    daemon: u32,
    peers: &'a [u32],
}

impl Pids<'_> {
    /// CPU seconds so far of the daemon, the peers and the clients, and of the daemon's the
    /// seconds in the kernel.
    fn cpu(&self) -> ([f64; 3], f64) {
        let (user, sys) = cpu_seconds_split(self.daemon);
        let cpu = [
            user + sys,
            self.peers.iter().copied().map(cpu_seconds).sum(),
            cpu_seconds(std::process::id()),
        ];
        (cpu, sys)
    }
}

/// `clients` clients making `per_client` allocations each, started together.
fn run_phase(
    sock: &Path,
    addr: &str,
    pids: &Pids<'_>,
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
                let mut cycles = Vec::with_capacity(per_client);
                barrier.wait();
                let mut cycle_start = Instant::now();
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
                    let now = Instant::now();
                    cycles.push(now - cycle_start);
                    cycle_start = now;
                }
                (latencies, cycles)
            })
        })
        .collect();
    let counters = |text: &str| {
        [
            "pluglet_journal_syncs_total",
            "pluglet_device_plugin_allocate_calls_total",
        ]
        .map(|name| counter(text, name))
    };
    let before = counters(&scrape(addr));
    let (cpu_before, sys_before) = pids.cpu();
    let stages_before = stage_sums(addr);
    barrier.wait();
    let started = Instant::now();
    let (mut latencies, mut cycles) = (Vec::new(), Vec::new());
    for thread in threads {
        let (l, c) = thread.join().expect("a client panicked");
        latencies.extend(l);
        cycles.extend(c);
    }
    let wall = started.elapsed();
    let (cpu_after, sys_after) = pids.cpu();
    let after = counters(&scrape(addr));
    let [syncs, calls] = [0, 1].map(|i| after[i] - before[i]);
    let stages = stages_since(&stage_sums(addr), &stages_before);
    Phase {
        allocations: latencies.len(),
        wall,
        latencies,
        cycles,
        syncs,
        calls,
        cpu: [0, 1, 2].map(|i| cpu_after[i] - cpu_before[i]),
        daemon_sys: sys_after - sys_before,
        stages,
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
