//! The peer process: device plugins and CSI drivers driven by stdin commands.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pluglet_proto::csi::v1 as csi;
use pluglet_proto::csi::v1::node_server::{Node, NodeServer};
use pluglet_proto::pluginregistration as reg;
use pluglet_proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use pluglet_proto::v1beta1;
use pluglet_proto::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use tokio::io::AsyncBufReadExt as _;
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt as _};
use tonic::{Request, Response, Status};

use super::now_ns;

/// One fake device plugin: `n` devices `<prefix>-<k>`; device 0 can be flipped unhealthy.
struct Devices {
    prefix: String,
    n: usize,
    zero_unhealthy: Mutex<bool>,
    list: watch::Sender<Vec<v1beta1::Device>>,
}

impl Devices {
    fn render(&self, zero_unhealthy: bool) -> Vec<v1beta1::Device> {
        (0..self.n)
            .map(|k| v1beta1::Device {
                id: format!("{}-{k}", self.prefix),
                health: if k == 0 && zero_unhealthy {
                    "Unhealthy"
                } else {
                    "Healthy"
                }
                .into(),
                topology: Some(v1beta1::TopologyInfo {
                    nodes: vec![v1beta1::NumaNode { id: 0 }],
                }),
            })
            .collect()
    }
}

#[derive(Clone)]
struct DeviceService(Arc<Devices>);

type ListStream = Pin<Box<dyn Stream<Item = Result<v1beta1::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for DeviceService {
    async fn get_device_plugin_options(
        &self,
        _: Request<v1beta1::Empty>,
    ) -> Result<Response<v1beta1::DevicePluginOptions>, Status> {
        Ok(Response::new(v1beta1::DevicePluginOptions::default()))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(
        &self,
        _: Request<v1beta1::Empty>,
    ) -> Result<Response<ListStream>, Status> {
        let stream = tokio_stream::wrappers::WatchStream::new(self.0.list.subscribe())
            .map(|devices| Ok(v1beta1::ListAndWatchResponse { devices }));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<v1beta1::PreferredAllocationRequest>,
    ) -> Result<Response<v1beta1::PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented("not offered"))
    }

    async fn allocate(
        &self,
        request: Request<v1beta1::AllocateRequest>,
    ) -> Result<Response<v1beta1::AllocateResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|r| v1beta1::ContainerAllocateResponse {
                envs: [("BENCH_DEVICES".to_string(), r.devices_ids.join(","))].into(),
                devices: r
                    .devices_ids
                    .iter()
                    .map(|id| v1beta1::DeviceSpec {
                        container_path: format!("/dev/bench/{id}"),
                        host_path: "/dev/null".into(),
                        permissions: "rw".into(),
                    })
                    .collect(),
                ..Default::default()
            })
            .collect();
        Ok(Response::new(v1beta1::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<v1beta1::PreStartContainerRequest>,
    ) -> Result<Response<v1beta1::PreStartContainerResponse>, Status> {
        Ok(Response::new(v1beta1::PreStartContainerResponse {}))
    }
}

/// One CSI driver found through the watcher; prints `NOTIFY <name> <GetInfo received>
/// <Notify received> <registered>` when notified.
#[derive(Clone)]
struct CsiService {
    name: String,
    get_info_at: Arc<Mutex<u64>>,
}

#[tonic::async_trait]
impl Registration for CsiService {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        *self.get_info_at.lock().unwrap() = now_ns();
        Ok(Response::new(reg::PluginInfo {
            r#type: "CSIPlugin".into(),
            name: self.name.clone(),
            endpoint: String::new(),
            supported_versions: vec!["1.0.0".into()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let at = now_ns();
        let status = request.into_inner();
        let got = *self.get_info_at.lock().unwrap();
        println!(
            "NOTIFY {} {got} {at} {}",
            self.name, status.plugin_registered
        );
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

#[tonic::async_trait]
impl Node for CsiService {
    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: "bench-node".into(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}

/// Binds `socket` and serves a device plugin of `n` devices `<prefix>-<k>` on it.
fn serve_devices(socket: &Path, prefix: &str, n: usize) -> Arc<Devices> {
    let devices = Arc::new(Devices {
        prefix: prefix.into(),
        n,
        zero_unhealthy: Mutex::new(false),
        list: watch::Sender::new(Vec::new()),
    });
    devices.list.send_replace(devices.render(false));
    let listener = pluglet_uds::bind(socket, None).expect("bind device plugin socket");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(DeviceService(devices.clone())))
            .serve_with_incoming(pluglet_uds::incoming(listener)),
    );
    devices
}

/// Binds `socket`, serves the device plugin, calls `Register`; prints `REG <sent> <answered>`.
async fn device_plugin(
    kubelet: &Path,
    resource: &str,
    socket: &Path,
    prefix: &str,
    n: usize,
) -> Arc<Devices> {
    let devices = serve_devices(socket, prefix, n);
    let channel = pluglet_uds::connect(kubelet, Duration::from_secs(10))
        .await
        .expect("dial kubelet.sock");
    let mut client = v1beta1::registration_client::RegistrationClient::new(channel);
    let request = v1beta1::RegisterRequest {
        version: "v1beta1".into(),
        endpoint: socket
            .file_name()
            .expect("socket file name")
            .to_string_lossy()
            .into_owned(),
        resource_name: resource.into(),
        options: Some(v1beta1::DevicePluginOptions::default()),
    };
    let sent = now_ns();
    client.register(request).await.expect("Register");
    println!("REG {sent} {}", now_ns());
    devices
}

/// Serves `count` device plugins of `n` devices each (resource `<resource>-<i>`, socket
/// `<dir>/many-<i>.sock`, devices `<prefix><i>-<k>`), then sends all their `Register` calls at
/// once, each on a connection of its own; prints `REGMANY <first sent> <last answered>`.
async fn many_device_plugins(
    kubelet: &Path,
    count: usize,
    dir: &Path,
    resource: &str,
    prefix: &str,
    n: usize,
) -> Vec<Arc<Devices>> {
    let plugins: Vec<(String, PathBuf, Arc<Devices>)> = (0..count)
        .map(|i| {
            let socket = dir.join(format!("many-{i}.sock"));
            let devices = serve_devices(&socket, &format!("{prefix}{i}"), n);
            (format!("{resource}-{i}"), socket, devices)
        })
        .collect();
    let sent = now_ns();
    let mut registers = tokio::task::JoinSet::new();
    for (resource, socket, _) in &plugins {
        let (kubelet, resource) = (kubelet.to_owned(), resource.clone());
        let endpoint = socket
            .file_name()
            .expect("socket file name")
            .to_string_lossy()
            .into_owned();
        registers.spawn(async move {
            let channel = pluglet_uds::connect(&kubelet, Duration::from_secs(30))
                .await
                .expect("dial kubelet.sock");
            v1beta1::registration_client::RegistrationClient::new(channel)
                .register(v1beta1::RegisterRequest {
                    version: "v1beta1".into(),
                    endpoint,
                    resource_name: resource,
                    options: Some(v1beta1::DevicePluginOptions::default()),
                })
                .await
                .expect("Register");
        });
    }
    while let Some(done) = registers.join_next().await {
        done.expect("a Register task");
    }
    println!("REGMANY {sent} {}", now_ns());
    plugins.into_iter().map(|(_, _, devices)| devices).collect()
}

/// Raises this process's soft limit on open files to its hard limit (a thousand plugins hold
/// two sockets each).
fn raise_open_files_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
    {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

/// Serves a CSI driver on `socket`; prints `BOUND <name> <bind returned>`.
fn csi_driver(socket: &Path, name: &str) {
    let listener = pluglet_uds::bind(socket, None).expect("bind CSI socket");
    println!("BOUND {name} {}", now_ns());
    let service = CsiService {
        name: name.into(),
        get_info_at: Arc::new(Mutex::new(0)),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(service.clone()))
            .add_service(NodeServer::new(service))
            .serve_with_incoming(pluglet_uds::incoming(listener)),
    );
}

pub fn run(kubelet: PathBuf) {
    raise_open_files_limit();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("peer runtime");
    rt.block_on(async {
        let mut plugins: HashMap<String, Arc<Devices>> = HashMap::new();
        let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
        while let Some(line) = lines.next_line().await.expect("read stdin") {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["dp", resource, socket, prefix, n] => {
                    let devices = device_plugin(
                        &kubelet,
                        resource,
                        Path::new(socket),
                        prefix,
                        n.parse().expect("device count"),
                    )
                    .await;
                    plugins.insert((*socket).to_string(), devices);
                }
                ["serve", socket, prefix, n] => {
                    let devices =
                        serve_devices(Path::new(socket), prefix, n.parse().expect("count"));
                    plugins.insert((*socket).to_string(), devices);
                    println!("SERVING {}", now_ns());
                }
                ["flip", socket] => {
                    let devices = &plugins[*socket];
                    let mut zero = devices.zero_unhealthy.lock().unwrap();
                    *zero = !*zero;
                    let list = devices.render(*zero);
                    let sent = now_ns();
                    devices.list.send_replace(list);
                    println!("SENT {sent}");
                }
                ["dpmany", count, dir, resource, prefix, n] => {
                    let many = many_device_plugins(
                        &kubelet,
                        count.parse().expect("plugin count"),
                        Path::new(dir),
                        resource,
                        prefix,
                        n.parse().expect("device count"),
                    )
                    .await;
                    for (i, devices) in many.into_iter().enumerate() {
                        plugins.insert(format!("{dir}/many-{i}.sock"), devices);
                    }
                }
                ["csi", socket, name] => csi_driver(Path::new(socket), name),
                _ => panic!("peer: unknown command {line:?}"),
            }
        }
    });
    // Servers and ListAndWatch streams never end on their own.
    std::process::exit(0);
}
