//! Why a pull or a push failed, sorted into the outcomes the metrics count.

use std::path::PathBuf;

use crate::layout::LayoutError;
use crate::options::AuthFileError;

/// The outcome of a pull, as `pluglet_handler_pulls_total{outcome}` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// Pulled and checked.
    Pulled,
    /// The tag resolved to a digest already kept on the node: nothing downloaded.
    Kept,
    /// The registry could not be reached (connection refused, TLS, DNS).
    Unreachable,
    /// No answer within the timeout.
    Timeout,
    /// 401 or 403: credentials missing or refused.
    Unauthorized,
    /// Unknown repository, tag or digest.
    NotFound,
    /// Not a wasm module (a container image, an index, several layers).
    WrongArtifact,
    /// The module is over the size limit.
    TooLarge,
    /// A manifest or blob does not match its digest.
    DigestMismatch,
    /// A signature or vectors referrer is malformed.
    BadReferrer,
    /// Anything else (a local file, a malformed answer).
    Error,
}

impl Outcome {
    /// Every outcome, in label order.
    pub const ALL: [Outcome; 11] = [
        Outcome::Pulled,
        Outcome::Kept,
        Outcome::Unreachable,
        Outcome::Timeout,
        Outcome::Unauthorized,
        Outcome::NotFound,
        Outcome::WrongArtifact,
        Outcome::TooLarge,
        Outcome::DigestMismatch,
        Outcome::BadReferrer,
        Outcome::Error,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Pulled => "pulled",
            Outcome::Kept => "kept",
            Outcome::Unreachable => "unreachable",
            Outcome::Timeout => "timeout",
            Outcome::Unauthorized => "unauthorized",
            Outcome::NotFound => "not_found",
            Outcome::WrongArtifact => "wrong_artifact",
            Outcome::TooLarge => "too_large",
            Outcome::DigestMismatch => "digest_mismatch",
            Outcome::BadReferrer => "bad_referrer",
            Outcome::Error => "error",
        }
    }
}

/// Why a pull failed.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The registry's answer (or its absence).
    #[error("{message}")]
    Registry {
        /// How it is counted.
        outcome: Outcome,
        /// What was asked and what the registry said.
        message: String,
    },
    /// The manifest is not a module in the wasm layout, or the module is too large.
    #[error("{reference}: {source}")]
    Layout {
        /// The reference pulled.
        reference: String,
        /// What is wrong.
        #[source]
        source: LayoutError,
    },
    /// A manifest or blob does not match its digest.
    #[error("{what} does not match its digest: expected {expected}, got {actual}")]
    DigestMismatch {
        /// What was fetched.
        what: String,
        /// The digest asked for.
        expected: String,
        /// What the bytes give.
        actual: String,
    },
    /// A referrer is malformed.
    #[error("referrer {digest} is not valid: {reason}")]
    BadReferrer {
        /// The referrer's manifest digest.
        digest: String,
        /// Why.
        reason: String,
    },
    /// The credentials file.
    #[error(transparent)]
    Auth(#[from] AuthFileError),
    /// A `--registry-ca` file could not be read.
    #[error("cannot read the registry CA file {path}")]
    CaFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl PullError {
    /// How the metrics count this failure.
    pub fn outcome(&self) -> Outcome {
        match self {
            PullError::Registry { outcome, .. } => *outcome,
            PullError::Layout {
                source: LayoutError::TooLarge { .. },
                ..
            } => Outcome::TooLarge,
            PullError::Layout { .. } => Outcome::WrongArtifact,
            PullError::DigestMismatch { .. } => Outcome::DigestMismatch,
            PullError::BadReferrer { .. } => Outcome::BadReferrer,
            PullError::Auth(_) | PullError::CaFile { .. } => Outcome::Error,
        }
    }
}

/// Why a push failed.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    /// A push names a tag (the digest is what the push makes).
    #[error(
        "push to {reference}: name a tag (oci://REGISTRY/REPO:TAG); the digest is the push's answer"
    )]
    NeedsTag {
        /// What was given.
        reference: String,
    },
    /// Talking to the registry failed.
    #[error(transparent)]
    Registry(#[from] PullError),
}
