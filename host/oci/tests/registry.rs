//! The registry client against a real registry (Debian's docker-registry, distribution 2.8, which
//! has no referrers API: the referrers go through the tag schema).

use std::time::Duration;

use pluglet_oci::layout::sha256_digest;
use pluglet_oci::{OciRef, Outcome, Registry, RegistryOptions};
use pluglet_test_support::e2e::oci_registry::{PASSWORD, USER};
use pluglet_test_support::e2e::{OciRegistry, RegistryConfig};

const SECURE: RegistryConfig = RegistryConfig {
    tls: true,
    auth: true,
};

fn module() -> Vec<u8> {
    let mut bytes = b"\0asm\x0d\0\x01\0".to_vec();
    bytes.extend((0..4096u32).map(|i| (i % 251) as u8));
    bytes
}

fn options_for(registry: &OciRegistry, dir: &std::path::Path) -> RegistryOptions {
    let auth = dir.join("config.json");
    registry.write_auth(&auth, USER, PASSWORD);
    RegistryOptions {
        auth_file: Some(auth),
        cas: vec![registry.ca_arg().parse().unwrap()],
        ..RegistryOptions::default()
    }
}

fn oci(text: &str) -> OciRef {
    OciRef::parse(text).unwrap()
}

#[tokio::test]
async fn push_then_pull_by_tag_and_digest_with_referrers() {
    let registry = OciRegistry::start(SECURE);
    let dir = tempfile::tempdir().unwrap();
    let client = Registry::new(options_for(&registry, dir.path()));
    let reference = oci(&registry.reference("vendor/policy:v1"));
    let pushed = client
        .push(
            &reference,
            &module(),
            Some(b"untrusted comment: x\nSIG\n"),
            Some(b"{\"cases\": []}"),
        )
        .await
        .unwrap();
    assert_eq!(pushed.module_digest, sha256_digest(&module()));
    assert!(pushed.signature.is_some() && pushed.vectors.is_some());

    let pulled = client.pull(&reference).await.unwrap();
    assert_eq!(pulled.digest, pushed.digest);
    assert_eq!(pulled.module, module());
    assert_eq!(pulled.module_digest, pushed.module_digest);
    assert_eq!(
        pulled.signatures,
        vec!["untrusted comment: x\nSIG\n".to_owned()]
    );
    assert_eq!(pulled.vectors.as_deref(), Some(&b"{\"cases\": []}"[..]));

    let by_digest = client.pull(&oci(&pushed.pinned)).await.unwrap();
    assert_eq!(by_digest.module, module());
    assert_eq!(client.resolve(&reference).await.unwrap(), pushed.digest);

    // Pushing the same bytes again gives the same digest: a refresh sees no change.
    let again = client
        .push(&reference, &module(), None, None)
        .await
        .unwrap();
    assert_eq!(again.digest, pushed.digest);
    // The referrers are not pushed twice.
    let pulled = client.pull(&reference).await.unwrap();
    assert_eq!(pulled.signatures.len(), 1);
}

#[tokio::test]
async fn credentials_and_ca_are_required() {
    let registry = OciRegistry::start(SECURE);
    let dir = tempfile::tempdir().unwrap();
    let good = Registry::new(options_for(&registry, dir.path()));
    let reference = oci(&registry.reference("p:v1"));
    good.push(&reference, &module(), None, None).await.unwrap();

    let anonymous = Registry::new(RegistryOptions {
        cas: vec![registry.ca_arg().parse().unwrap()],
        ..RegistryOptions::default()
    });
    let e = anonymous.pull(&reference).await.unwrap_err();
    assert_eq!(e.outcome(), Outcome::Unauthorized, "{e}");

    let wrong = dir.path().join("wrong.json");
    registry.write_auth(&wrong, USER, "not-the-password");
    let wrong = Registry::new(RegistryOptions {
        auth_file: Some(wrong),
        cas: vec![registry.ca_arg().parse().unwrap()],
        ..RegistryOptions::default()
    });
    let e = wrong.pull(&reference).await.unwrap_err();
    assert_eq!(e.outcome(), Outcome::Unauthorized, "{e}");

    let no_ca = Registry::new(RegistryOptions {
        auth_file: Some(dir.path().join("config.json")),
        ..RegistryOptions::default()
    });
    let e = no_ca.pull(&reference).await.unwrap_err();
    assert_eq!(e.outcome(), Outcome::Unreachable, "{e}");
}

#[tokio::test]
async fn bad_answers_are_refused_with_their_reason() {
    let registry = OciRegistry::start(SECURE);
    let dir = tempfile::tempdir().unwrap();
    let options = options_for(&registry, dir.path());
    let client = Registry::new(options.clone());
    let reference = oci(&registry.reference("p:v1"));
    let pushed = client
        .push(&reference, &module(), None, None)
        .await
        .unwrap();

    // Unknown tag.
    let e = client
        .pull(&oci(&registry.reference("p:nope")))
        .await
        .unwrap_err();
    assert_eq!(e.outcome(), Outcome::NotFound, "{e}");

    // Over the size limit: refused from the manifest, before the download.
    let small = Registry::new(RegistryOptions {
        max_module_size: 1024,
        ..options.clone()
    });
    let e = small.pull(&reference).await.unwrap_err();
    assert_eq!(e.outcome(), Outcome::TooLarge, "{e}");
    assert!(e.to_string().contains("--registry-max-module-size"), "{e}");

    // A container image: pushed by hand with an image config.
    let image_ref = oci(&registry.reference("image:v1"));
    let config =
        br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
    let raw = oci_client_manifest(config);
    push_raw(&registry, &image_ref, config, &raw).await;
    let e = client.pull(&image_ref).await.unwrap_err();
    assert_eq!(e.outcome(), Outcome::WrongArtifact, "{e}");
    assert!(e.to_string().contains("container image"), "{e}");

    // A blob whose bytes no longer match its digest (same length, other bytes).
    let file = registry.blob_file(&pushed.module_digest);
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&file, &bytes).unwrap();
    let e = client.pull(&reference).await.unwrap_err();
    assert_eq!(e.outcome(), Outcome::DigestMismatch, "{e}");

    // A digest reference the registry does not hold.
    let other = oci(&registry.reference(&format!("p@{}", sha256_digest(b"other"))));
    let e = client.pull(&other).await.unwrap_err();
    assert_eq!(e.outcome(), Outcome::NotFound, "{e}");
}

#[tokio::test]
async fn plain_http_only_when_listed() {
    let registry = OciRegistry::start(RegistryConfig {
        tls: false,
        auth: false,
    });
    let reference = oci(&registry.reference("p:v1"));
    let tls_only = Registry::new(RegistryOptions::default());
    let e = tls_only
        .push(&reference, &module(), None, None)
        .await
        .unwrap_err();
    assert!(!e.to_string().is_empty());
    let insecure = Registry::new(RegistryOptions {
        insecure: vec![registry.host()],
        ..RegistryOptions::default()
    });
    let pushed = insecure
        .push(&reference, &module(), None, None)
        .await
        .unwrap();
    assert_eq!(insecure.resolve(&reference).await.unwrap(), pushed.digest);
}

#[tokio::test]
async fn a_registry_that_never_answers_times_out() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let host = listener.local_addr().unwrap().to_string();
    let client = Registry::new(RegistryOptions {
        insecure: vec![host.clone()],
        timeout: Duration::from_millis(300),
        ..RegistryOptions::default()
    });
    let e = client
        .pull(&oci(&format!("oci://{host}/p:v1")))
        .await
        .unwrap_err();
    assert_eq!(e.outcome(), Outcome::Timeout, "{e}");
    assert!(e.to_string().contains("--registry-timeout"), "{e}");
    drop(listener);
}

fn oci_client_manifest(config: &[u8]) -> Vec<u8> {
    let layer = b"not a tarball";
    serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": sha256_digest(config), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": sha256_digest(layer), "size": layer.len()}],
    }))
    .unwrap()
}

/// Pushes blobs and a manifest with oci-client itself (what another tool would push).
async fn push_raw(registry: &OciRegistry, at: &OciRef, config: &[u8], manifest: &[u8]) {
    use oci_client::client::{Certificate, CertificateEncoding, ClientConfig};
    let client = oci_client::Client::try_from(ClientConfig {
        extra_root_certificates: vec![Certificate {
            encoding: CertificateEncoding::Pem,
            data: std::fs::read(registry.ca().unwrap()).unwrap(),
        }],
        ..ClientConfig::default()
    })
    .unwrap();
    let image: oci_client::Reference = at.as_str().trim_start_matches("oci://").parse().unwrap();
    let auth = oci_client::secrets::RegistryAuth::Basic(USER.into(), PASSWORD.into());
    client
        .auth(&image, &auth, oci_client::RegistryOperation::Push)
        .await
        .unwrap();
    for blob in [config, &b"not a tarball"[..]] {
        client
            .push_blob(&image, blob.to_vec(), &sha256_digest(blob))
            .await
            .unwrap();
    }
    client
        .push_manifest_raw(
            &image,
            manifest.to_vec(),
            http::HeaderValue::from_static("application/vnd.oci.image.manifest.v1+json"),
        )
        .await
        .unwrap();
}
