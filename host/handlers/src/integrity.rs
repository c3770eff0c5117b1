//! Integrity of a configured module, checked before it is compiled: the digest pin of its entry
//! (`sha256 = "<hex>"` in `handlers.toml`) and its detached minisign signature
//! (`<module>.minisig`, as `minisign -Sm <module>` writes it) against the keys the daemon trusts.
//!
//! This module holds the checks themselves; the transaction that applies a change decides, with
//! them, what an entry's module may do (see `live::transaction`).
//!
//! Signatures are verified by `minisign-verify`; this module only reads the key id out of the
//! key and signature lines to name them.

use std::path::{Path, PathBuf};

use base64::Engine;
use minisign_verify::{PublicKey, Signature};

/// The file name suffix of a detached signature: `spread.wasm.minisig`.
pub const SIGNATURE_SUFFIX: &str = ".minisig";

/// The detached signature file of `module`.
pub fn signature_path(module: &Path) -> PathBuf {
    let mut name = module.as_os_str().to_owned();
    name.push(SIGNATURE_SUFFIX);
    PathBuf::from(name)
}

/// A pin that is not a sha256 digest.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "sha256 = \"{text}\" is not a sha256 digest; write the 64 lowercase hex digits that \
     `sha256sum <module>` prints"
)]
pub struct PinError {
    /// The pin as written.
    pub text: String,
}

/// Checks a pin as written in `handlers.toml`: 64 lowercase hex digits.
pub fn parse_pin(text: &str) -> Result<String, PinError> {
    if text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(text.to_owned())
    } else {
        Err(PinError {
            text: text.to_owned(),
        })
    }
}

/// A public key the daemon trusts (a minisign public key file, as `minisign -G` writes it).
#[derive(Clone, Debug)]
pub struct TrustedKey {
    id: String,
    key: PublicKey,
}

/// Why a public key file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The file could not be read.
    #[error("cannot read the public key file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a minisign public key.
    #[error(
        "{path} is not a minisign public key ({problem}); give the .pub file `minisign -G` wrote \
         (an `untrusted comment:` line, then the base64 key line)"
    )]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        problem: KeyDecodeError,
    },
}

/// Why a text is not a minisign public key.
#[derive(Debug, thiserror::Error)]
pub enum KeyDecodeError {
    /// The first line is not minisign's comment line.
    #[error("the first line is not an `untrusted comment:` line")]
    NoComment,
    /// The key line does not decode.
    #[error("{0}")]
    Key(#[source] minisign_verify::Error),
    /// The key line is too short to hold a key id.
    #[error("the key line is too short")]
    TooShort,
}

impl TrustedKey {
    /// Reads a minisign public key file.
    pub fn read(path: &Path) -> Result<TrustedKey, KeyError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        TrustedKey::decode(&text).map_err(|problem| KeyError::Invalid {
            path: path.to_path_buf(),
            problem,
        })
    }

    /// Parses the text of a minisign public key file.
    pub fn decode(text: &str) -> Result<TrustedKey, KeyDecodeError> {
        let mut lines = text.lines();
        let comment = lines.next().unwrap_or_default();
        if !comment.starts_with("untrusted comment:") {
            return Err(KeyDecodeError::NoComment);
        }
        let line = lines.next().unwrap_or_default().trim();
        let key = PublicKey::from_base64(line).map_err(KeyDecodeError::Key)?;
        let id = key_id(line).ok_or(KeyDecodeError::TooShort)?;
        Ok(TrustedKey { id, key })
    }

    /// The key id, hex, as minisign prints it.
    pub fn id(&self) -> &str {
        &self.id
    }
}

/// The key id in a base64 key or signature line (bytes 2..10, a little-endian number), as
/// minisign prints it.
fn key_id(line: &str) -> Option<String> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(line.trim())
        .ok()?;
    let id: [u8; 8] = bytes.get(2..10)?.try_into().ok()?;
    Some(format!("{:X}", u64::from_le_bytes(id)))
}

/// The trust the daemon puts in signatures: the keys given by `--trusted-key` and whether
/// every configured module must be signed by one of them (`--require-signatures`).
#[derive(Clone, Debug, Default)]
pub struct Trust {
    /// The trusted keys.
    pub keys: Vec<TrustedKey>,
    /// Whether a configured module without a valid signature by a trusted key is refused.
    pub require: bool,
}

/// A signature that verified.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SignatureInfo {
    /// The id of the key that made it, hex, as minisign prints it.
    pub key_id: String,
    /// Its trusted comment.
    pub trusted_comment: String,
}

/// Why a signature does not vouch for a module.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// The text is not a minisign signature.
    #[error("the signature file is not a minisign signature ({0}); write it with `minisign -S`")]
    Malformed(String),
    /// Made by a key that is not trusted.
    #[error(
        "signed by key {key_id}, which is not trusted; sign the module with a key given to \
         --trusted-key, or trust this key"
    )]
    UntrustedKey {
        /// The key that made it.
        key_id: String,
    },
    /// Made by a trusted key, but not over these bytes.
    #[error(
        "the signature by key {key_id} does not verify: the module (or the signature) was \
         changed after signing; sign the module again"
    )]
    Invalid {
        /// The key that made it.
        key_id: String,
    },
}

/// Verifies the text of a detached signature over `bytes` with one of `keys`.
pub fn verify(
    keys: &[TrustedKey],
    bytes: &[u8],
    signature: &str,
) -> Result<SignatureInfo, SignatureError> {
    let parsed =
        Signature::decode(signature).map_err(|e| SignatureError::Malformed(e.to_string()))?;
    let key_id =
        signature.lines().nth(1).and_then(key_id).ok_or_else(|| {
            SignatureError::Malformed("the signature line is too short".to_owned())
        })?;
    let Some(key) = keys.iter().find(|k| k.id == key_id) else {
        return Err(SignatureError::UntrustedKey { key_id });
    };
    match key.key.verify(bytes, &parsed, false) {
        Ok(()) => Ok(SignatureInfo {
            key_id,
            trusted_comment: parsed.trusted_comment().to_owned(),
        }),
        Err(_) => Err(SignatureError::Invalid { key_id }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODULE: &[u8] = include_bytes!("../tests/fixtures/module.bin");
    const TRUSTED_PUB: &str = include_str!("../tests/fixtures/trusted.pub");
    const OTHER_PUB: &str = include_str!("../tests/fixtures/other.pub");
    const SIGNED_BY_TRUSTED: &str = include_str!("../tests/fixtures/module.bin.minisig");
    const SIGNED_BY_OTHER: &str = include_str!("../tests/fixtures/other.minisig");

    fn trusted() -> Vec<TrustedKey> {
        vec![TrustedKey::decode(TRUSTED_PUB).unwrap()]
    }

    #[test]
    fn pins_are_64_lowercase_hex_digits() {
        let digest = "a".repeat(64);
        assert_eq!(parse_pin(&digest).unwrap(), digest);
        for bad in [
            "A".repeat(64),
            "a".repeat(63),
            "g".repeat(64),
            String::new(),
        ] {
            let err = parse_pin(&bad).unwrap_err().to_string();
            assert!(err.contains("is not a sha256 digest"), "{err}");
        }
    }

    #[test]
    fn key_ids_read_as_minisign_prints_them() {
        let key = TrustedKey::decode(TRUSTED_PUB).unwrap();
        assert!(TRUSTED_PUB.contains(&format!("minisign public key {}", key.id())));
        let err = TrustedKey::decode("untrusted comment: x\nnot base64\n").unwrap_err();
        assert!(!err.to_string().is_empty());
        assert!(TrustedKey::decode("RWQ\n").is_err());
    }

    #[test]
    fn a_signature_by_a_trusted_key_verifies_with_its_trusted_comment() {
        let info = verify(&trusted(), MODULE, SIGNED_BY_TRUSTED).unwrap();
        assert_eq!(info.trusted_comment, "spread-policy 1.2.0");
        assert_eq!(info.key_id, trusted()[0].id());
    }

    #[test]
    fn untrusted_tampered_and_malformed_signatures_are_told_apart() {
        let other = TrustedKey::decode(OTHER_PUB).unwrap();
        assert_eq!(
            verify(&trusted(), MODULE, SIGNED_BY_OTHER),
            Err(SignatureError::UntrustedKey {
                key_id: other.id().to_owned()
            })
        );
        let mut tampered = MODULE.to_vec();
        tampered[0] ^= 1;
        assert_eq!(
            verify(&trusted(), &tampered, SIGNED_BY_TRUSTED),
            Err(SignatureError::Invalid {
                key_id: trusted()[0].id().to_owned()
            })
        );
        assert!(matches!(
            verify(&trusted(), MODULE, "untrusted comment: x\n"),
            Err(SignatureError::Malformed(_))
        ));
    }
}
