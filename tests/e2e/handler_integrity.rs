//! Integrity of handler modules: a digest pin in `handlers.toml` (a module whose digest differs
//! is refused at start and on a change; a module file changed under an unchanged pin waits for
//! the pin), and minisign signatures checked against `--trusted-key` with
//! `--require-signatures` (unsigned, signed by another key and changed after signing are each
//! refused with their own reason), and `pluglet handler verify`.
//!
//! Keys and signatures are made at test time by the `minisign` program (Debian package
//! `minisign`; `bash scripts/test.sh` installs it).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use crate::handler_swap::{
    guest, handlers, handlers_toml, rename_into_place, sha256, wait_gpu_row, wait_gpu_sha,
    wait_until,
};
use crate::support::daemon::pluglet;
use crate::support::{Daemon, TestRoot};

/// The `minisign` program; fails the test, naming the package, when it is missing.
fn minisign(args: &[&str]) -> Output {
    let out = Command::new("minisign")
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run the minisign program ({e}); install the Debian package `minisign` \
             (apt-get install minisign) or run `bash scripts/test.sh`, which does"
            )
        });
    assert!(
        out.status.success(),
        "minisign {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A key pair made by `minisign -G -W` (no password) in `dir`; returns the public key file,
/// the secret key file and the key id.
pub(crate) fn key_pair(dir: &Path, name: &str) -> (PathBuf, PathBuf, String) {
    let public = dir.join(format!("{name}.pub"));
    let secret = dir.join(format!("{name}.key"));
    minisign(&[
        "-G",
        "-W",
        "-p",
        public.to_str().unwrap(),
        "-s",
        secret.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&public).unwrap();
    let id = text
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("untrusted comment: minisign public key "))
        .expect("a minisign public key file")
        .trim()
        .to_owned();
    (public, secret, id)
}

/// Signs `file` with `secret` and the trusted comment `comment` (writes `file.minisig`).
pub(crate) fn sign(secret: &Path, file: &Path, comment: &str) {
    minisign(&[
        "-S",
        "-s",
        secret.to_str().unwrap(),
        "-m",
        file.to_str().unwrap(),
        "-t",
        comment,
    ]);
}

/// `handlers.toml` naming `module` for the gpu slot, with an optional pin.
fn toml(module: &str, pin: Option<&str>) -> String {
    let pin = pin.map_or_else(String::new, |p| format!("sha256 = \"{p}\"\n"));
    format!("[resources.\"vendor.com/gpu\"]\nmodule = \"{module}\"\n{pin}")
}

/// Waits for the gpu slot's last change to be a refusal whose reason contains `reason`; checks
/// that `serving` still serves.
fn refused(daemon: &Daemon, reason: &str, serving: &str) -> Value {
    let row = wait_gpu_row(daemon, &format!("refusing ({reason})"), |r| {
        r["last_change"]["state"] == "refused"
            && r["last_change"]["reason"]
                .as_str()
                .is_some_and(|why| why.contains(reason))
    });
    assert_eq!(row["sha256"], serving, "the version in force serves: {row}");
    row
}

#[test]
fn a_pin_decides_which_module_serves() {
    let root = TestRoot::new();
    let spread = sha256(&guest("spread-policy"));
    let misbehave = sha256(&guest("misbehave"));
    handlers_toml(
        &root,
        &[("spread-policy", "policy.wasm")],
        &toml("policy.wasm", Some(&spread)),
    );
    let daemon = Daemon::start(&root.path(), &[]);
    let row = wait_gpu_sha(&daemon, &spread);
    assert!(row["signature"].is_null(), "{row}");

    // The module file changes but the pin still names the version in force: it keeps serving,
    // and that is no refusal.
    rename_into_place(
        &root,
        "policy.wasm",
        &std::fs::read(guest("misbehave")).unwrap(),
    );
    wait_until(&daemon, "the log to tell the pin holds", || {
        let log = daemon.log_text();
        (
            log.contains("still pins sha256").then_some(()),
            String::new(),
        )
    });
    // It shows as pending, with the file's digest.
    let row = wait_gpu_row(&daemon, "showing the new file as pending", |r| {
        r["last_change"]["state"] == "pending"
    });
    assert_eq!(row["sha256"], spread.as_str(), "{row}");
    assert_eq!(row["last_change"]["sha256"], misbehave.as_str(), "{row}");

    // The pin names the new digest: the pair applies.
    rename_into_place(
        &root,
        "handlers.toml",
        toml("policy.wasm", Some(&misbehave)).as_bytes(),
    );
    let row = wait_gpu_sha(&daemon, &misbehave);
    assert_eq!(row["last_change"]["state"], "applied", "{row}");

    // A pin no module matches: refused, with both digests; the version in force serves on.
    let wrong = "0".repeat(64);
    rename_into_place(
        &root,
        "handlers.toml",
        toml("policy.wasm", Some(&wrong)).as_bytes(),
    );
    let row = refused(&daemon, "does not match the pin", &misbehave);
    let why = row["last_change"]["reason"].as_str().unwrap();
    assert!(
        why.contains(&format!(
            "module sha256 {misbehave} does not match the pin {wrong} in handlers.toml"
        )),
        "{why}"
    );

    // A pin that is not a digest: the file names the entry.
    rename_into_place(
        &root,
        "handlers.toml",
        toml("policy.wasm", Some("abc")).as_bytes(),
    );
    let top = wait_until(&daemon, "handlers.toml refused", || {
        let all = handlers(&daemon);
        let seen = all.to_string();
        let top = all["last_change"].clone();
        ((top["state"] == "refused").then_some(top), seen)
    });
    let why = top["reason"].as_str().unwrap();
    assert!(
        why.contains("entry resources.\"vendor.com/gpu\"") && why.contains("not a sha256 digest"),
        "{why}"
    );
}

#[test]
fn a_wrong_pin_fails_the_start() {
    let root = TestRoot::new();
    let wrong = "f".repeat(64);
    handlers_toml(
        &root,
        &[("spread-policy", "policy.wasm")],
        &toml("policy.wasm", Some(&wrong)),
    );
    let (status, log) = Daemon::spawn(&root.path(), &[]).wait_exit();
    assert!(!status.success(), "{log}");
    let spread = sha256(&guest("spread-policy"));
    assert!(
        log.contains(&format!(
            "module sha256 {spread} does not match the pin {wrong} in handlers.toml"
        )),
        "{log}"
    );
}

#[test]
fn required_signatures_admit_only_modules_signed_by_a_trusted_key() {
    let root = TestRoot::new();
    let keys = root.side("keys");
    std::fs::create_dir_all(&keys).unwrap();
    let (trusted_pub, trusted_key, trusted_id) = key_pair(&keys, "trusted");
    let (other_pub, other_key, other_id) = key_pair(&keys, "other");
    let dir = root.handlers();
    std::fs::create_dir_all(&dir).unwrap();

    // Served: spread-policy signed by the trusted key.
    let spread_file = dir.join("spread.wasm");
    std::fs::copy(guest("spread-policy"), &spread_file).unwrap();
    sign(&trusted_key, &spread_file, "spread-policy 1.0 by vendor");
    handlers_toml(&root, &[], &toml("spread.wasm", None));
    let daemon = Daemon::start(
        &root.path(),
        &[
            "--require-signatures",
            "--trusted-key",
            trusted_pub.to_str().unwrap(),
        ],
    );
    let spread = sha256(&guest("spread-policy"));
    let row = wait_gpu_sha(&daemon, &spread);
    assert_eq!(row["signature"]["key_id"], trusted_id.as_str(), "{row}");
    assert_eq!(
        row["signature"]["trusted_comment"], "spread-policy 1.0 by vendor",
        "{row}"
    );
    let table = daemon.ctl(&["handlers"]);
    assert!(
        String::from_utf8_lossy(&table.stdout).contains(&format!("signed:{trusted_id}")),
        "{}",
        String::from_utf8_lossy(&table.stdout)
    );

    let misbehave = std::fs::read(guest("misbehave")).unwrap();
    // Unsigned.
    std::fs::write(dir.join("unsigned.wasm"), &misbehave).unwrap();
    rename_into_place(
        &root,
        "handlers.toml",
        toml("unsigned.wasm", None).as_bytes(),
    );
    refused(&daemon, "no signature:", &spread);

    // Signed by a key that is not trusted.
    let other_file = dir.join("other.wasm");
    std::fs::write(&other_file, &misbehave).unwrap();
    sign(&other_key, &other_file, "someone else");
    rename_into_place(&root, "handlers.toml", toml("other.wasm", None).as_bytes());
    let row = refused(&daemon, "which is not trusted", &spread);
    assert!(
        row["last_change"]["reason"]
            .as_str()
            .unwrap()
            .contains(&format!("signed by key {other_id}")),
        "{row}"
    );

    // Signed by the trusted key, then one byte flipped.
    let tampered_file = dir.join("tampered.wasm");
    std::fs::write(&tampered_file, &misbehave).unwrap();
    sign(&trusted_key, &tampered_file, "misbehave");
    let mut tampered = misbehave.clone();
    let last = tampered.len() - 1;
    tampered[last] ^= 0x01;
    std::fs::write(&tampered_file, &tampered).unwrap();
    rename_into_place(
        &root,
        "handlers.toml",
        toml("tampered.wasm", None).as_bytes(),
    );
    refused(&daemon, "does not verify", &spread);

    // The offline check agrees.
    let verify = |module: &Path, key: &Path| {
        Command::new(pluglet())
            .args(["handler", "verify"])
            .arg(module)
            .arg("--key")
            .arg(key)
            .output()
            .unwrap()
    };
    let out = verify(&spread_file, &trusted_pub);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(&trusted_id), "{stdout}");
    assert!(stdout.contains("spread-policy 1.0 by vendor"), "{stdout}");
    for (module, key, reason) in [
        (&other_file, &trusted_pub, "which is not trusted"),
        (&tampered_file, &trusted_pub, "does not verify"),
        (&spread_file, &other_pub, "which is not trusted"),
    ] {
        let out = verify(module, key);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(reason), "{reason:?} in {stderr}");
    }

    // Signed properly: applied, with its signature.
    let good_file = dir.join("good.wasm");
    std::fs::write(&good_file, &misbehave).unwrap();
    sign(&trusted_key, &good_file, "misbehave 2.0");
    rename_into_place(&root, "handlers.toml", toml("good.wasm", None).as_bytes());
    let row = wait_gpu_sha(&daemon, &sha256(&good_file));
    assert_eq!(
        row["signature"]["trusted_comment"], "misbehave 2.0",
        "{row}"
    );
    assert_eq!(row["last_change"]["state"], "applied", "{row}");
}

#[test]
fn a_key_file_that_cannot_be_used_fails_the_start() {
    let root = TestRoot::new();
    let bad = root.side("bad.pub");
    std::fs::write(&bad, "not a key\n").unwrap();
    let (status, log) =
        Daemon::spawn(&root.path(), &["--trusted-key", bad.to_str().unwrap()]).wait_exit();
    assert!(!status.success(), "{log}");
    assert!(log.contains("is not a minisign public key"), "{log}");
    let (status, log) = Daemon::spawn(&root.path(), &["--require-signatures"]).wait_exit();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("--require-signatures needs at least one --trusted-key"),
        "{log}"
    );
}

#[test]
fn a_signature_installed_before_its_module_waits_for_it() {
    let root = TestRoot::new();
    let keys = root.side("keys");
    std::fs::create_dir_all(&keys).unwrap();
    let (public, secret, _) = key_pair(&keys, "vendor");
    let dir = root.handlers();
    std::fs::create_dir_all(&dir).unwrap();
    let module = dir.join("policy.wasm");
    std::fs::copy(guest("spread-policy"), &module).unwrap();
    sign(&secret, &module, "spread-policy 1.0");
    handlers_toml(&root, &[], &toml("policy.wasm", None));
    let daemon = Daemon::start(
        &root.path(),
        &[
            "--require-signatures",
            "--trusted-key",
            public.to_str().unwrap(),
        ],
    );
    let spread = sha256(&guest("spread-policy"));
    wait_gpu_sha(&daemon, &spread);

    // Version 2's signature first, as the guide installs it: the module in force keeps
    // serving, and the change shows as pending, not refused.
    let staged = root.side("next.wasm");
    std::fs::copy(guest("misbehave"), &staged).unwrap();
    sign(&secret, &staged, "misbehave 2.0");
    rename_into_place(
        &root,
        "policy.wasm.minisig",
        &std::fs::read(crate::handler_integrity::signature_of(&staged)).unwrap(),
    );
    let row = wait_gpu_row(&daemon, "waiting for the module its signature signs", |r| {
        r["last_change"]["state"] == "pending"
    });
    assert_eq!(row["sha256"], spread.as_str(), "{row}");
    assert!(
        row["last_change"]["reason"]
            .as_str()
            .is_some_and(|why| why.contains("waits for the module it signs")),
        "{row}"
    );

    // Then the module: the pair applies, with the new signature.
    rename_into_place(&root, "policy.wasm", &std::fs::read(&staged).unwrap());
    let row = wait_gpu_sha(&daemon, &sha256(&staged));
    assert_eq!(row["last_change"]["state"], "applied", "{row}");
    assert_eq!(
        row["signature"]["trusted_comment"], "misbehave 2.0",
        "{row}"
    );
}

/// The detached signature file minisign writes beside `file`.
pub(crate) fn signature_of(file: &Path) -> PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(".minisig");
    PathBuf::from(name)
}
