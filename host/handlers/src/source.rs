//! Modules named by an OCI reference (`module = "oci://REGISTRY/REPO:TAG"` or `@sha256:HEX`):
//! before a transaction, each such entry is given the digest it runs and the files of that
//! digest in the content-addressed store `<state>/handlers/oci/<hex>/` (the manifest, the
//! module, and the signature and vectors attached to it), so the transaction checks, compiles
//! and applies a pulled module exactly as a file.
//!
//! A tag is resolved once, when its entry is applied: an entry whose reference is the one in
//! force keeps its digest (no network) until `handlers.toml` changes it or a refresh asks. The
//! store is checked when read (the manifest against its digest, the module against the layer
//! digest the manifest names); a digest the store lacks or fails is pulled again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pluglet_oci::{OciRef, Outcome, PullError, Registry, RegistryOptions};

use crate::file::HandlersFile;
use crate::integrity::signature_path;
use crate::slot::SlotKey;
use crate::vectors::vectors_path;

/// The module file's name inside a digest's folder of the store.
const MODULE_FILE: &str = "module.wasm";
/// The manifest's file name inside a digest's folder.
const MANIFEST_FILE: &str = "manifest.json";

/// The upper bounds (seconds) of the pull duration histogram's buckets.
pub const PULL_BUCKETS: [f64; 10] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Pulls counted by outcome, and a histogram of their durations.
#[derive(Clone, Debug, Default)]
pub struct PullStats {
    /// Pulls by outcome label (`pulled`, `unreachable`, `unauthorized`, ...).
    pub by_outcome: BTreeMap<&'static str, u64>,
    /// Pulls per bucket of [`PULL_BUCKETS`] (each its own count, not cumulative), then the
    /// pulls above the last bound.
    pub buckets: [u64; PULL_BUCKETS.len() + 1],
    /// The pulls' total time, seconds.
    pub sum_seconds: f64,
    /// Pulls timed.
    pub count: u64,
}

impl PullStats {
    fn observe(&mut self, took: Duration) {
        let seconds = took.as_secs_f64();
        let bucket = PULL_BUCKETS
            .iter()
            .position(|bound| seconds <= *bound)
            .unwrap_or(PULL_BUCKETS.len());
        self.buckets[bucket] += 1;
        self.sum_seconds += seconds;
        self.count += 1;
    }
}

/// The registries and the store the handler set pulls from and into.
pub(crate) struct Sources {
    options: RegistryOptions,
    store: Option<PathBuf>,
    stats: Mutex<PullStats>,
}

/// Why an entry's module could not be had: the slot, and the reason.
pub(crate) type Unpulled = (SlotKey, String);

impl Sources {
    /// Pulls with `options`, into `<state_dir>/handlers/oci` (none without a state directory).
    pub(crate) fn new(options: RegistryOptions, state_dir: Option<&Path>) -> Sources {
        Sources {
            options,
            store: state_dir.map(|s| s.join("handlers").join("oci")),
            stats: Mutex::new(PullStats::default()),
        }
    }

    /// The pull counters and durations so far.
    pub(crate) fn stats(&self) -> PullStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Gives each `oci://` entry of `file` its digest and its module's path in the store.
    /// `in_force(slot, source)`: the digest in force for `slot` when its entry has that source;
    /// `refresh(slot)`: resolve the tag again even so. Blocks on the network for what must be
    /// pulled: call it off the async reactor.
    pub(crate) fn resolve(
        &self,
        file: &mut HandlersFile,
        in_force: impl Fn(&SlotKey, &str) -> Option<String>,
        refresh: impl Fn(&SlotKey) -> bool,
    ) -> Result<(), Vec<Unpulled>> {
        let mut unpulled = Vec::new();
        let mut runtime = None;
        for (slot, entry) in file.entries.iter_mut() {
            let Some(source) = entry.source.clone() else {
                continue;
            };
            match self.one(slot, &source, &in_force, &refresh, &mut runtime) {
                Ok((digest, module)) => {
                    entry.digest = Some(digest);
                    entry.module = module;
                }
                Err(reason) => unpulled.push((slot.clone(), reason)),
            }
        }
        if unpulled.is_empty() {
            Ok(())
        } else {
            Err(unpulled)
        }
    }

    fn one(
        &self,
        slot: &SlotKey,
        source: &str,
        in_force: &impl Fn(&SlotKey, &str) -> Option<String>,
        refresh: &impl Fn(&SlotKey) -> bool,
        runtime: &mut Option<tokio::runtime::Runtime>,
    ) -> Result<(String, PathBuf), String> {
        let store = self.store.as_ref().ok_or_else(|| {
            "a module named by an OCI reference needs the state directory (--state-dir)".to_owned()
        })?;
        let reference = OciRef::parse(source).map_err(|e| e.to_string())?;
        let known = reference
            .digest()
            .map(str::to_owned)
            .or_else(|| (!refresh(slot)).then(|| in_force(slot, source)).flatten());
        if let Some(digest) = &known {
            match check_kept(store, digest) {
                Ok(module) => return Ok((digest.clone(), module)),
                Err(why) => {
                    tracing::info!(%slot, source, digest, reason = why, "pulling the module again");
                }
            }
        }
        let runtime = match runtime {
            Some(rt) => rt,
            None => runtime.insert(
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| format!("cannot start the pull: {e}"))?,
            ),
        };
        let registry = Registry::new(self.options.clone());
        let started = Instant::now();
        let result = runtime.block_on(async {
            let digest = match &known {
                Some(digest) => digest.clone(),
                None => registry.resolve(&reference).await?,
            };
            if let Ok(module) = check_kept(store, &digest) {
                return Ok::<_, PullError>((digest, module, Outcome::Kept));
            }
            let pulled = registry.pull(&reference.with_digest(&digest)).await?;
            let module = keep(store, &pulled).map_err(|e| PullError::Registry {
                outcome: Outcome::Error,
                message: format!("cannot keep the pulled module in {}: {e}", store.display()),
            })?;
            Ok((digest, module, Outcome::Pulled))
        });
        let outcome = match &result {
            Ok((_, _, outcome)) => *outcome,
            Err(e) => e.outcome(),
        };
        {
            let mut stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            *stats.by_outcome.entry(outcome.as_str()).or_default() += 1;
            stats.observe(started.elapsed());
        }
        match result {
            Ok((digest, module, outcome)) => {
                if outcome == Outcome::Kept {
                    tracing::debug!(%slot, source, digest, "the tag names a module already kept");
                } else {
                    tracing::info!(%slot, source, digest, "module pulled");
                }
                Ok((digest, module))
            }
            Err(e) => {
                let reason = format!(
                    "cannot pull {source} ({}): {}",
                    outcome.as_str(),
                    pluglet_core::error_chain(&e)
                );
                tracing::warn!(%slot, source, reason, "pull refused");
                Err(reason)
            }
        }
    }
}

/// The module of `digest` in the store, checked: the manifest against the digest, the module
/// against the layer digest the manifest names.
fn check_kept(store: &Path, digest: &str) -> Result<PathBuf, String> {
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|_| pluglet_oci::reference::is_sha256_digest(digest))
        .ok_or_else(|| format!("{digest} is not a sha256 digest"))?;
    let dir = store.join(hex);
    let manifest = std::fs::read(dir.join(MANIFEST_FILE))
        .map_err(|e| format!("not kept ({}): {e}", dir.display()))?;
    if pluglet_oci::layout::sha256_digest(&manifest) != digest {
        return Err(format!(
            "the kept manifest in {} does not match its digest",
            dir.display()
        ));
    }
    let layer = pluglet_oci::layout::module_layer(&manifest, u64::MAX)
        .map_err(|e| format!("the kept manifest: {e}"))?;
    let module = dir.join(MODULE_FILE);
    let bytes = std::fs::read(&module).map_err(|e| format!("the kept module: {e}"))?;
    if pluglet_oci::layout::sha256_digest(&bytes) != layer.digest {
        return Err(format!(
            "the kept module {} does not match the layer digest {}",
            module.display(),
            layer.digest
        ));
    }
    Ok(module)
}

/// Writes a pulled module into the store (a folder written whole, then renamed into place).
fn keep(store: &Path, pulled: &pluglet_oci::Pulled) -> std::io::Result<PathBuf> {
    let hex = pulled.digest.trim_start_matches("sha256:");
    let dir = store.join(hex);
    std::fs::create_dir_all(store)?;
    let tmp = store.join(format!(".{hex}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let module = tmp.join(MODULE_FILE);
    write_synced(&tmp.join(MANIFEST_FILE), &pulled.manifest)?;
    write_synced(&module, &pulled.module)?;
    if let Some(signature) = pulled.signatures.last() {
        write_synced(&signature_path(&module), signature.as_bytes())?;
    }
    if let Some(vectors) = &pulled.vectors {
        write_synced(&vectors_path(&module), vectors)?;
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::rename(&tmp, &dir)?;
    std::fs::File::open(store)?.sync_all()?;
    Ok(dir.join(MODULE_FILE))
}

fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut file = std::fs::File::create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}
