//! The kubelet's pod-resources API (`v1.PodResourcesLister`), for the agents that read it from
//! the kubelet's `pod-resources/kubelet.sock`: GPU exporters (per-pod device metrics), Multus
//! (the devices of a pod), NUMA topology exporters (what is allocatable, what is held).
//!
//! Stages: [`view`] computes every answer from a snapshot; [`PodResourcesService`] serves it,
//! behind one rate limit over every method as the kubelet's server has, counting requests
//! and errors under the kubelet's metric names ([`PodResourcesMetrics`]); [`serve`] runs it on a
//! bound socket with the same tolerance of Go clients' `:authority` as `kubelet.sock`.
//!
//! Reads never take the allocator's lock: allocations come from the state the journal last
//! made durable ([`DeviceManager::acknowledged`]), devices from the registry's shared device
//! sets, so a client calling in a loop does not slow allocations. See
//! `docs/kubelet-compatibility.md`, "Pod resources API".

pub mod view;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use pluglet_proto::podresources::v1 as pb;
use pluglet_proto::podresources::v1::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::DeviceManager;

/// The kubelet's default rate limit of the endpoint: requests per second over every method.
pub const DEFAULT_QPS: u32 = 100;

/// The kubelet's default burst of the endpoint.
pub const DEFAULT_BURST: u32 = 10;

/// The kubelet's answer to a request over the rate limit (gRPC `RESOURCE_EXHAUSTED`).
pub const RATE_LIMITED: &str = "rejected by rate limit";

/// The `server_api_version` label value of every series.
const API_VERSION: &str = "v1";

/// The methods, as the metrics count them.
#[derive(Clone, Copy, Debug)]
enum Method {
    List,
    GetAllocatable,
    Get,
}

/// Requests and errors of the endpoint, under the kubelet's names
/// (`kubelet_pod_resources_endpoint_*{server_api_version="v1"}`). Cheap to clone; register it
/// once as a collector.
#[derive(Clone, Debug, Default)]
pub struct PodResourcesMetrics(Arc<Counts>);

#[derive(Debug, Default)]
struct Counts {
    total: AtomicU64,
    requests: [AtomicU64; 3],
    errors: [AtomicU64; 3],
}

impl PodResourcesMetrics {
    fn request(&self, method: Method) {
        self.0.total.fetch_add(1, Ordering::Relaxed);
        self.0.requests[method as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn error(&self, method: Method) {
        self.0.errors[method as usize].fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct VersionLabel {
    server_api_version: &'static str,
}

impl Collector for PodResourcesMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let label = VersionLabel {
            server_api_version: API_VERSION,
        };
        // A counter's samples are written with `_total` appended: the kubelet's one name that
        // ends so is a counter here; its other names are whole, so they are written untyped to
        // keep them exactly as dashboards query them.
        let mut family = encoder.encode_descriptor(
            "kubelet_pod_resources_endpoint_requests",
            "Number of requests to the PodResource endpoint. Broken down by server api version.",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(self.0.total.load(Ordering::Relaxed))
            .encode(family.encode_family(&label)?)?;
        let names = [
            (
                "kubelet_pod_resources_endpoint_requests_list",
                "Number of requests to the PodResource List endpoint. Broken down by server api version.",
                &self.0.requests[Method::List as usize],
            ),
            (
                "kubelet_pod_resources_endpoint_requests_get_allocatable",
                "Number of requests to the PodResource GetAllocatableResources endpoint. Broken down by server api version.",
                &self.0.requests[Method::GetAllocatable as usize],
            ),
            (
                "kubelet_pod_resources_endpoint_requests_get",
                "Number of requests to the PodResource Get endpoint. Broken down by server api version.",
                &self.0.requests[Method::Get as usize],
            ),
            (
                "kubelet_pod_resources_endpoint_errors_list",
                "Number of requests to the PodResource List endpoint which returned error. Broken down by server api version.",
                &self.0.errors[Method::List as usize],
            ),
            (
                "kubelet_pod_resources_endpoint_errors_get_allocatable",
                "Number of requests to the PodResource GetAllocatableResources endpoint which returned error. Broken down by server api version.",
                &self.0.errors[Method::GetAllocatable as usize],
            ),
            (
                "kubelet_pod_resources_endpoint_errors_get",
                "Number of requests to the PodResource Get endpoint which returned error. Broken down by server api version.",
                &self.0.errors[Method::Get as usize],
            ),
        ];
        for (name, help, count) in names {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Unknown)?;
            let value = i64::try_from(count.load(Ordering::Relaxed)).unwrap_or(i64::MAX);
            ConstGauge::new(value).encode(family.encode_family(&label)?)?;
        }
        Ok(())
    }
}

/// The rate limit: `qps` requests a second over every method, up to `burst` at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Sustained requests per second.
    pub qps: NonZeroU32,
    /// Requests allowed at once.
    pub burst: NonZeroU32,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            qps: NonZeroU32::new(DEFAULT_QPS).expect("not zero"),
            burst: NonZeroU32::new(DEFAULT_BURST).expect("not zero"),
        }
    }
}

/// `v1.PodResourcesLister` over a device manager's state.
#[derive(Clone)]
pub struct PodResourcesService {
    devices: DeviceManager,
    limiter: Arc<DefaultDirectRateLimiter>,
    metrics: PodResourcesMetrics,
}

impl PodResourcesService {
    /// The service over `devices`, limited by `limits`, counting into `metrics`.
    pub fn new(
        devices: DeviceManager,
        limits: Limits,
        metrics: PodResourcesMetrics,
    ) -> PodResourcesService {
        let quota = Quota::per_second(limits.qps).allow_burst(limits.burst);
        PodResourcesService {
            devices,
            limiter: Arc::new(RateLimiter::direct(quota)),
            metrics,
        }
    }

    /// Refuses a request over the rate limit, as the kubelet's interceptor does (before the
    /// method runs, so it is not counted as a request).
    fn admit(&self) -> Result<(), Status> {
        self.limiter
            .check()
            .map_err(|_| Status::resource_exhausted(RATE_LIMITED))
    }
}

#[tonic::async_trait]
impl PodResourcesLister for PodResourcesService {
    async fn list(
        &self,
        _request: Request<pb::ListPodResourcesRequest>,
    ) -> Result<Response<pb::ListPodResourcesResponse>, Status> {
        self.admit()?;
        self.metrics.request(Method::List);
        Ok(Response::new(view::list(&self.devices.acknowledged())))
    }

    async fn get_allocatable_resources(
        &self,
        _request: Request<pb::AllocatableResourcesRequest>,
    ) -> Result<Response<pb::AllocatableResourcesResponse>, Status> {
        self.admit()?;
        self.metrics.request(Method::GetAllocatable);
        let sets = self.devices.device_sets();
        Ok(Response::new(view::allocatable(
            sets.iter().map(|(name, set)| (name, set)),
        )))
    }

    async fn get(
        &self,
        request: Request<pb::GetPodResourcesRequest>,
    ) -> Result<Response<pb::GetPodResourcesResponse>, Status> {
        self.admit()?;
        self.metrics.request(Method::Get);
        let request = request.into_inner();
        match view::get(
            &self.devices.acknowledged(),
            &request.pod_name,
            &request.pod_namespace,
        ) {
            Some(pod) => Ok(Response::new(pb::GetPodResourcesResponse {
                pod_resources: Some(pod),
            })),
            None => {
                self.metrics.error(Method::Get);
                // The kubelet's words; it answers them with an untyped error (UNKNOWN).
                Err(Status::unknown(format!(
                    "pod {} in namespace {} not found",
                    request.pod_name, request.pod_namespace
                )))
            }
        }
    }
}

/// Serves `service` on the bound `listener` until `cancel` fires. Go clients dial the socket by
/// its path, so their `:authority` is accepted as `kubelet.sock`'s is.
pub async fn serve(
    service: PodResourcesService,
    listener: UnixListener,
    cancel: CancellationToken,
) {
    pluglet_uds::serve(
        pluglet_uds::incoming_any_authority(listener),
        PodResourcesListerServer::new(service),
        cancel.cancelled_owned(),
    )
    .await;
}
