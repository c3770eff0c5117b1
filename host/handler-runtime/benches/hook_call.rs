//! One `validate` call as the daemon makes it (wait for a pool slot, the instance of the
//! handler's call before, as the built-ins and entries with `reuse_instances` are run, or a fresh
//! store and instance from the shared `InstancePre`; WASI context, limits, fuel, deadline, stderr
//! capture) against the same validation in plain Rust (the CSI handler's `validate` called
//! natively).
//!
//! `cargo bench -p pluglet-handler-runtime --bench hook_call -- --warm-up-time 1 --measurement-time 3`
//! prints criterion's figures, then the medians of a simple sample loop and their ratios.
//!
//! For instruction counts (`scripts/instructions.sh`, rows "hook call"): with
//! `PLUGLET_BENCH_HOOK_CALLS=N` the bench makes N `validate` calls and exits, nothing timed,
//! in a reused instance, or in a fresh instance each with `PLUGLET_BENCH_HOOK_INSTANCE=fresh`;
//! with `PLUGLET_BENCH_CACHE_DIR=DIR` it loads the handler through a compile cache in DIR, so
//! that a second run deserialises the module instead of compiling it. Two runs under callgrind
//! with different N, the cache filled by a run before them, differ by the calls alone. A counted
//! run has a pool of one slot (valgrind's address space has no room for the default 64).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use pluglet_handler_runtime::{
    CallContext, CompileCache, Limits, ModuleSource, PluginInfo, Runtime, RuntimeConfig,
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
    let fresh = runtime
        .load(
            ModuleSource::Builtin {
                name: "csi".into(),
                bytes: pluglet_wasm_guests::CSI,
            },
            BTreeMap::new(),
            None,
        )
        .expect("builtin csi loads");
    let reused = fresh
        .reconfigured(
            fresh.module().to_owned(),
            BTreeMap::new(),
            Some(Limits {
                reuse_instances: true,
                ..runtime.config().default_limits
            }),
        )
        .expect("the same module, its instances reused");
    let cx = CallContext {
        node_name: "node-1".into(),
    };
    let plugin = wasm_plugin();
    let native = native_plugin();
    let call = |handler: &pluglet_handler_runtime::Handler| {
        let call = handler
            .validate(&cx, black_box(&plugin), None)
            .unwrap_or_else(|e| panic!("hook call failed: {e}"));
        black_box(call.value.is_ok())
    };
    let fresh_call = || call(&fresh);
    let reused_call = || call(&reused);
    let native_call = || black_box(pluglet_handler_csi::validate(black_box(&native), None).is_ok());
    assert!(fresh_call() && reused_call() && native_call());
    if let Some(calls) = counted {
        let one: &dyn Fn() -> bool = match std::env::var("PLUGLET_BENCH_HOOK_INSTANCE").as_deref() {
            Ok("fresh") => &fresh_call,
            _ => &reused_call,
        };
        for _ in 0..calls {
            assert!(one());
        }
        return;
    }

    let mut c = Criterion::default().configure_from_args();
    let mut group = c.benchmark_group("hook_call");
    group.bench_function("wasm_validate_fresh_instance", |b| b.iter(fresh_call));
    group.bench_function("wasm_validate_reused_instance", |b| b.iter(reused_call));
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
    let fresh = median(time(&fresh_call, 5_000));
    let reused = median(time(&reused_call, 5_000));
    let native = median(time(&native_call, 50_000));
    let ratio = |d: Duration| d.as_secs_f64() / native.as_secs_f64().max(1e-12);
    println!(
        "hook_call medians: wasm validate {:.2} µs in a fresh instance ({:.0}x native), {:.2} µs \
         in a reused one ({:.0}x), native validate {:.3} µs",
        fresh.as_secs_f64() * 1e6,
        ratio(fresh),
        reused.as_secs_f64() * 1e6,
        ratio(reused),
        native.as_secs_f64() * 1e6,
    );
}
