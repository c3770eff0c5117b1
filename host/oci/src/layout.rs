//! The CNCF wasm OCI artifact layout (the one `wkg oci push`, Spin and wasmCloud use) and the two
//! referrers Pluglet attaches to a module's manifest: pure building and checking of manifests,
//! no network.
//!
//! - A module: an OCI image manifest whose config has media type
//!   [`WASM_CONFIG_MEDIA_TYPE`] and whose one layer, of media type [`WASM_LAYER_MEDIA_TYPE`], is
//!   the component's bytes.
//! - Its signature: an OCI 1.1 artifact manifest with `artifactType`
//!   [`SIGNATURE_ARTIFACT_TYPE`], the empty config, one layer (the `.minisig` file's text) of the
//!   same media type, and `subject` the module's manifest.
//! - Its conformance vectors: likewise with [`VECTORS_ARTIFACT_TYPE`] (the `.vectors.json` file).

use std::collections::BTreeMap;

use oci_client::manifest::{
    IMAGE_DOCKER_CONFIG_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE, OCI_IMAGE_INDEX_MEDIA_TYPE,
    OCI_IMAGE_MEDIA_TYPE, OciDescriptor, OciImageManifest,
};
use sha2::Digest as _;

/// The config media type of a wasm artifact.
pub const WASM_CONFIG_MEDIA_TYPE: &str = "application/vnd.wasm.config.v0+json";
/// The media type of the one layer of a wasm artifact: the component.
pub const WASM_LAYER_MEDIA_TYPE: &str = "application/wasm";
/// The artifact type (and layer media type) of a module's minisign signature.
pub const SIGNATURE_ARTIFACT_TYPE: &str = "application/vnd.pluglet.handler.signature.v1+minisign";
/// The artifact type (and layer media type) of a module's conformance vectors.
pub const VECTORS_ARTIFACT_TYPE: &str = "application/vnd.pluglet.handler.vectors.v1+json";
/// The OCI empty descriptor's media type, the config of the referrers.
pub const EMPTY_MEDIA_TYPE: &str = "application/vnd.oci.empty.v1+json";
/// The content of the empty config.
pub const EMPTY_CONFIG: &[u8] = b"{}";
/// The manifest media types a pull accepts (others are asked for only to say what they are).
pub const ACCEPTED_MANIFEST_TYPES: &[&str] = &[
    OCI_IMAGE_MEDIA_TYPE,
    IMAGE_MANIFEST_MEDIA_TYPE,
    OCI_IMAGE_INDEX_MEDIA_TYPE,
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

/// `sha256:HEX` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}

/// A manifest that is not a module in the wasm artifact layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// Not JSON, or not an image manifest.
    #[error("the manifest is not an OCI image manifest: {0}")]
    NotAManifest(String),
    /// An image index (a multi-platform container image, or a list of artifacts).
    #[error(
        "the reference names an image index, not a wasm module; name the module's own manifest"
    )]
    Index,
    /// Another artifact: a container image or anything whose config is not the wasm config.
    #[error(
        "not a wasm module: config media type {found} (a container image?); a handler module has config media type {WASM_CONFIG_MEDIA_TYPE}, as `pluglet handler push` and `wkg oci push` write"
    )]
    NotWasm {
        /// The config media type found.
        found: String,
    },
    /// Not exactly one `application/wasm` layer.
    #[error(
        "a wasm module has exactly one layer of media type {WASM_LAYER_MEDIA_TYPE}; this manifest has {found}"
    )]
    Layers {
        /// What was found.
        found: String,
    },
    /// The layer is larger than the limit.
    #[error("the module is {size} bytes, over the limit of {limit} (--registry-max-module-size)")]
    TooLarge {
        /// The layer's size as the manifest declares it.
        size: u64,
        /// The limit.
        limit: u64,
    },
}

/// Checks that `raw` is a module's manifest in the wasm artifact layout whose layer is at most
/// `limit` bytes; returns the layer's descriptor.
pub fn module_layer(raw: &[u8], limit: u64) -> Result<OciDescriptor, LayoutError> {
    let value: serde_json::Value =
        serde_json::from_slice(raw).map_err(|e| LayoutError::NotAManifest(e.to_string()))?;
    let media_type = value.get("mediaType").and_then(|m| m.as_str());
    if value.get("manifests").is_some()
        || matches!(media_type, Some(m) if m.contains("index") || m.contains("list"))
    {
        return Err(LayoutError::Index);
    }
    let manifest: OciImageManifest =
        serde_json::from_value(value).map_err(|e| LayoutError::NotAManifest(e.to_string()))?;
    if manifest.config.media_type != WASM_CONFIG_MEDIA_TYPE {
        return Err(LayoutError::NotWasm {
            found: manifest.config.media_type,
        });
    }
    let layer = match manifest.layers.as_slice() {
        [layer] if layer.media_type == WASM_LAYER_MEDIA_TYPE => layer.clone(),
        layers => {
            return Err(LayoutError::Layers {
                found: if layers.is_empty() {
                    "none".to_owned()
                } else {
                    layers
                        .iter()
                        .map(|l| l.media_type.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                },
            });
        }
    };
    let size = u64::try_from(layer.size).unwrap_or(u64::MAX);
    if size > limit {
        return Err(LayoutError::TooLarge { size, limit });
    }
    Ok(layer)
}

/// The config blob of a module: the wasm config (`architecture` `wasm`, `os` `wasip2`, the
/// layer's digest). `created` is fixed, so pushing the same bytes twice gives the same
/// manifest digest and a refresh sees no change.
pub fn wasm_config(layer_digest: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "created": "1970-01-01T00:00:00Z",
        "architecture": "wasm",
        "os": "wasip2",
        "layerDigests": [layer_digest],
    }))
    .expect("a JSON value serialises")
}

/// A descriptor of `bytes`.
pub fn descriptor(media_type: &str, bytes: &[u8]) -> OciDescriptor {
    OciDescriptor {
        media_type: media_type.to_owned(),
        digest: sha256_digest(bytes),
        size: bytes.len() as i64,
        urls: None,
        annotations: None,
        artifact_type: None,
    }
}

/// The manifest of a module: `config` the wasm config's bytes, `module` the component's.
pub fn module_manifest(config: &[u8], module: &[u8]) -> OciImageManifest {
    OciImageManifest {
        schema_version: 2,
        media_type: Some(OCI_IMAGE_MEDIA_TYPE.to_owned()),
        config: descriptor(WASM_CONFIG_MEDIA_TYPE, config),
        layers: vec![descriptor(WASM_LAYER_MEDIA_TYPE, module)],
        subject: None,
        artifact_type: None,
        annotations: None,
    }
}

/// The manifest of a referrer of `subject` carrying `content` as its one layer.
pub fn referrer_manifest(
    artifact_type: &str,
    content: &[u8],
    subject: OciDescriptor,
) -> OciImageManifest {
    OciImageManifest {
        schema_version: 2,
        media_type: Some(OCI_IMAGE_MEDIA_TYPE.to_owned()),
        config: descriptor(EMPTY_MEDIA_TYPE, EMPTY_CONFIG),
        layers: vec![descriptor(artifact_type, content)],
        subject: Some(subject),
        artifact_type: Some(artifact_type.to_owned()),
        annotations: Some(BTreeMap::from([(
            "org.opencontainers.image.created".to_owned(),
            "1970-01-01T00:00:00Z".to_owned(),
        )])),
    }
}

/// The canonical JSON of a manifest, as it is pushed and digested.
pub fn manifest_bytes<T: serde::Serialize>(manifest: &T) -> Vec<u8> {
    let mut body = Vec::new();
    let mut ser =
        serde_json::Serializer::with_formatter(&mut body, olpc_cjson::CanonicalFormatter::new());
    serde::Serialize::serialize(manifest, &mut ser).expect("a manifest serialises");
    body
}

/// Whether a config media type is a container image's (for a clearer refusal).
pub fn is_container_config(media_type: &str) -> bool {
    media_type == IMAGE_DOCKER_CONFIG_MEDIA_TYPE
        || media_type == oci_client::manifest::IMAGE_CONFIG_MEDIA_TYPE
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest_json(config_type: &str, layers: &[(&str, i64)]) -> Vec<u8> {
        let layers: Vec<_> = layers
            .iter()
            .map(|(m, s)| {
                serde_json::json!({"mediaType": m, "digest": sha256_digest(m.as_bytes()), "size": s})
            })
            .collect();
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_IMAGE_MEDIA_TYPE,
            "config": {"mediaType": config_type, "digest": sha256_digest(b"{}"), "size": 2},
            "layers": layers,
        }))
        .unwrap()
    }

    #[test]
    fn a_wasm_manifest_gives_its_layer() {
        let config = wasm_config("sha256:x");
        let manifest = module_manifest(&config, b"\0asm");
        let raw = manifest_bytes(&manifest);
        let layer = module_layer(&raw, 1024).unwrap();
        assert_eq!(layer.digest, sha256_digest(b"\0asm"));
        assert_eq!(layer.size, 4);
    }

    #[test]
    fn other_artifacts_are_refused_with_the_reason() {
        let image = manifest_json(
            IMAGE_DOCKER_CONFIG_MEDIA_TYPE,
            &[("application/vnd.docker.image.rootfs.diff.tar.gzip", 10)],
        );
        let e = module_layer(&image, 1024).unwrap_err();
        assert!(matches!(e, LayoutError::NotWasm { .. }));
        assert!(e.to_string().contains("container image"), "{e}");

        let two = manifest_json(
            WASM_CONFIG_MEDIA_TYPE,
            &[(WASM_LAYER_MEDIA_TYPE, 1), (WASM_LAYER_MEDIA_TYPE, 1)],
        );
        assert!(matches!(
            module_layer(&two, 1024),
            Err(LayoutError::Layers { .. })
        ));
        let none = manifest_json(WASM_CONFIG_MEDIA_TYPE, &[]);
        assert!(matches!(
            module_layer(&none, 1024),
            Err(LayoutError::Layers { .. })
        ));

        let index = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2, "mediaType": OCI_IMAGE_INDEX_MEDIA_TYPE, "manifests": []
        }))
        .unwrap();
        assert_eq!(module_layer(&index, 1024).unwrap_err(), LayoutError::Index);
        assert!(matches!(
            module_layer(b"<html>", 1024),
            Err(LayoutError::NotAManifest(_))
        ));
    }

    #[test]
    fn a_layer_over_the_limit_is_refused_before_download() {
        let big = manifest_json(WASM_CONFIG_MEDIA_TYPE, &[(WASM_LAYER_MEDIA_TYPE, 2048)]);
        assert_eq!(
            module_layer(&big, 1024).unwrap_err(),
            LayoutError::TooLarge {
                size: 2048,
                limit: 1024
            }
        );
    }

    #[test]
    fn the_same_module_gives_the_same_manifest() {
        let a = manifest_bytes(&module_manifest(&wasm_config("d"), b"m"));
        let b = manifest_bytes(&module_manifest(&wasm_config("d"), b"m"));
        assert_eq!(sha256_digest(&a), sha256_digest(&b));
    }

    #[test]
    fn a_referrer_names_its_subject_and_type() {
        let subject = descriptor(OCI_IMAGE_MEDIA_TYPE, b"manifest");
        let m = referrer_manifest(SIGNATURE_ARTIFACT_TYPE, b"sig", subject.clone());
        let v: serde_json::Value = serde_json::from_slice(&manifest_bytes(&m)).unwrap();
        assert_eq!(v["artifactType"], SIGNATURE_ARTIFACT_TYPE);
        assert_eq!(v["subject"]["digest"], subject.digest);
        assert_eq!(v["config"]["mediaType"], EMPTY_MEDIA_TYPE);
        assert_eq!(v["layers"][0]["mediaType"], SIGNATURE_ARTIFACT_TYPE);
    }
}
