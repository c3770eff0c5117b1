//! The built-in handlers compiled once per test process instead of once per daemon.
//!
//! A fresh daemon compiles its built-in handlers before it answers (about half a second of two
//! cores in a debug build); a restarted one loads them from its compile cache
//! (`<state>/handler-cache` and the node key beside it). The first daemon of a test process that
//! becomes ready on the default state directory leaves its cache here, in memory; every later
//! daemon started on a root that has no state directory yet is given a copy, so it starts as a
//! restarted node does. Nothing else of the state is copied, and a daemon whose engine or
//! modules differ finds no matching entry and compiles as usual. Tests of the first start itself
//! use [`Daemon::start_cold`](super::Daemon::start_cold).

use std::fs::{DirBuilder, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use pluglet_handler_runtime::{CACHE_DIR, KEY_FILE};

/// The node key and the finished entries (file name, bytes) of the first ready daemon.
struct Compiled {
    key: Vec<u8>,
    entries: Vec<(String, Vec<u8>)>,
}

static COMPILED: OnceLock<Compiled> = OnceLock::new();

/// The state directory of a daemon run on `root` with `extra` arguments, if it is the default
/// one (`<root>/state`); only those are seeded and captured.
pub(crate) fn default_state(root: &Path, extra: &[&str]) -> Option<PathBuf> {
    (!extra.contains(&"--state-dir")).then(|| root.join("state"))
}

/// Gives a daemon about to start on `state` a copy of the compiled built-ins, when that
/// directory does not exist yet and a daemon of this process has compiled them.
pub(crate) fn seed(state: &Path) {
    let Some(compiled) = COMPILED.get() else {
        return;
    };
    if state.exists() {
        return;
    }
    let dir_mode = |mode| {
        let mut b = DirBuilder::new();
        b.mode(mode);
        b
    };
    let write = |path: &Path, bytes: &[u8]| {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .and_then(|mut f| f.write_all(bytes))
            .unwrap_or_else(|e| panic!("seed {}: {e}", path.display()));
    };
    dir_mode(0o755)
        .create(state)
        .unwrap_or_else(|e| panic!("create {}: {e}", state.display()));
    let dir = state.join(CACHE_DIR);
    dir_mode(0o700)
        .create(&dir)
        .unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    write(&state.join(KEY_FILE), &compiled.key);
    for (name, bytes) in &compiled.entries {
        write(&dir.join(name), bytes);
    }
}

/// Keeps the compile cache of a daemon that is ready on `state`, if none is kept yet.
pub(crate) fn capture(state: &Path) {
    if COMPILED.get().is_some() {
        return;
    }
    let Ok(key) = std::fs::read(state.join(KEY_FILE)) else {
        return;
    };
    let Ok(dir) = std::fs::read_dir(state.join(CACHE_DIR)) else {
        return;
    };
    // Finished entries only: one being written still ends in `.tmp`.
    let entries: Vec<(String, Vec<u8>)> = dir
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.ends_with(".cwasm")
                .then(|| Some((name, std::fs::read(e.path()).ok()?)))?
        })
        .collect();
    if !entries.is_empty() {
        let _ = COMPILED.set(Compiled { key, entries });
    }
}
