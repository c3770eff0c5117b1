//! What the live set tells about itself: the last change of each slot and of the file, the
//! status `ctl handlers` shows, the events it sends, and the outcome of a reload.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use crate::served::Served;
use crate::slot::SlotKey;

/// What became of a change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeState {
    /// Put in force.
    Applied,
    /// Refused; the set in force kept serving.
    Refused,
    /// Rolled back to the previous version.
    RolledBack,
    /// Waiting, the version in force serving: a module file that changed while the pin still
    /// names the version in force, or a signature installed before the module it signs.
    Pending,
}

impl std::fmt::Display for ChangeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ChangeState::Applied => "applied",
            ChangeState::Refused => "refused",
            ChangeState::RolledBack => "rolled_back",
            ChangeState::Pending => "pending",
        })
    }
}

/// The last change of a slot, or of the file as a whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChangeRecord {
    /// What became of it.
    pub state: ChangeState,
    /// When.
    pub at: SystemTime,
    /// Why (what changed, what was wrong, why it was rolled back).
    pub reason: String,
    /// The module file concerned, if any.
    pub module: Option<String>,
    /// Its sha256, when it could be read.
    pub sha256: Option<String>,
}

/// One slot as `ctl handlers` shows it.
#[derive(Clone, Debug)]
pub struct SlotStatus {
    /// The slot.
    pub slot: SlotKey,
    /// The version in force.
    pub current: Arc<Served>,
    /// The previous version, kept warm.
    pub previous: Option<Arc<Served>>,
    /// The last change of the slot that was refused, rolled back or applied.
    pub last_change: Option<ChangeRecord>,
}

/// The set in force and the last changes.
#[derive(Clone, Debug)]
pub struct Status {
    /// Generation of the set in force.
    pub generation: u64,
    /// Every slot.
    pub slots: Vec<SlotStatus>,
    /// A refusal of the file as a whole (syntax, unknown key), until the next successful change.
    pub last_change: Option<ChangeRecord>,
}

/// What the set did, for tests and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HandlersEvent {
    /// A new set is in force.
    Applied {
        /// Its generation.
        generation: u64,
        /// The slots that changed.
        slots: Vec<SlotKey>,
    },
    /// A change was refused; nothing changed.
    Refused {
        /// Why, whole.
        reason: String,
    },
    /// A slot was rolled back.
    RolledBack {
        /// The slot.
        slot: SlotKey,
        /// Why.
        reason: String,
    },
}

/// What [`Handlers::reload`](crate::Handlers::reload) did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// A new set is in force; these slots changed.
    Applied(Vec<SlotKey>),
    /// Nothing that serves calls changed.
    Unchanged,
    /// Refused (the reasons, one per line); the set in force keeps serving.
    Refused(String),
    /// `handlers.toml` looks half-written (empty, when it was not a moment ago): nothing was
    /// decided; read it again once its writer is done ([`Handlers::reload_written`](crate::Handlers::reload_written)).
    Waiting(String),
}

/// One entry that cannot be applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryRefusal {
    /// `handlers.toml`.
    pub file: PathBuf,
    /// The slot.
    pub slot: SlotKey,
    /// The module file.
    pub module: PathBuf,
    /// Its sha256, when it could be read.
    pub sha256: Option<String>,
    /// What is wrong and what to do.
    pub reason: String,
}

impl std::fmt::Display for EntryRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: entry {}: module {}",
            self.file.display(),
            self.slot.entry_name(),
            self.module.display()
        )?;
        if let Some(sha) = &self.sha256 {
            write!(f, " (sha256 {sha})")?;
        }
        write!(f, ": {}", self.reason)
    }
}

/// The event message of an applied change: the module, its short digest and why.
pub(super) fn change_message(record: &ChangeRecord) -> String {
    let module = record.module.as_deref().unwrap_or("-");
    match &record.sha256 {
        Some(sha) => format!("{module} (sha256 {}): {}", short(sha), record.reason),
        None => format!("{module}: {}", record.reason),
    }
}

/// The first 12 hex digits of a digest.
pub(super) fn short(sha256: &str) -> &str {
    sha256.get(..12).unwrap_or(sha256)
}
