"""Writes the answers a registry with the OCI 1.1 referrers API gives for one module with a
signature, conformance vectors and an unrelated referrer (an SBOM), as files replayed by
../referrers_api.rs. Run from this directory: python3 make.py (stdlib only). A pull does not check
a signature's text (the handler set does), so the one here only has a signature's shape."""

import hashlib
import json
import os

REPO = "vendor/gpu-policy"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
SIGNATURE = "application/vnd.pluglet.handler.signature.v1+minisign"
VECTORS = "application/vnd.pluglet.handler.vectors.v1+json"
SBOM = "application/spdx+json"
EMPTY = "application/vnd.oci.empty.v1+json"


def digest(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def desc(media_type, data, **extra):
    return {"mediaType": media_type, "digest": digest(data), "size": len(data), **extra}


def pretty(value):
    # Registries serve manifests byte for byte as pushed; other tools push indented JSON.
    return (json.dumps(value, indent=3) + "\n").encode()


answers = []
blobs = {}


def answer(path, status, content_type, body, name):
    with open(os.path.join("bodies", name), "wb") as f:
        f.write(body)
    answers.append(
        {"path": path, "status": status, "content_type": content_type, "body": name}
    )


os.makedirs("bodies", exist_ok=True)
module = b"\0asm\r\0\x01\0" + bytes(i % 251 for i in range(2048))
config = json.dumps(
    {"architecture": "wasm", "os": "wasip2", "layerDigests": [digest(module)]}
).encode()
manifest = pretty(
    {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": desc("application/vnd.wasm.config.v0+json", config),
        "layers": [desc("application/wasm", module)],
    }
)
subject = desc(OCI_MANIFEST, manifest)
signature = (
    b"untrusted comment: signature from minisign secret key\n"
    b"RURK8wIjv8VFB4iicWJQj/pCTSntQy2RVUNLcqgbULFqc81utp8/CRO98hy0pyyZmNEZzm3ic9QXOMJ5teqnUJ6PYKc5Hwvx7AY=\n"
    b"trusted comment: gpu-policy 2.0\n"
    b"K3XfR7sL5OsvSseNGMSBEb6XvmSLOKkbzFF8k/2MnjqyrVg/eUQ9PCoAEmedS8jTfZPaWd10NvUdS4zyUOzdBg==\n"
)
vectors = b'{"cases": []}\n'
sbom = b'{"spdxVersion": "SPDX-2.3"}\n'


def referrer(artifact_type, layer_type, content, of=subject):
    return pretty(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "artifactType": artifact_type,
            "config": desc(EMPTY, b"{}"),
            "layers": [desc(layer_type, content)],
            "subject": of,
            "annotations": {"org.opencontainers.image.created": "2026-01-01T00:00:00Z"},
        }
    )


sig_manifest = referrer(SIGNATURE, SIGNATURE, signature)
vec_manifest = referrer(VECTORS, VECTORS, vectors)
sbom_manifest = referrer(SBOM, SBOM, sbom)
# A signature referrer listed for this module whose own subject names another manifest.
stray = referrer(SIGNATURE, SIGNATURE, signature, of=desc(OCI_MANIFEST, b"another manifest"))


def index(manifests):
    return pretty(
        {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [
                desc(
                    OCI_MANIFEST,
                    m,
                    artifactType=t,
                    annotations={"org.opencontainers.image.created": "2026-01-01T00:00:00Z"},
                )
                for m, t in manifests
            ],
        }
    )


v2 = f"/v2/{REPO}"
answer("/v2/", 200, "application/json", b"{}", "base.json")
for ref in ["v1", digest(manifest)]:
    answer(f"{v2}/manifests/{ref}", 200, OCI_MANIFEST, manifest, "module-manifest.json")
answer(f"{v2}/blobs/{digest(module)}", 200, "application/octet-stream", module, "module.wasm")
for name, m, blob, body in [
    ("signature", sig_manifest, signature, "module.wasm.minisig"),
    ("vectors", vec_manifest, vectors, "module.vectors.json"),
    ("sbom", sbom_manifest, sbom, "sbom.spdx.json"),
    ("stray", stray, signature, "module.wasm.minisig"),
]:
    answer(f"{v2}/manifests/{digest(m)}", 200, OCI_MANIFEST, m, f"{name}-manifest.json")
    answer(f"{v2}/blobs/{digest(blob)}", 200, "application/octet-stream", blob, body)
answer(
    f"{v2}/referrers/{digest(manifest)}",
    200,
    OCI_INDEX,
    index([(sbom_manifest, SBOM), (sig_manifest, SIGNATURE), (vec_manifest, VECTORS)]),
    "referrers.json",
)
# What a registry answers once the stray signature is listed instead (served in place of the
# above by the test that needs it).
with open(os.path.join("bodies", "referrers-stray.json"), "wb") as f:
    f.write(index([(stray, SIGNATURE)]))

with open("answers.json", "w") as f:
    json.dump(
        {
            "repository": REPO,
            "manifest_digest": digest(manifest),
            "answers": answers,
        },
        f,
        indent=2,
    )
    f.write("\n")
