//! The peer process seen from the bench: started (Rust, or Python with
//! `PLUGLET_BENCH_PEER=python`) and driven one command per line.

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;

use crate::{PEER_ENV, PYTHON_PEER, TIMEOUT};

/// The peer process and its stdout lines.
pub struct Peer {
    pub child: Child,
    pub stdin: ChildStdin,
    pub lines: mpsc::Receiver<String>,
}

impl Peer {
    pub fn start(kubelet: &Path) -> Peer {
        let mut command = match python() {
            Some((python, stubs)) => {
                let mut c = Command::new(python);
                c.arg(PYTHON_PEER).arg(stubs).arg(kubelet);
                c
            }
            None => {
                let mut c = Command::new(std::env::current_exe().expect("own executable"));
                c.env(PEER_ENV, kubelet).env("RUST_LOG", "warn");
                c
            }
        };
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn peer");
        let stdin = child.stdin.take().expect("peer stdin");
        let stdout = child.stdout.take().expect("peer stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Peer {
            child,
            stdin,
            lines,
        }
    }

    pub fn send(&mut self, command: &str) {
        writeln!(self.stdin, "{command}").expect("write to peer");
        self.stdin.flush().expect("flush peer stdin");
    }

    /// The next line, split in words, whose first word is `tag`.
    pub fn expect(&self, tag: &str) -> Vec<String> {
        let line = self
            .lines
            .recv_timeout(TIMEOUT)
            .unwrap_or_else(|_| panic!("the peer sent no {tag} line"));
        let words: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        assert_eq!(words.first().map(String::as_str), Some(tag), "peer: {line}");
        words
    }

    /// Starts `count` device plugins of `n` devices (sockets `many-<i>.sock` in `dir`,
    /// resources `<resource>-<i>`, devices `<prefix><i>-<k>`) and registers them all at once;
    /// returns when the first `Register` was sent (ns). The Rust peer only.
    pub fn device_plugins(
        &mut self,
        count: usize,
        dir: &Path,
        resource: &str,
        prefix: &str,
        n: usize,
    ) -> u64 {
        self.send(&format!(
            "dpmany {count} {} {resource} {prefix} {n}",
            dir.display()
        ));
        self.expect("REGMANY")[1].parse().expect("REGMANY time")
    }

    /// Starts a device plugin and registers it; returns when `Register` was sent (ns).
    pub fn device_plugin(&mut self, resource: &str, socket: &Path, prefix: &str, n: usize) -> u64 {
        self.send(&format!("dp {resource} {} {prefix} {n}", socket.display()));
        self.expect("REG")[1].parse().expect("REG time")
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// With `PLUGLET_BENCH_PEER=python`: the interpreter and the generated stubs directory.
/// The interpreter is `PLUGLET_BENCH_PYTHON`, or a venv `<target>/outside-python` created
/// on first use with `pip install grpcio grpcio-tools`; the stubs are generated from
/// `proto/proto` into `<target>/outside-python/stubs` on every run.
pub fn python() -> Option<(PathBuf, PathBuf)> {
    static SETUP: std::sync::OnceLock<Option<(PathBuf, PathBuf)>> = std::sync::OnceLock::new();
    SETUP
        .get_or_init(|| {
            if std::env::var("PLUGLET_BENCH_PEER").ok()? != "python" {
                return None;
            }
            // <target>/release/deps/outside-<hash>
            let exe = std::env::current_exe().expect("own executable");
            let target = exe.ancestors().nth(3).expect("target dir").to_path_buf();
            let home = target.join("outside-python");
            let python = match std::env::var_os("PLUGLET_BENCH_PYTHON") {
                Some(p) => PathBuf::from(p),
                None => {
                    let python = home.join("bin/python");
                    if !python.exists() {
                        run_setup(Command::new("python3").args(["-m", "venv"]).arg(&home));
                        run_setup(Command::new(&python).args([
                            "-m",
                            "pip",
                            "install",
                            "-q",
                            "grpcio",
                            "grpcio-tools",
                        ]));
                    }
                    python
                }
            };
            let stubs = home.join("stubs");
            std::fs::create_dir_all(&stubs).expect("stubs dir");
            let protos = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/proto");
            run_setup(
                Command::new(&python)
                    .args(["-m", "grpc_tools.protoc", "-I"])
                    .arg(&protos)
                    .arg(format!("--python_out={}", stubs.display()))
                    .arg(format!("--grpc_python_out={}", stubs.display()))
                    .args([
                        "deviceplugin.proto",
                        "pluginregistration.proto",
                        "csi.proto",
                    ]),
            );
            println!("peer: Python ({})", python.display());
            Some((python, stubs))
        })
        .clone()
}

pub fn run_setup(command: &mut Command) {
    let status = command.status().expect("run a setup command");
    assert!(status.success(), "{command:?} failed: {status}");
}
