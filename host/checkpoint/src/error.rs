//! Errors: [`FormatError`] says why some bytes are not a valid checkpoint, [`CheckpointError`]
//! says what went wrong with which file and what to do about it.
//!
//! Following the team style, the cause is a `#[source]`, not repeated in the message: print the
//! chain (`{:#}` with anyhow, or walk `source()`) to see it.

use std::io;
use std::path::{Path, PathBuf};

/// Why some bytes are not a valid checkpoint (kubelet format or side file). Carries no path;
/// [`CheckpointError::Corrupt`] adds it.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The text is not JSON of the expected shape.
    #[error("not JSON of the expected shape")]
    Json(#[source] serde_json::Error),
    /// An `AllocResp` is not valid padded standard base64.
    #[error("AllocResp of pod {pod_uid} container {container_name} is not valid base64")]
    AllocResp {
        /// The entry's `PodUID`.
        pod_uid: String,
        /// The entry's `ContainerName`.
        container_name: String,
        /// The decoder's complaint.
        #[source]
        source: base64::DecodeError,
    },
    /// A side file does not have the envelope Pluglet writes.
    #[error("not a Pluglet side file: {0}")]
    Layout(&'static str),
    /// The stored checksum is not the one of the stored data (the kubelet's "checkpoint is
    /// corrupted"): a decimal FNV value for the kubelet format, sha256 hex for a side file.
    #[error("checksum mismatch: the file says {stored}, its data hashes to {computed}")]
    ChecksumMismatch {
        /// The checksum written in the file.
        stored: String,
        /// The checksum computed over the data read.
        computed: String,
    },
}

/// What went wrong with a checkpoint or side file.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file exists (or may exist) but cannot be read.
    #[error(
        "cannot read checkpoint {path}: check its permissions and that the filesystem is healthy"
    )]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The file does not parse or fails its checksum. Pluglet's start keeps such a file aside
    /// and restores what its other files prove.
    #[error("checkpoint {path} is corrupt")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Why it is not a valid checkpoint.
        #[source]
        source: FormatError,
    },
    /// The value to store in a side file cannot be serialized to JSON.
    #[error(
        "cannot encode the state for {path}: the value is not representable as JSON (a map with non-string keys?)"
    )]
    Encode {
        /// The file that was to be written.
        path: PathBuf,
        /// serde_json's complaint.
        #[source]
        source: serde_json::Error,
    },
    /// Writing the file failed at `step`; the previous content, if any, is untouched.
    #[error(
        "cannot write checkpoint {path} ({step}): check that the directory exists and is writable and that the disk is not full"
    )]
    Write {
        /// The file.
        path: PathBuf,
        /// Which step failed, e.g. "create temporary file" or "rename over the checkpoint".
        step: &'static str,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A corrupt file could not be renamed out of the way.
    #[error(
        "cannot set corrupt checkpoint {path} aside as {to}: move or delete it by hand, then start again"
    )]
    SetAside {
        /// The corrupt file.
        path: PathBuf,
        /// The name it was to get.
        to: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

impl CheckpointError {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            CheckpointError::Read { path, .. }
            | CheckpointError::Corrupt { path, .. }
            | CheckpointError::Encode { path, .. }
            | CheckpointError::Write { path, .. }
            | CheckpointError::SetAside { path, .. } => path,
        }
    }

    /// Whether the file exists but is not a valid checkpoint (does not parse or fails its
    /// checksum), the case [`crate::load_or_set_aside`] handles.
    pub fn is_corrupt(&self) -> bool {
        matches!(self, CheckpointError::Corrupt { .. })
    }
}
