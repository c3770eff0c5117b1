//! The private compile cache: compiled components kept on disk between starts, so a restart (or
//! a swap back to a module seen before) deserialises the machine code instead of compiling it.
//!
//! Layout under the state directory:
//!
//! ```text
//! handler-cache/          0700, owned by the daemon's user
//!   <entry key>.cwasm     0600: MAGIC ‖ HMAC-SHA256(node key, entry key ‖ artifact) ‖ artifact
//! handler-cache.key       0600: the node's secret key, 32 random bytes, created on first use
//! ```
//!
//! The entry key is a sha256 over the module's sha256, the wasmtime version, this crate's
//! version and the engine's compatibility hash (`Engine::precompile_compatibility_hash`: target,
//! compiler flags, tunables, wasm features), so another wasmtime, another Pluglet or another
//! engine configuration never finds an old entry.
//!
//! Deserialising a wasmtime artifact is `unsafe`: forged bytes can run arbitrary code. So only
//! bytes whose MAC verifies under the node's key, bytes this daemon wrote, ever reach
//! [`deserialize_verified`], the one function allowed `unsafe`; the MAC check is the only way to
//! a [`Verified`] artifact. A missing, stale, corrupt or forged entry is compiled again and
//! rewritten (temporary file, then rename), with a log line. Failing to write an entry only logs:
//! the module still loads. Nothing is fsynced: an entry torn by a crash fails its MAC and is
//! compiled again.

use std::fs::{self, OpenOptions, Permissions};
use std::hash::{Hash as _, Hasher};
use std::io::{self, Read as _, Write as _};
use std::os::unix::fs::{
    DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// The cache directory's name in the state directory.
pub const CACHE_DIR: &str = "handler-cache";
/// The node key's file name in the state directory.
pub const KEY_FILE: &str = "handler-cache.key";

/// The wasmtime version compiled in (the workspace pins it exactly; a test checks it against
/// `Cargo.lock`).
const WASMTIME_VERSION: &str = "48.0.8";
/// The first bytes of every entry (format version 1).
const MAGIC: &[u8; 8] = b"PLGCWA01";
const MAC_LEN: usize = 32;
const HEADER_LEN: usize = MAGIC.len() + MAC_LEN;
const KEY_LEN: usize = 32;
/// Entries larger than this are not read (a compiled handler is a few MiB).
const MAX_ENTRY_BYTES: u64 = 256 << 20;
/// An entry's file name ends so.
const ENTRY_SUFFIX: &str = ".cwasm";
/// A file being written ends so, until it is renamed into place.
const TEMP_SUFFIX: &str = ".tmp";

type HmacSha256 = Hmac<Sha256>;

/// Why the compile cache cannot be used (the daemon then compiles every module).
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A file or directory of the cache could not be created, read or changed.
    #[error("compile cache: cannot use {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The directory or key file belongs to another user, who could plant artifacts.
    #[error(
        "compile cache: {path} is owned by uid {owner}, not by this daemon's uid {uid}; \
         refused (remove it, or give it to uid {uid})"
    )]
    Owner {
        /// The file or directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// The daemon's effective uid.
        uid: u32,
    },
    /// The path is a symlink or not of the expected kind.
    #[error(
        "compile cache: {path} is not a {expected} (a symlink or another kind of file); refused (remove it)"
    )]
    NotPrivate {
        /// The path.
        path: PathBuf,
        /// `directory` or `regular file`.
        expected: &'static str,
    },
    /// No random bytes for a new key.
    #[error("compile cache: cannot draw a random key")]
    Random(#[source] getrandom::Error),
}

/// A private on-disk cache of compiled components with this node's secret key: give it to
/// [`crate::Runtime::with_cache`].
pub struct CompileCache {
    dir: PathBuf,
    key: [u8; KEY_LEN],
}

impl std::fmt::Debug for CompileCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompileCache")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl CompileCache {
    /// Opens (creates) `<state_dir>/handler-cache` (0700) and the node key
    /// `<state_dir>/handler-cache.key` (0600, 32 random bytes). A directory of wider mode is made
    /// private again; a key file readable by others is replaced by a new key (its secret may be
    /// known), which leaves every old entry untrusted. A directory or key owned by another user,
    /// or a symlink, is refused.
    pub fn open(state_dir: &Path) -> Result<CompileCache, CacheError> {
        let dir = state_dir.join(CACHE_DIR);
        private_dir(&dir)?;
        remove_leftover_temp_files(&dir);
        let key = node_key(&state_dir.join(KEY_FILE))?;
        Ok(CompileCache { dir, key })
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// What the compile cache of a runtime did since the runtime started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Loads served from an entry (deserialised, not compiled).
    pub hits: u64,
    /// Loads that compiled: no entry, or one not trusted.
    pub compiled: u64,
    /// Entries not used: corrupt, forged, written under another key, or refused by wasmtime.
    pub untrusted: u64,
    /// Entries written (new or rewritten).
    pub written: u64,
    /// Entries that could not be written (the module loaded all the same).
    pub write_failures: u64,
}

/// A cache in use by a runtime: the cache, the engine's part of every entry key, counters.
pub(crate) struct ActiveCache {
    cache: CompileCache,
    engine: [u8; 32],
    hits: AtomicU64,
    compiled: AtomicU64,
    untrusted: AtomicU64,
    written: AtomicU64,
    write_failures: AtomicU64,
}

impl ActiveCache {
    pub(crate) fn new(cache: CompileCache, engine: &Engine) -> ActiveCache {
        ActiveCache {
            cache,
            engine: engine_digest(engine),
            hits: AtomicU64::new(0),
            compiled: AtomicU64::new(0),
            untrusted: AtomicU64::new(0),
            written: AtomicU64::new(0),
            write_failures: AtomicU64::new(0),
        }
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.cache.dir
    }

    pub(crate) fn stats(&self) -> CacheStats {
        let get = |n: &AtomicU64| n.load(Ordering::Relaxed);
        CacheStats {
            hits: get(&self.hits),
            compiled: get(&self.compiled),
            untrusted: get(&self.untrusted),
            written: get(&self.written),
            write_failures: get(&self.write_failures),
        }
    }

    /// The entry's path for a module.
    fn entry_path(&self, key: &[u8; 32]) -> PathBuf {
        self.cache
            .dir
            .join(format!("{}{ENTRY_SUFFIX}", hex::encode(key)))
    }

    /// The compiled component of `wasm` (whose sha256 is `module_sha256`): from its entry when
    /// one verifies, else compiled by `compile` and written to the cache. `true` when it came from
    /// the cache.
    pub(crate) fn component<E>(
        &self,
        engine: &Engine,
        module: &str,
        module_sha256: &[u8; 32],
        compile: impl FnOnce() -> Result<Component, E>,
    ) -> Result<(Component, bool), E> {
        let key = entry_key(
            module_sha256,
            WASMTIME_VERSION,
            env!("CARGO_PKG_VERSION"),
            &self.engine,
        );
        let path = self.entry_path(&key);
        let replacing = match read_entry(&self.cache.key, &key, &path) {
            Lookup::Verified(artifact) => match deserialize_verified(engine, &artifact) {
                Ok(component) => {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok((component, true));
                }
                Err(e) => {
                    self.untrusted.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        module,
                        entry = %path.display(),
                        error = %e,
                        "compile cache entry refused by wasmtime (stale); compiling the module again and rewriting the entry"
                    );
                    true
                }
            },
            Lookup::Missing => false,
            Lookup::Untrusted(reason) => {
                self.untrusted.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    module,
                    entry = %path.display(),
                    reason,
                    "compile cache entry not trusted; compiling the module again and rewriting the entry"
                );
                true
            }
        };
        let component = compile()?;
        self.compiled.fetch_add(1, Ordering::Relaxed);
        match write_entry(&self.cache.key, &key, &path, &component) {
            Ok(()) => {
                self.written.fetch_add(1, Ordering::Relaxed);
                if replacing {
                    tracing::info!(module, entry = %path.display(), "compile cache entry rewritten");
                } else {
                    tracing::debug!(module, entry = %path.display(), "compile cache entry written");
                }
            }
            Err(e) => {
                self.write_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    module,
                    entry = %path.display(),
                    error = %e,
                    "cannot write the compile cache entry; the module is loaded all the same and will be compiled again at the next start"
                );
            }
        }
        Ok((component, false))
    }
}

/// The engine's part of an entry key: its compatibility hash fed to sha256 (a fixed hasher, unlike
/// `DefaultHasher`).
pub(crate) fn engine_digest(engine: &Engine) -> [u8; 32] {
    let mut hasher = Sha256Hasher(Sha256::new());
    engine.precompile_compatibility_hash().hash(&mut hasher);
    hasher.0.finalize().into()
}

/// Feeds `Hash` input to sha256; the digest is taken from the inner hasher, not `finish`.
struct Sha256Hasher(Sha256);

impl Hasher for Sha256Hasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    fn finish(&self) -> u64 {
        let digest = self.0.clone().finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        u64::from_le_bytes(first)
    }
}

/// The key of a module's entry: changes with the module, the wasmtime version, this crate's
/// version and the engine's configuration.
fn entry_key(
    module_sha256: &[u8; 32],
    wasmtime_version: &str,
    crate_version: &str,
    engine: &[u8; 32],
) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"pluglet handler compile cache\0");
    h.update(module_sha256);
    for part in [wasmtime_version, crate_version] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.update(engine);
    h.finalize().into()
}

/// The MAC of an entry: over the entry key and the artifact bytes.
fn entry_mac(node_key: &[u8; KEY_LEN], entry_key: &[u8; 32], artifact: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(node_key).expect("HMAC takes a key of any length");
    mac.update(entry_key);
    mac.update(artifact);
    mac
}

/// Artifact bytes whose MAC verified under the node's key: made only by [`verify`].
pub(crate) struct Verified {
    bytes: Vec<u8>,
}

impl Verified {
    /// The artifact (the bytes after the header, exactly those the MAC covered).
    fn artifact(&self) -> &[u8] {
        &self.bytes[HEADER_LEN..]
    }
}

/// Checks an entry's header and MAC (constant-time, by `hmac`'s `verify_slice`).
fn verify(
    node_key: &[u8; KEY_LEN],
    entry_key: &[u8; 32],
    bytes: Vec<u8>,
) -> Result<Verified, &'static str> {
    if bytes.len() < HEADER_LEN || bytes[..MAGIC.len()] != MAGIC[..] {
        return Err("not a compile cache entry (no Pluglet header)");
    }
    let tag = &bytes[MAGIC.len()..HEADER_LEN];
    entry_mac(node_key, entry_key, &bytes[HEADER_LEN..])
        .verify_slice(tag)
        .map_err(|_| {
            "its MAC does not verify under this node's key (corrupt, forged or written under another key)"
        })?;
    Ok(Verified { bytes })
}

/// Deserialises an artifact this daemon wrote.
#[allow(unsafe_code)]
fn deserialize_verified(engine: &Engine, artifact: &Verified) -> wasmtime::Result<Component> {
    #[cfg(test)]
    tests::DESERIALISED.with(|n| n.set(n.get() + 1));
    // SAFETY: `Component::deserialize` trusts its bytes to be an artifact wasmtime produced. These
    // are: a `Verified` exists only once the HMAC-SHA256 over exactly these bytes (and the entry
    // key) verified under this node's secret key, which is 32 random bytes kept 0600 in the state
    // directory, beside a cache directory that is 0700 and owned by this daemon's user. Only this
    // daemon, which writes `Component::serialize` output and nothing else, holds the key, so no
    // one else can produce bytes that verify. The bytes are verified in memory and deserialised
    // from that same buffer, never read from disk again. An artifact of another wasmtime or engine
    // configuration is refused by wasmtime with an error, not undefined behaviour.
    unsafe { Component::deserialize(engine, artifact.artifact()) }
}

/// What reading an entry found.
enum Lookup {
    Verified(Verified),
    Missing,
    Untrusted(String),
}

fn read_entry(node_key: &[u8; KEY_LEN], entry_key: &[u8; 32], path: &Path) -> Lookup {
    let mut file = match OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Lookup::Missing,
        Err(e) => return Lookup::Untrusted(format!("cannot be read: {e}")),
    };
    let len = match file.metadata() {
        Ok(meta) if !meta.is_file() => return Lookup::Untrusted("not a regular file".into()),
        Ok(meta) => meta.len(),
        Err(e) => return Lookup::Untrusted(format!("cannot be read: {e}")),
    };
    if len > MAX_ENTRY_BYTES {
        return Lookup::Untrusted(format!("{len} bytes, more than an entry can be"));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    if let Err(e) = file.read_to_end(&mut bytes) {
        return Lookup::Untrusted(format!("cannot be read: {e}"));
    }
    match verify(node_key, entry_key, bytes) {
        Ok(verified) => Lookup::Verified(verified),
        Err(reason) => Lookup::Untrusted(reason.into()),
    }
}

fn write_entry(
    node_key: &[u8; KEY_LEN],
    entry_key: &[u8; 32],
    path: &Path,
    component: &Component,
) -> io::Result<()> {
    let artifact = component
        .serialize()
        .map_err(|e| io::Error::other(format!("cannot serialise the component: {e}")))?;
    let tag = entry_mac(node_key, entry_key, &artifact)
        .finalize()
        .into_bytes();
    write_private(
        path,
        &[MAGIC.as_slice(), tag.as_slice(), artifact.as_slice()],
    )
}

/// Writes `parts` to `path` atomically (a 0600 temporary file beside it, then rename).
fn write_private(path: &Path, parts: &[&[u8]]) -> io::Result<()> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = path.with_file_name(format!(
        ".{name}.{}.{}{TEMP_SUFFIX}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&temp)?;
        // The umask may have taken bits away (never added any): make it exactly 0600.
        file.set_permissions(Permissions::from_mode(0o600))?;
        for part in parts {
            file.write_all(part)?;
        }
        drop(file);
        fs::rename(&temp, path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&temp);
    }
    written
}

/// Creates the cache directory 0700, or checks the one there: a symlink, a non-directory or
/// another owner is refused; a wider mode is narrowed to 0700 with a log line.
fn private_dir(dir: &Path) -> Result<(), CacheError> {
    let io_err = |source: io::Error| CacheError::Io {
        path: dir.to_owned(),
        source,
    };
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {
            fs::set_permissions(dir, Permissions::from_mode(0o700)).map_err(io_err)?;
            tracing::info!(dir = %dir.display(), "compile cache directory created");
            return Ok(());
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_err(e)),
    }
    let meta = fs::symlink_metadata(dir).map_err(io_err)?;
    if !meta.file_type().is_dir() {
        return Err(CacheError::NotPrivate {
            path: dir.to_owned(),
            expected: "directory",
        });
    }
    check_owner(dir, &meta)?;
    let mode = meta.mode() & 0o7777;
    if mode != 0o700 {
        fs::set_permissions(dir, Permissions::from_mode(0o700)).map_err(io_err)?;
        tracing::warn!(
            dir = %dir.display(),
            mode = %format!("{mode:04o}"),
            "compile cache directory was not private; its mode is now 0700"
        );
    }
    Ok(())
}

/// Refuses a file or directory that is not the daemon's user's.
fn check_owner(path: &Path, meta: &fs::Metadata) -> Result<(), CacheError> {
    let uid = nix::unistd::geteuid().as_raw();
    if meta.uid() != uid {
        return Err(CacheError::Owner {
            path: path.to_owned(),
            owner: meta.uid(),
            uid,
        });
    }
    Ok(())
}

/// Removes temporary files a crash left in the cache directory (best effort).
fn remove_leftover_temp_files(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') && name.ends_with(TEMP_SUFFIX) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Reads the node key, or creates it: 32 random bytes, 0600. A key file that others may read or
/// write, or of the wrong length, is replaced by a new key (with a log line).
fn node_key(path: &Path) -> Result<[u8; KEY_LEN], CacheError> {
    let io_err = |source: io::Error| CacheError::Io {
        path: path.to_owned(),
        source,
    };
    let mut file = match OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let key = new_key(path)?;
            tracing::info!(key = %path.display(), "compile cache key created");
            return Ok(key);
        }
        Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => {
            return Err(CacheError::NotPrivate {
                path: path.to_owned(),
                expected: "regular file",
            });
        }
        Err(e) => return Err(io_err(e)),
    };
    let meta = file.metadata().map_err(io_err)?;
    if !meta.is_file() {
        return Err(CacheError::NotPrivate {
            path: path.to_owned(),
            expected: "regular file",
        });
    }
    check_owner(path, &meta)?;
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        let key = new_key(path)?;
        tracing::warn!(
            key = %path.display(),
            mode = %format!("{mode:04o}"),
            "compile cache key was open to other users; replaced by a new key (every cached module will be compiled again)"
        );
        return Ok(key);
    }
    let mut bytes = Vec::with_capacity(KEY_LEN + 1);
    std::io::Read::by_ref(&mut file)
        .take(KEY_LEN as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err)?;
    match <[u8; KEY_LEN]>::try_from(bytes.as_slice()) {
        Ok(key) => Ok(key),
        Err(_) => {
            let key = new_key(path)?;
            tracing::warn!(
                key = %path.display(),
                "compile cache key was damaged; replaced by a new key (every cached module will be compiled again)"
            );
            Ok(key)
        }
    }
}

/// Draws a new key and writes it to `path` (0600, atomically).
fn new_key(path: &Path) -> Result<[u8; KEY_LEN], CacheError> {
    let mut key = [0u8; KEY_LEN];
    getrandom::fill(&mut key).map_err(CacheError::Random)?;
    write_private(path, &[key.as_slice()]).map_err(|source| CacheError::Io {
        path: path.to_owned(),
        source,
    })?;
    Ok(key)
}

#[cfg(test)]
mod tests;
