//! Loading one module with and without the compile cache: `Runtime::load` of the same component,
//! timed from the call to the admitted handler.
//!
//! Run: `cargo bench -p pluglet-handler-runtime --bench cache` (prints p50, p99 and min;
//! `PLUGLET_BENCH_RUNS` sets the runs per row, default 40; `PLUGLET_BENCH_MODULE` a component
//! file to load instead of spread-policy (115 KB) and the two built-in handlers).
//!
//! - no cache: `Runtime::new`, every load compiles.
//! - cold: a fresh state directory per run, so the load compiles and writes the entry (serialise,
//!   MAC, temporary file, rename).
//! - warm: one state directory whose entry exists; each run opens the cache and creates a runtime
//!   as a restart does (untimed), then the load reads the entry, checks its MAC and deserialises.
//!
//! Each run uses a new runtime (a new engine), as a daemon start does; creating it is not timed.
//! The rows alternate run by run so the machine's noise hits each alike.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pluglet_handler_runtime::{CompileCache, ModuleSource, Runtime, RuntimeConfig};

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    println!(
        "{name:<48} p50 {:>10}  p99 {:>10}  min {:>10}  ({} runs)",
        ms(pct(&samples, 0.5)),
        ms(pct(&samples, 0.99)),
        ms(samples[0]),
        samples.len()
    );
}

fn config() -> RuntimeConfig {
    RuntimeConfig {
        pool_size: 4,
        ..RuntimeConfig::default()
    }
}

/// Times one load; asserts where it came from.
fn timed_load(runtime: &Runtime, module: &(String, Arc<[u8]>), from_cache: bool) -> Duration {
    let source = ModuleSource::Bytes {
        id: module.0.clone(),
        bytes: module.1.clone(),
    };
    let started = Instant::now();
    let handler = runtime
        .load(source, BTreeMap::new(), None)
        .expect("the module loads");
    let took = started.elapsed();
    assert_eq!(handler.from_cache(), from_cache, "{}", module.0);
    took
}

/// The modules measured: `PLUGLET_BENCH_MODULE`, else spread-policy (115 KB, when the build has
/// it) and the two built-ins.
fn modules() -> Vec<(String, Arc<[u8]>)> {
    if let Ok(path) = std::env::var("PLUGLET_BENCH_MODULE") {
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
        return vec![(path, bytes.into())];
    }
    let mut modules = Vec::new();
    let spread = pluglet_wasm_guests::guest_path("spread-policy");
    if let Ok(bytes) = std::fs::read(&spread) {
        modules.push(("spread-policy".to_owned(), bytes.into()));
    }
    modules.push(("builtin:csi".to_owned(), pluglet_wasm_guests::CSI.into()));
    modules.push((
        "builtin:device-plugin".to_owned(),
        pluglet_wasm_guests::DEVICE_PLUGIN.into(),
    ));
    modules
}

fn main() {
    let runs: usize = std::env::var("PLUGLET_BENCH_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    for module in modules() {
        bench(&module, runs);
    }
}

fn bench(module: &(String, Arc<[u8]>), runs: usize) {
    let warm_state = tempfile::tempdir().expect("state dir");
    let prime = Runtime::with_cache(config(), CompileCache::open(warm_state.path()).unwrap())
        .expect("runtime");
    timed_load(&prime, module, false);
    drop(prime);
    let entry_bytes: u64 = std::fs::read_dir(warm_state.path().join("handler-cache"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    println!(
        "\n{}: {} bytes, cache entry {entry_bytes} bytes; {runs} runs per row",
        module.0,
        module.1.len()
    );

    let (mut none, mut cold, mut warm, mut open) = (vec![], vec![], vec![], vec![]);
    for _ in 0..runs {
        let runtime = Runtime::new(config()).expect("runtime");
        none.push(timed_load(&runtime, module, false));
        drop(runtime);

        let state = tempfile::tempdir().expect("state dir");
        let runtime = Runtime::with_cache(config(), CompileCache::open(state.path()).unwrap())
            .expect("runtime");
        cold.push(timed_load(&runtime, module, false));
        drop(runtime);

        let started = Instant::now();
        let cache = CompileCache::open(warm_state.path()).unwrap();
        open.push(started.elapsed());
        let runtime = Runtime::with_cache(config(), cache).expect("runtime");
        warm.push(timed_load(&runtime, module, true));
        drop(runtime);
    }
    report("load, no cache (compile)", none);
    report("load, cold cache (compile + write entry)", cold);
    report("load, warm cache (read + MAC + deserialise)", warm);
    report("CompileCache::open (dir check + key read)", open);
}
