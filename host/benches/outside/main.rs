//! Pluglet measured from outside: the real `pluglet run` binary and real peer processes, timed
//! only at points a black-box observer sees, the way the kubelet's own device manager and
//! plugin manager code was measured for the comparison in `BENCHMARKS.md` ("Measured from
//! outside").
//!
//! Run: `cargo bench -p pluglet --bench outside`. `PLUGLET_BENCH_ITERS` (default 200) sets the
//! iterations per timed row, `PLUGLET_BENCH_FIRST_RUNS` (default 10) the daemons started for
//! the "first registration of 10,000 devices" row and the memory per 10,000 devices;
//! `PLUGLET_BENCH_DAEMON_ARGS` adds options to every `pluglet run` (e.g. `--no-cdi`);
//! `PLUGLET_BENCH_BIN` names another `pluglet` binary to measure (an A/B of two builds);
//! `PLUGLET_BENCH_ROWS=parallel` runs only the allocations in parallel (`parallel.rs`), on a
//! daemon of their own (`PLUGLET_BENCH_PEERS=each`: a peer process per plugin there);
//! `PLUGLET_BENCH_ROWS=scale` only the scale of one node (`scale.rs`:
//! a thousand plugins at once, 100,000 devices, a restart with 10,000 allocations held).
//!
//! # Processes
//!
//! - the daemon: `pluglet run --root <tempdir>` (the release binary cargo builds for this
//!   bench), `RUST_LOG=warn`, its log in `<root>/pluglet.log`; its CDI specs in a fresh
//!   directory on the tmpfs `/dev/shm` (`--cdi-spec-dir`), as `/var/run/cdi` is a tmpfs on a
//!   systemd node (`PLUGLET_BENCH_CDI_DIR=root` leaves them under the root, on its disk); the
//!   daemon of the timed rows also serves `/metrics` on a loopback port, from which the
//!   allocation and release rows read how long each step inside the daemon took
//!   (`pluglet_device_stage_duration_seconds`, read after each allocation and its release,
//!   outside the timed calls; printed as p50 per step under the table);
//! - the peer: this same bench executable started again with `PLUGLET_OUTSIDE_PEER=<kubelet.sock
//!   path>` (so nothing else has to be built). It is a separate process with its own tokio
//!   runtime serving tonic gRPC on unix sockets: device plugins (`v1beta1.DevicePlugin`,
//!   registered the classic way by calling `Register` on `kubelet.sock`) and CSI drivers
//!   (`pluginregistration.Registration` + CSI `Node` on one socket in `plugins_registry/`, found
//!   by the daemon's watcher). The bench drives it with one command per line on its stdin; the
//!   peer answers on stdout with wall-clock timestamps (ns since the epoch, `CLOCK_REALTIME`,
//!   the clock both processes share): when it sent `Register`, when it sent a ListAndWatch
//!   update, when it received `GetInfo` and `NotifyRegistrationStatus`.
//!   With `PLUGLET_BENCH_PEER=python` the peer is `benches/outside_peer.py` instead (same
//!   commands, grpcio; the kubelet's figures were taken with Python peers): the bench makes a
//!   venv `<target>/outside-python` on first use (`pip install grpcio grpcio-tools`, so it needs
//!   the network once) unless `PLUGLET_BENCH_PYTHON` names an interpreter that has them, and
//!   generates the stubs from `proto/proto` on every run.
//!
//! # Observation points
//!
//! - "devices visible": the inotify event of the rename of `kubelet_internal_checkpoint` in the
//!   device plugins directory that carries them (the device manager writes it as the kubelet
//!   does: temporary file, fsync, rename). On each rename event the bench reads the file and
//!   checks for the devices it waits for; as it reads right after the event, the timestamp can
//!   be attributed to an earlier rename only when a later one happened within that read's few
//!   tens of µs. No polling.
//! - "socket created": the inotify create event of the CSI peer's socket in `plugins_registry/`.
//! - `Register` sent, ListAndWatch update sent, `GetInfo` received, `Notify` received: the peer's
//!   own timestamps.
//! - allocations, releases and the bare admin round trip: `Allocate`, `Release` and
//!   `ListAllocations` of the admin API (`proto/proto/admin.proto`) called from this process on
//!   one kept-open connection to `<root>/pluglet.sock`, timed around the call.
//!
//! # Rows and floors
//!
//! Every iteration of a row also takes one sample of its floor, what the row cannot avoid, from
//! freshly measured parts (the floor's p50 is that of the per-iteration sums):
//!
//! - peer RT: one `GetDevicePluginOptions` round trip from the bench to the peer's device plugin
//!   socket (a bare tonic unary call on a unix socket, kept-open connection);
//! - peer Allocate RT: the peer's `Allocate` called directly with the same device ids, right
//!   after the daemon's call in even iterations and right before it in odd ones (a peer that has
//!   just answered answers faster than one woken from a wait, as the daemon's call always finds
//!   it; the samples taken after the daemon's call are also printed on their own);
//! - fsync: `pwrite` of 64 bytes + `fdatasync` of a file in the directory the daemon writes to
//!   (device plugins dir for the checkpoint rows, state dir for the allocation journal); for the
//!   10,000-device rows, a file of the checkpoint's size; the same small write and
//!   `fdatasync` is also sampled right after the 1-id peer `Allocate`s taken after the daemon's
//!   call and printed on its own (not part of any floor): what one `fdatasync` costs when it
//!   follows a peer's answer, as the daemon's journal record does;
//! - admin RT: `ListAllocations` with no allocations.
//! - peer delivery (10k): the peer flips device 0 of another plugin of 10,000 devices that it
//!   serves without registering (`serve`), and a bare ListAndWatch receiver in the bench (a
//!   codec that reads only the message's length) times from the peer's `SENT` to the last byte
//!   in: what any receiver waits before it can start on such an update (the peer clones,
//!   encodes and writes 10,000 devices; the daemon pays that too).
//!
//! | row | from → to | floor |
//! |---|---|---|
//! | Register → visible | peer sends `Register` (8 new device ids for one resource, re-registered on a new socket each time) → checkpoint rename carrying them | 2 × peer RT + fsync |
//! | 10k update → visible | peer sends one ListAndWatch update of 10,000 devices (device 0's health flipped) → checkpoint rename reflecting it | peer delivery (10k) + fsync (checkpoint size) |
//! | first registration of 10k | `Register` of a new resource of 10,000 devices on a freshly started daemon (warm compile cache) → visible | 2 × peer RT + fsync (checkpoint size) |
//! | allocate k of n | admin `Allocate` round trip (one new pod each time) | admin RT + peer Allocate RT + fsync |
//! | release | admin `Release` of that pod | admin RT + fsync |
//! | admin bare RT | `ListAllocations`, no allocations | peer RT |
//! | GetInfo → Notify | the CSI peer receives `GetInfo` → receives `NotifyRegistrationStatus` | 2 × peer RT |
//! | socket created → Notify | inotify create of the CSI peer's socket → the peer receives `Notify` | 3 × peer RT |
//!
//! The kubelet's figures (same rows, kubelet v1.24 code, Python peers, 2-core VM) are the
//! constants of `kubelet.rs`; the table prints Pluglet / kubelet for p50 and p99.
//!
//! # Memory
//!
//! `VmRSS` and `VmHWM` from `/proc/<daemon pid>/status`:
//! - start with a cold compile cache (fresh root) and a warm one (second start on that root):
//!   read when the admin socket first answers and again after the settle;
//! - idle, no plugin, and idle with one device plugin of 8 devices;
//! - added per device plugin (10 more plugins of 8 devices) and per 10,000 devices (median
//!   over the first-registration daemons).
//!
//! "Idle" means: the event awaited happened (devices visible in the checkpoint, admin
//! `ListAllocations` answered), then a fixed settle of `SETTLE` (1 s) so that work the
//! allocators release lazily is counted as it stands at rest; that settle is part of the
//! definition, not a guess at readiness.

#![allow(missing_docs)]

mod events;
mod floors;
mod kubelet;
mod node;
mod parallel;
mod peer;
mod peer_handle;
mod report;
mod run;
mod scale;
mod stages;
mod timed_rows;

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const PLUGLET: &str = env!("CARGO_BIN_EXE_pluglet");
/// Set (to the `kubelet.sock` path) when this executable runs as the peer.
const PEER_ENV: &str = "PLUGLET_OUTSIDE_PEER";
/// The settle before an idle memory reading (part of the definition of "idle").
const SETTLE: Duration = Duration::from_secs(1);
/// How long any single awaited event may take before the bench gives up.
const TIMEOUT: Duration = Duration::from_secs(60);
const CHECKPOINT: &str = "kubelet_internal_checkpoint";
/// The daemon measured: `PLUGLET_BENCH_BIN` if set (to compare two builds in alternating runs
/// under the same VM state), else the `pluglet` this bench was built with.
fn daemon_binary() -> String {
    std::env::var("PLUGLET_BENCH_BIN").unwrap_or_else(|_| PLUGLET.to_owned())
}

/// Options `PLUGLET_BENCH_DAEMON_ARGS` adds to `pluglet run` (split at whitespace).
fn daemon_args() -> Vec<String> {
    std::env::var("PLUGLET_BENCH_DAEMON_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// The Python peer (`PLUGLET_BENCH_PEER=python`).
const PYTHON_PEER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/outside_peer.py");

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos() as u64
}

fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    if let Some(kubelet) = std::env::var_os(PEER_ENV) {
        peer::run(PathBuf::from(kubelet));
        return;
    }
    run::run();
}
