//! Pull and push against a registry with `oci-client`: one client per registry (its own CA and
//! scheme), credentials read from the `--registry-auth` file at each operation, every manifest
//! and blob checked against its digest, the module's size bounded before and during download,
//! each request under the timeout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::{
    ImageIndexEntry, OCI_IMAGE_INDEX_MEDIA_TYPE, OCI_IMAGE_MEDIA_TYPE, OciDescriptor, OciImageIndex,
};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, RegistryOperation};
use serde::Serialize;

use crate::error::{Outcome, PullError, PushError};
use crate::layout::{self, LayoutError};
use crate::options::{MAX_SIDE_FILE_SIZE, RegistryOptions, credentials_for};
use crate::reference::OciRef;

/// A module pulled from a registry, with what was attached to it.
#[derive(Debug, Clone)]
pub struct Pulled {
    /// `sha256:HEX` of the module's manifest: what is in force.
    pub digest: String,
    /// The manifest as the registry gave it (its sha256 is `digest`).
    pub manifest: Vec<u8>,
    /// The component's bytes (checked against the layer digest).
    pub module: Vec<u8>,
    /// `sha256:HEX` of the component (the layer digest).
    pub module_digest: String,
    /// The `.minisig` texts attached as signature referrers, newest last.
    pub signatures: Vec<String>,
    /// The `.vectors.json` attached as a vectors referrer (the newest), if any.
    pub vectors: Option<Vec<u8>>,
}

/// What `push` wrote.
#[derive(Debug, Clone, Serialize)]
pub struct Pushed {
    /// The reference pushed to, as given.
    pub reference: String,
    /// `sha256:HEX` of the module's manifest.
    pub digest: String,
    /// The reference pinned to that digest.
    pub pinned: String,
    /// `sha256:HEX` of the component (the layer).
    pub module_digest: String,
    /// The component's size in bytes.
    pub size: u64,
    /// The signature referrer's manifest digest, when one was attached.
    pub signature: Option<String>,
    /// The vectors referrer's manifest digest, when attached.
    pub vectors: Option<String>,
}

/// The registries a node pulls from and pushes to.
pub struct Registry {
    options: RegistryOptions,
    clients: Mutex<HashMap<String, Arc<Client>>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("options", &self.options)
            .finish()
    }
}

impl Registry {
    /// A registry client with `options`.
    pub fn new(options: RegistryOptions) -> Registry {
        // reqwest is built without a crypto provider of its own: use ring, as the rest of the
        // binary does. Installing twice is harmless (the first stays). rustls now steers
        // towards aws-lc-rs for its post-quantum key exchange; ring stays, as aws-lc-rs builds
        // C with cmake, and what is pulled is checked by digest and signature, not by TLS.
        #[allow(deprecated)]
        let provider = rustls::crypto::ring::default_provider();
        let _ = provider.install_default();
        Registry {
            options,
            clients: Mutex::new(HashMap::new()),
        }
    }

    /// The options in use.
    pub fn options(&self) -> &RegistryOptions {
        &self.options
    }

    fn client(&self, registry: &str) -> Result<Arc<Client>, PullError> {
        let mut clients = self.clients.lock().expect("registry clients lock");
        if let Some(client) = clients.get(registry) {
            return Ok(client.clone());
        }
        let mut extra_root_certificates = Vec::new();
        for file in self.options.cas_for(registry) {
            let data = std::fs::read(file).map_err(|source| PullError::CaFile {
                path: file.to_owned(),
                source,
            })?;
            extra_root_certificates.push(Certificate {
                encoding: CertificateEncoding::Pem,
                data,
            });
        }
        let config = ClientConfig {
            protocol: if self.options.is_insecure(registry) {
                ClientProtocol::Http
            } else {
                ClientProtocol::Https
            },
            extra_root_certificates,
            read_timeout: Some(self.options.timeout),
            connect_timeout: Some(self.options.timeout),
            user_agent: concat!("pluglet/", env!("CARGO_PKG_VERSION")),
            ..ClientConfig::default()
        };
        let client = Arc::new(Client::try_from(config).map_err(|e| PullError::Registry {
            outcome: Outcome::Error,
            message: format!("cannot set up the client for {registry}: {e}"),
        })?);
        clients.insert(registry.to_owned(), client.clone());
        Ok(client)
    }

    fn auth(&self, registry: &str) -> Result<RegistryAuth, PullError> {
        let Some(path) = &self.options.auth_file else {
            return Ok(RegistryAuth::Anonymous);
        };
        Ok(match credentials_for(path, registry)? {
            Some(c) => RegistryAuth::Basic(c.username, c.password),
            None => RegistryAuth::Anonymous,
        })
    }

    async fn timed<T>(
        &self,
        what: &str,
        future: impl Future<Output = Result<T, OciDistributionError>>,
    ) -> Result<T, PullError> {
        match tokio::time::timeout(self.options.timeout, future).await {
            Ok(result) => result.map_err(|e| classify(what, e)),
            Err(_) => Err(PullError::Registry {
                outcome: Outcome::Timeout,
                message: format!(
                    "{what}: no answer within {} (--registry-timeout)",
                    humanize(self.options.timeout)
                ),
            }),
        }
    }

    /// Resolves `reference` to the digest of its manifest (a digest reference is its own
    /// answer, after the manifest is fetched and checked against it).
    pub async fn resolve(&self, reference: &OciRef) -> Result<String, PullError> {
        let (_, digest, _, _) = self.manifest(reference).await?;
        Ok(digest)
    }

    async fn manifest(
        &self,
        reference: &OciRef,
    ) -> Result<(Arc<Client>, String, OciDescriptor, Vec<u8>), PullError> {
        let client = self.client(reference.registry())?;
        let auth = self.auth(reference.registry())?;
        let image = reference.inner();
        let what = format!("manifest of {reference}");
        let (raw, _) = self
            .timed(
                &what,
                client.pull_manifest_raw(image, &auth, layout::ACCEPTED_MANIFEST_TYPES),
            )
            .await?;
        if raw.len() as u64 > MAX_SIDE_FILE_SIZE {
            return Err(PullError::Layout {
                reference: reference.to_string(),
                source: LayoutError::NotAManifest(format!("{} bytes", raw.len())),
            });
        }
        let digest = layout::sha256_digest(&raw);
        if let Some(expected) = reference.digest()
            && expected != digest
        {
            return Err(PullError::DigestMismatch {
                what,
                expected: expected.to_owned(),
                actual: digest,
            });
        }
        let layer = layout::module_layer(&raw, self.options.max_module_size).map_err(|source| {
            PullError::Layout {
                reference: reference.to_string(),
                source,
            }
        })?;
        Ok((client, digest, layer, raw.to_vec()))
    }

    /// Pulls the module `reference` names, and its signature and vectors referrers.
    pub async fn pull(&self, reference: &OciRef) -> Result<Pulled, PullError> {
        let (client, digest, layer, manifest) = self.manifest(reference).await?;
        let pinned = reference.with_digest(&digest);
        let module = self
            .blob(
                &client,
                &pinned,
                &layer,
                self.options.max_module_size,
                "module",
            )
            .await?;
        let mut pulled = Pulled {
            digest,
            manifest,
            module,
            module_digest: layer.digest.clone(),
            signatures: Vec::new(),
            vectors: None,
        };
        let index = self
            .timed(
                &format!("referrers of {pinned}"),
                client.pull_referrers(pinned.inner(), None),
            )
            .await?;
        for entry in index.manifests {
            let kind = match entry.artifact_type.as_deref() {
                Some(layout::SIGNATURE_ARTIFACT_TYPE) => layout::SIGNATURE_ARTIFACT_TYPE,
                Some(layout::VECTORS_ARTIFACT_TYPE) => layout::VECTORS_ARTIFACT_TYPE,
                _ => continue,
            };
            let content = self.referrer(&client, &pinned, &entry, kind).await?;
            if kind == layout::SIGNATURE_ARTIFACT_TYPE {
                let text = String::from_utf8(content).map_err(|_| PullError::BadReferrer {
                    digest: entry.digest.clone(),
                    reason: "the signature is not text (a .minisig file is)".to_owned(),
                })?;
                pulled.signatures.push(text);
            } else {
                pulled.vectors = Some(content);
            }
        }
        Ok(pulled)
    }

    /// The one layer of a referrer manifest, checked to name `subject`.
    async fn referrer(
        &self,
        client: &Client,
        subject: &OciRef,
        entry: &ImageIndexEntry,
        kind: &str,
    ) -> Result<Vec<u8>, PullError> {
        let bad = |reason: String| PullError::BadReferrer {
            digest: entry.digest.clone(),
            reason,
        };
        let at = subject.with_digest(&entry.digest);
        let auth = self.auth(subject.registry())?;
        let (raw, _) = self
            .timed(
                &format!("referrer {}", entry.digest),
                client.pull_manifest_raw(at.inner(), &auth, &[OCI_IMAGE_MEDIA_TYPE]),
            )
            .await?;
        let manifest: oci_client::manifest::OciImageManifest =
            serde_json::from_slice(&raw).map_err(|e| bad(format!("not an OCI manifest: {e}")))?;
        if manifest.subject.as_ref().map(|s| s.digest.as_str()) != subject.digest() {
            return Err(bad("its subject is not this module's manifest".to_owned()));
        }
        let layer = match manifest.layers.as_slice() {
            [layer] if layer.media_type == kind => layer.clone(),
            _ => return Err(bad(format!("it has no single layer of media type {kind}"))),
        };
        self.blob(client, subject, &layer, MAX_SIDE_FILE_SIZE, "referrer")
            .await
    }

    async fn blob(
        &self,
        client: &Client,
        at: &OciRef,
        layer: &OciDescriptor,
        limit: u64,
        what: &str,
    ) -> Result<Vec<u8>, PullError> {
        let size = u64::try_from(layer.size).unwrap_or(u64::MAX);
        if size > limit {
            return Err(PullError::Layout {
                reference: at.to_string(),
                source: LayoutError::TooLarge { size, limit },
            });
        }
        let mut out = Limited {
            bytes: Vec::with_capacity(size as usize),
            limit,
        };
        let result = self
            .timed(
                &format!("{what} blob {}", layer.digest),
                client.pull_blob(at.inner(), layer, &mut out),
            )
            .await;
        match result {
            Err(PullError::Registry { .. }) if out.bytes.len() as u64 > limit => {
                Err(PullError::Layout {
                    reference: at.to_string(),
                    source: LayoutError::TooLarge {
                        size: out.bytes.len() as u64,
                        limit,
                    },
                })
            }
            Err(e) => Err(e),
            Ok(()) if out.bytes.len() as u64 != size => Err(PullError::DigestMismatch {
                what: format!("{what} blob {}", layer.digest),
                expected: format!("{size} bytes"),
                actual: format!("{} bytes", out.bytes.len()),
            }),
            Ok(()) => Ok(out.bytes),
        }
    }

    /// Pushes `module` to `reference` (which names a tag) in the wasm artifact layout, then
    /// attaches `signature` and `vectors` as referrers of its manifest.
    pub async fn push(
        &self,
        reference: &OciRef,
        module: &[u8],
        signature: Option<&[u8]>,
        vectors: Option<&[u8]>,
    ) -> Result<Pushed, PushError> {
        if reference.tag().is_none() || reference.digest().is_some() {
            return Err(PushError::NeedsTag {
                reference: reference.to_string(),
            });
        }
        let registry = reference.registry();
        let client = self.client(registry)?;
        let auth = self.auth(registry)?;
        self.timed(
            &format!("sign in to {registry}"),
            client.auth(reference.inner(), &auth, RegistryOperation::Push),
        )
        .await?;
        let module_digest = layout::sha256_digest(module);
        let config = layout::wasm_config(&module_digest);
        let manifest = layout::module_manifest(&config, module);
        let body = layout::manifest_bytes(&manifest);
        let digest = layout::sha256_digest(&body);
        self.push_blob(&client, reference, &config).await?;
        self.push_blob(&client, reference, module).await?;
        self.timed(
            &format!("push manifest {reference}"),
            client.push_manifest_raw(
                reference.inner(),
                body.clone(),
                http::HeaderValue::from_static(OCI_IMAGE_MEDIA_TYPE),
            ),
        )
        .await?;
        let subject = layout::descriptor(OCI_IMAGE_MEDIA_TYPE, &body);
        let pinned = reference.with_digest(&digest);
        let mut pushed = Pushed {
            reference: reference.to_string(),
            digest: digest.clone(),
            pinned: pinned.to_string(),
            module_digest,
            size: module.len() as u64,
            signature: None,
            vectors: None,
        };
        if let Some(signature) = signature {
            pushed.signature = Some(
                self.attach(
                    &client,
                    &pinned,
                    &subject,
                    layout::SIGNATURE_ARTIFACT_TYPE,
                    signature,
                )
                .await?,
            );
        }
        if let Some(vectors) = vectors {
            pushed.vectors = Some(
                self.attach(
                    &client,
                    &pinned,
                    &subject,
                    layout::VECTORS_ARTIFACT_TYPE,
                    vectors,
                )
                .await?,
            );
        }
        Ok(pushed)
    }

    async fn push_blob(&self, client: &Client, at: &OciRef, bytes: &[u8]) -> Result<(), PullError> {
        let digest = layout::sha256_digest(bytes);
        let exists = self
            .timed(
                &format!("look up blob {digest}"),
                client.blob_exists(at.inner(), &digest),
            )
            .await?;
        if !exists {
            self.timed(
                &format!("push blob {digest}"),
                client.push_blob(at.inner(), bytes.to_vec(), &digest),
            )
            .await?;
        }
        Ok(())
    }

    /// Pushes a referrer of `subject` and lists it under the referrers tag (`sha256-HEX`), for
    /// registries without the referrers API; returns the referrer's manifest digest.
    async fn attach(
        &self,
        client: &Client,
        pinned: &OciRef,
        subject: &OciDescriptor,
        artifact_type: &str,
        content: &[u8],
    ) -> Result<String, PullError> {
        self.push_blob(client, pinned, layout::EMPTY_CONFIG).await?;
        self.push_blob(client, pinned, content).await?;
        let manifest = layout::referrer_manifest(artifact_type, content, subject.clone());
        let body = layout::manifest_bytes(&manifest);
        let digest = layout::sha256_digest(&body);
        let at = pinned.with_digest(&digest);
        self.timed(
            &format!("push referrer {digest}"),
            client.push_manifest_raw(
                at.inner(),
                body.clone(),
                http::HeaderValue::from_static(OCI_IMAGE_MEDIA_TYPE),
            ),
        )
        .await?;
        let tag = subject.digest.replace(':', "-");
        let tag_ref = pinned.with_tag(&tag);
        let auth = self.auth(pinned.registry())?;
        let existing = client
            .pull_manifest_raw(&tag_ref, &auth, &[OCI_IMAGE_INDEX_MEDIA_TYPE])
            .await
            .map_err(|e| classify(&format!("referrers tag {tag}"), e));
        let mut index = match existing {
            Ok((raw, _)) => {
                serde_json::from_slice::<OciImageIndex>(&raw).map_err(|e| PullError::Registry {
                    outcome: Outcome::Error,
                    message: format!("the referrers tag {tag} holds no image index: {e}"),
                })?
            }
            Err(e) if e.outcome() == Outcome::NotFound => OciImageIndex {
                schema_version: 2,
                media_type: Some(OCI_IMAGE_INDEX_MEDIA_TYPE.to_owned()),
                manifests: Vec::new(),
                artifact_type: None,
                annotations: None,
            },
            Err(e) => return Err(e),
        };
        if !index.manifests.iter().any(|m| m.digest == digest) {
            index.manifests.push(ImageIndexEntry {
                media_type: OCI_IMAGE_MEDIA_TYPE.to_owned(),
                digest: digest.clone(),
                size: body.len() as i64,
                platform: None,
                annotations: manifest.annotations.clone(),
                artifact_type: Some(artifact_type.to_owned()),
            });
            self.timed(
                &format!("push referrers tag {tag}"),
                client.push_manifest_raw(
                    &tag_ref,
                    layout::manifest_bytes(&index),
                    http::HeaderValue::from_static(OCI_IMAGE_INDEX_MEDIA_TYPE),
                ),
            )
            .await?;
        }
        Ok(digest)
    }
}

/// An in-memory sink that refuses to grow past its limit.
struct Limited {
    bytes: Vec<u8>,
    limit: u64,
}

impl tokio::io::AsyncWrite for Limited {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.bytes.extend_from_slice(buf);
        if self.bytes.len() as u64 > self.limit {
            return std::task::Poll::Ready(Err(std::io::Error::other("over the size limit")));
        }
        std::task::Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

fn humanize(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// Sorts a client error into an outcome and a message naming what was asked.
fn classify(what: &str, e: OciDistributionError) -> PullError {
    let outcome = match &e {
        OciDistributionError::UnauthorizedError { .. }
        | OciDistributionError::AuthenticationFailure(_) => Outcome::Unauthorized,
        OciDistributionError::ServerError {
            code: 401 | 403, ..
        } => Outcome::Unauthorized,
        OciDistributionError::ServerError { code: 404, .. }
        | OciDistributionError::ImageManifestNotFoundError(_) => Outcome::NotFound,
        OciDistributionError::RegistryError { envelope, .. } => {
            match envelope.errors.first().map(|e| &e.code) {
                Some(OciErrorCode::Unauthorized | OciErrorCode::Denied) => Outcome::Unauthorized,
                Some(
                    OciErrorCode::ManifestUnknown
                    | OciErrorCode::NameUnknown
                    | OciErrorCode::BlobUnknown
                    | OciErrorCode::NotFound,
                ) => Outcome::NotFound,
                _ => Outcome::Error,
            }
        }
        OciDistributionError::DigestError(_) => {
            return PullError::DigestMismatch {
                what: what.to_owned(),
                expected: String::new(),
                actual: e.to_string(),
            };
        }
        OciDistributionError::RequestError(r) if r.is_timeout() => Outcome::Timeout,
        OciDistributionError::RequestError(r) if r.is_connect() => Outcome::Unreachable,
        OciDistributionError::RequestError(_) => Outcome::Unreachable,
        _ => Outcome::Error,
    };
    PullError::Registry {
        outcome,
        message: format!("{what}: {}", chain(&e)),
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}
