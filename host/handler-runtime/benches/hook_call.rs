//! One `validate` call as the daemon makes it (wait for a pool slot, fresh store and instance
//! from the shared `InstancePre`, WASI context, limits, fuel, deadline, stderr capture) against
//! the same validation in plain Rust (the CSI handler's `validate` called natively).
//!
//! `cargo bench -p pluglet-handler-runtime --bench hook_call -- --warm-up-time 1 --measurement-time 3`
//! prints criterion's figures, then the medians of a simple sample loop and their ratio.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use pluglet_handler_runtime::{CallContext, ModuleSource, PluginInfo, Runtime, RuntimeConfig};

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
    let runtime = Runtime::new(RuntimeConfig::default()).expect("runtime");
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
