//! `handlers.toml`: which module each plugin type and resource is configured to run.
//!
//! ```toml
//! [plugin_types.CSIPlugin]           # replaces builtin:csi for CSI drivers
//! module = "strict-csi.wasm"         # relative to the handlers dir, or absolute
//! sha256 = "9f86d0…"                 # optional pin: the module's digest (64 lowercase hex)
//! deadline_ms = 50                   # optional limits
//! memory_mib = 16
//! fuel = 50000000
//! max_concurrent_calls = 1           # calls of this slot at once (default: half the cores)
//! reuse_instances = true             # a call may run in an instance that served one before
//!                                    # (default: a fresh instance each call)
//! settings = { min_version = "1.2.0" }
//! rollback_after = 3                 # failures during probation before the previous version
//!                                    # comes back (0: never)
//! on_failure = "fail"                # or "builtin": a failed call is decided by the built-in
//!
//! [resources."vendor.com/gpu"]       # allocation policy for one resource
//! module = "spread-policy.wasm"
//! ```
//!
//! Parsing is pure: this module reads text and names files, it loads nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pluglet_handler_runtime::Limits;
use serde::{Deserialize, Serialize};

use crate::integrity::parse_pin;
use crate::slot::SlotKey;

/// The file name read from the handlers directory.
pub const HANDLERS_FILE: &str = "handlers.toml";

/// Failures of a new module during its probation before it is rolled back, unless an entry
/// says otherwise.
pub const DEFAULT_ROLLBACK_AFTER: u32 = 3;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    plugin_types: BTreeMap<String, EntryConfig>,
    #[serde(default)]
    resources: BTreeMap<String, EntryConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EntryConfig {
    module: PathBuf,
    sha256: Option<String>,
    deadline_ms: Option<u64>,
    memory_mib: Option<u32>,
    fuel: Option<u64>,
    max_concurrent_calls: Option<u32>,
    reuse_instances: Option<bool>,
    #[serde(default)]
    settings: BTreeMap<String, toml::Value>,
    rollback_after: Option<u32>,
    on_failure: Option<OnFailure>,
}

/// What a failed call (trap, deadline, memory cap, fuel) of a configured module means.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnFailure {
    /// The call fails with the handler's error.
    #[default]
    Fail,
    /// The call is decided by the built-in handler of the slot; the failure is still counted.
    Builtin,
}

impl std::fmt::Display for OnFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OnFailure::Fail => "fail",
            OnFailure::Builtin => "builtin",
        })
    }
}

/// Calls of one slot that may run at once unless its entry says otherwise: half the cores the
/// daemon may use, at least one, so that a runaway module never holds every core.
pub fn default_max_concurrent_calls() -> u32 {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    u32::try_from(cores / 2).unwrap_or(u32::MAX).max(1)
}

/// One checked entry: the module a slot is configured to run, and how.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SlotEntry {
    /// The module file (relative names already joined to the handlers directory).
    pub module: PathBuf,
    /// `sha256`, if given: the digest the module must have (64 lowercase hex digits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// `deadline_ms`, if given.
    pub deadline_ms: Option<u64>,
    /// `memory_mib`, if given.
    pub memory_mib: Option<u32>,
    /// `fuel`, if given.
    pub fuel: Option<u64>,
    /// `max_concurrent_calls`, if given: how many calls of the slot may run at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_calls: Option<u32>,
    /// `reuse_instances`, if given: whether a call may run in an instance that served an
    /// earlier call of the slot (for modules whose calls keep no state in the guest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reuse_instances: Option<bool>,
    /// Settings handed to the guest, as strings.
    pub settings: BTreeMap<String, String>,
    /// Failures during probation before the previous version comes back (0: never).
    pub rollback_after: u32,
    /// What a failed call means.
    pub on_failure: OnFailure,
    /// For a module named by an OCI reference: the reference as written in `handlers.toml`
    /// (`module` is then the pulled file in the state directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// For a module named by an OCI reference: the manifest digest (`sha256:HEX`) in force,
    /// resolved when the entry was applied; `None` until it is resolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// For an entry put in by a fleet rollout rather than `handlers.toml`: the rollout's name
    /// (the entry's source is then shown as `rollout/NAME`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<String>,
}

impl SlotEntry {
    /// An entry serving `module` (a file, or an `oci://` reference, kept as the entry's source
    /// and pulled when the entry is applied) with the defaults of `handlers.toml`; the caller
    /// sets the other fields.
    pub fn new(module: &str) -> Result<SlotEntry, pluglet_oci::RefError> {
        let source = if pluglet_oci::is_oci(module) {
            Some(pluglet_oci::OciRef::parse(module)?.to_string())
        } else {
            None
        };
        Ok(SlotEntry {
            module: PathBuf::from(module),
            sha256: None,
            deadline_ms: None,
            memory_mib: None,
            fuel: None,
            max_concurrent_calls: None,
            reuse_instances: None,
            settings: BTreeMap::new(),
            rollback_after: DEFAULT_ROLLBACK_AFTER,
            on_failure: OnFailure::default(),
            source,
            digest: None,
            rollout: None,
        })
    }

    /// A short digest of the settings (the first 8 hex digits of the sha256 of their
    /// `key=value` lines, sorted), to tell two versions of one module apart; `None` without
    /// settings.
    pub fn settings_hash(&self) -> Option<String> {
        use sha2::Digest as _;
        if self.settings.is_empty() {
            return None;
        }
        let mut digest = sha2::Sha256::new();
        for (key, value) in &self.settings {
            digest.update(format!("{key}={value}\n"));
        }
        Some(hex::encode(digest.finalize())[..8].to_owned())
    }

    /// The entry's limits over `defaults`.
    pub fn limits(&self, defaults: Limits) -> Limits {
        let mut limits = defaults;
        if let Some(ms) = self.deadline_ms {
            limits.deadline = Duration::from_millis(ms);
        }
        if let Some(mib) = self.memory_mib {
            limits.memory_mib = mib;
        }
        if let Some(fuel) = self.fuel {
            limits.fuel = Some(fuel);
        }
        if let Some(reuse) = self.reuse_instances {
            limits.reuse_instances = reuse;
        }
        limits
    }
}

/// `handlers.toml`, parsed: one entry per configured slot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HandlersFile {
    /// The entries by slot.
    pub entries: BTreeMap<SlotKey, SlotEntry>,
}

/// Why `handlers.toml` as a whole cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The file exists but could not be read.
    #[error("cannot read {path}: {source}; check its permissions")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML of the expected shape.
    #[error(
        "{path} is not a valid handlers file: {message}; expected [plugin_types.<type>] and \
         [resources.\"<resource>\"] tables with module, settings and optional \
         sha256/deadline_ms/memory_mib/fuel/max_concurrent_calls/reuse_instances/rollback_after/\
         on_failure"
    )]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// An entry's values are out of range.
    #[error("{path}: entry {entry}: {message}")]
    InvalidEntry {
        /// The file.
        path: PathBuf,
        /// The entry, e.g. `plugin_types.CSIPlugin`.
        entry: String,
        /// What is wrong and what to do.
        message: String,
    },
}

/// Reads `<dir>/handlers.toml`; a missing file is an empty configuration (built-ins only).
pub fn read(dir: &Path) -> Result<HandlersFile, FileError> {
    let path = dir.join(HANDLERS_FILE);
    match read_text(&path)? {
        Some(text) => parse(dir, &path, &text),
        None => Ok(HandlersFile::default()),
    }
}

/// Times a file that keeps changing while it is read is read again.
const READ_TRIES: usize = 5;

/// The text of `path`, read whole (`None`: no such file). A file that changed while it was read
/// (its inode, size or change time differ after the read) is read again, a few times; the
/// last text read is returned (a writer still busy is seen by the watcher and read again).
pub(crate) fn read_text(path: &Path) -> Result<Option<String>, FileError> {
    use std::os::unix::fs::MetadataExt;
    let stamp = |m: &std::fs::Metadata| (m.ino(), m.len(), m.ctime(), m.ctime_nsec());
    let mut text = None;
    for _ in 0..READ_TRIES {
        let before = match std::fs::metadata(path) {
            Ok(m) => stamp(&m),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(FileError::Read {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        text = match std::fs::read_to_string(path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(FileError::Read {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        if std::fs::metadata(path).is_ok_and(|m| stamp(&m) == before) {
            break;
        }
    }
    Ok(text)
}

/// Parses the text of `path`; module paths are relative to `dir`.
pub fn parse(dir: &Path, path: &Path, text: &str) -> Result<HandlersFile, FileError> {
    let config = toml::from_str::<FileConfig>(text).map_err(|e| FileError::Parse {
        path: path.to_path_buf(),
        message: e.message().to_string(),
    })?;
    let mut entries = BTreeMap::new();
    for (key, entry) in config.plugin_types {
        let slot = SlotKey::PluginType(key);
        let entry = check(dir, path, &slot, entry)?;
        entries.insert(slot, entry);
    }
    for (key, entry) in config.resources {
        let slot = SlotKey::Resource(key);
        let entry = check(dir, path, &slot, entry)?;
        entries.insert(slot, entry);
    }
    Ok(HandlersFile { entries })
}

fn check(
    dir: &Path,
    path: &Path,
    slot: &SlotKey,
    entry: EntryConfig,
) -> Result<SlotEntry, FileError> {
    let invalid = |message: String| FileError::InvalidEntry {
        path: path.to_path_buf(),
        entry: slot.entry_name(),
        message,
    };
    let mut settings = BTreeMap::new();
    for (key, value) in entry.settings {
        let text = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => {
                return Err(invalid(format!(
                    "setting {key} is a {}; settings must be strings, numbers or booleans",
                    other.type_str()
                )));
            }
        };
        settings.insert(key, text);
    }
    if entry.deadline_ms == Some(0) {
        return Err(invalid(
            "deadline_ms must be at least 1 (leave it out for the default)".into(),
        ));
    }
    if entry.max_concurrent_calls == Some(0) {
        return Err(invalid(
            "max_concurrent_calls must be at least 1 (leave it out for the default)".into(),
        ));
    }
    let sha256 = entry
        .sha256
        .as_deref()
        .map(parse_pin)
        .transpose()
        .map_err(|e| invalid(e.to_string()))?;
    let written = entry.module.to_string_lossy();
    let source = if pluglet_oci::is_oci(&written) {
        let reference = pluglet_oci::OciRef::parse(&written).map_err(|e| invalid(e.to_string()))?;
        Some(reference.to_string())
    } else {
        None
    };
    let module = if source.is_some() || entry.module.is_absolute() {
        entry.module
    } else {
        dir.join(entry.module)
    };
    Ok(SlotEntry {
        source,
        digest: None,
        rollout: None,
        module,
        sha256,
        deadline_ms: entry.deadline_ms,
        memory_mib: entry.memory_mib,
        fuel: entry.fuel,
        max_concurrent_calls: entry.max_concurrent_calls,
        reuse_instances: entry.reuse_instances,
        settings,
        rollback_after: entry.rollback_after.unwrap_or(DEFAULT_ROLLBACK_AFTER),
        on_failure: entry.on_failure.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_text(text: &str) -> Result<HandlersFile, FileError> {
        parse(Path::new("/h"), Path::new("/h/handlers.toml"), text)
    }

    #[test]
    fn entries_get_their_defaults_and_relative_modules_the_directory() {
        let file = parse_text(
            "[plugin_types.CSIPlugin]\nmodule = \"a.wasm\"\nsettings = { n = 3, b = true }\n\
             [resources.\"vendor.com/gpu\"]\nmodule = \"/abs/p.wasm\"\nrollback_after = 0\n\
             on_failure = \"builtin\"\nreuse_instances = true\n",
        )
        .unwrap();
        let csi = &file.entries[&SlotKey::PluginType("CSIPlugin".into())];
        assert_eq!(csi.module, Path::new("/h/a.wasm"));
        assert_eq!(csi.rollback_after, DEFAULT_ROLLBACK_AFTER);
        assert_eq!(csi.on_failure, OnFailure::Fail);
        assert_eq!(csi.settings["n"], "3");
        assert_eq!(csi.settings["b"], "true");
        assert!(
            !csi.limits(Limits::default()).reuse_instances,
            "fresh by default"
        );
        let gpu = &file.entries[&SlotKey::Resource("vendor.com/gpu".into())];
        assert_eq!(gpu.module, Path::new("/abs/p.wasm"));
        assert_eq!(gpu.rollback_after, 0);
        assert_eq!(gpu.on_failure, OnFailure::Builtin);
        assert!(gpu.limits(Limits::default()).reuse_instances);
    }

    #[test]
    fn unknown_keys_bad_values_and_syntax_are_named() {
        let err = parse_text("[plugin_types.CSIPlugin]\nmodul = 1\n").unwrap_err();
        assert!(err.to_string().contains("unknown field `modul`"), "{err}");
        let err = parse_text("[plugin_types.CSIPlugin\n").unwrap_err();
        assert!(
            err.to_string().contains("not a valid handlers file"),
            "{err}"
        );
        let err =
            parse_text("[plugin_types.X]\nmodule = \"a\"\non_failure = \"retry\"\n").unwrap_err();
        assert!(err.to_string().contains("retry"), "{err}");
        let err = parse_text("[plugin_types.X]\nmodule = \"a\"\ndeadline_ms = 0\n").unwrap_err();
        assert!(
            err.to_string()
                .contains("entry plugin_types.X: deadline_ms must be at least 1"),
            "{err}"
        );
        let err =
            parse_text("[plugin_types.X]\nmodule = \"a\"\nsettings = { l = [1] }\n").unwrap_err();
        assert!(err.to_string().contains("setting l is a array"), "{err}");
        let err = parse_text("[plugin_types.X]\nmodule = \"a\"\nsha256 = \"ABC\"\n").unwrap_err();
        assert!(
            err.to_string()
                .contains("entry plugin_types.X: sha256 = \"ABC\" is not a sha256 digest"),
            "{err}"
        );
        let pin = "0123456789abcdef".repeat(4);
        let file = parse_text(&format!(
            "[plugin_types.X]\nmodule = \"a\"\nsha256 = \"{pin}\"\n"
        ))
        .unwrap();
        assert_eq!(
            file.entries[&SlotKey::PluginType("X".into())]
                .sha256
                .as_deref(),
            Some(pin.as_str())
        );
    }

    #[test]
    fn an_entry_made_in_code_has_the_file_defaults_and_an_oci_source() {
        let pin = format!("oci://r.example:5000/vendor/p@sha256:{}", "ab".repeat(32));
        let entry = SlotEntry::new(&pin).unwrap();
        assert_eq!(entry.source.as_deref(), Some(pin.as_str()));
        assert_eq!(entry.rollback_after, DEFAULT_ROLLBACK_AFTER);
        assert_eq!(entry.on_failure, OnFailure::Fail);
        assert_eq!(entry.rollout, None);
        let file = SlotEntry::new("/abs/p.wasm").unwrap();
        assert_eq!(file.source, None);
        assert_eq!(file.module, Path::new("/abs/p.wasm"));
        assert!(SlotEntry::new("oci://noregistry").is_err());
    }
}
