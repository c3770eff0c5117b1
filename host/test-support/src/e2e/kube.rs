//! A real Kubernetes control plane for one test: Debian's `etcd` and a `kube-apiserver` (1.20,
//! built from Debian's source package by `scripts/kube-apiserver.sh`), each under a
//! [`ChildGuard`], reached through `kubectl` with a kubeconfig holding a static admin token.
//!
//! `bash scripts/test.sh` builds (or finds cached) the API server and exports its path as
//! `PLUGLET_KUBE_APISERVER`, and etcd's as `PLUGLET_ETCD`. Without them the harness runs the
//! script itself and looks for `etcd` on `PATH`; when that fails too the test fails, never
//! passes silently.

use std::ffi::OsString;
use std::fs;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::process::ChildGuard;
use super::wait_for;

/// How long a start (or restart) may take to answer `/readyz`: about 3 s on an idle machine, much
/// more while the suite builds and runs beside it.
const READY_DEADLINE: Duration = Duration::from_secs(120);

/// How long a SIGTERMed etcd or kube-apiserver gets before SIGKILL.
const GRACE: Duration = Duration::from_secs(10);

/// etcd and kube-apiserver on loopback ports, with their data, keys, kubeconfig and logs under
/// the test's directory. Dropping it stops both (the API server first).
pub struct ApiServer {
    // Declared before `etcd`: fields drop in order, so the API server never outlives its store.
    apiserver: Option<ChildGuard>,
    etcd: ChildGuard,
    dir: PathBuf,
    binary: PathBuf,
    args: Vec<OsString>,
    port: u16,
    token: String,
    kubeconfig: PathBuf,
    starts: u32,
}

impl ApiServer {
    /// Starts etcd and kube-apiserver with their files under `dir` (created if missing) and
    /// returns once `/readyz` answers 200.
    pub fn start(dir: &Path) -> ApiServer {
        let binary = apiserver_binary().to_owned();
        let etcd_binary = etcd_binary();
        fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        let dir = dir.canonicalize().expect("canonical test dir");

        let [client, peer, metrics, port] = free_ports();
        let etcd_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut etcd = Command::new(&etcd_binary);
        etcd.arg("--name=default")
            .arg(format!("--data-dir={}", dir.join("etcd").display()))
            .arg(format!("--listen-client-urls={etcd_url}"))
            .arg(format!("--advertise-client-urls={etcd_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=default={peer_url}"))
            .arg(format!("--listen-metrics-urls=http://127.0.0.1:{metrics}"))
            .arg("--logger=zap");
        let etcd = ChildGuard::spawn(&mut etcd, &dir.join("etcd.log"), GRACE);

        let token = format!(
            "pluglet-e2e-{:x}{:x}",
            std::process::id(),
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos()
        );
        let tokens = dir.join("tokens.csv");
        fs::write(&tokens, format!("{token},admin,admin,system:masters\n"))
            .expect("write tokens.csv");
        let (sa_key, sa_pub) = (dir.join("sa.key"), dir.join("sa.pub"));
        openssl(&["genrsa", "-out", path_str(&sa_key), "2048"]);
        openssl(&[
            "rsa",
            "-in",
            path_str(&sa_key),
            "-pubout",
            "-out",
            path_str(&sa_pub),
        ]);

        let flag = |name: &str, value: &dyn std::fmt::Display| -> OsString {
            format!("--{name}={value}").into()
        };
        let args = vec![
            flag("etcd-servers", &etcd_url),
            flag("bind-address", &"127.0.0.1"),
            flag("advertise-address", &"127.0.0.1"),
            flag("secure-port", &port),
            flag("insecure-port", &0),
            flag("cert-dir", &dir.join("certs").display()),
            flag("service-cluster-ip-range", &"10.0.0.0/24"),
            flag(
                "service-account-issuer",
                &"https://kubernetes.default.svc.cluster.local",
            ),
            flag("service-account-key-file", &sa_pub.display()),
            flag("service-account-signing-key-file", &sa_key.display()),
            flag("token-auth-file", &tokens.display()),
            flag("authorization-mode", &"AlwaysAllow"),
            flag("endpoint-reconciler-type", &"none"),
        ];

        let kubeconfig = dir.join("kubeconfig");
        fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\n\
                 kind: Config\n\
                 clusters:\n\
                 - name: pluglet-e2e\n  \
                   cluster:\n    \
                     server: https://127.0.0.1:{port}\n    \
                     insecure-skip-tls-verify: true\n\
                 users:\n\
                 - name: admin\n  \
                   user:\n    \
                     token: {token}\n\
                 contexts:\n\
                 - name: pluglet-e2e\n  \
                   context:\n    \
                     cluster: pluglet-e2e\n    \
                     user: admin\n\
                 current-context: pluglet-e2e\n"
            ),
        )
        .expect("write kubeconfig");

        let mut server = ApiServer {
            apiserver: None,
            etcd,
            dir,
            binary,
            args,
            port,
            token,
            kubeconfig,
            starts: 0,
        };
        server.restart();
        server
    }

    /// The kubeconfig: server `https://127.0.0.1:PORT`, the admin token, TLS unchecked.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// `https://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The static bearer token of the admin user (group `system:masters`).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The directory holding the data, keys, kubeconfig and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the API server process is running (etcd always is).
    pub fn is_running(&self) -> bool {
        self.apiserver.is_some()
    }

    /// Stops the API server (SIGTERM, then SIGKILL after a grace period); etcd keeps running.
    pub fn stop(&mut self) {
        if let Some(mut apiserver) = self.apiserver.take()
            && apiserver.terminate(GRACE).is_none()
        {
            apiserver.kill();
        }
    }

    /// (Re)starts the API server with the same port and flags, stopping it first if it runs,
    /// and returns once `/readyz` answers 200. Each start logs to its own file:
    /// `kube-apiserver.log`, then `kube-apiserver.2.log`, ...
    pub fn restart(&mut self) {
        self.stop();
        self.starts += 1;
        let log = self.apiserver_log();
        let mut command = Command::new(&self.binary);
        command.args(&self.args);
        self.apiserver = Some(ChildGuard::spawn(&mut command, &log, GRACE));
        let started = Instant::now();
        let mut last_probe: Option<Instant> = None;
        wait_for("kube-apiserver /readyz", READY_DEADLINE, || {
            self.check_alive();
            // Cheap until the port listens; then one kubectl at a time, at most every 100 ms.
            if TcpStream::connect_timeout(
                &SocketAddr::from(([127, 0, 0, 1], self.port)),
                Duration::from_millis(200),
            )
            .is_err()
                || last_probe.is_some_and(|t| t.elapsed() < Duration::from_millis(100))
            {
                return None;
            }
            last_probe = Some(Instant::now());
            self.kubectl(&["--request-timeout=5s", "get", "--raw", "/readyz"])
                .status
                .success()
                .then_some(())
        });
        eprintln!(
            "kube-apiserver ready after {:?} (start {}, {})",
            started.elapsed(),
            self.starts,
            log.display()
        );
    }

    /// Runs `kubectl --kubeconfig <ours> <args>` and returns what it did, success or not.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_command(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run kubectl: {e}"))
    }

    /// [`kubectl`](Self::kubectl) with `input` on its standard input (for `create -f -`,
    /// `apply -f -`, ...).
    pub fn kubectl_input(&self, args: &[&str], input: &str) -> Output {
        let mut child = self
            .kubectl_command(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("run kubectl: {e}"));
        child
            .stdin
            .take()
            .expect("kubectl stdin")
            .write_all(input.as_bytes())
            .expect("write kubectl stdin");
        child.wait_with_output().expect("wait for kubectl")
    }

    /// Runs kubectl (adding `-o json` unless the arguments choose an output or use `--raw`) and
    /// parses what it prints; panics with its stderr when it fails.
    pub fn kubectl_json(&self, args: &[&str]) -> serde_json::Value {
        let mut args = args.to_vec();
        let chooses_output = args.iter().any(|a| {
            *a == "-o" || a.starts_with("-o=") || a.starts_with("--output") || *a == "--raw"
        });
        if !chooses_output {
            args.extend(["-o", "json"]);
        }
        let stdout = self.kubectl_ok(&args);
        serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("kubectl {args:?} printed no JSON ({e}): {stdout}"))
    }

    /// The API server's Prometheus metrics (`kubectl get --raw /metrics`), for example
    /// `apiserver_request_total`.
    pub fn metrics(&self) -> String {
        self.kubectl_ok(&["get", "--raw", "/metrics"])
    }

    /// Runs kubectl and returns its stdout; panics with its stderr when it fails.
    fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("kubectl printed UTF-8")
    }

    fn kubectl_command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(kubectl_binary());
        command
            .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            // Discovery cache in the test's directory, not in $HOME.
            .arg(format!(
                "--cache-dir={}",
                self.dir.join("kube-cache").display()
            ))
            .args(args);
        command
    }

    fn apiserver_log(&self) -> PathBuf {
        match self.starts {
            1 => self.dir.join("kube-apiserver.log"),
            n => self.dir.join(format!("kube-apiserver.{n}.log")),
        }
    }

    /// Panics with the end of its log if etcd or the API server has exited.
    fn check_alive(&mut self) {
        if let Some(status) = self.etcd.exited() {
            panic!(
                "etcd exited ({status}); end of {}:\n{}",
                self.dir.join("etcd.log").display(),
                log_tail(&self.dir.join("etcd.log"))
            );
        }
        if let Some(status) = self.apiserver.as_mut().and_then(ChildGuard::exited) {
            self.apiserver = None;
            let log = self.apiserver_log();
            panic!(
                "kube-apiserver exited ({status}); end of {}:\n{}",
                log.display(),
                log_tail(&log)
            );
        }
    }
}

/// Four distinct free loopback ports (each bound at once, then all released).
fn free_ports() -> [u16; 4] {
    let listeners: Vec<TcpListener> = (0..4)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a loopback port"))
        .collect();
    let ports: Vec<u16> = listeners
        .iter()
        .map(|l| l.local_addr().expect("local address").port())
        .collect();
    ports.try_into().expect("four ports")
}

/// The kube-apiserver binary: `$PLUGLET_KUBE_APISERVER`, else whatever
/// `scripts/kube-apiserver.sh` prints (it builds the binary when not cached).
fn apiserver_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        if let Some(path) = std::env::var_os("PLUGLET_KUBE_APISERVER") {
            let path = PathBuf::from(path);
            assert!(
                path.is_file(),
                "PLUGLET_KUBE_APISERVER={} is not a file: run the tests with `bash scripts/test.sh`, \
                 which builds kube-apiserver with scripts/kube-apiserver.sh",
                path.display()
            );
            return path;
        }
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("repository root");
        let out = Command::new("bash")
            .arg(repo.join("scripts/kube-apiserver.sh"))
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run bash scripts/kube-apiserver.sh: {e}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let path = stdout.lines().last().map(PathBuf::from);
        match path {
            Some(path) if out.status.success() && path.is_file() => path,
            _ => panic!(
                "no kube-apiserver: PLUGLET_KUBE_APISERVER is unset and `bash scripts/kube-apiserver.sh` \
                 failed ({}); run the tests with `bash scripts/test.sh` (as root, it installs and \
                 builds what they need). Its output:\n{}",
                out.status,
                tail(&String::from_utf8_lossy(&out.stderr), 40)
            ),
        }
    })
}

/// etcd: `$PLUGLET_ETCD`, else `etcd` on `PATH`.
fn etcd_binary() -> PathBuf {
    match std::env::var_os("PLUGLET_ETCD") {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => on_path("etcd").unwrap_or_else(|| {
            panic!(
                "no etcd: PLUGLET_ETCD is unset and `etcd` is not on PATH; run the tests with \
                 `bash scripts/test.sh` (it installs Debian's etcd-server)"
            )
        }),
    }
}

/// kubectl on `PATH`.
fn kubectl_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        on_path("kubectl").unwrap_or_else(|| {
            panic!(
                "no kubectl on PATH: run the tests with `bash scripts/test.sh` (it installs \
                 Debian's kubernetes-client when kubectl is missing)"
            )
        })
    })
}

fn on_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

fn openssl(args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run openssl (Debian package openssl): {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

fn log_tail(path: &Path) -> String {
    tail(&fs::read_to_string(path).unwrap_or_default(), 40)
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
