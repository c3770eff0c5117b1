//! One `validate` call as the daemon makes it (wait for a pool slot, fresh store and instance
//! from the shared `InstancePre`, WASI context, limits, fuel, deadline, stderr capture) against
//! the same validation in plain Rust (the CSI handler's `validate` called natively).
//!
//! `cargo bench -p pluglet-handler-runtime --bench hook_call -- --warm-up-time 1 --measurement-time 3`
//! prints criterion's figures, then the medians of a simple sample loop and their ratio.
//!
//! For instruction counts (`scripts/instructions.sh`, row "hook call"): with
//! `PLUGLET_BENCH_HOOK_CALLS=N` the bench makes N `validate` calls and exits, nothing timed; with
//! `PLUGLET_BENCH_CACHE_DIR=DIR` it loads the handler through a compile cache in DIR, so that a
//! second run deserialises the module instead of compiling it. Two runs under callgrind with
//! different N, the cache filled by a run before them, differ by the calls alone. A counted run
//! has a pool of one slot (valgrind's address space has no room for the default 64).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use pluglet_handler_runtime::{
    CallContext, CompileCache, ModuleSource, PluginInfo, Runtime, RuntimeConfig,
};

fn wasm_plugin() -> PluginInfo {
    PluginInfo {
        plugin_type: "CSIPlugin".into(),
        name: "csi.example.com".into(),
        endpoint: "/var/lib/kubelet/plugins/csi.example.com/csi.sock".into(),
        supported_versions: vec!["1.0.0".into(), "1.2.0".into()],
    }
}

fn native_plugin() -> pluglet_guest::PluginInfo {
    pluglet_guest::PluginInfo {
        plugin_type: "CSIPlugin".into(),
        name: "csi.example.com".into(),
        endpoint: "/var/lib/kubelet/plugins/csi.example.com/csi.sock".into(),
        supported_versions: vec!["1.0.0".into(), "1.2.0".into()],
    }
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    let counted = std::env::var("PLUGLET_BENCH_HOOK_CALLS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok());
    // Counted runs go under valgrind, whose address space does not fit the default pool's
    // reservation: one slot, as the daemon is run there (`--handler-pool-size 1`).
    let mut config = RuntimeConfig::default();
    if counted.is_some() {
        config.pool_size = 1;
    }
    let runtime = match std::env::var_os("PLUGLET_BENCH_CACHE_DIR") {
        Some(dir) => Runtime::with_cache(
            config,
            CompileCache::open(std::path::Path::new(&dir)).expect("compile cache"),
        ),
        None => Runtime::new(config),
    }
    .expect("runtime");
    let handler = runtime
        .load(
            ModuleSource::Builtin {
                name: "csi".into(),
                bytes: pluglet_wasm_guests::CSI,
            },
            BTreeMap::new(),
            None,
        )
        .expect("builtin csi loads");
    let cx = CallContext {
        node_name: "node-1".into(),
    };
    let plugin = wasm_plugin();
    let native = native_plugin();
    let wasm_call = || {
        let call = handler
            .validate(&cx, black_box(&plugin), None)
            .unwrap_or_else(|e| panic!("hook call failed: {e}"));
        black_box(call.value.is_ok())
    };
    let native_call = || black_box(pluglet_handler_csi::validate(black_box(&native), None).is_ok());
    assert!(wasm_call() && native_call());
    if let Some(calls) = counted {
        for _ in 0..calls {
            assert!(wasm_call());
        }
        return;
    }

    let mut c = Criterion::default().configure_from_args();
    let mut group = c.benchmark_group("hook_call");
    group.bench_function("wasm_validate_fresh_instance", |b| b.iter(wasm_call));
    group.bench_function("native_validate", |b| b.iter(native_call));
    group.finish();
    c.final_summary();

    let time = |f: &dyn Fn() -> bool, n: usize| {
        (0..n)
            .map(|_| {
                let started = Instant::now();
                f();
                started.elapsed()
            })
            .collect::<Vec<_>>()
    };
    let wasm = median(time(&wasm_call, 5_000));
    let native = median(time(&native_call, 50_000));
    println!(
        "hook_call medians: wasm validate {:.2} µs, native validate {:.3} µs, ratio {:.0}x",
        wasm.as_secs_f64() * 1e6,
        native.as_secs_f64() * 1e6,
        wasm.as_secs_f64() / native.as_secs_f64().max(1e-12)
    );
}
