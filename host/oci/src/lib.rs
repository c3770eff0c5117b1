//! Handler modules in OCI registries: a vendor pushes a module once, nodes pull it by digest.
//!
//! The data flow, one module per step:
//!
//! - [`reference`]: `oci://REGISTRY/REPO:TAG` or `@sha256:HEX`, parsed;
//! - [`options`]: how registries are reached (credentials, CAs, plain HTTP, size limit, timeout);
//! - [`layout`]: the CNCF wasm artifact layout and the signature and vectors referrers, built and
//!   checked without a network;
//! - [`client`]: pull (manifest → layer → referrers, each checked against its digest) and push
//!   (blobs → manifest → referrers and the referrers tag), with `oci-client`;
//! - [`error`]: why a pull failed, sorted into the outcomes the metrics count.
//!
//! The crate knows no handler and no WASM: it moves bytes and proves they are the ones named.

pub mod client;
pub mod error;
pub mod layout;
pub mod options;
pub mod reference;

pub use client::{Pulled, Pushed, Registry};
pub use error::{Outcome, PullError, PushError};
pub use options::{RegistryCa, RegistryOptions};
pub use reference::{OciRef, RefError, is_oci};
