//! Good calls under attack: the latency of good handler calls on a quiet set, and the same calls
//! while hostile calls (infinite loops, memory bombs) run concurrently on other slots.
//!
//! Run: `cargo bench -p pluglet-handlers --bench hostile` (prints p50, p99, min and max per
//! row, and each row's p50 and p99 over the quiet row's).
//!
//! The set is the daemon's (`Handlers::load` over the embedded built-ins) with four entries, all
//! the test guest `misbehave` at the default limits (50 ms deadline, 16 MiB, 50 million fuel):
//! a good plugin type and a good resource, answering well; a hostile plugin type whose `validate`
//! spins until stopped, and a hostile resource whose `allocate` allocates until stopped. One
//! thread makes good calls back to back for 3 s (`allocate` 1 of 8 devices on the good resource,
//! then `validate` on the good type): quiet, then while four threads call the hostile slots
//! without pause (two loops, two memory bombs). The attack is run twice: with the hostile slots
//! at `max_concurrent_calls = 1`, and with them at 4 (as if there were no per-slot limit).
//! The floor is the quiet row's minimum: the call with nothing else running.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pluglet_handler_runtime::{CallContext, PluginInfo, Runtime, RuntimeConfig};
use pluglet_handlers::{Builtins, Handlers, Trust};
use pluglet_test_support::guests::one_of_eight;

/// The daemon's allocator (see `host/src/main.rs`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const GOOD_TYPE: &str = "GoodPlugin";
const GOOD_RESOURCE: &str = "bench.example.com/good";
const LOOP_TYPE: &str = "LoopPlugin";
const BOMB_RESOURCE: &str = "bench.example.com/bomb";
/// How long each row calls.
const CALLING: Duration = Duration::from_secs(3);

fn handlers_toml(hostile_limit: u32) -> String {
    format!(
        "[plugin_types.{GOOD_TYPE}]\nmodule = \"good.wasm\"\n\n\
         [resources.\"{GOOD_RESOURCE}\"]\nmodule = \"good.wasm\"\n\n\
         [plugin_types.{LOOP_TYPE}]\nmodule = \"hostile.wasm\"\nsettings = {{ mode = \"loop\" }}\n\
         max_concurrent_calls = {hostile_limit}\nrollback_after = 0\n\n\
         [resources.\"{BOMB_RESOURCE}\"]\nmodule = \"hostile.wasm\"\n\
         settings = {{ allocate = \"alloc\" }}\nmax_concurrent_calls = {hostile_limit}\n\
         rollback_after = 0\n"
    )
}

fn cx() -> CallContext {
    CallContext {
        node_name: "bench".into(),
    }
}

fn plugin(plugin_type: &str) -> PluginInfo {
    PluginInfo {
        plugin_type: plugin_type.into(),
        name: "bench".into(),
        endpoint: "/tmp/bench.sock".into(),
        supported_versions: vec!["1.0.0".into()],
    }
}

fn load(dir: &Path, hostile_limit: u32) -> Handlers {
    std::fs::write(dir.join("handlers.toml"), handlers_toml(hostile_limit))
        .expect("write handlers.toml");
    let runtime = Runtime::new(RuntimeConfig::default()).expect("wasm runtime");
    let builtins = Builtins::embedded(&runtime).expect("built-in handlers");
    Handlers::load(runtime, dir, None, builtins, Trust::default()).expect("the bench's set")
}

/// Good calls back to back for [`CALLING`]: each sample one `allocate` or one `validate`.
fn good_calls(handlers: &Handlers) -> (Vec<Duration>, u64) {
    let (cx, request, plugin) = (cx(), one_of_eight(GOOD_RESOURCE), plugin(GOOD_TYPE));
    let mut samples = Vec::with_capacity(200_000);
    let mut failed = 0;
    let started = Instant::now();
    while started.elapsed() < CALLING {
        let t = Instant::now();
        let ok = matches!(
            handlers.for_resource(GOOD_RESOURCE).allocate(&cx, &request),
            Ok(call) if call.value.is_ok()
        );
        samples.push(t.elapsed());
        failed += u64::from(!ok);
        let t = Instant::now();
        let served = handlers.for_plugin_type(GOOD_TYPE).expect("the good type");
        let ok = matches!(served.validate(&cx, &plugin, None), Ok(call) if call.value.is_ok());
        samples.push(t.elapsed());
        failed += u64::from(!ok);
    }
    samples.sort();
    (samples, failed)
}

/// Runs `good_calls` while four threads call the hostile slots without pause; returns the good
/// calls and how many hostile calls ended (all failing).
fn under_attack(handlers: &Handlers) -> (Vec<Duration>, u64, u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let hostile_calls = Arc::new(AtomicU64::new(0));
    let attackers: Vec<_> = [true, true, false, false]
        .into_iter()
        .map(|looping| {
            let (handlers, stop, count) = (handlers.clone(), stop.clone(), hostile_calls.clone());
            std::thread::spawn(move || {
                let (cx, request, plugin) = (cx(), one_of_eight(BOMB_RESOURCE), plugin(LOOP_TYPE));
                while !stop.load(Ordering::Relaxed) {
                    let failed = if looping {
                        let served = handlers.for_plugin_type(LOOP_TYPE).expect("the loop type");
                        served.validate(&cx, &plugin, None).is_err()
                    } else {
                        handlers
                            .for_resource(BOMB_RESOURCE)
                            .allocate(&cx, &request)
                            .is_err()
                    };
                    assert!(failed, "a hostile call fails");
                    count.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // Let the attack start before measuring.
    std::thread::sleep(Duration::from_millis(200));
    let (samples, failed) = good_calls(handlers);
    stop.store(true, Ordering::Relaxed);
    for attacker in attackers {
        attacker.join().expect("attacker");
    }
    (samples, failed, hostile_calls.load(Ordering::Relaxed))
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn row(name: &str, samples: &[Duration], failed: u64, hostile: Option<u64>, quiet: &[Duration]) {
    let ratio = |p: f64| pct(samples, p).as_secs_f64() / pct(quiet, p).as_secs_f64();
    println!(
        "{name:<36} {:>9} {:>9} {:>8} {:>9} {:>8} {:>6} {:>7} {:>6.2}x {:>6.2}x",
        us(pct(samples, 0.5)),
        us(pct(samples, 0.99)),
        us(samples[0]),
        us(samples[samples.len() - 1]),
        samples.len(),
        failed,
        hostile.map_or("—".into(), |n| n.to_string()),
        ratio(0.5),
        ratio(0.99),
    );
}

fn main() {
    let root = tempfile::tempdir().expect("temporary directory");
    let misbehave = pluglet_wasm_guests::guest_path("misbehave");
    for name in ["good.wasm", "hostile.wasm"] {
        std::fs::copy(&misbehave, root.path().join(name))
            .unwrap_or_else(|e| panic!("{}: {e}", misbehave.display()));
    }
    println!(
        "{:<36} {:>9} {:>9} {:>8} {:>9} {:>8} {:>6} {:>7} {:>7} {:>7}",
        "good calls (allocate + validate), 3 s",
        "p50",
        "p99",
        "min",
        "max",
        "calls",
        "failed",
        "hostile",
        "p50/q",
        "p99/q"
    );
    let handlers = load(root.path(), 1);
    let (quiet, failed) = good_calls(&handlers);
    row("quiet (floor: its min)", &quiet, failed, None, &quiet);
    let (attacked, failed, hostile) = under_attack(&handlers);
    row(
        "4 hostile, max_concurrent_calls = 1",
        &attacked,
        failed,
        Some(hostile),
        &quiet,
    );
    drop(handlers);
    let handlers = load(root.path(), 4);
    let (attacked, failed, hostile) = under_attack(&handlers);
    row(
        "4 hostile, max_concurrent_calls = 4",
        &attacked,
        failed,
        Some(hostile),
        &quiet,
    );
}
