//! Handlers from an OCI registry: a vendor pushes a policy with `pluglet handler push` to a real
//! registry (Debian's docker-registry with TLS and htpasswd), `handlers.toml` names it
//! `oci://…`, and the daemon pulls, checks and serves it: allocations follow the pulled policy,
//! a change of the reference swaps it, a restart with the registry stopped serves the digest in
//! force, a first start that cannot pull fails naming the entry and the registry's error, and
//! `--require-signatures` applies to the signature attached in the registry. A tool no one here
//! wrote, `wkg` (the Bytecode Alliance's wasm-pkg-tools, the pinned version `scripts/test.sh`
//! installs), reads what `pluglet handler push` wrote and writes what the daemon serves, over
//! plain HTTP (it cannot be given a CA).

use std::path::{Path, PathBuf};
use std::process::Command;

use pluglet_test_support::e2e::oci_registry::{PASSWORD, USER, wkg};
use pluglet_test_support::e2e::{OciRegistry, RegistryConfig};

use crate::device_support::{DevicePluginProcess, FLOWS, wait_allocatable};
use crate::handler_integrity::{key_pair, sign};
use crate::handler_swap::{
    FIRST_FIT, GPU, SPREAD, allocate_ok, guest, handlers_toml, rename_into_place, sha256,
    wait_gpu_row, wait_gpu_sha,
};
use crate::support::{Daemon, TestRoot};

const SECURE: RegistryConfig = RegistryConfig {
    tls: true,
    auth: true,
};

/// Plain HTTP, no credentials: what `wkg` can reach.
const PLAIN: RegistryConfig = RegistryConfig {
    tls: false,
    auth: false,
};

/// Runs the pinned `wkg` with `args` (no Docker credentials: `DOCKER_CONFIG` is the empty `dir`)
/// and returns what it printed.
fn run_wkg(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(wkg())
        .args(args)
        .env("DOCKER_CONFIG", dir)
        .output()
        .expect("run wkg");
    assert!(
        out.status.success(),
        "wkg {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `--registry-auth` and `--registry-ca` for `registry`, the credentials file in `dir`.
pub(crate) fn flags(registry: &OciRegistry, dir: &Path) -> Vec<String> {
    let auth = dir.join("registry-auth.json");
    registry.write_auth(&auth, USER, PASSWORD);
    vec![
        "--registry-auth".into(),
        auth.display().to_string(),
        "--registry-ca".into(),
        registry.ca_arg(),
    ]
}

pub(crate) fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `pluglet handler push REFERENCE MODULE [--signature SIG]`; returns the manifest digest.
pub(crate) fn push(
    flags: &[String],
    reference: &str,
    module: &Path,
    signature: Option<&Path>,
) -> String {
    let mut command = Command::new(pluglet_test_support::e2e::bin("pluglet"));
    command
        .args(["handler", "push", reference])
        .arg(module)
        .args(["-o", "json"])
        .args(flags);
    if let Some(sig) = signature {
        command.arg("--signature").arg(sig);
    }
    let out = command.output().expect("run pluglet handler push");
    assert!(
        out.status.success(),
        "push failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["digest"].as_str().unwrap().to_owned()
}

fn toml(reference: &str) -> String {
    format!("[resources.\"{GPU}\"]\nmodule = \"{reference}\"\n")
}

/// Pushes `module` to `reference` with `signature` attached as its signature referrer, whatever
/// that text is, through the registry client (no check of the signature on the way).
fn push_with_signature(
    registry: &OciRegistry,
    dir: &Path,
    reference: &str,
    module: &[u8],
    signature: &[u8],
) {
    let auth = dir.join("push-config.json");
    registry.write_auth(&auth, USER, PASSWORD);
    let client = pluglet_oci::Registry::new(pluglet_oci::RegistryOptions {
        auth_file: Some(auth),
        cas: vec![registry.ca_arg().parse().unwrap()],
        ..pluglet_oci::RegistryOptions::default()
    });
    let reference = pluglet_oci::OciRef::parse(reference).unwrap();
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(client.push(&reference, module, Some(signature), None))
        .unwrap();
}

/// `pluglet_handler_pulls_total{outcome}` as the daemon serving metrics on `metrics` counts it.
fn pulls(metrics: &str, outcome: &str) -> f64 {
    let samples = crate::ops::scrape(metrics);
    samples
        .iter()
        .find(|(k, _)| {
            k.starts_with("pluglet_handler_pulls_total") && k.contains(&format!("\"{outcome}\""))
        })
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("no pulls sample for {outcome}: {samples:#?}"))
}

/// A copy of guest `name` in `dir` (to sign it beside the copy).
fn copy_guest(dir: &Path, name: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(format!("{name}.wasm"));
    std::fs::copy(guest(name), &path).unwrap();
    path
}

#[test]
fn a_pulled_policy_serves_swaps_and_outlives_its_registry() {
    let mut registry = OciRegistry::start(SECURE);
    let root = TestRoot::new();
    let flags = flags(&registry, &root.path());
    let spread = sha256(&guest("spread-policy"));
    let first_fit = sha256(&guest("misbehave"));
    let v1 = registry.reference("vendor/gpu-policy:v1");
    let v2 = registry.reference("vendor/gpu-policy:v2");
    let digest1 = push(&flags, &v1, &guest("spread-policy"), None);
    let digest2 = push(&flags, &v2, &guest("misbehave"), None);

    handlers_toml(&root, &[], &toml(&v1));
    let daemon = Daemon::start(&root.path(), &strs(&flags));
    let _plugin =
        DevicePluginProcess::start(&root, FLOWS[0], GPU, &["--preferred", "--reregister"]);
    wait_allocatable(&daemon, GPU, 4);
    let row = wait_gpu_sha(&daemon, &spread);
    assert!(
        row["module"].as_str().unwrap().contains(&format!(
            "handlers/oci/{}/module.wasm",
            digest1.trim_start_matches("sha256:")
        )),
        "the module in force is the pulled one, kept by digest: {row}"
    );
    assert_eq!(row["source"], v1.as_str(), "{row}");
    assert_eq!(row["digest"], digest1.as_str(), "{row}");
    assert_eq!(allocate_ok(&daemon, "pod-0"), SPREAD);

    // handlers.toml names another tag: pulled, applied, the previous version kept warm.
    rename_into_place(&root, "handlers.toml", toml(&v2).as_bytes());
    let row = wait_gpu_sha(&daemon, &first_fit);
    assert_eq!(row["previous"]["sha256"], spread.as_str(), "{row}");
    assert_eq!(row["previous"]["source"], v1.as_str(), "{row}");
    assert_eq!(row["previous"]["digest"], digest1.as_str(), "{row}");
    assert_eq!(row["last_change"]["source"], v2.as_str(), "{row}");
    assert_eq!(row["last_change"]["digest"], digest2.as_str(), "{row}");
    assert_eq!(
        (&row["source"], &row["digest"]),
        (&v2.clone().into(), &digest2.clone().into()),
        "{row}"
    );
    assert_eq!(allocate_ok(&daemon, "pod-1"), FIRST_FIT);

    // The registry goes away; a restart serves the digest in force without asking it.
    registry.stop();
    let status = daemon.terminate();
    assert!(status.success());
    let metrics = crate::ops::free_addr();
    let mut with_metrics = flags.clone();
    with_metrics.extend(["--metrics-addr".into(), metrics.clone()]);
    let daemon = Daemon::start(&root.path(), &strs(&with_metrics));
    wait_allocatable(&daemon, GPU, 4);
    wait_gpu_sha(&daemon, &first_fit);
    assert_eq!(allocate_ok(&daemon, "pod-2"), FIRST_FIT);
    let pulls = |outcome: &str| pulls(&metrics, outcome);
    // The restart asked the registry nothing.
    assert_eq!(pulls("pulled"), 0.0);
    assert_eq!(pulls("unreachable"), 0.0);

    // A live change to a reference that cannot be pulled is refused with the registry's
    // error; the version in force keeps serving.
    let v3 = registry.reference("vendor/gpu-policy:v3");
    rename_into_place(&root, "handlers.toml", toml(&v3).as_bytes());
    let row = wait_gpu_row(&daemon, "refusing the unpullable tag", |r| {
        r["last_change"]["state"] == "refused"
    });
    let why = row["last_change"]["reason"].as_str().unwrap();
    assert!(why.contains(&format!("cannot pull {v3}")), "{why}");
    assert_eq!(row["last_change"]["source"], v3.as_str(), "{row}");
    assert_eq!(row["digest"], digest2.as_str(), "{row}");
    assert_eq!(row["sha256"], first_fit.as_str(), "{row}");
    assert_eq!(allocate_ok(&daemon, "pod-3"), FIRST_FIT);
    assert!(pulls("unreachable") >= 1.0);
    let samples = crate::ops::scrape(&metrics);
    assert!(
        samples.iter().any(
            |(k, v)| k.starts_with("pluglet_handler_pull_duration_seconds_count") && *v >= 1.0
        ),
        "{samples:#?}"
    );
    // The registry comes back with the tag: the refused change is tried again, with backoff,
    // until it applies.
    registry.restart();
    push(&flags, &v3, &guest("spread-policy"), None);
    let row = wait_gpu_sha(&daemon, &spread);
    assert_eq!(row["source"], v3.as_str(), "{row}");
    assert!(
        daemon.log_text().contains("the change is tried again"),
        "{}",
        daemon.log_text()
    );
    // v3 holds v1's bytes, so the same manifest digest, kept since v1: not downloaded again.
    assert_eq!(pulls("pulled"), 0.0);
    assert!(pulls("kept") >= 1.0);
    drop(daemon);
    registry.stop();

    // A first start whose entry was never pulled and cannot be: exit 1, naming the entry and
    // the registry's error.
    let fresh = TestRoot::new();
    let never = registry.reference("vendor/gpu-policy:never-pulled");
    handlers_toml(&fresh, &[], &toml(&never));
    let (status, log) = Daemon::spawn(&fresh.path(), &strs(&flags)).wait_exit();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("entry resources.\"vendor.com/gpu\""), "{log}");
    assert!(
        log.contains(&format!("cannot pull {never} (unreachable)")),
        "{log}"
    );

    // The registry back: the digest by reference is served on a fresh node too.
    registry.restart();
    let pinned = format!("oci://{}/vendor/gpu-policy@{digest2}", registry.host());
    let pinned_root = TestRoot::new();
    handlers_toml(&pinned_root, &[], &toml(&pinned));
    let daemon = Daemon::start(&pinned_root.path(), &strs(&flags));
    wait_gpu_sha(&daemon, &first_fit);
}

#[test]
fn required_signatures_apply_to_the_signature_in_the_registry() {
    let registry = OciRegistry::start(SECURE);
    let root = TestRoot::new();
    let flags = flags(&registry, &root.path());
    let keys = root.side("keys");
    std::fs::create_dir_all(&keys).unwrap();

    let (trusted_pub, trusted_key, _) = key_pair(&keys, "trusted");
    let (_, other_key, _) = key_pair(&keys, "other");
    let spread = sha256(&guest("spread-policy"));

    // Signed by the trusted key.
    let signed = copy_guest(&keys, "spread-policy");
    sign(&trusted_key, &signed, "spread-policy by vendor");
    let good = registry.reference("policy:signed");
    push(
        &flags,
        &good,
        &signed,
        Some(&keys.join("spread-policy.wasm.minisig")),
    );
    // Unsigned (other bytes than the next: a manifest digest names its bytes, and the
    // signatures attached to it travel with it).
    let unsigned = registry.reference("policy:unsigned");
    push(&flags, &unsigned, &guest("contract-v1-1"), None);
    // Signed by another key.
    let other = copy_guest(&root.side("other"), "misbehave");
    sign(&other_key, &other, "not ours");
    let by_other = registry.reference("policy:other-key");
    push(
        &flags,
        &by_other,
        &other,
        Some(&other.with_extension("wasm.minisig")),
    );
    // A signature (by the trusted key) of other bytes, attached to this module.
    let tampered = registry.reference("policy:tampered");
    let stranger = copy_guest(&root.side("stranger"), "misbehave");
    sign(&trusted_key, &stranger, "of other bytes");
    let mut changed = std::fs::read(guest("misbehave")).unwrap();
    changed.extend_from_slice(b"\0");
    let changed_path = root.side("changed.wasm");
    std::fs::write(&changed_path, &changed).unwrap();
    push(
        &flags,
        &tampered,
        &changed_path,
        Some(&stranger.with_extension("wasm.minisig")),
    );

    // A signature referrer that is not a minisign signature (`handler push` refuses to attach
    // one; another tool might), pushed with the registry client itself.
    let malformed = registry.reference("policy:malformed");
    let mut bytes = std::fs::read(guest("misbehave")).unwrap();
    bytes.extend_from_slice(b"\0\0");
    push_with_signature(
        &registry,
        &root.path(),
        &malformed,
        &bytes,
        b"not a signature\n",
    );

    let mut args = flags.clone();
    args.extend([
        "--require-signatures".into(),
        "--trusted-key".into(),
        trusted_pub.display().to_string(),
    ]);
    handlers_toml(&root, &[], &toml(&good));
    let daemon = Daemon::start(&root.path(), &strs(&args));
    let row = wait_gpu_sha(&daemon, &spread);
    assert!(!row["signature"].is_null(), "{row}");

    for (reference, reason) in [
        (&unsigned, "no signature:"),
        (&by_other, "which is not trusted"),
        (&tampered, "does not verify"),
        (&malformed, "is not a minisign signature"),
    ] {
        rename_into_place(&root, "handlers.toml", toml(reference).as_bytes());
        let row = wait_gpu_row(&daemon, &format!("refusing {reference} ({reason})"), |r| {
            r["last_change"]["state"] == "refused"
                && r["last_change"]["reason"]
                    .as_str()
                    .is_some_and(|why| why.contains(reason))
        });
        assert_eq!(
            row["sha256"],
            spread.as_str(),
            "the signed version serves on: {row}"
        );
    }
}

#[test]
fn a_moved_tag_is_applied_on_refresh_and_only_then() {
    let mut registry = OciRegistry::start(SECURE);
    let root = TestRoot::new();
    let flags = flags(&registry, &root.path());
    let spread = sha256(&guest("spread-policy"));
    let first_fit = sha256(&guest("misbehave"));
    let stable = registry.reference("vendor/gpu-policy:stable");
    let before = push(&flags, &stable, &guest("spread-policy"), None);
    handlers_toml(&root, &[], &toml(&stable));
    let metrics = crate::ops::free_addr();
    let mut args = flags.clone();
    args.extend(["--metrics-addr".into(), metrics.clone()]);
    let daemon = Daemon::start(&root.path(), &strs(&args));
    wait_gpu_sha(&daemon, &spread);

    let refresh = |args: &[&str]| {
        let mut all = vec!["handlers", "refresh", "-o", "json"];
        all.extend_from_slice(args);
        let out = daemon.ctl(&all);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "not JSON ({e}): {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        });
        assert_eq!(v["kind"], "HandlerRefresh", "{v}");
        (out.status.code(), v)
    };

    // The tag has not moved: nothing changes, nothing is downloaded.
    let (code, v) = refresh(&[]);
    assert_eq!((code, &v["outcome"]), (Some(0), &"unchanged".into()), "{v}");
    assert_eq!(
        pulls(&metrics, "pulled"),
        1.0,
        "the first start's pull only"
    );
    assert_eq!(
        pulls(&metrics, "kept"),
        1.0,
        "the refresh found the digest kept"
    );

    // The tag moves: the node keeps its digest until asked.
    let after = push(&flags, &stable, &guest("misbehave"), None);
    assert_ne!(before, after);
    let row = crate::handler_swap::gpu_row(&daemon).unwrap();
    assert_eq!(row["digest"], before.as_str(), "{row}");
    let (code, v) = refresh(&["--resource", GPU]);
    assert_eq!((code, &v["outcome"]), (Some(0), &"applied".into()), "{v}");
    assert_eq!(v["items"][0]["digest"], after.as_str(), "{v}");
    let row = wait_gpu_sha(&daemon, &first_fit);
    assert_eq!(
        row["previous"]["digest"],
        before.as_str(),
        "kept warm: {row}"
    );

    // The registry gone: the refresh is refused (exit 1) and the version in force serves on.
    registry.stop();
    let (code, v) = refresh(&[]);
    assert_eq!((code, &v["outcome"]), (Some(1), &"refused".into()), "{v}");
    assert!(
        v["reason"]
            .as_str()
            .unwrap()
            .contains(&format!("cannot pull {stable}")),
        "{v}"
    );
    let row = crate::handler_swap::gpu_row(&daemon).unwrap();
    assert_eq!(row["sha256"], first_fit.as_str(), "{row}");
}

#[test]
fn bad_registry_answers_are_refused_with_their_reason() {
    let registry = OciRegistry::start(SECURE);
    let root = TestRoot::new();
    let flags = flags(&registry, &root.path());
    let spread = sha256(&guest("spread-policy"));
    let good = registry.reference("p:good");
    push(&flags, &good, &guest("spread-policy"), None);
    let tampered = registry.reference("p:tampered");
    push(&flags, &tampered, &guest("misbehave"), None);
    let blob = registry.blob_file(&format!("sha256:{}", sha256(&guest("misbehave"))));
    let mut bytes = std::fs::read(&blob).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&blob, &bytes).unwrap();

    // Without credentials the first start fails with the registry's 401.
    let anonymous = TestRoot::new();
    handlers_toml(&anonymous, &[], &toml(&good));
    let (status, log) =
        Daemon::spawn(&anonymous.path(), &["--registry-ca", &registry.ca_arg()]).wait_exit();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains(&format!("cannot pull {good} (unauthorized)")),
        "{log}"
    );

    // A container image, pushed by skopeo as an image build would.
    let image = registry.push_container_image("p:image");
    // A module over the daemon's size limit (every other module here is under it).
    let limit = [guest("spread-policy"), guest("misbehave")]
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .max()
        .unwrap()
        + 1;
    let big = guest("uses-tcp");
    assert!(
        std::fs::metadata(&big).unwrap().len() > limit,
        "the guest uses-tcp must be the largest for this test"
    );
    let oversized = registry.reference("p:oversized");
    push(&flags, &oversized, &big, None);
    // A registry that accepts connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_host = silent.local_addr().unwrap().to_string();
    let slow = format!("oci://{silent_host}/p:v1");

    handlers_toml(&root, &[], &toml(&good));
    let metrics = crate::ops::free_addr();
    let mut args = flags.clone();
    args.extend([
        "--metrics-addr".into(),
        metrics.clone(),
        "--registry-max-module-size".into(),
        limit.to_string(),
        "--registry-timeout".into(),
        "2s".into(),
        "--insecure-registry".into(),
        silent_host,
    ]);
    let daemon = Daemon::start(&root.path(), &strs(&args));
    wait_gpu_sha(&daemon, &spread);
    for (reference, reason) in [
        (registry.reference("p:missing"), "(not_found)"),
        (tampered.clone(), "(digest_mismatch)"),
        (image, "(wrong_artifact)"),
        (oversized, "(too_large)"),
        (slow, "(timeout)"),
    ] {
        rename_into_place(&root, "handlers.toml", toml(&reference).as_bytes());
        let row = wait_gpu_row(&daemon, &format!("refusing {reference}"), |r| {
            r["last_change"]["state"] == "refused"
                && r["last_change"]["source"] == reference.as_str()
        });
        let why = row["last_change"]["reason"].as_str().unwrap();
        assert!(
            why.contains(&format!("cannot pull {reference} {reason}")),
            "{why}"
        );
        assert_eq!(row["sha256"], spread.as_str(), "{row}");
        assert!(daemon.log_text().contains(reason), "{}", daemon.log_text());
        let outcome = reason.trim_matches(['(', ')']);
        assert!(pulls(&metrics, outcome) >= 1.0, "{outcome} counted");
    }
    drop(silent);
}

#[test]
fn wkg_and_pluglet_read_what_the_other_pushed() {
    let wkg_binary = wkg();
    assert!(wkg_binary.is_file());
    let registry = OciRegistry::start(PLAIN);
    let root = TestRoot::new();
    let host = registry.host();
    let flags = vec!["--insecure-registry".to_owned(), host.clone()];
    let docker = root.side("docker");
    std::fs::create_dir_all(&docker).unwrap();
    let spread = sha256(&guest("spread-policy"));

    // wkg pushes over plain HTTP; the daemon pulls and serves it (unsigned).
    let by_wkg = format!("{host}/vendor/wkg-policy:v1");
    let module = guest("spread-policy");
    let printed = run_wkg(
        &docker,
        &[
            "oci",
            "push",
            "--insecure",
            &host,
            &by_wkg,
            module.to_str().unwrap(),
        ],
    );
    let digest = printed
        .lines()
        .find_map(|l| l.strip_prefix("digest: "))
        .unwrap_or_else(|| panic!("wkg printed no digest: {printed}"))
        .trim()
        .to_owned();
    let reference = format!("oci://{by_wkg}");
    handlers_toml(&root, &[], &toml(&reference));
    let daemon = Daemon::start(&root.path(), &strs(&flags));
    let plugin = DevicePluginProcess::start(&root, FLOWS[0], GPU, &["--preferred", "--reregister"]);
    wait_allocatable(&daemon, GPU, 4);
    let row = wait_gpu_sha(&daemon, &spread);
    assert_eq!(row["source"], reference.as_str(), "{row}");
    assert_eq!(row["digest"], digest.as_str(), "{row}");
    assert!(row["signature"].is_null(), "{row}");
    assert_eq!(allocate_ok(&daemon, "pod-0"), SPREAD);
    drop(plugin);
    drop(daemon);

    // Under --require-signatures the same unsigned module is refused, saying why.
    let keys = root.side("keys");
    std::fs::create_dir_all(&keys).unwrap();
    let (trusted_pub, _, _) = key_pair(&keys, "trusted");
    let strict = TestRoot::new();
    handlers_toml(&strict, &[], &toml(&reference));
    let mut args = flags.clone();
    args.extend([
        "--require-signatures".into(),
        "--trusted-key".into(),
        trusted_pub.display().to_string(),
    ]);
    let (status, log) = Daemon::spawn(&strict.path(), &strs(&args)).wait_exit();
    assert!(!status.success(), "{log}");
    assert!(log.contains("no signature"), "{log}");

    // pluglet pushes (with a signature attached as a referrer); wkg pulls the module byte for
    // byte.
    let signed = copy_guest(&keys, "misbehave");
    let vendor_keys = root.side("vendor-keys");
    std::fs::create_dir_all(&vendor_keys).unwrap();
    let (_, secret, _) = key_pair(&vendor_keys, "vendor");
    sign(&secret, &signed, "misbehave by vendor");
    let by_pluglet = registry.reference("vendor/pluglet-policy:v1");
    push(
        &flags,
        &by_pluglet,
        &signed,
        Some(&signed.with_extension("wasm.minisig")),
    );
    let pulled = root.side("pulled-by-wkg.wasm");
    run_wkg(
        &docker,
        &[
            "oci",
            "pull",
            "--insecure",
            &host,
            by_pluglet.trim_start_matches("oci://"),
            "-o",
            pulled.to_str().unwrap(),
        ],
    );
    assert!(
        std::fs::read(&pulled).unwrap() == std::fs::read(&signed).unwrap(),
        "wkg pulled other bytes than pluglet pushed"
    );
}
