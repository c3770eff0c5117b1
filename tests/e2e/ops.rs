//! What an operator watches: `/metrics` read by the Prometheus project's own Python parser (in
//! both formats served), `/healthz` and `/readyz` through start-up, a stage that stops taking
//! the daemon down with it, and systemd's notifications on a `NOTIFY_SOCKET`.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::device_support::{DevicePluginProcess, Flow, allocate, release, wait_allocatable};
use crate::support::{CsiPlugin, DEADLINE, Daemon, TestRoot, hooks, wait_for};

const GPU: &str = "vendor.com/gpu";

/// A free loopback address for `--metrics-addr`.
pub(crate) fn free_addr() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// One HTTP/1.1 GET: (status, content type, body); `None` while nothing listens.
pub(crate) fn get(addr: &str, path: &str, accept: Option<&str>) -> Option<(u16, String, String)> {
    let mut stream = TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{accept}Connection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let content_type = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_owned())
        })
        .unwrap_or_default();
    Some((status, content_type, body.to_owned()))
}

/// The Prometheus Python client's parser (Debian's `python3-prometheus-client`, installed by
/// `scripts/test.sh`): every sample as `name{k="v",...}` → value, keys sorted.
fn parse(text: &str, openmetrics: bool) -> BTreeMap<String, f64> {
    const SCRIPT: &str = r#"
import json, sys
if sys.argv[1] == "openmetrics":
    from prometheus_client.openmetrics.parser import text_string_to_metric_families
else:
    from prometheus_client.parser import text_string_to_metric_families
out = {}
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        labels = ",".join('%s="%s"' % (k, v) for k, v in sorted(s.labels.items()))
        out["%s{%s}" % (s.name, labels)] = s.value
print(json.dumps(out))
"#;
    let python = "/usr/bin/python3";
    let check = Command::new(python)
        .args(["-c", "import prometheus_client"])
        .output();
    assert!(
        check.as_ref().is_ok_and(|o| o.status.success()),
        "the metrics tests read /metrics with the Prometheus Python client: install the Debian \
         package python3-prometheus-client (scripts/test.sh does, as root); {check:?}"
    );
    let mut child = Command::new(python)
        .args([
            "-c",
            SCRIPT,
            if openmetrics { "openmetrics" } else { "text" },
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the parser refused /metrics: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let values: BTreeMap<String, Value> = serde_json::from_slice(&out.stdout).unwrap();
    values
        .into_iter()
        .map(|(k, v)| (k, v.as_f64().unwrap()))
        .collect()
}

/// Both formats, parsed; they must agree on every sample they share.
pub(crate) fn scrape(addr: &str) -> BTreeMap<String, f64> {
    let (status, content_type, text) = get(addr, "/metrics", None).expect("/metrics answers");
    assert_eq!(status, 200, "{text}");
    assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8");
    let samples = parse(&text, false);
    let (status, content_type, om) = get(
        addr,
        "/metrics",
        Some("application/openmetrics-text;version=1.0.0,text/plain;q=0.5"),
    )
    .expect("/metrics answers");
    assert_eq!(status, 200);
    assert_eq!(
        content_type,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(om.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");
    let om = parse(&om, true);
    assert!(om.contains_key("pluglet_ready{}"), "{om:?}");
    samples
}

fn value(samples: &BTreeMap<String, f64>, key: &str) -> f64 {
    *samples
        .get(key)
        .unwrap_or_else(|| panic!("no sample {key} in {samples:#?}"))
}

#[test]
fn metrics_count_registrations_allocations_and_handler_calls() {
    let root = TestRoot::new();
    let addr = free_addr();
    let daemon = Daemon::start(&root.path(), &["--metrics-addr", &addr]);
    let reg = root.registry().join("metrics.example.com-reg.sock");
    let csi = CsiPlugin::start(&root.side("."), &reg, &["--name", "metrics.example.com"]);
    csi.wait_registered();
    let _plugin = DevicePluginProcess::start(&root, Flow::Classic, GPU, &[]);
    wait_allocatable(&daemon, GPU, 4);
    let got = allocate(&daemon, "pod-1", "ctr", GPU, 2).unwrap();
    assert_eq!(got["device_ids"].as_array().unwrap().len(), 2, "{got}");

    let s = scrape(&addr);
    let socket = reg.display().to_string();
    for state in ["desired_state_of_world", "actual_state_of_world"] {
        let key =
            format!("plugin_manager_total_plugins{{socket_path=\"{socket}\",state=\"{state}\"}}");
        assert_eq!(value(&s, &key), 1.0);
    }
    let gpu = format!("resource_name=\"{GPU}\"");
    // Prometheus' default buckets, as the kubelet's histogram has.
    for le in [
        "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0",
    ] {
        let key = |le: &str| {
            format!("kubelet_device_plugin_alloc_duration_seconds_bucket{{le=\"{le}\",{gpu}}}")
        };
        // `1.0` may be written `1`.
        let short = le.strip_suffix(".0").unwrap_or(le);
        assert!(
            s.contains_key(&key(le)) || s.contains_key(&key(short)),
            "{}",
            key(le)
        );
    }
    assert_eq!(
        value(
            &s,
            &format!("kubelet_device_plugin_registration_total{{{gpu}}}")
        ),
        1.0
    );
    assert_eq!(
        value(
            &s,
            &format!("kubelet_device_plugin_alloc_duration_seconds_count{{{gpu}}}")
        ),
        1.0
    );
    assert_eq!(
        value(
            &s,
            &format!("kubelet_device_plugin_alloc_duration_seconds_bucket{{le=\"+Inf\",{gpu}}}")
        ),
        1.0
    );
    assert_eq!(
        value(
            &s,
            &format!("pluglet_device_plugin_allocate_calls_total{{{gpu}}}")
        ),
        1.0,
        "one allocation alone: one Allocate call"
    );
    assert_eq!(
        value(
            &s,
            "pluglet_registrations_total{door=\"registry\",outcome=\"registered\",plugin_type=\"CSIPlugin\"}"
        ),
        1.0
    );
    assert_eq!(
        value(
            &s,
            "pluglet_registrations_total{door=\"kubelet_sock\",outcome=\"registered\",plugin_type=\"DevicePlugin\"}"
        ),
        1.0
    );
    assert_eq!(
        value(
            &s,
            "pluglet_registration_duration_seconds_count{plugin_type=\"CSIPlugin\"}"
        ),
        1.0
    );
    for (name, want) in [("capacity", 4.0), ("allocatable", 4.0), ("allocated", 2.0)] {
        assert_eq!(
            value(&s, &format!("pluglet_resource_{name}_devices{{{gpu}}}")),
            want,
            "{name}"
        );
    }
    assert_eq!(
        value(&s, &format!("pluglet_resource_plugin_connected{{{gpu}}}")),
        1.0
    );
    assert_eq!(
        value(
            &s,
            &format!("pluglet_device_allocations_total{{outcome=\"allocated\",{gpu}}}")
        ),
        1.0
    );
    // One allocation, timed step by step (no GetPreferredAllocation: the plugin offers none).
    let stage = |operation: &str, stage: &str| {
        format!(
            "pluglet_device_stage_duration_seconds_count{{operation=\"{operation}\",stage=\"{stage}\"}}"
        )
    };
    for step in [
        "queue",
        "candidates",
        "policy",
        "reserve",
        "plugin",
        "cdi",
        "commit",
    ] {
        assert_eq!(value(&s, &stage("allocate", step)), 1.0, "{step}");
    }
    assert!(!s.contains_key(&stage("allocate", "preferred")));
    assert!(value(&s, "pluglet_journal_writes_total{outcome=\"ok\"}") >= 1.0);
    assert!(value(&s, "pluglet_journal_syncs_total{}") >= 1.0);
    assert!(value(&s, "pluglet_checkpoint_writes_total{outcome=\"ok\"}") >= 1.0);
    // The default policy chose once; the CSI type's hooks ran validate and register.
    let calls = |slot: &str| -> f64 {
        s.iter()
            .filter(|(k, _)| {
                k.starts_with("pluglet_handler_calls_total{")
                    && k.contains(&format!("slot=\"{slot}\""))
            })
            .map(|(_, v)| v)
            .sum()
    };
    assert_eq!(calls("default_policy"), 1.0);
    assert_eq!(calls("plugin_type/CSIPlugin"), 2.0);
    assert!(
        s.keys().any(
            |k| k.starts_with("pluglet_handler_call_duration_seconds_count{")
                && k.contains("slot=\"default_policy\"")
        ),
        "{s:#?}"
    );
    assert_eq!(value(&s, "pluglet_ready{}"), 1.0);
    assert!(value(&s, "process_resident_memory_bytes{}") > 0.0);

    release(&daemon, "pod-1", None);
    // Releasing again finds nothing, and says so.
    let again = daemon.ctl(&["release", "--pod", "pod-1"]);
    assert!(again.status.success());
    assert_eq!(
        String::from_utf8_lossy(&again.stdout),
        "nothing released: pod pod-1 holds no devices\n"
    );
    let s = scrape(&addr);
    assert_eq!(
        value(&s, &format!("pluglet_device_releases_total{{{gpu}}}")),
        1.0
    );
    for step in ["commit", "cdi_remove"] {
        assert_eq!(value(&s, &stage("release", step)), 1.0, "{step}");
    }
    assert_eq!(
        value(&s, &format!("pluglet_resource_allocated_devices{{{gpu}}}")),
        0.0
    );
    assert!(
        !s.keys().any(|k| k.contains("pod-1") || k.contains("dev-")),
        "no pod UID or device id in a label"
    );
}

#[test]
fn readyz_waits_for_the_start_up_scan_and_healthz_follows_the_stages() {
    hooks::require();
    let root = TestRoot::new();
    let addr = free_addr();
    let fifo = root.side("hold-scan.fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let mut daemon = Daemon::spawn_with_env(
        &root.path(),
        &["--metrics-addr", &addr],
        &[(hooks::HOLD_SCAN, fifo.as_os_str())],
    );
    let (status, _, body) = wait_for("/readyz answering", DEADLINE, || {
        get(&addr, "/readyz?verbose", None)
    });
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("[-]registry-scanned waiting"), "{body}");
    let (status, _, body) = get(&addr, "/healthz", None).unwrap();
    assert_eq!((status, body.as_str()), (200, "ok\n"));

    // Closing the FIFO lets the scan run.
    drop(std::fs::OpenOptions::new().write(true).open(&fifo).unwrap());
    daemon.wait_ready();
    let (status, _, body) = get(&addr, "/readyz?verbose", None).unwrap();
    assert_eq!(status, 200, "{body}");
    for check in [
        "handlers-loaded",
        "checkpoint-restored",
        "kubelet-socket-serving",
        "registry-scanned",
        "admin-socket-serving",
    ] {
        assert!(body.contains(&format!("[+]{check} ok")), "{body}");
    }
    let (status, _, body) = get(&addr, "/healthz?verbose", None).unwrap();
    assert_eq!(status, 200);
    for stage in [
        "watcher",
        "reconciler",
        "device-manager",
        "admin-server",
        "handler-watcher",
    ] {
        assert!(body.contains(&format!("[+]{stage} ok")), "{body}");
    }
    // Every stage ends when asked to, none is left to the shutdown grace period.
    let (status, log) = daemon.terminate_with_log();
    assert!(status.success(), "{log}");
    assert!(log.contains("pluglet stopped"), "{log}");
    assert!(
        !log.contains("did not stop within the grace period"),
        "{log}"
    );
}

#[test]
fn a_stage_that_stops_takes_the_daemon_down_with_it_named() {
    hooks::require();
    for stage in [
        "reconciler",
        "watcher",
        "device-manager",
        "admin-server",
        "handler-watcher",
    ] {
        let root = TestRoot::new();
        let daemon =
            Daemon::spawn_with_env(&root.path(), &[], &[(hooks::FAIL_STAGE, OsStr::new(stage))]);
        let (status, log) = daemon.wait_exit();
        assert_eq!(status.code(), Some(1), "{stage}: {log}");
        assert!(
            log.contains(&format!("stage {stage} stopped unexpectedly")),
            "{stage}: {log}"
        );
        assert!(
            !root.admin_socket().exists(),
            "{stage}: the admin socket is removed on the way out"
        );
    }
}

#[test]
fn systemd_hears_ready_watchdog_and_stopping() {
    let root = TestRoot::new();
    let socket_path = root.side("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    socket.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut daemon = Daemon::spawn_with_env(
        &root.path(),
        &[],
        &[
            ("NOTIFY_SOCKET", socket_path.as_os_str()),
            ("WATCHDOG_USEC", OsStr::new("200000")),
        ],
    );
    let mut heard = Vec::new();
    let mut next = |what: &str| -> String {
        let mut buf = [0u8; 4096];
        loop {
            let n = socket
                .recv(&mut buf)
                .unwrap_or_else(|e| panic!("no {what} from the daemon ({e}); heard {heard:?}"));
            let message = String::from_utf8_lossy(&buf[..n]).into_owned();
            heard.push(message.clone());
            if message.lines().any(|l| l == what) {
                return message;
            }
        }
    };
    let ready = next("READY=1");
    assert!(ready.contains("STATUS=ready"), "{ready}");
    next("WATCHDOG=1");
    next("WATCHDOG=1");
    daemon.wait_ready();
    assert!(daemon.terminate().success());
    next("STOPPING=1");
}
