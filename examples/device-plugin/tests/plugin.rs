//! Drives the real `example-device-plugin` binary over its sockets.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pluglet_proto::pluginregistration as reg;
use pluglet_proto::v1beta1;
use pluglet_proto::v1beta1::device_plugin_client::DevicePluginClient;
use pluglet_uds::Channel;
use tokio::sync::mpsc;

const BIN: &str = env!("CARGO_BIN_EXE_example-device-plugin");

struct Plugin(Child);

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[&str]) -> Plugin {
    Plugin(
        Command::new(BIN)
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn example-device-plugin"),
    )
}

async fn wait_for(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn client(path: &Path) -> DevicePluginClient<Channel> {
    let channel = pluglet_uds::connect(path, Duration::from_secs(10))
        .await
        .expect("dial the plugin");
    DevicePluginClient::new(channel)
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[tokio::test]
async fn watcher_flow_serves_info_devices_health_and_allocate() {
    let dir = tempfile::tempdir().unwrap();
    let dp = dir.path().join("dp.sock");
    let regs = dir.path().join("reg.sock");
    let health = dir.path().join("health");
    let status = dir.path().join("status.jsonl");
    let calls = dir.path().join("calls.jsonl");
    let _plugin = spawn(&[
        "--socket",
        s(&dp),
        "--reg-socket",
        s(&regs),
        "--status-file",
        s(&status),
        "--health-file",
        s(&health),
        "--calls-file",
        s(&calls),
        "--devices",
        "4",
        "--numa-nodes",
        "2",
        "--preferred",
        "--pre-start",
        "--cdi-devices",
        "--resource",
        "example.com/fpga",
    ]);

    let channel = pluglet_uds::connect(&regs, Duration::from_secs(10))
        .await
        .unwrap();
    let mut registration = reg::registration_client::RegistrationClient::new(channel);
    let info = registration
        .get_info(reg::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.r#type, "DevicePlugin");
    assert_eq!(info.name, "example.com/fpga");
    assert_eq!(PathBuf::from(&info.endpoint), dp);
    assert_eq!(info.supported_versions, ["v1beta1"]);
    registration
        .notify_registration_status(reg::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    let text = std::fs::read_to_string(&status).unwrap();
    assert_eq!(text.trim(), r#"{"error":"","plugin_registered":true}"#);

    let mut plugin = client(&dp).await;
    let options = plugin
        .get_device_plugin_options(v1beta1::Empty {})
        .await
        .unwrap()
        .into_inner();
    assert!(options.pre_start_required && options.get_preferred_allocation_available);

    let mut stream = plugin
        .list_and_watch(v1beta1::Empty {})
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap().devices;
    let summary: Vec<(String, String, i64)> = first
        .iter()
        .map(|d| {
            (
                d.id.clone(),
                d.health.clone(),
                d.topology.as_ref().unwrap().nodes[0].id,
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("dev-0".into(), "Healthy".into(), 0),
            ("dev-1".into(), "Healthy".into(), 1),
            ("dev-2".into(), "Healthy".into(), 0),
            ("dev-3".into(), "Healthy".into(), 1),
        ]
    );

    std::fs::write(&health, "dev-3 Unhealthy\n").unwrap();
    let second = stream.message().await.unwrap().unwrap().devices;
    assert_eq!(second[3].health, "Unhealthy");
    assert_eq!(second[0].health, "Healthy");

    let preferred = plugin
        .get_preferred_allocation(v1beta1::PreferredAllocationRequest {
            container_requests: vec![v1beta1::ContainerPreferredAllocationRequest {
                available_device_i_ds: vec!["dev-2".into(), "dev-0".into(), "dev-1".into()],
                must_include_device_i_ds: vec![],
                allocation_size: 2,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        preferred.container_responses[0].device_i_ds,
        ["dev-2", "dev-1"]
    );

    let allocated = plugin
        .allocate(v1beta1::AllocateRequest {
            container_requests: vec![v1beta1::ContainerAllocateRequest {
                devices_ids: vec!["dev-0".into(), "dev-1".into()],
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let answer = &allocated.container_responses[0];
    assert_eq!(answer.envs["VENDOR_DEVICES"], "dev-0,dev-1");
    assert_eq!(answer.annotations["vendor.com/devices"], "dev-0,dev-1");
    assert_eq!(answer.devices.len(), 2);
    assert_eq!(answer.cdi_devices[1].name, "example.com/fpga=dev-1");
    plugin
        .pre_start_container(v1beta1::PreStartContainerRequest {
            devices_ids: vec!["dev-0".into()],
        })
        .await
        .unwrap();
    let calls = std::fs::read_to_string(&calls).unwrap();
    let methods: Vec<String> = calls
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["method"].to_string())
        .collect();
    assert_eq!(
        methods,
        [
            "\"GetInfo\"",
            "\"NotifyRegistrationStatus\"",
            "\"GetDevicePluginOptions\"",
            "\"ListAndWatch\"",
            "\"GetPreferredAllocation\"",
            "\"Allocate\"",
            "\"PreStartContainer\"",
        ]
    );
}

/// A stand-in kubelet.sock that forwards every Register it receives.
struct FakeKubelet(mpsc::UnboundedSender<v1beta1::RegisterRequest>);

#[tonic::async_trait]
impl v1beta1::registration_server::Registration for FakeKubelet {
    async fn register(
        &self,
        request: tonic::Request<v1beta1::RegisterRequest>,
    ) -> Result<tonic::Response<v1beta1::Empty>, tonic::Status> {
        let _ = self.0.send(request.into_inner());
        Ok(tonic::Response::new(v1beta1::Empty {}))
    }
}

#[tokio::test]
async fn classic_flow_registers_and_sigterm_removes_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = dir.path().join("kubelet.sock");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let listener = pluglet_uds::bind(&kubelet, None).unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(v1beta1::registration_server::RegistrationServer::new(
                FakeKubelet(tx),
            ))
            .serve_with_incoming(pluglet_uds::incoming(listener)),
    );
    let plugin = spawn(&["--kubelet-socket", s(&kubelet), "--fail-allocate"]);
    let request = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(request.version, "v1beta1");
    assert_eq!(request.resource_name, "vendor.com/gpu");
    assert_eq!(request.endpoint, "vendor.com_gpu.sock");
    let dp = dir.path().join(&request.endpoint);
    assert!(dp.exists());

    let mut client = client(&dp).await;
    let err = client
        .allocate(v1beta1::AllocateRequest {
            container_requests: vec![v1beta1::ContainerAllocateRequest {
                devices_ids: vec!["dev-0".into()],
            }],
        })
        .await
        .unwrap_err();
    assert!(err.message().contains("--fail-allocate"), "{err:?}");

    let pid = plugin.0.id();
    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let dp2 = dp.clone();
    wait_for("the socket to go", move || !dp2.exists()).await;
    server.abort();
    drop(plugin);
}
