//! `oci://REGISTRY/REPO:TAG` and `oci://REGISTRY/REPO@sha256:HEX`: a module named by an OCI
//! reference. The registry is always written out (no implied `docker.io`), and a tag or a digest
//! is always given (no implied `latest`): what a node runs is never a guess.

use std::fmt;

/// The scheme that marks a module as an OCI reference.
pub const SCHEME: &str = "oci://";

/// Whether `text` names a module in a registry (starts with `oci://`).
pub fn is_oci(text: &str) -> bool {
    text.starts_with(SCHEME)
}

/// A parsed `oci://` reference, keeping the text as written.
#[derive(Clone, PartialEq, Eq)]
pub struct OciRef {
    text: String,
    inner: oci_client::Reference,
}

/// What is wrong with an `oci://` reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RefError {
    /// It does not start with `oci://`.
    #[error(
        "{text:?} is not an OCI reference; write oci://REGISTRY/REPO:TAG or oci://REGISTRY/REPO@sha256:HEX"
    )]
    NoScheme {
        /// What was given.
        text: String,
    },
    /// The first path element is not a registry host.
    #[error(
        "{text:?} names no registry; write the registry's host (and port) first, as in oci://registry.example.com/REPO:TAG"
    )]
    NoRegistry {
        /// What was given.
        text: String,
    },
    /// Neither a tag nor a digest.
    #[error("{text:?} has neither a tag nor a digest; add :TAG or @sha256:HEX (no tag is implied)")]
    NoTagOrDigest {
        /// What was given.
        text: String,
    },
    /// The digest is not `sha256:` and 64 lowercase hex digits.
    #[error("{text:?}: the digest must be sha256: followed by 64 lowercase hex digits")]
    BadDigest {
        /// What was given.
        text: String,
    },
    /// The distribution grammar refused it.
    #[error("{text:?} is not a valid OCI reference: {reason}")]
    Grammar {
        /// What was given.
        text: String,
        /// The parser's reason.
        reason: String,
    },
}

impl OciRef {
    /// Parses `oci://REGISTRY/REPO:TAG`, `oci://REGISTRY/REPO@sha256:HEX` or both
    /// (`REPO:TAG@sha256:HEX`: the digest decides, the tag is a label).
    pub fn parse(text: &str) -> Result<OciRef, RefError> {
        let rest = text
            .strip_prefix(SCHEME)
            .ok_or_else(|| RefError::NoScheme {
                text: text.to_owned(),
            })?;
        let (host, _) = rest.split_once('/').ok_or_else(|| RefError::NoRegistry {
            text: text.to_owned(),
        })?;
        if !(host.contains('.') || host.contains(':') || host == "localhost") {
            return Err(RefError::NoRegistry {
                text: text.to_owned(),
            });
        }
        let inner: oci_client::Reference =
            rest.parse()
                .map_err(|e: oci_client::ParseError| RefError::Grammar {
                    text: text.to_owned(),
                    reason: e.to_string(),
                })?;
        let explicit_tag = rest
            .rsplit_once('/')
            .is_some_and(|(_, last)| last.split('@').next().unwrap_or("").contains(':'));
        if let Some(digest) = inner.digest() {
            if !is_sha256_digest(digest) {
                return Err(RefError::BadDigest {
                    text: text.to_owned(),
                });
            }
        } else if !explicit_tag {
            return Err(RefError::NoTagOrDigest {
                text: text.to_owned(),
            });
        }
        Ok(OciRef {
            text: text.to_owned(),
            inner,
        })
    }

    /// The reference as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The registry as written (`host` or `host:port`).
    pub fn registry(&self) -> &str {
        self.inner.resolve_registry()
    }

    /// The repository path inside the registry.
    pub fn repository(&self) -> &str {
        self.inner.repository()
    }

    /// The tag, when one was written.
    pub fn tag(&self) -> Option<&str> {
        self.inner.tag()
    }

    /// The digest, when one was written.
    pub fn digest(&self) -> Option<&str> {
        self.inner.digest()
    }

    /// The last element of the repository: the file name `handler pull` writes.
    pub fn name(&self) -> &str {
        self.repository()
            .rsplit('/')
            .next()
            .unwrap_or(self.repository())
    }

    /// This reference pinned to `digest` (the tag dropped).
    pub fn with_digest(&self, digest: &str) -> OciRef {
        let text = format!("{SCHEME}{}/{}@{digest}", self.registry(), self.repository());
        OciRef {
            inner: oci_client::Reference::with_digest(
                self.registry().to_owned(),
                self.repository().to_owned(),
                digest.to_owned(),
            ),
            text,
        }
    }

    /// The same repository under another tag.
    pub(crate) fn with_tag(&self, tag: &str) -> oci_client::Reference {
        oci_client::Reference::with_tag(
            self.registry().to_owned(),
            self.repository().to_owned(),
            tag.to_owned(),
        )
    }

    /// The reference for the client.
    pub(crate) fn inner(&self) -> &oci_client::Reference {
        &self.inner
    }
}

impl fmt::Display for OciRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for OciRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OciRef({})", self.text)
    }
}

impl std::str::FromStr for OciRef {
    type Err = RefError;
    fn from_str(s: &str) -> Result<OciRef, RefError> {
        OciRef::parse(s)
    }
}

/// Whether `digest` is `sha256:` and 64 lowercase hex digits.
pub fn is_sha256_digest(digest: &str) -> bool {
    digest.strip_prefix("sha256:").is_some_and(|hex| {
        hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn tag_and_digest_references_parse() {
        let r = OciRef::parse("oci://127.0.0.1:5000/vendor/gpu-policy:v1").unwrap();
        assert_eq!(r.registry(), "127.0.0.1:5000");
        assert_eq!(r.repository(), "vendor/gpu-policy");
        assert_eq!(r.tag(), Some("v1"));
        assert_eq!(r.digest(), None);
        assert_eq!(r.name(), "gpu-policy");
        assert_eq!(r.to_string(), "oci://127.0.0.1:5000/vendor/gpu-policy:v1");

        let text = format!("oci://registry.example.com/policy@sha256:{HEX}");
        let r = OciRef::parse(&text).unwrap();
        assert_eq!(r.registry(), "registry.example.com");
        assert_eq!(r.digest(), Some(format!("sha256:{HEX}").as_str()));
        assert_eq!(r.tag(), None);

        let r = OciRef::parse("oci://localhost/p:latest").unwrap();
        assert_eq!(r.registry(), "localhost");
    }

    #[test]
    fn with_digest_pins_and_drops_the_tag() {
        let r = OciRef::parse("oci://localhost:5000/a/b:v2").unwrap();
        let pinned = r.with_digest(&format!("sha256:{HEX}"));
        assert_eq!(
            pinned.as_str(),
            format!("oci://localhost:5000/a/b@sha256:{HEX}")
        );
        assert_eq!(OciRef::parse(pinned.as_str()).unwrap(), pinned);
    }

    #[test]
    fn bad_references_say_what_to_write() {
        assert!(matches!(
            OciRef::parse("registry.example.com/p:v1"),
            Err(RefError::NoScheme { .. })
        ));
        assert!(matches!(
            OciRef::parse("oci://policy:v1"),
            Err(RefError::NoRegistry { .. })
        ));
        assert!(matches!(
            OciRef::parse("oci://library/policy:v1"),
            Err(RefError::NoRegistry { .. })
        ));
        assert!(matches!(
            OciRef::parse("oci://localhost:5000/policy"),
            Err(RefError::NoTagOrDigest { .. })
        ));
        assert!(matches!(
            OciRef::parse("oci://localhost:5000/policy@sha512:abcd"),
            Err(RefError::BadDigest { .. }) | Err(RefError::Grammar { .. })
        ));
        assert!(matches!(
            OciRef::parse("oci://localhost:5000/Policy:v1"),
            Err(RefError::Grammar { .. })
        ));
        let e = OciRef::parse("oci://localhost:5000/policy").unwrap_err();
        assert!(e.to_string().contains(":TAG or @sha256:HEX"), "{e}");
    }
}
