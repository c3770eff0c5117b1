//! Daemon start to admin socket answering, with a cold and a warm compile cache.
//!
//! Run: `cargo bench -p pluglet --bench daemon_start` (prints p50, p99 and min;
//! `PLUGLET_BENCH_RUNS` sets the runs per row, default 20).
//!
//! Each run spawns the release `pluglet run --root <root>` (no handlers configured: the two
//! built-in handlers are loaded) and runs `pluglet ctl --root <root> plugins` back to back until
//! one succeeds; the figure is the time from spawn to that success, so it includes one `ctl`
//! process (a few ms) and is quantised by it. Then the daemon is stopped with SIGTERM and
//! reaped. Cold: a fresh root per run (so the cache directory, its key and both entries are
//! created). Warm: one root, started once before the runs so its cache holds both entries. The
//! rows alternate run by run. The daemon's own handler loading time (its `handler modules
//! loaded ms=` log line) is printed too.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PLUGLET: &str = env!("CARGO_BIN_EXE_pluglet");

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    println!(
        "{name:<52} p50 {:>9}  p99 {:>9}  min {:>9}  ({} runs)",
        ms(pct(&samples, 0.5)),
        ms(pct(&samples, 0.99)),
        ms(samples[0]),
        samples.len()
    );
}

struct DaemonProcess(Child);

impl DaemonProcess {
    fn stop(mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let status = self.0.wait().expect("reap pluglet");
        assert!(status.success(), "pluglet exited with {status}");
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the daemon on `root` and returns the time until `ctl plugins` answered, and the
/// daemon's own handler loading time from its log.
fn start(root: &Path) -> (Duration, Duration) {
    let log = root.join("pluglet.log");
    let started = Instant::now();
    let daemon = DaemonProcess(
        Command::new(PLUGLET)
            .args(["run", "--root"])
            .arg(root)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn pluglet run"),
    );
    loop {
        let answered = Command::new(PLUGLET)
            .args(["ctl", "--root"])
            .arg(root)
            .arg("plugins")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run pluglet ctl")
            .success();
        if answered {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the daemon did not answer; log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }
    let ready = started.elapsed();
    daemon.stop();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let loading = text
        .lines()
        .find(|l| l.contains("handler modules loaded"))
        .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("ms=")))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| Duration::from_secs_f64(v / 1e3))
        .unwrap_or_else(|| panic!("no `handler modules loaded ms=` line in:\n{text}"));
    (ready, loading)
}

fn root() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("pstart")
        .tempdir_in("/tmp")
        .expect("tempdir")
}

fn main() {
    let runs: usize = std::env::var("PLUGLET_BENCH_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let warm_root = root();
    let (first, _) = start(warm_root.path());
    println!("priming start (cold): {}", ms(first));

    let (mut cold, mut warm, mut cold_load, mut warm_load) = (vec![], vec![], vec![], vec![]);
    for _ in 0..runs {
        let fresh = root();
        let (ready, loading) = start(fresh.path());
        cold.push(ready);
        cold_load.push(loading);

        let (ready, loading) = start(warm_root.path());
        warm.push(ready);
        warm_load.push(loading);
    }
    report("start → admin socket answers, cold cache", cold);
    report("start → admin socket answers, warm cache", warm);
    report("  of which handler modules loaded, cold cache", cold_load);
    report("  of which handler modules loaded, warm cache", warm_load);
}
