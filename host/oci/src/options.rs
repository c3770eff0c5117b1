//! How the node reaches its registries: credentials from a Docker-style `config.json`, a CA per
//! registry, the registries allowed over plain HTTP, the size limit of a module and the timeout.
//!
//! The `config.json` reader is written here: the maintained crates that read it
//! (`docker_credential`) look only at the user's own file and run credential helpers, while the
//! daemon is given one file by path and must never run another program to read it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;

/// The default largest module a pull accepts: 64 MiB.
pub const DEFAULT_MAX_MODULE_SIZE: u64 = 64 * 1024 * 1024;
/// The default timeout of one request to a registry.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest signature, vectors file or referrer manifest a pull accepts (1 MiB).
pub const MAX_SIDE_FILE_SIZE: u64 = 1024 * 1024;

/// What every pull and push is given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryOptions {
    /// A Docker-style `config.json` holding credentials per registry (read at each pull, so a
    /// rotated password needs no restart).
    pub auth_file: Option<PathBuf>,
    /// The CA that signs a registry's certificate, per registry.
    pub cas: Vec<RegistryCa>,
    /// Registries (`HOST:PORT`) reached over plain HTTP.
    pub insecure: Vec<String>,
    /// The largest module a pull accepts, in bytes.
    pub max_module_size: u64,
    /// The timeout of each request.
    pub timeout: Duration,
}

impl Default for RegistryOptions {
    fn default() -> RegistryOptions {
        RegistryOptions {
            auth_file: None,
            cas: Vec::new(),
            insecure: Vec::new(),
            max_module_size: DEFAULT_MAX_MODULE_SIZE,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

impl RegistryOptions {
    /// The CA files that apply to `registry` (`host` or `host:port`): those given for exactly
    /// that, and those given for its host without a port.
    pub fn cas_for(&self, registry: &str) -> Vec<&Path> {
        let host = host_of(registry);
        self.cas
            .iter()
            .filter(|ca| ca.registry == registry || ca.registry == host)
            .map(|ca| ca.file.as_path())
            .collect()
    }

    /// Whether `registry` is reached over plain HTTP.
    pub fn is_insecure(&self, registry: &str) -> bool {
        self.insecure.iter().any(|r| r == registry)
    }
}

/// `HOST[:PORT]=FILE`: the CA file (PEM) for one registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryCa {
    /// `host` or `host:port`.
    pub registry: String,
    /// The PEM file.
    pub file: PathBuf,
}

/// A `--registry-ca` that is not `HOST[:PORT]=FILE`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "--registry-ca {text:?} is not HOST[:PORT]=FILE (the registry, then the PEM file of its CA)"
)]
pub struct RegistryCaError {
    /// What was given.
    pub text: String,
}

impl std::str::FromStr for RegistryCa {
    type Err = RegistryCaError;
    fn from_str(text: &str) -> Result<RegistryCa, RegistryCaError> {
        match text.split_once('=') {
            Some((registry, file))
                if !registry.is_empty() && !file.is_empty() && !registry.contains('/') =>
            {
                Ok(RegistryCa {
                    registry: registry.to_owned(),
                    file: PathBuf::from(file),
                })
            }
            _ => Err(RegistryCaError {
                text: text.to_owned(),
            }),
        }
    }
}

/// An `--insecure-registry` that is not `HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "--insecure-registry {text:?} is not HOST:PORT (plain HTTP is allowed per registry and port)"
)]
pub struct InsecureRegistryError {
    /// What was given.
    pub text: String,
}

/// Checks an `--insecure-registry` value: `HOST:PORT`.
pub fn parse_insecure_registry(text: &str) -> Result<String, InsecureRegistryError> {
    match text.rsplit_once(':') {
        Some((host, port))
            if !host.is_empty() && !host.contains('/') && port.parse::<u16>().is_ok() =>
        {
            Ok(text.to_owned())
        }
        _ => Err(InsecureRegistryError {
            text: text.to_owned(),
        }),
    }
}

fn host_of(registry: &str) -> &str {
    if registry.starts_with('[') {
        return registry.split_once(']').map_or(registry, |(h, _)| &h[1..]);
    }
    registry.rsplit_once(':').map_or(registry, |(h, _)| h)
}

/// A user name and password for one registry.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The user name.
    pub username: String,
    /// The password or token.
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, ***)", self.username)
    }
}

/// What is wrong with the `--registry-auth` file.
#[derive(Debug, thiserror::Error)]
pub enum AuthFileError {
    /// It could not be read.
    #[error("cannot read the registry credentials file {path}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It is not a Docker `config.json`.
    #[error(
        "registry credentials file {path} is not a Docker config.json ({{\"auths\": {{\"HOST\": {{\"auth\": \"BASE64(user:password)\"}}}}}})"
    )]
    NotJson {
        /// The file.
        path: PathBuf,
        /// The parser's reason.
        #[source]
        source: serde_json::Error,
    },
    /// An `auth` value is not base64 of `user:password`.
    #[error(
        "registry credentials file {path}: the auth of {registry} is not base64 of user:password"
    )]
    BadAuth {
        /// The file.
        path: PathBuf,
        /// The entry.
        registry: String,
    },
}

#[derive(serde::Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, DockerAuth>,
}

#[derive(serde::Deserialize)]
struct DockerAuth {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
}

/// Reads the credentials for `registry` from a Docker-style `config.json`: the entry whose key,
/// without `https://`/`http://` and any path, is `registry`. `None` when the file has no entry
/// for it (the registry is then asked anonymously).
pub fn credentials_for(path: &Path, registry: &str) -> Result<Option<Credentials>, AuthFileError> {
    let text = std::fs::read(path).map_err(|source| AuthFileError::Unreadable {
        path: path.to_owned(),
        source,
    })?;
    let config: DockerConfig =
        serde_json::from_slice(&text).map_err(|source| AuthFileError::NotJson {
            path: path.to_owned(),
            source,
        })?;
    for (key, entry) in config.auths {
        let bare = key
            .trim_start_matches("https://")
            .trim_start_matches("http://");
        let bare = bare.split('/').next().unwrap_or(bare);
        if bare != registry {
            continue;
        }
        if let (Some(username), Some(password)) = (entry.username, entry.password) {
            return Ok(Some(Credentials { username, password }));
        }
        let bad = || AuthFileError::BadAuth {
            path: path.to_owned(),
            registry: key.clone(),
        };
        let Some(auth) = entry.auth else { continue };
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|_| bad())?;
        let decoded = String::from_utf8(decoded).map_err(|_| bad())?;
        let (username, password) = decoded.split_once(':').ok_or_else(bad)?;
        return Ok(Some(Credentials {
            username: username.to_owned(),
            password: password.to_owned(),
        }));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_ca_is_host_port_equals_file() {
        let ca: RegistryCa = "127.0.0.1:5000=/etc/ca.pem".parse().unwrap();
        assert_eq!(ca.registry, "127.0.0.1:5000");
        assert_eq!(ca.file, PathBuf::from("/etc/ca.pem"));
        assert!("127.0.0.1:5000".parse::<RegistryCa>().is_err());
        assert!("=/etc/ca.pem".parse::<RegistryCa>().is_err());
        assert!("https://r/x=/ca".parse::<RegistryCa>().is_err());
    }

    #[test]
    fn cas_apply_by_host_port_or_host() {
        let options = RegistryOptions {
            cas: vec![
                "r.example:5000=/a".parse().unwrap(),
                "r.example=/b".parse().unwrap(),
                "other:5000=/c".parse().unwrap(),
            ],
            ..RegistryOptions::default()
        };
        assert_eq!(
            options.cas_for("r.example:5000"),
            vec![Path::new("/a"), Path::new("/b")]
        );
        assert_eq!(options.cas_for("r.example:6000"), vec![Path::new("/b")]);
        assert!(options.cas_for("other:6000").is_empty());
    }

    #[test]
    fn insecure_registries_name_a_port() {
        assert_eq!(
            parse_insecure_registry("127.0.0.1:5000").unwrap(),
            "127.0.0.1:5000"
        );
        assert!(parse_insecure_registry("127.0.0.1").is_err());
        assert!(parse_insecure_registry("http://127.0.0.1:5000").is_err());
    }

    #[test]
    fn credentials_come_from_docker_config() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        // "alice:s3cret"
        std::fs::write(
            &path,
            r#"{"auths": {"https://127.0.0.1:5000/v1/": {"auth": "YWxpY2U6czNjcmV0"},
                          "other:1": {"username": "bob", "password": "pw"},
                          "bad:2": {"auth": "!!"}}}"#,
        )
        .unwrap();
        let c = credentials_for(&path, "127.0.0.1:5000").unwrap().unwrap();
        assert_eq!(
            (c.username.as_str(), c.password.as_str()),
            ("alice", "s3cret")
        );
        let c = credentials_for(&path, "other:1").unwrap().unwrap();
        assert_eq!(c.username, "bob");
        assert!(credentials_for(&path, "nowhere:3").unwrap().is_none());
        assert!(matches!(
            credentials_for(&path, "bad:2"),
            Err(AuthFileError::BadAuth { .. })
        ));
        assert!(!format!("{c:?}").contains("pw"));
        std::fs::write(&path, "not json").unwrap();
        assert!(matches!(
            credentials_for(&path, "x"),
            Err(AuthFileError::NotJson { .. })
        ));
    }
}
