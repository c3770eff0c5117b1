//! `pluglet handler push` and `pluglet handler pull`, run as the real binary against a real
//! registry (Debian's docker-registry, with TLS and htpasswd), with minisign signing and skopeo
//! reading what was pushed. Each program missing fails the test, naming its Debian package.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use pluglet_test_support::e2e::oci_registry::{PASSWORD, USER};
use pluglet_test_support::e2e::{OciRegistry, RegistryConfig};

fn pluglet(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pluglet"))
        .args(args)
        .env("RUST_LOG", "off")
        .output()
        .expect("run pluglet")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn ok(out: &Output) -> &Output {
    assert!(
        out.status.success(),
        "failed: {}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&ok(out).stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(&out.stdout)))
}

fn program(name: &str, args: &[&str], package: &str) -> Output {
    Command::new(name).args(args).output().unwrap_or_else(|e| {
        panic!(
            "cannot run {name} ({e}); install the Debian package {package} (scripts/test.sh does)"
        )
    })
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The spread policy (a real component), its vectors, and a minisign key pair and signature
/// made in `dir`.
struct Vendor {
    module: PathBuf,
    vectors: PathBuf,
    public: PathBuf,
    signature: PathBuf,
}

fn vendor(dir: &Path) -> Vendor {
    let module = dir.join("spread-policy.wasm");
    std::fs::copy(pluglet_wasm_guests::guest_path("spread-policy"), &module).unwrap();
    let vectors = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/spread-policy/spread-policy.vectors.json");
    let (public, secret) = (dir.join("vendor.pub"), dir.join("vendor.key"));
    ok(&program(
        "minisign",
        &["-G", "-W", "-p", s(&public), "-s", s(&secret)],
        "minisign",
    ));
    ok(&program(
        "minisign",
        &[
            "-S",
            "-s",
            s(&secret),
            "-m",
            s(&module),
            "-t",
            "spread policy 1",
        ],
        "minisign",
    ));
    Vendor {
        signature: dir.join("spread-policy.wasm.minisig"),
        module,
        vectors,
        public,
    }
}

fn registry_flags(registry: &OciRegistry, dir: &Path) -> Vec<String> {
    let auth = dir.join("config.json");
    registry.write_auth(&auth, USER, PASSWORD);
    vec![
        "--registry-auth".into(),
        s(&auth).into(),
        "--registry-ca".into(),
        registry.ca_arg(),
    ]
}

#[test]
fn push_then_pull_gives_the_same_bytes_signature_and_vectors() {
    let registry = OciRegistry::start(RegistryConfig {
        tls: true,
        auth: true,
    });
    let dir = tempfile::tempdir().unwrap();
    let v = vendor(dir.path());
    let flags = registry_flags(&registry, dir.path());
    let reference = registry.reference("vendor/spread-policy:1.0");
    let mut args = vec![
        "handler",
        "push",
        &reference,
        s(&v.module),
        "--signature",
        s(&v.signature),
        "--vectors",
        s(&v.vectors),
        "-o",
        "json",
    ];
    args.extend(flags.iter().map(String::as_str));
    let pushed = json(&pluglet(&args));
    assert_eq!(pushed["kind"], "HandlerPush");
    let digest = pushed["digest"].as_str().unwrap().to_owned();
    assert!(digest.starts_with("sha256:"), "{pushed}");
    assert!(pushed["signature"].as_str().unwrap().starts_with("sha256:"));
    assert!(pushed["vectors"].as_str().unwrap().starts_with("sha256:"));

    // skopeo reads the manifest (trusting the registry's CA): the CNCF wasm layout.
    let certs = dir.path().join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    std::fs::copy(registry.ca().unwrap(), certs.join("ca.crt")).unwrap();
    let raw = program(
        "skopeo",
        &[
            "inspect",
            "--raw",
            "--cert-dir",
            s(&certs),
            "--creds",
            &format!("{USER}:{PASSWORD}"),
            &format!("docker://{}/vendor/spread-policy:1.0", registry.host()),
        ],
        "skopeo",
    );
    let manifest: serde_json::Value = serde_json::from_slice(&ok(&raw).stdout).unwrap();
    assert_eq!(
        manifest["config"]["mediaType"],
        "application/vnd.wasm.config.v0+json"
    );
    assert_eq!(manifest["layers"][0]["mediaType"], "application/wasm");
    assert_eq!(
        pluglet_oci::layout::sha256_digest(&raw.stdout),
        digest,
        "skopeo's manifest is the pushed one"
    );

    // Pull into a directory: the same bytes, the signature and the vectors beside them.
    let dest = dir.path().join("pulled");
    let mut args = vec![
        "handler",
        "pull",
        &reference,
        "--dest",
        s(&dest),
        "-o",
        "json",
    ];
    args.extend(flags.iter().map(String::as_str));
    let pulled = json(&pluglet(&args));
    assert_eq!(pulled["kind"], "HandlerPull");
    assert_eq!(pulled["digest"], digest.as_str());
    let module = dest.join("spread-policy.wasm");
    assert_eq!(
        std::fs::read(&module).unwrap(),
        std::fs::read(&v.module).unwrap()
    );
    assert_eq!(
        std::fs::read(dest.join("spread-policy.wasm.minisig")).unwrap(),
        std::fs::read(&v.signature).unwrap()
    );
    assert_eq!(
        std::fs::read(dest.join("spread-policy.vectors.json")).unwrap(),
        std::fs::read(&v.vectors).unwrap()
    );
    // ... on which verify and the vectors run offline.
    let out = pluglet(&["handler", "verify", s(&module), "--key", s(&v.public)]);
    assert!(text(&ok(&out).stdout).contains("spread policy 1"));
    ok(&pluglet(&[
        "handler",
        "test",
        s(&module),
        "--vectors",
        s(&dest.join("spread-policy.vectors.json")),
    ]));

    // By digest, the same.
    let pinned = pushed["pinned"].as_str().unwrap().to_owned();
    let dest2 = dir.path().join("pinned");
    let mut args = vec![
        "handler",
        "pull",
        &pinned,
        "--dest",
        s(&dest2),
        "-o",
        "json",
    ];
    args.extend(flags.iter().map(String::as_str));
    assert_eq!(json(&pluglet(&args))["digest"], digest.as_str());
}

#[test]
fn bad_input_is_refused_with_what_to_do() {
    let registry = OciRegistry::start(RegistryConfig {
        tls: true,
        auth: true,
    });
    let dir = tempfile::tempdir().unwrap();
    let v = vendor(dir.path());
    let flags = registry_flags(&registry, dir.path());
    let reference = registry.reference("p:v1");

    // Not a component.
    let readme = dir.path().join("readme.wasm");
    std::fs::write(&readme, "not wasm").unwrap();
    let mut args = vec!["handler", "push", &reference, s(&readme)];
    args.extend(flags.iter().map(String::as_str));
    let out = pluglet(&args);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("is not a WebAssembly component"),
        "{}",
        text(&out.stderr)
    );

    // A signature that is not one.
    let mut args = vec![
        "handler",
        "push",
        &reference,
        s(&v.module),
        "--signature",
        s(&v.vectors),
    ];
    args.extend(flags.iter().map(String::as_str));
    let out = pluglet(&args);
    assert!(
        text(&out.stderr).contains("is not a minisign signature"),
        "{}",
        text(&out.stderr)
    );

    // No tag; no registry.
    let out = pluglet(&["handler", "push", "oci://127.0.0.1:1/p", s(&v.module)]);
    assert!(
        text(&out.stderr).contains(":TAG or @sha256:HEX"),
        "{}",
        text(&out.stderr)
    );
    let out = pluglet(&["handler", "pull", "oci://p:v1", "--dest", "/tmp"]);
    assert!(
        text(&out.stderr).contains("names no registry"),
        "{}",
        text(&out.stderr)
    );

    // Without credentials: the registry's 401.
    let out = pluglet(&[
        "handler",
        "push",
        &reference,
        s(&v.module),
        "--registry-ca",
        &registry.ca_arg(),
    ]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("cannot push") && err.to_lowercase().contains("auth"),
        "{err}"
    );

    // An unknown tag.
    let mut args = vec!["handler", "pull", &reference, "--dest", s(dir.path())];
    args.extend(flags.iter().map(String::as_str));
    let out = pluglet(&args);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains(&format!("cannot pull {reference}")), "{err}");
    assert!(
        err.contains("MANIFEST_UNKNOWN") || err.contains("manifest unknown"),
        "{err}"
    );

    // A bad --registry-ca.
    let out = pluglet(&[
        "handler",
        "pull",
        &reference,
        "--dest",
        "/tmp",
        "--registry-ca",
        "nofile",
    ]);
    assert!(
        text(&out.stderr).contains("HOST[:PORT]=FILE"),
        "{}",
        text(&out.stderr)
    );
}
