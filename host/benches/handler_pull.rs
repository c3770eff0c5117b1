//! Handlers from an OCI registry, measured against a real one: Debian's docker-registry on a
//! loopback port with TLS and htpasswd, as the end-to-end tests start it
//! (`pluglet_test_support::e2e::OciRegistry`), and the daemon's handler set in this process
//! (`Handlers::load_with_registry` with the compile cache, watching its directory as the daemon
//! does).
//!
//! ```sh
//! cargo bench -p pluglet --bench handler_pull
//! ```
//!
//! The module is the built-in device-plugin policy (about 140 KB), with a custom section
//! appended per push so that every tag names new bytes (a new manifest digest, a new sha256 for
//! the compile cache). `PLUGLET_BENCH_PULLS` (default 30) sets the pushes, and so the samples
//! per row. Each sample is timed from the rename of a `handlers.toml` naming the next tag to the
//! first `allocate` answered by the pulled module. Rows:
//!
//! - **cold pull + apply, compile cache cold**: a tag never pulled, of bytes never compiled on
//!   this node: manifest, blob and referrers downloaded and checked, kept in the store,
//!   compiled, admitted, applied;
//! - **cold pull + apply, compile cache warm**: the same tags again after the store of pulled
//!   modules was emptied: downloaded again, but the compile cache has them;
//! - **refresh, unchanged digest**: `Handlers::refresh` of the slot whose tag has not moved: one
//!   manifest request, nothing downloaded, nothing applied;
//! - floors, same run: **pull alone** (`Registry::pull` of the same references: the network and
//!   the checks, no store, no compile) and **the same swap from a file** (the bytes renamed into
//!   the handlers directory, compile cache warm).

#![allow(missing_docs)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pluglet_handler_runtime::{CallContext, CompileCache, Runtime, RuntimeConfig};
use pluglet_handlers::{Builtins, Handlers, HandlersEvent, ReloadOutcome, SlotKey, Trust};
use pluglet_oci::{OciRef, Registry, RegistryOptions};
use pluglet_test_support::e2e::oci_registry::{PASSWORD, USER};
use pluglet_test_support::e2e::{OciRegistry, RegistryConfig};
use pluglet_test_support::guests::{one_of_eight, tagged};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// The daemon's allocator (see `host/src/main.rs`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const RESOURCE: &str = "bench.example.com/gpu";

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e3
}

fn row(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    println!(
        "{name:<52} {:>5} {:>9.2} {:>9.2} {:>9.2}",
        samples.len(),
        pct(&samples, 0.5),
        pct(&samples, 0.99),
        samples[0].as_secs_f64() * 1e3,
    );
}

/// Waits for the set to apply a change of the slot; panics on a refusal.
fn wait_applied(events: &mut broadcast::Receiver<HandlersEvent>) {
    let slot = SlotKey::Resource(RESOURCE.into());
    loop {
        match events.blocking_recv() {
            Ok(HandlersEvent::Applied { slots, .. }) if slots.contains(&slot) => return,
            Ok(HandlersEvent::Refused { reason }) => panic!("change refused: {reason}"),
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => panic!("handler set gone"),
        }
    }
}

/// Writes `bytes` to a temporary name in `dir` and renames it over `name` (the clock starts at
/// the rename); waits until the slot is applied and its first call answered.
fn apply(handlers: &Handlers, dir: &Path, name: &str, bytes: &[u8]) -> Duration {
    let staging = dir.join(format!(".{name}.tmp"));
    std::fs::write(&staging, bytes).expect("write the staged file");
    let mut events = handlers.subscribe();
    let started = Instant::now();
    std::fs::rename(&staging, dir.join(name)).expect("rename into place");
    wait_applied(&mut events);
    let served = handlers.for_resource(RESOURCE);
    let call = served
        .allocate(
            &CallContext {
                node_name: "bench".into(),
            },
            &one_of_eight(RESOURCE),
        )
        .expect("first call");
    let took = started.elapsed();
    assert_eq!(call.value.expect("allocated").len(), 1);
    took
}

fn toml(module: &str) -> Vec<u8> {
    format!("[resources.\"{RESOURCE}\"]\nmodule = \"{module}\"\n").into_bytes()
}

fn main() {
    let pulls: u64 = std::env::var("PLUGLET_BENCH_PULLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let registry = OciRegistry::start(RegistryConfig {
        tls: true,
        auth: true,
    });
    let root = tempfile::tempdir().expect("temporary directory");
    let auth = root.path().join("config.json");
    registry.write_auth(&auth, USER, PASSWORD);
    let options = RegistryOptions {
        auth_file: Some(auth),
        cas: vec![registry.ca_arg().parse().expect("a CA argument")],
        ..RegistryOptions::default()
    };
    let client = Registry::new(options.clone());

    let base = std::fs::read(pluglet_wasm_guests::guest_path("device-plugin"))
        .expect("the device-plugin guest");
    println!("module: device-plugin, {} bytes", base.len());
    let modules: Vec<Vec<u8>> = (0..pulls).map(|i| tagged(&base, i)).collect();
    let references: Vec<String> = (0..pulls)
        .map(|i| registry.reference(&format!("vendor/gpu-policy:v{i}")))
        .collect();
    for (reference, bytes) in references.iter().zip(&modules) {
        let at = OciRef::parse(reference).expect("a reference");
        rt.block_on(client.push(&at, bytes, None, None))
            .expect("push");
    }

    let dir: PathBuf = root.path().join("handlers");
    let state: PathBuf = root.path().join("state");
    std::fs::create_dir_all(&dir).expect("handlers dir");
    std::fs::create_dir_all(&state).expect("state dir");
    // The same bytes as files, for the floor row; written before the set watches the directory.
    for (i, bytes) in modules.iter().enumerate() {
        std::fs::write(dir.join(format!("policy-{i}.wasm")), bytes).expect("write a module");
    }
    let wasm = Runtime::with_cache(
        RuntimeConfig::default(),
        CompileCache::open(&state).expect("compile cache"),
    )
    .expect("wasm runtime");
    let builtins = Builtins::embedded(&wasm).expect("built-in handlers");
    let handlers = Handlers::load_with_registry(
        wasm,
        &dir,
        Some(&state),
        builtins,
        Trust::default(),
        options,
    )
    .expect("handlers");
    let cancel = CancellationToken::new();
    let watch = {
        let _guard = rt.enter();
        handlers
            .watch(cancel.clone())
            .expect("watch the handlers dir")
    };
    let watching = rt.spawn(watch);

    println!(
        "\n{:<52} {:>5} {:>9} {:>9} {:>9}",
        "row (ms)", "n", "p50", "p99", "min"
    );
    let cold: Vec<Duration> = references
        .iter()
        .map(|r| apply(&handlers, &dir, "handlers.toml", &toml(r)))
        .collect();
    let store = state.join("handlers").join("oci");
    std::fs::remove_dir_all(&store).expect("empty the store of pulled modules");
    let warm: Vec<Duration> = references
        .iter()
        .map(|r| apply(&handlers, &dir, "handlers.toml", &toml(r)))
        .collect();
    let slot = SlotKey::Resource(RESOURCE.into());
    let refresh: Vec<Duration> = (0..pulls)
        .map(|_| {
            let started = Instant::now();
            let outcome = handlers.refresh(&|s| s == &slot);
            let took = started.elapsed();
            assert!(
                matches!(outcome, ReloadOutcome::Unchanged),
                "an unmoved tag changes nothing: {outcome:?}"
            );
            took
        })
        .collect();
    let alone: Vec<Duration> = references
        .iter()
        .map(|r| {
            let at = OciRef::parse(r).expect("a reference");
            let started = Instant::now();
            rt.block_on(client.pull(&at)).expect("pull");
            started.elapsed()
        })
        .collect();
    let from_file: Vec<Duration> = modules
        .iter()
        .enumerate()
        .map(|(i, _)| {
            apply(
                &handlers,
                &dir,
                "handlers.toml",
                &toml(&format!("policy-{i}.wasm")),
            )
        })
        .collect();
    row("cold pull + apply, compile cache cold", cold);
    row("cold pull + apply, compile cache warm", warm);
    row("refresh, unchanged digest (no download)", refresh);
    row("floor: pull alone (manifest, blob, referrers)", alone);
    row("floor: the same swap from a file, cache warm", from_file);

    cancel.cancel();
    rt.block_on(watching).expect("watch task");
}
