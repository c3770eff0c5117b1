//! Live handler swap: how long a module renamed into the handlers directory takes to answer its
//! first call, and what a storm of swaps does to the calls made meanwhile.
//!
//! Run: `cargo bench -p pluglet-handlers --bench swap` (prints p50, p99 and min).
//!
//! The set is the daemon's: `Handlers::load` over the embedded built-ins, `handlers.watch` on a
//! multi-thread tokio runtime (inotify, debounced), one entry `[resources."bench.example.com/gpu"]
//! module = "policy.wasm"`. A swap writes the new module to a temporary name in the handlers
//! directory (and lets that settle, untimed: its reload changes nothing), then renames it over
//! `policy.wasm`. The clock starts just before the rename and stops when the first
//! `for_resource(..).allocate(..)` answered by the new module returns (the bench waits for the
//! `Applied` event, checks the sha256 in force, then calls).
//!
//! - warm: alternating two modules (misbehave ↔ spread-policy). After the first two swaps the
//!   module swapped back to is the slot's previous version, kept warm: no compile.
//! - cold: every swap brings bytes never seen before (the module with a different custom section
//!   appended, so its sha256 differs), so every swap compiles and admits it. Done for each
//!   allocation-policy module available, smallest to largest.
//! - calls: one thread calling `allocate` (8 devices, count 1) back to back, with no swaps
//!   (quiet), then while another thread swaps continuously (warm, then cold).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pluglet_handler_runtime::{AllocationRequest, CallContext, Runtime, RuntimeConfig};
use pluglet_handlers::{Builtins, Handlers, HandlersEvent, SlotKey, Trust};
use pluglet_test_support::guests::{one_of_eight, tagged};
use sha2::{Digest, Sha256};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// The daemon's allocator (see `host/src/main.rs`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const RESOURCE: &str = "bench.example.com/gpu";
const MODULE: &str = "policy.wasm";
const STAGING: &str = ".policy.wasm.tmp";
/// Swaps per latency row.
const SWAPS: usize = 50;
/// How long each call-latency row calls.
const CALLING: Duration = Duration::from_secs(3);

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn cx() -> CallContext {
    CallContext {
        node_name: "bench".into(),
    }
}

/// Whether one call through the set in force succeeded with one id.
fn call(handlers: &Handlers, cx: &CallContext, request: &AllocationRequest) -> bool {
    let served = handlers.for_resource(RESOURCE);
    matches!(served.allocate(cx, request), Ok(call) if call.value.as_ref().is_ok_and(|ids| ids.len() == 1))
}

/// Waits for the set to apply a change of the resource's slot; panics on a refusal.
fn wait_applied(events: &mut broadcast::Receiver<HandlersEvent>) {
    let slot = SlotKey::Resource(RESOURCE.into());
    loop {
        match events.blocking_recv() {
            Ok(HandlersEvent::Applied { slots, .. }) if slots.contains(&slot) => return,
            Ok(HandlersEvent::Refused { reason }) => panic!("swap refused: {reason}"),
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => panic!("handler set gone"),
        }
    }
}

/// Writes `bytes` to the staging name in `dir` and lets the watcher see it settle.
fn stage(dir: &Path, bytes: &[u8], settle: Duration) {
    std::fs::write(dir.join(STAGING), bytes).expect("write the staged module");
    std::thread::sleep(settle);
}

fn rename_into_place(dir: &Path) {
    std::fs::rename(dir.join(STAGING), dir.join(MODULE)).expect("rename the module into place");
}

struct Swap {
    /// Rename → first call answered by the new module.
    answered: Duration,
    /// Rename → `Applied` seen.
    applied: Duration,
    /// Compile time of the handler in force (its first load).
    compile: Duration,
}

/// One timed swap to `bytes` (see the module doc).
fn swap(handlers: &Handlers, dir: &Path, bytes: &[u8]) -> Swap {
    let expected = sha256(bytes);
    let (cx, request) = (cx(), one_of_eight(RESOURCE));
    stage(dir, bytes, Duration::from_millis(100));
    let mut events = handlers.subscribe();
    let started = Instant::now();
    rename_into_place(dir);
    wait_applied(&mut events);
    let applied = started.elapsed();
    let served = handlers.for_resource(RESOURCE);
    assert_eq!(served.sha256(), expected, "the new module is in force");
    let call = served.allocate(&cx, &request).expect("first call");
    let answered = started.elapsed();
    assert_eq!(call.value.expect("allocated").len(), 1);
    Swap {
        answered,
        applied,
        compile: served.handler().compile_time(),
    }
}

fn report(name: &str, swaps: &[Swap], compiles: bool) {
    let mut answered: Vec<Duration> = swaps.iter().map(|s| s.answered).collect();
    let mut applied: Vec<Duration> = swaps.iter().map(|s| s.applied).collect();
    let mut compile: Vec<Duration> = swaps.iter().map(|s| s.compile).collect();
    answered.sort();
    applied.sort();
    compile.sort();
    println!(
        "{name:<44} {:>10} {:>10} {:>10} {:>12} {:>10}",
        ms(pct(&answered, 0.5)),
        ms(pct(&answered, 0.99)),
        ms(answered[0]),
        ms(pct(&applied, 0.5)),
        if compiles {
            ms(pct(&compile, 0.5))
        } else {
            "—".into()
        },
    );
}

/// Calls back to back for `CALLING` on this thread; the latencies and the failed calls.
fn calls(handlers: &Handlers) -> (Vec<Duration>, u64) {
    let (cx, request) = (cx(), one_of_eight(RESOURCE));
    let mut samples = Vec::with_capacity(200_000);
    let mut failed = 0;
    let started = Instant::now();
    while started.elapsed() < CALLING {
        let t = Instant::now();
        let ok = call(handlers, &cx, &request);
        samples.push(t.elapsed());
        if !ok {
            failed += 1;
        }
    }
    (samples, failed)
}

fn report_calls(name: &str, mut samples: Vec<Duration>, failed: u64, swaps: Option<u64>) {
    samples.sort();
    println!(
        "{name:<44} {:>10} {:>10} {:>10} {:>8} {:>7} {:>6}",
        us(pct(&samples, 0.5)),
        us(pct(&samples, 0.99)),
        us(samples[samples.len() - 1]),
        samples.len(),
        failed,
        swaps.map_or("—".into(), |n| n.to_string()),
    );
}

/// Calls for `CALLING` while another thread swaps among `modules` without pause (each swap:
/// write, rename, wait until applied); `fresh`: every swap brings new bytes (compiles).
fn storm(
    handlers: &Handlers,
    dir: &Path,
    modules: &[Vec<u8>],
    fresh: bool,
) -> (Vec<Duration>, u64, u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicU64::new(0));
    let swapper = {
        let (handlers, dir, modules) = (handlers.clone(), dir.to_path_buf(), modules.to_vec());
        let (stop, swaps) = (stop.clone(), swaps.clone());
        std::thread::spawn(move || {
            let mut tag = 1_000_000;
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let base = &modules[i % modules.len()];
                let bytes = if fresh {
                    tag += 1;
                    tagged(base, tag)
                } else {
                    base.clone()
                };
                let mut events = handlers.subscribe();
                stage(&dir, &bytes, Duration::ZERO);
                rename_into_place(&dir);
                wait_applied(&mut events);
                swaps.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        })
    };
    let (samples, failed) = calls(handlers);
    stop.store(true, Ordering::Relaxed);
    swapper.join().expect("swapper");
    (samples, failed, swaps.load(Ordering::Relaxed))
}

fn main() {
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let wasm = Runtime::new(RuntimeConfig::default()).expect("wasm runtime");
    let builtins = Builtins::embedded(&wasm).expect("built-in handlers");
    let root = tempfile::tempdir().expect("temporary directory");
    let dir: PathBuf = root.path().join("handlers");
    std::fs::create_dir(&dir).expect("handlers dir");

    let read = |name: &str| {
        let path = pluglet_wasm_guests::guest_path(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let misbehave = read("misbehave");
    let spread = read("spread-policy");
    let device_plugin = read("device-plugin");
    let mut policies = vec![
        ("misbehave", &misbehave),
        ("spread-policy", &spread),
        ("device-plugin", &device_plugin),
    ];
    policies.sort_by_key(|(_, b)| b.len());
    println!("allocation-policy components:");
    for (name, bytes) in &policies {
        println!("  {name:<16} {:>8} bytes", bytes.len());
    }

    std::fs::write(dir.join(MODULE), &misbehave).expect("write the first module");
    std::fs::write(
        dir.join("handlers.toml"),
        format!("[resources.\"{RESOURCE}\"]\nmodule = \"{MODULE}\"\n"),
    )
    .expect("write handlers.toml");
    let handlers = Handlers::load(wasm, &dir, None, builtins, Trust::default()).expect("handlers");
    assert_eq!(handlers.for_resource(RESOURCE).sha256(), sha256(&misbehave));
    let cancel = CancellationToken::new();
    let watch = {
        let _guard = rt.enter();
        handlers
            .watch(cancel.clone())
            .expect("watch the handlers dir")
    };
    let watching = rt.spawn(watch);

    println!();
    println!(
        "{:<44} {:>10} {:>10} {:>10} {:>12} {:>10}",
        "swap: rename -> first call answered", "p50", "p99", "min", "applied p50", "compile"
    );
    // Warm: misbehave ↔ spread-policy. The first swap to spread-policy compiles it (untimed
    // warm-up, with the swap back to misbehave that makes both warm).
    swap(&handlers, &dir, &spread);
    swap(&handlers, &dir, &misbehave);
    let warm: Vec<Swap> = (0..SWAPS)
        .map(|i| {
            swap(
                &handlers,
                &dir,
                if i % 2 == 0 { &spread } else { &misbehave },
            )
        })
        .collect();
    report(
        &format!("warm, misbehave <-> spread-policy ({SWAPS})"),
        &warm,
        false,
    );
    let mut tag = 0;
    for (name, bytes) in &policies {
        let cold: Vec<Swap> = (0..SWAPS)
            .map(|_| {
                tag += 1;
                swap(&handlers, &dir, &tagged(bytes, tag))
            })
            .collect();
        report(
            &format!("cold, {name} {} KB ({SWAPS})", bytes.len() / 1000),
            &cold,
            true,
        );
    }

    println!();
    println!(
        "{:<44} {:>10} {:>10} {:>10} {:>8} {:>7} {:>6}",
        "allocate 1 of 8, one thread, 3 s", "p50", "p99", "max", "calls", "failed", "swaps"
    );
    swap(&handlers, &dir, &misbehave);
    let (mut quiet, mut failed) = calls(&handlers);
    swap(&handlers, &dir, &spread);
    let (more, more_failed) = calls(&handlers);
    quiet.extend(more);
    failed += more_failed;
    report_calls("quiet (3 s on each module)", quiet, failed, None);
    let pair = vec![misbehave.clone(), spread.clone()];
    let (samples, failed, swaps) = storm(&handlers, &dir, &pair, false);
    report_calls(
        "during warm swaps (misbehave <-> spread)",
        samples,
        failed,
        Some(swaps),
    );
    let (samples, failed, swaps) = storm(&handlers, &dir, &pair, true);
    report_calls(
        "during cold swaps (compile each)",
        samples,
        failed,
        Some(swaps),
    );

    cancel.cancel();
    rt.block_on(watching).expect("watch task");
}
