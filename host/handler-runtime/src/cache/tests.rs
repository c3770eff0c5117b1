//! The compile cache against the built-in CSI handler: cold and warm loads, corrupt, forged and
//! foreign-key entries (none of which reaches `deserialize_verified`), permissions, keys.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use wasmtime::Config;

use super::*;
use crate::{CallContext, Handler, ModuleSource, PluginInfo, Runtime, RuntimeConfig};

thread_local! {
    /// Calls of `deserialize_verified` on this thread (each test loads on its own thread).
    pub(super) static DESERIALISED: Cell<u32> = const { Cell::new(0) };
}

fn deserialised() -> u32 {
    DESERIALISED.with(Cell::get)
}

fn runtime(state: &Path) -> Runtime {
    let cache = CompileCache::open(state).expect("the cache opens");
    let config = RuntimeConfig {
        pool_size: 2,
        ..RuntimeConfig::default()
    };
    Runtime::with_cache(config, cache).expect("runtime")
}

fn load(runtime: &Runtime) -> Arc<Handler> {
    let source = ModuleSource::Builtin {
        name: "csi".into(),
        bytes: pluglet_wasm_guests::CSI,
    };
    runtime
        .load(source, BTreeMap::new(), None)
        .expect("the built-in CSI handler loads")
}

/// The handler answers a validate call with the version it chose.
fn serves(handler: &Handler) {
    let plugin = PluginInfo {
        plugin_type: "CSIPlugin".into(),
        name: "csi.example.com".into(),
        endpoint: "/var/lib/kubelet/plugins/csi.example.com/csi.sock".into(),
        supported_versions: vec!["1.0.0".into()],
    };
    let cx = CallContext {
        node_name: "node-1".into(),
    };
    let call = handler.validate(&cx, &plugin, None).expect("the call runs");
    assert_eq!(call.value.unwrap().version.as_deref(), Some("1.0.0"));
}

fn entries(state: &Path) -> Vec<PathBuf> {
    let mut entries: Vec<PathBuf> = fs::read_dir(state.join(CACHE_DIR))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    entries
}

fn only_entry(state: &Path) -> PathBuf {
    let entries = entries(state);
    assert_eq!(
        entries.len(),
        1,
        "one entry (and no temporary file): {entries:?}"
    );
    assert!(entries[0].to_string_lossy().ends_with(ENTRY_SUFFIX));
    entries[0].clone()
}

/// The entry key named by an entry's file name.
fn key_of(entry: &Path) -> [u8; 32] {
    let name = entry.file_name().unwrap().to_string_lossy();
    let hex_key = name.strip_suffix(ENTRY_SUFFIX).unwrap();
    hex::decode(hex_key).unwrap().try_into().unwrap()
}

fn node_key_of(state: &Path) -> [u8; KEY_LEN] {
    fs::read(state.join(KEY_FILE)).unwrap().try_into().unwrap()
}

fn mode(path: &Path) -> u32 {
    fs::symlink_metadata(path).unwrap().mode() & 0o7777
}

/// Asserts that `entry` now holds an entry that verifies under the node's key.
fn assert_trusted(state: &Path, entry: &Path) {
    let bytes = fs::read(entry).unwrap();
    assert!(
        verify(&node_key_of(state), &key_of(entry), bytes).is_ok(),
        "{} verifies",
        entry.display()
    );
}

#[test]
fn a_cold_load_writes_a_private_entry_and_a_warm_load_uses_it() {
    let state = tempfile::tempdir().unwrap();
    let state = state.path();
    let before = deserialised();
    let cold_runtime = runtime(state);
    let cold = load(&cold_runtime);
    assert!(!cold.from_cache());
    assert_eq!(deserialised(), before);
    let stats = cold_runtime.cache_stats().unwrap();
    assert_eq!((stats.hits, stats.compiled, stats.written), (0, 1, 1));

    let entry = only_entry(state);
    assert_eq!(mode(&state.join(CACHE_DIR)), 0o700);
    assert_eq!(mode(&entry), 0o600);
    assert_eq!(mode(&state.join(KEY_FILE)), 0o600);
    assert_eq!(fs::read(state.join(KEY_FILE)).unwrap().len(), KEY_LEN);
    assert_trusted(state, &entry);

    let warm_runtime = runtime(state);
    let warm = load(&warm_runtime);
    assert!(warm.from_cache());
    assert_eq!(deserialised(), before + 1);
    assert_eq!(
        warm_runtime.cache_stats(),
        Some(CacheStats {
            hits: 1,
            ..CacheStats::default()
        })
    );
    assert!(
        warm.compile_time() < cold.compile_time(),
        "warm {:?} < cold {:?}",
        warm.compile_time(),
        cold.compile_time()
    );
    assert_eq!(warm.sha256(), cold.sha256());
    assert_eq!(warm.families(), cold.families());
    serves(&warm);
    serves(&cold);
}

#[test]
fn flipped_bytes_are_detected_recompiled_and_rewritten() {
    let state = tempfile::tempdir().unwrap();
    let state = state.path();
    load(&runtime(state));
    let entry = only_entry(state);
    let good = fs::read(&entry).unwrap();
    for (what, offset) in [
        ("header", 2),
        ("MAC", MAGIC.len() + 5),
        ("artifact", good.len() / 2),
        ("last byte", good.len() - 1),
    ] {
        let mut corrupt = good.clone();
        corrupt[offset] ^= 0x40;
        fs::write(&entry, &corrupt).unwrap();

        let before = deserialised();
        let rt = runtime(state);
        let handler = load(&rt);
        assert!(!handler.from_cache(), "{what}");
        assert_eq!(
            deserialised(),
            before,
            "{what}: the corrupt entry was deserialised"
        );
        let stats = rt.cache_stats().unwrap();
        assert_eq!(
            (stats.untrusted, stats.compiled, stats.written),
            (1, 1, 1),
            "{what}"
        );
        assert_ne!(fs::read(&entry).unwrap(), corrupt, "{what}: rewritten");
        assert_trusted(state, &only_entry(state));
        serves(&handler);
        assert!(load(&runtime(state)).from_cache(), "{what}: used after");
    }
}

#[test]
fn a_forged_entry_never_reaches_deserialise_and_is_rewritten() {
    let state = tempfile::tempdir().unwrap();
    let state = state.path();
    let rt = runtime(state);
    load(&rt);
    let entry = only_entry(state);
    let entry_key = key_of(&entry);
    let node_key = node_key_of(state);
    // A genuine wasmtime artifact of this very module for this very engine: what a forger with
    // the same Pluglet build (but not the node's key) could write.
    let artifact = Component::new(rt.engine(), pluglet_wasm_guests::CSI)
        .unwrap()
        .serialize()
        .unwrap();
    let with_tag = |tag: &[u8]| [MAGIC.as_slice(), tag, artifact.as_slice()].concat();
    let forgeries = [
        ("a zero MAC", with_tag(&[0; MAC_LEN])),
        (
            "a MAC under another key",
            with_tag(
                &entry_mac(&[7; KEY_LEN], &entry_key, &artifact)
                    .finalize()
                    .into_bytes(),
            ),
        ),
        (
            "the node's MAC of another entry",
            with_tag(
                &entry_mac(&node_key, &[0; 32], &artifact)
                    .finalize()
                    .into_bytes(),
            ),
        ),
        ("no header (a bare artifact)", artifact.clone()),
        (
            "a truncated header",
            [MAGIC.as_slice(), &[0u8; 10][..]].concat(),
        ),
        ("an empty file", Vec::new()),
    ];
    for (what, forged) in forgeries {
        fs::write(&entry, &forged).unwrap();
        let before = deserialised();
        let rt = runtime(state);
        let handler = load(&rt);
        assert!(!handler.from_cache(), "{what}");
        assert_eq!(
            deserialised(),
            before,
            "{what}: the forged entry was deserialised"
        );
        assert_eq!(rt.cache_stats().unwrap().untrusted, 1, "{what}");
        assert_ne!(fs::read(&entry).unwrap(), forged, "{what}: rewritten");
        assert_trusted(state, &entry);
        serves(&handler);
    }
    // The check is the MAC, not the artifact: the same artifact under the node's MAC is used.
    fs::write(
        &entry,
        with_tag(
            &entry_mac(&node_key, &entry_key, &artifact)
                .finalize()
                .into_bytes(),
        ),
    )
    .unwrap();
    let before = deserialised();
    assert!(load(&runtime(state)).from_cache());
    assert_eq!(deserialised(), before + 1);
}

#[test]
fn entries_written_under_another_key_are_not_trusted() {
    let state = tempfile::tempdir().unwrap();
    let state = state.path();
    load(&runtime(state));
    let entry = only_entry(state);
    let written = fs::read(&entry).unwrap();
    fs::write(state.join(KEY_FILE), [9u8; KEY_LEN]).unwrap();

    let before = deserialised();
    let rt = runtime(state);
    let handler = load(&rt);
    assert!(!handler.from_cache());
    assert_eq!(deserialised(), before);
    assert_eq!(rt.cache_stats().unwrap().untrusted, 1);
    assert_ne!(
        fs::read(&entry).unwrap(),
        written,
        "rewritten under the new key"
    );
    assert_trusted(state, &entry);
    assert!(load(&runtime(state)).from_cache());
}

#[test]
fn a_wider_directory_is_made_private_and_an_exposed_or_damaged_key_is_replaced() {
    let state = tempfile::tempdir().unwrap();
    let state = state.path();
    let dir = state.join(CACHE_DIR);
    let key = state.join(KEY_FILE);
    CompileCache::open(state).unwrap();
    let first = fs::read(&key).unwrap();

    fs::set_permissions(&dir, Permissions::from_mode(0o755)).unwrap();
    CompileCache::open(state).unwrap();
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(fs::read(&key).unwrap(), first, "a good key is kept");

    fs::set_permissions(&key, Permissions::from_mode(0o644)).unwrap();
    CompileCache::open(state).unwrap();
    assert_eq!(mode(&key), 0o600);
    let second = fs::read(&key).unwrap();
    assert_eq!(second.len(), KEY_LEN);
    assert_ne!(second, first, "a key others could read is replaced");

    fs::write(&key, b"short").unwrap();
    CompileCache::open(state).unwrap();
    let third = fs::read(&key).unwrap();
    assert_eq!(third.len(), KEY_LEN);
    assert_ne!(third, second);
    assert_eq!(mode(&key), 0o600);
}

#[test]
fn symlinks_and_other_owners_are_refused() {
    let state = tempfile::tempdir().unwrap();
    let state = state.path();
    let elsewhere = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(elsewhere.path(), state.join(CACHE_DIR)).unwrap();
    let err = CompileCache::open(state).unwrap_err();
    assert!(matches!(err, CacheError::NotPrivate { .. }), "{err}");

    let state = tempfile::tempdir().unwrap();
    let state = state.path();
    let planted = elsewhere.path().join("key");
    fs::write(&planted, [1u8; KEY_LEN]).unwrap();
    std::os::unix::fs::symlink(&planted, state.join(KEY_FILE)).unwrap();
    let err = CompileCache::open(state).unwrap_err();
    assert!(matches!(err, CacheError::NotPrivate { .. }), "{err}");

    // Giving the directory to another user needs root (as on CI).
    if nix::unistd::geteuid().is_root() {
        let state = tempfile::tempdir().unwrap();
        let state = state.path();
        fs::DirBuilder::new()
            .mode(0o700)
            .create(state.join(CACHE_DIR))
            .unwrap();
        std::os::unix::fs::chown(state.join(CACHE_DIR), Some(65534), Some(65534)).unwrap();
        let err = CompileCache::open(state).unwrap_err();
        assert!(
            matches!(err, CacheError::Owner { owner: 65534, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("owned by uid 65534"), "{err}");
    }
}

#[test]
fn a_failed_write_only_logs_and_the_module_loads() {
    let state = tempfile::tempdir().unwrap();
    let state = state.path();
    let rt = runtime(state);
    fs::remove_dir(state.join(CACHE_DIR)).unwrap();
    let handler = load(&rt);
    assert!(!handler.from_cache());
    assert_eq!(rt.cache_stats().unwrap().write_failures, 1);
    serves(&handler);
}

#[test]
fn leftover_temporary_files_are_removed_at_open() {
    let state = tempfile::tempdir().unwrap();
    let state = state.path();
    CompileCache::open(state).unwrap();
    let leftover = state.join(CACHE_DIR).join(".abc.cwasm.1.0.tmp");
    fs::write(&leftover, b"half").unwrap();
    CompileCache::open(state).unwrap();
    assert!(!leftover.exists());
}

#[test]
fn the_entry_key_changes_with_the_module_wasmtime_pluglet_and_the_engine() {
    let base = entry_key(&[1; 32], "48.0.8", "0.1.0", &[2; 32]);
    assert_eq!(base, entry_key(&[1; 32], "48.0.8", "0.1.0", &[2; 32]));
    assert_ne!(base, entry_key(&[3; 32], "48.0.8", "0.1.0", &[2; 32]));
    assert_ne!(base, entry_key(&[1; 32], "48.0.9", "0.1.0", &[2; 32]));
    assert_ne!(base, entry_key(&[1; 32], "48.0.8", "0.1.1", &[2; 32]));
    assert_ne!(base, entry_key(&[1; 32], "48.0.80.1", ".0", &[2; 32]));
    assert_ne!(base, entry_key(&[1; 32], "48.0.8", "0.1.0", &[4; 32]));

    let plain = Engine::new(&Config::new()).unwrap();
    let again = Engine::new(&Config::new()).unwrap();
    let mut fuel = Config::new();
    fuel.consume_fuel(true);
    let fuel = Engine::new(&fuel).unwrap();
    assert_eq!(engine_digest(&plain), engine_digest(&again));
    assert_ne!(engine_digest(&plain), engine_digest(&fuel));
}

#[test]
fn the_wasmtime_version_in_the_key_is_the_one_built() {
    let lock = fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock"))
        .expect("the workspace's Cargo.lock");
    let version = lock
        .split("[[package]]")
        .find(|p| p.contains("\nname = \"wasmtime\"\n"))
        .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = \"")))
        .and_then(|v| v.strip_suffix('"'))
        .expect("wasmtime in Cargo.lock");
    assert_eq!(WASMTIME_VERSION, version);
}

#[test]
fn a_runtime_without_a_cache_compiles_and_reports_no_cache() {
    let rt = Runtime::new(RuntimeConfig {
        pool_size: 2,
        ..RuntimeConfig::default()
    })
    .unwrap();
    let handler = load(&rt);
    assert!(!handler.from_cache());
    assert!(rt.cache_stats().is_none());
    assert!(rt.cache_dir().is_none());
}
