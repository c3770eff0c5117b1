//! A real OCI registry for one test: Debian's `docker-registry` (distribution 2.8) on a free
//! loopback port, with its configuration, storage, TLS files, htpasswd file and log under the
//! test's directory. TLS uses a CA and a certificate for `127.0.0.1` made with `openssl`; the
//! credential tests use htpasswd (bcrypt, made with `htpasswd` from apache2-utils).
//!
//! Started without TLS it serves plain HTTP, for clients that cannot be given a CA (`wkg`, the
//! Bytecode Alliance's registry client, with its `--insecure HOST:PORT`; Pluglet with
//! `--insecure-registry HOST:PORT`). [`wkg`] finds the pinned `wkg` that `scripts/test.sh`
//! installs.
//!
//! When the test fails (the registry is dropped while panicking), the directory is kept and the
//! end of the registry's log printed, so the registry's own view of the failure is at hand.

use std::fs;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use sha2::{Digest as _, Sha256};

use super::process::ChildGuard;
use super::wait_for;

/// The user name the registry accepts when started with authentication.
pub const USER: &str = "vendor";
/// Its password.
pub const PASSWORD: &str = "s3cret-push";

/// How to start the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegistryConfig {
    /// Serve HTTPS with a CA made for the test (else plain HTTP).
    pub tls: bool,
    /// Ask for [`USER`] and [`PASSWORD`] (htpasswd, bcrypt).
    pub auth: bool,
}

/// A running `docker-registry`. Dropping it stops it.
pub struct OciRegistry {
    child: Option<ChildGuard>,
    dir: Option<tempfile::TempDir>,
    path: PathBuf,
    port: u16,
    config: RegistryConfig,
    starts: u32,
}

impl OciRegistry {
    /// Starts a registry and returns once it accepts connections.
    pub fn start(config: RegistryConfig) -> OciRegistry {
        program("docker-registry", "docker-registry");
        let dir = tempfile::Builder::new()
            .prefix("preg")
            .tempdir_in("/tmp")
            .expect("create the registry's directory");
        let path = dir.path().to_owned();
        let port = {
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
            listener.local_addr().expect("local address").port()
        };
        let mut yaml = format!(
            "version: 0.1\nlog:\n  level: info\n  formatter: text\nstorage:\n  filesystem:\n    \
             rootdirectory: {data}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n  \
             secret: pluglet-test-secret\n",
            data = path.join("data").display()
        );
        if config.tls {
            make_tls(&path);
            yaml.push_str(&format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                path.join("server.pem").display(),
                path.join("server.key").display()
            ));
        }
        if config.auth {
            let htpasswd = program("htpasswd", "apache2-utils");
            let out = Command::new(htpasswd)
                .args(["-Bbn", USER, PASSWORD])
                .output()
                .expect("run htpasswd");
            assert!(out.status.success(), "htpasswd failed: {out:?}");
            fs::write(path.join("htpasswd"), &out.stdout).expect("write htpasswd");
            yaml.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: pluglet-test\n    path: {}\n",
                path.join("htpasswd").display()
            ));
        }
        fs::write(path.join("config.yml"), yaml).expect("write the registry's config");
        let mut registry = OciRegistry {
            child: None,
            dir: Some(dir),
            path,
            port,
            config,
            starts: 0,
        };
        registry.restart();
        registry
    }

    /// Starts the registry again (after [`OciRegistry::stop`]) on the same port, with the same
    /// storage.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "the registry is already running");
        self.starts += 1;
        let log = self.path.join(format!("registry-{}.log", self.starts));
        let mut command = Command::new(program("docker-registry", "docker-registry"));
        command.arg("serve").arg(self.path.join("config.yml"));
        self.child = Some(ChildGuard::spawn(
            &mut command,
            &log,
            Duration::from_secs(5),
        ));
        let port = self.port;
        let child = self.child.as_mut().expect("just started");
        wait_for(
            "the registry to accept connections",
            super::DEADLINE,
            || {
                if let Some(status) = child.exited() {
                    panic!(
                        "docker-registry exited with {status} at start; its log:\n{}",
                        fs::read_to_string(&log).unwrap_or_default()
                    );
                }
                TcpStream::connect(("127.0.0.1", port)).ok()
            },
        );
    }

    /// Stops the registry (SIGTERM, then SIGKILL); its storage stays.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take()
            && child.terminate(Duration::from_secs(5)).is_none()
        {
            child.kill();
        }
    }

    /// `127.0.0.1:PORT`, as a reference names it.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `oci://127.0.0.1:PORT/REPO`.
    pub fn reference(&self, repo_and_tag: &str) -> String {
        format!("oci://{}/{repo_and_tag}", self.host())
    }

    /// The CA file (PEM) that signs the registry's certificate; `None` without TLS.
    pub fn ca(&self) -> Option<PathBuf> {
        self.config.tls.then(|| self.path.join("ca.pem"))
    }

    /// `HOST:PORT=CA` for `--registry-ca`.
    pub fn ca_arg(&self) -> String {
        let ca = self.ca().expect("the registry was started with TLS");
        format!("{}={}", self.host(), ca.display())
    }

    /// Writes a Docker `config.json` with `user`:`password` for this registry to `path`.
    pub fn write_auth(&self, path: &Path, user: &str, password: &str) {
        use base64::Engine as _;
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        fs::write(
            path,
            format!(
                r#"{{"auths": {{"{}": {{"auth": "{auth}"}}}}}}"#,
                self.host()
            ),
        )
        .expect("write config.json");
    }

    /// The registry's storage root (`docker/registry/v2/...` below it).
    pub fn storage(&self) -> PathBuf {
        self.path.join("data")
    }

    /// The file holding blob `sha256:HEX` in the registry's storage.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
        self.storage()
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// Pushes a small container image (an image config and one empty gzip tar layer) as
    /// `repo_and_tag` with `skopeo copy`, as an image build would: a manifest of another
    /// artifact type than a wasm module. Returns its reference (`oci://…`).
    pub fn push_container_image(&self, repo_and_tag: &str) -> String {
        let skopeo = program("skopeo", "skopeo");
        let work = tempfile::tempdir().expect("a directory for the image");
        let image = work.path().join("image");
        let empty = work.path().join("empty");
        fs::create_dir_all(&image).expect("create the image directory");
        fs::create_dir_all(&empty).expect("create the layer's directory");
        let layer_file = work.path().join("layer.tar.gz");
        let tar = Command::new("tar")
            .arg("czf")
            .arg(&layer_file)
            .arg("-C")
            .arg(&empty)
            .arg(".")
            .status()
            .expect("run tar");
        assert!(tar.success(), "tar failed");
        let layer = fs::read(&layer_file).expect("read the layer");
        let config =
            br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
        let mut described = Vec::new();
        for (bytes, media_type) in [
            (&config[..], "application/vnd.oci.image.config.v1+json"),
            (&layer[..], "application/vnd.oci.image.layer.v1.tar+gzip"),
        ] {
            let hex = hex::encode(Sha256::digest(bytes));
            fs::write(image.join(&hex), bytes).expect("write a blob");
            described.push(serde_json::json!({
                "mediaType": media_type,
                "digest": format!("sha256:{hex}"),
                "size": bytes.len(),
            }));
        }
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": described[0],
            "layers": [described[1]],
        });
        fs::write(image.join("manifest.json"), manifest.to_string()).expect("write the manifest");
        fs::write(image.join("version"), "Directory Transport Version: 1.1\n")
            .expect("write the version");
        let mut copy = Command::new(skopeo);
        copy.arg("copy");
        if let Some(ca) = self.ca() {
            let certs = work.path().join("certs");
            fs::create_dir_all(&certs).expect("create the certificate directory");
            fs::copy(ca, certs.join("ca.crt")).expect("copy the CA");
            copy.arg("--dest-cert-dir").arg(certs);
        } else {
            copy.arg("--dest-tls-verify=false");
        }
        if self.config.auth {
            copy.arg("--dest-creds").arg(format!("{USER}:{PASSWORD}"));
        }
        let reference = self.reference(repo_and_tag);
        let out = copy
            .arg(format!("dir:{}", image.display()))
            .arg(reference.replace("oci://", "docker://"))
            .output()
            .expect("run skopeo copy");
        assert!(
            out.status.success(),
            "skopeo copy failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        reference
    }

    /// Everything the registry logged so far.
    pub fn log(&self) -> String {
        (1..=self.starts)
            .map(|n| {
                fs::read_to_string(self.path.join(format!("registry-{n}.log"))).unwrap_or_default()
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for OciRegistry {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking()
            && let Some(dir) = self.dir.take()
        {
            let kept = dir.keep();
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "the registry's files are kept in {}; the end of its log:\n{}",
                kept.display(),
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        }
    }
}

/// The `wkg` version `scripts/test.sh` installs (keep the two in step).
pub const WKG_VERSION: &str = "0.16.1";

/// The `wkg` program: `$PLUGLET_WKG`, else the one `scripts/test.sh` installs under
/// `~/.cache/pluglet/wkg-VERSION/bin`; a failure saying how to get it otherwise.
pub fn wkg() -> PathBuf {
    if let Some(path) = std::env::var_os("PLUGLET_WKG").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "PLUGLET_WKG={} is not a file: run the tests with `bash scripts/test.sh`, which \
             installs wkg {WKG_VERSION} with `cargo install --debug --locked wkg`",
            path.display()
        );
        return path;
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let cached = home.join(format!(".cache/pluglet/wkg-{WKG_VERSION}/bin/wkg"));
    assert!(
        cached.is_file(),
        "no wkg: PLUGLET_WKG is unset and {} does not exist; run the tests with \
         `bash scripts/test.sh` (it installs wkg {WKG_VERSION} there with `cargo install --debug \
         --locked wkg --version {WKG_VERSION} --root ~/.cache/pluglet/wkg-{WKG_VERSION}`) or set \
         PLUGLET_WKG to a wkg {WKG_VERSION} binary",
        cached.display()
    );
    cached
}

/// The path of `name`, or a failure naming the Debian package that brings it.
fn program(name: &str, package: &str) -> PathBuf {
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
    {
        let path = dir.join(name);
        if path.is_file() {
            return path;
        }
    }
    panic!(
        "{name} not found: install the Debian package {package} (`apt-get install -y {package}`; \
         scripts/test.sh does)"
    )
}

fn make_tls(dir: &Path) {
    let p = |name: &str| dir.join(name).to_str().expect("UTF-8 path").to_owned();
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        &p("ca.key"),
        "-out",
        &p("ca.pem"),
        "-days",
        "2",
        "-subj",
        "/CN=pluglet test registry CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        &p("server.key"),
        "-out",
        &p("server.csr"),
        "-subj",
        "/CN=127.0.0.1",
    ]);
    fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
         keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    .expect("write server.ext");
    openssl(&[
        "x509",
        "-req",
        "-in",
        &p("server.csr"),
        "-CA",
        &p("ca.pem"),
        "-CAkey",
        &p("ca.key"),
        "-CAcreateserial",
        "-out",
        &p("server.pem"),
        "-days",
        "2",
        "-extfile",
        &p("server.ext"),
    ]);
}

fn openssl(args: &[&str]) {
    let out = Command::new(program("openssl", "openssl"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
