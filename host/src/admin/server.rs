//! The admin gRPC server (`pluglet.admin.v1.Admin`) on the admin socket (mode 0600 unless
//! configured). Reads the plugin manager through its handle and the handler set directly; maps
//! internal types to the wire in one place ([`plugin_to_wire`], [`socket_to_wire`],
//! [`handler_to_wire`], [`event_to_wire`]). The status and the events come from the daemon's
//! [`Health`] and [`EventLog`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use chrono::SecondsFormat;
use pluglet_core::events::{Event, EventLog, Followed};
use pluglet_csi::CsiNodeInfo;
use pluglet_handlers::{ChangeRecord, Handlers, SlotKey, SlotStatus};
use pluglet_plugin_manager::{PluginManagerHandle, SocketPlugin, SocketState, SocketStatus};
use pluglet_proto::admin::v1 as pb;
use pluglet_proto::admin::v1::admin_server::{Admin, AdminServer};
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::info;

use crate::config::SocketGroup;
use crate::ops::health::Health;

/// The admin server could not run.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The admin socket could not be bound.
    #[error("cannot listen on admin socket {path}")]
    Bind {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: pluglet_uds::UdsError,
    },
    /// The admin socket could not be given to its group.
    #[error(
        "cannot give admin socket {path} to group {group}: run the daemon as root, or as a \
         member of that group"
    )]
    Group {
        /// The socket.
        path: PathBuf,
        /// The group's name.
        group: String,
        /// Why.
        #[source]
        source: nix::Error,
    },
}

/// The admin service.
#[derive(Clone)]
pub struct AdminService {
    plugins: PluginManagerHandle,
    handlers: Handlers,
    devices: Option<pluglet_device_manager::DeviceManager>,
    publisher: Option<pluglet_fleet::Publisher>,
    rollouts: Option<std::sync::Arc<std::sync::Mutex<pluglet_fleet::rollout::AgentView>>>,
    pipeline: Option<pluglet_registration::Pipeline>,
    health: Health,
    events: EventLog,
    /// Fires when the server stops: event followers end then, so they never hold the stop up.
    stopping: CancellationToken,
}

/// How many refusals and failures `GetStatus` shows.
pub const LAST_ERRORS: usize = 5;

impl AdminService {
    /// A service reading `plugins` and `handlers` (with a health and an event log of its own
    /// until the daemon's are given).
    pub fn new(plugins: PluginManagerHandle, handlers: Handlers) -> AdminService {
        AdminService {
            plugins,
            handlers,
            devices: None,
            publisher: None,
            rollouts: None,
            pipeline: None,
            health: Health::new(),
            events: EventLog::default(),
            stopping: CancellationToken::new(),
        }
    }

    /// Reports readiness and uptime from `health`.
    pub fn with_health(mut self, health: Health) -> AdminService {
        self.health = health;
        self
    }

    /// Serves the events of `events`.
    pub fn with_events(mut self, events: EventLog) -> AdminService {
        self.events = events;
        self
    }

    /// Reports publishing to a Kubernetes API server from `publisher`.
    pub fn with_publisher(mut self, publisher: Option<pluglet_fleet::Publisher>) -> AdminService {
        self.publisher = publisher;
        self
    }

    /// Reports this node's part in the fleet rollouts of handlers from `view`.
    pub fn with_rollouts(
        mut self,
        view: Option<std::sync::Arc<std::sync::Mutex<pluglet_fleet::rollout::AgentView>>>,
    ) -> AdminService {
        self.rollouts = view;
        self
    }

    /// Lists the plugins registered through `kubelet.sock` from `pipeline` (the one both doors
    /// register through).
    pub fn with_pipeline(mut self, pipeline: pluglet_registration::Pipeline) -> AdminService {
        self.pipeline = Some(pipeline);
        self
    }

    /// Serves the device RPCs from `devices`.
    pub fn with_devices(mut self, devices: pluglet_device_manager::DeviceManager) -> AdminService {
        self.devices = Some(devices);
        self
    }

    fn devices(&self, rpc: &str) -> Result<&pluglet_device_manager::DeviceManager, Status> {
        self.devices
            .as_ref()
            .ok_or_else(|| device_manager_missing(rpc))
    }
}

/// Binds `path` with `mode` and serves `service` until `cancel` fires (ending the event streams
/// of `WatchEvents` then), then removes the socket. Binding happens before this returns the
/// serving future, so the socket exists once it resolves to the future.
pub fn bind_and_serve(
    path: &Path,
    mode: u32,
    mut service: AdminService,
    cancel: CancellationToken,
) -> Result<impl Future<Output = ()> + use<>, AdminError> {
    service.stopping = cancel.clone();
    let listener = pluglet_uds::bind(path, Some(mode)).map_err(|source| AdminError::Bind {
        path: path.to_owned(),
        source,
    })?;
    info!(path = %path.display(), mode = format!("{mode:04o}"), "admin API listening");
    let path = path.to_owned();
    Ok(async move {
        pluglet_uds::serve(
            // grpc-go and grpc-python clients dial a unix socket with its path as
            // `:authority`; serve them too (docs/kubelet-compatibility.md, "HTTP/2
            // authority from Go plugins").
            pluglet_uds::incoming_any_authority(listener),
            server(service),
            cancel.cancelled_owned(),
        )
        .await;
        let _ = std::fs::remove_file(&path);
    })
}

/// The admin server: the generated one, with Allocate and Release (every allocation's calls)
/// answered by routes of their own that call the same methods ([`pluglet_uds::Routes`]).
fn server(service: AdminService) -> pluglet_uds::Routes<AdminServer<AdminService>> {
    let service = Arc::new(service);
    let allocate = Arc::clone(&service);
    let release = Arc::clone(&service);
    pluglet_uds::Routes::new(AdminServer::from_arc(service))
        .unary("/pluglet.admin.v1.Admin/Allocate", move |request| {
            let service = Arc::clone(&allocate);
            async move {
                let answer = service.allocate(Request::new(request)).await?;
                Ok::<_, Status>(answer.into_inner())
            }
        })
        .unary("/pluglet.admin.v1.Admin/Release", move |request| {
            let service = Arc::clone(&release);
            async move {
                let answer = service.release(Request::new(request)).await?;
                Ok::<_, Status>(answer.into_inner())
            }
        })
}

/// Gives the admin socket at `path`, bound by [`bind_and_serve`], to `group` (nothing to do
/// without one). On failure the socket is removed: the daemon does not start.
pub fn set_socket_group(path: &Path, group: Option<&SocketGroup>) -> Result<(), AdminError> {
    let Some(group) = group else {
        return Ok(());
    };
    let gid = nix::unistd::Gid::from_raw(group.gid);
    if let Err(source) = nix::unistd::chown(path, None, Some(gid)) {
        let _ = std::fs::remove_file(path);
        return Err(AdminError::Group {
            path: path.to_owned(),
            group: group.name.clone(),
            source,
        });
    }
    info!(path = %path.display(), group = %group.name, "admin socket group set");
    Ok(())
}

/// Wire form of a registered plugin.
pub fn plugin_to_wire(p: &SocketPlugin) -> pb::Plugin {
    pb::Plugin {
        name: p.info.name.clone(),
        r#type: p.info.plugin_type.clone(),
        endpoint: p.info.endpoint.clone(),
        versions: p.info.supported_versions.clone(),
        version: p.version().unwrap_or_default().to_owned(),
        handler: p.handler_module().unwrap_or_default().to_owned(),
        registered_at: p.registered_at.to_rfc3339_opts(SecondsFormat::Millis, true),
        socket_path: p.socket.to_string(),
        door: DOOR_REGISTRY.to_owned(),
        csi: p.facts::<CsiNodeInfo>().map(|c| pb::CsiNodeInfo {
            node_id: c.node_id.clone(),
            max_volumes_per_node: c.max_volumes_per_node,
            topology: c.topology.clone().into_iter().collect(),
        }),
    }
}

/// The door of a plugin found in the plugin registry, as `ctl plugins` names it.
pub const DOOR_REGISTRY: &str = "registry";
/// The door of a device plugin that called `Register` on `kubelet.sock`.
pub const DOOR_KUBELET_SOCK: &str = "kubelet.sock";

/// Wire form of a device plugin registered through `kubelet.sock`.
pub fn kubelet_sock_plugin_to_wire(r: &pluglet_registration::Registration) -> pb::Plugin {
    pb::Plugin {
        name: r.info.name.clone(),
        r#type: r.info.plugin_type.clone(),
        endpoint: r.info.endpoint.clone(),
        versions: r.info.supported_versions.clone(),
        version: r.version.clone().unwrap_or_default(),
        handler: r.handler.module().to_owned(),
        registered_at: rfc3339(r.registered_at),
        socket_path: String::new(),
        csi: None,
        door: DOOR_KUBELET_SOCK.to_owned(),
    }
}

/// Wire form of a socket's status.
pub fn socket_to_wire(s: &SocketStatus) -> pb::SocketStatus {
    pb::SocketStatus {
        path: s.path.to_string(),
        state: s.state.as_str().to_owned(),
        attempts: s.attempts,
        last_error: s.last_error.clone().unwrap_or_default(),
        plugin_type: s.plugin_type.clone().unwrap_or_default(),
        plugin_name: s.plugin_name.clone().unwrap_or_default(),
        next_retry_ms: s.next_retry.map_or(0, |d| d.as_millis() as u64),
    }
}

fn rfc3339(at: std::time::SystemTime) -> String {
    chrono::DateTime::<chrono::Utc>::from(at).to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Wire form of where publishing stands.
fn publishing_to_wire(publisher: &pluglet_fleet::Publisher) -> pb::Publishing {
    let s = publisher.status();
    pb::Publishing {
        node: s.node,
        server: s.server,
        state: s.state.as_str().to_owned(),
        last_sync: s.last_sync.map(rfc3339).unwrap_or_default(),
        last_error: s.last_error.unwrap_or_default(),
        pending_changes: s.pending_changes,
        rounds: s.rounds,
        failures: s.failures,
        writes: s.writes,
        conflicts: s.conflicts,
        warnings: s.warnings,
        resources: s.resources as u32,
        csi_drivers: s.csi_drivers as u32,
    }
}

/// Wire form of a change record. A change of an `oci://` module names the reference (a pull
/// refused names it as its module) or the pulled file in the store, whose folder is the
/// manifest digest; `entries` are the slot's versions that may tell the reference.
fn change_to_wire(c: &ChangeRecord, entries: &[&pluglet_handlers::SlotEntry]) -> pb::HandlerChange {
    let module = c.module.clone().unwrap_or_default();
    let (source, digest) = if pluglet_oci::is_oci(&module) {
        (module.clone(), String::new())
    } else {
        let digest = std::path::Path::new(&module)
            .parent()
            .filter(|dir| dir.parent().is_some_and(|p| p.ends_with("handlers/oci")))
            .and_then(|dir| dir.file_name())
            .map(|hex| format!("sha256:{}", hex.to_string_lossy()))
            .unwrap_or_default();
        let source = entries
            .iter()
            .find(|e| !digest.is_empty() && e.digest.as_deref() == Some(digest.as_str()))
            .and_then(|e| e.source.clone())
            .unwrap_or_default();
        (source, digest)
    };
    pb::HandlerChange {
        state: c.state.to_string(),
        at: rfc3339(c.at),
        reason: c.reason.clone(),
        module,
        sha256: c.sha256.clone().unwrap_or_default(),
        source,
        digest,
    }
}

/// Wire form of a handler slot.
pub fn handler_to_wire(s: &SlotStatus) -> pb::HandlerInfo {
    let handler = s.current.handler();
    let stats = s.current.stats().snapshot();
    let entry = s.current.entry();
    let previous_entry = s.previous.as_ref().and_then(|p| p.entry());
    pb::HandlerInfo {
        plugin_type: s.slot.plugin_type().unwrap_or_default().to_owned(),
        resource: s.slot.resource().unwrap_or_default().to_owned(),
        module: handler.module().to_owned(),
        sha256: handler.sha256().to_owned(),
        contract_version: handler.contract_version().to_owned(),
        families: handler.families().iter().map(|f| f.to_string()).collect(),
        applied_at: rfc3339(s.current.applied_at()),
        previous_module: s
            .previous
            .as_ref()
            .map(|p| p.module().to_owned())
            .unwrap_or_default(),
        previous_sha256: s
            .previous
            .as_ref()
            .map(|p| p.sha256().to_owned())
            .unwrap_or_default(),
        calls: stats.calls,
        refusals: stats.refusals,
        failures: Some(pb::HandlerFailures {
            trap: stats.failures.trap,
            deadline: stats.failures.deadline,
            memory: stats.failures.memory,
            fuel: stats.failures.fuel,
            other: stats.failures.other,
        }),
        has_timing: stats.mean_us.is_some(),
        mean_us: stats.mean_us.unwrap_or_default(),
        p99_us: stats.p99_us.unwrap_or_default(),
        last_failure: stats.last_failure.map(|f| pb::HandlerFailure {
            at: rfc3339(f.at),
            kind: f.kind.as_str().to_owned(),
            message: f.message,
        }),
        last_change: s.last_change.as_ref().map(|c| {
            let entries: Vec<_> = std::iter::once(&s.current)
                .chain(s.previous.iter())
                .filter_map(|v| v.entry())
                .collect();
            change_to_wire(c, &entries)
        }),
        rollback_after: entry.map_or(0, |e| e.rollback_after),
        on_failure: entry.map(|e| e.on_failure.to_string()).unwrap_or_default(),
        on_probation: s.current.on_probation(),
        signature: s.current.signature().map(|sig| pb::HandlerSignature {
            key_id: sig.key_id.clone(),
            trusted_comment: sig.trusted_comment.clone(),
        }),
        running_calls: s.current.concurrency().map_or(0, |(running, _)| running),
        max_concurrent_calls: s.current.concurrency().map_or(0, |(_, limit)| limit),
        settings_sha256: entry.and_then(|e| e.settings_hash()).unwrap_or_default(),
        source: entry.and_then(|e| e.source.clone()).unwrap_or_default(),
        digest: entry.and_then(|e| e.digest.clone()).unwrap_or_default(),
        previous_source: previous_entry
            .and_then(|e| e.source.clone())
            .unwrap_or_default(),
        previous_digest: previous_entry
            .and_then(|e| e.digest.clone())
            .unwrap_or_default(),
        rollout: entry
            .and_then(|e| e.rollout.as_ref())
            .map(|name| format!("rollout/{name}"))
            .unwrap_or_default(),
    }
}

/// Wire form of an event.
pub fn event_to_wire(e: &Event) -> pb::Event {
    pb::Event {
        seq: e.seq,
        at: rfc3339(e.at),
        kind: e.kind.as_str().to_owned(),
        subject: e.subject.clone(),
        message: e.message.clone(),
        missed: 0,
    }
}

/// The marker a follower gets in place of the `missed` events it fell behind on.
fn missed_to_wire(missed: u64) -> pb::Event {
    pb::Event {
        seq: 0,
        at: rfc3339(std::time::SystemTime::now()),
        kind: "missed".to_owned(),
        subject: String::new(),
        message: format!(
            "{missed} events went by while this follower was behind; `pluglet ctl events` lists \
             the ones still kept"
        ),
        missed,
    }
}

/// Plugins by type and state: the registered ones, then the sockets the watcher knows that are
/// not registered (refused or retrying: failing; pending or in progress: waiting; files that are
/// not sockets are no plugins and not counted), then device
/// plugins whose resource is connected or in its grace period through kubelet.sock.
pub fn plugin_counts(
    plugins: &[SocketPlugin],
    sockets: &[SocketStatus],
    resources: &[pluglet_device_manager::ResourceInfo],
) -> Vec<pb::PluginCount> {
    let mut counts: BTreeMap<(String, &'static str), u32> = BTreeMap::new();
    for p in plugins {
        *counts
            .entry((p.info.plugin_type.clone(), "registered"))
            .or_default() += 1;
    }
    for s in sockets {
        let state = match s.state {
            SocketState::Registered | SocketState::Ignored => continue,
            SocketState::Refused | SocketState::Retrying => "failing",
            SocketState::InProgress | SocketState::Pending => "waiting",
        };
        let plugin_type = s
            .plugin_type
            .clone()
            .unwrap_or_else(|| "unknown".to_owned());
        *counts.entry((plugin_type, state)).or_default() += 1;
    }
    let endpoints: BTreeSet<&str> = plugins.iter().map(|p| p.info.endpoint.as_str()).collect();
    for r in resources {
        let through_registry = r
            .endpoint
            .as_ref()
            .is_some_and(|e| endpoints.contains(e.to_string_lossy().as_ref()));
        if through_registry {
            continue;
        }
        let state = if r.connected { "registered" } else { "failing" };
        *counts
            .entry((pluglet_core::names::DEVICE_PLUGIN.to_owned(), state))
            .or_default() += 1;
    }
    counts
        .into_iter()
        .map(|((plugin_type, state), count)| pb::PluginCount {
            r#type: plugin_type,
            state: state.to_owned(),
            count,
        })
        .collect()
}

fn stopped(e: pluglet_plugin_manager::Stopped) -> Status {
    Status::unavailable(e.to_string())
}

/// The stream `WatchEvents` answers with.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<pb::Event, Status>> + Send>>;

#[tonic::async_trait]
impl Admin for AdminService {
    type WatchEventsStream = EventStream;

    async fn get_status(
        &self,
        _: Request<pb::GetStatusRequest>,
    ) -> Result<Response<pb::GetStatusResponse>, Status> {
        let report = self.health.report();
        let plugins = self.plugins.plugins().await.map_err(stopped)?;
        let sockets = self.plugins.sockets().await.map_err(stopped)?;
        let (resources, allocations) = match &self.devices {
            Some(d) => (d.resources(), d.allocations()),
            None => (Vec::new(), Vec::new()),
        };
        let mut allocated: BTreeMap<&str, i64> = BTreeMap::new();
        for a in &allocations {
            *allocated.entry(a.resource.as_str()).or_default() += a.device_ids.len() as i64;
        }
        let handlers = self
            .handlers
            .status()
            .slots
            .iter()
            .map(|s| pb::HandlerSummary {
                slot: s.slot.id(),
                module: s.current.module().to_owned(),
                sha256: s.current.sha256().to_owned(),
            })
            .collect();
        let errors: Vec<Event> = self
            .events
            .recent()
            .into_iter()
            .filter(|e| e.kind.is_error())
            .collect();
        let last_errors = errors[errors.len().saturating_sub(LAST_ERRORS)..]
            .iter()
            .map(event_to_wire)
            .collect();
        Ok(Response::new(pb::GetStatusResponse {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            started_at: rfc3339(report.started_at),
            uptime_ms: report.uptime.as_millis() as u64,
            live: report.live,
            ready: report.ready,
            waiting_for: report
                .waiting_for
                .iter()
                .map(|c| c.name().to_owned())
                .collect(),
            stages: report
                .stages
                .iter()
                .map(|s| pb::StageStatus {
                    name: s.name.to_owned(),
                    ended: s.ended.clone().unwrap_or_default(),
                })
                .collect(),
            plugins: plugin_counts(&plugins, &sockets, &resources),
            resources: resources
                .iter()
                .map(|r| pb::ResourceSummary {
                    resource: r.resource.to_string(),
                    capacity: r.capacity as i64,
                    allocatable: r.allocatable as i64,
                    allocated: allocated
                        .get(r.resource.as_str())
                        .copied()
                        .unwrap_or_default(),
                    connected: r.connected,
                    last_error: r.last_error.clone().unwrap_or_default(),
                })
                .collect(),
            handlers,
            last_errors,
            devices: self.devices.is_some(),
            publishing: self.publisher.as_ref().map(publishing_to_wire),
            rollouts: self
                .rollouts
                .as_ref()
                .map(|view| {
                    view.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .rollouts
                        .iter()
                        .map(|r| pb::RolloutPart {
                            name: r.name.clone(),
                            state: r.state.as_str().to_owned(),
                            digest: r.digest.clone().unwrap_or_default(),
                            reason: r.reason.clone().unwrap_or_default(),
                        })
                        .collect()
                })
                .unwrap_or_default(),
        }))
    }

    async fn list_events(
        &self,
        _: Request<pb::ListEventsRequest>,
    ) -> Result<Response<pb::ListEventsResponse>, Status> {
        Ok(Response::new(pb::ListEventsResponse {
            events: self.events.recent().iter().map(event_to_wire).collect(),
        }))
    }

    async fn watch_events(
        &self,
        _: Request<pb::WatchEventsRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let mut follower = self.events.follow();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let stopping = self.stopping.clone();
        // Ends when the client goes away (the stream is dropped), the server stops (the stream
        // then ends for the client) or the log is gone.
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    _ = tx.closed() => return,
                    _ = stopping.cancelled() => return,
                    next = follower.next() => next,
                };
                let event = match next {
                    Some(Followed::Event(e)) => event_to_wire(&e),
                    Some(Followed::Missed(n)) => missed_to_wire(n),
                    None => return,
                };
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn list_plugins(
        &self,
        _: Request<pb::ListPluginsRequest>,
    ) -> Result<Response<pb::ListPluginsResponse>, Status> {
        let mut plugins: Vec<_> = self
            .plugins
            .plugins()
            .await
            .map_err(stopped)?
            .iter()
            .map(plugin_to_wire)
            .collect();
        if let Some(pipeline) = &self.pipeline {
            plugins.extend(
                pipeline
                    .registrations()
                    .iter()
                    .filter(|r| r.door == pluglet_registration::Door::KubeletSock)
                    .map(|r| kubelet_sock_plugin_to_wire(r)),
            );
        }
        plugins.sort_by(|a, b| {
            (&a.r#type, &a.name, &a.socket_path).cmp(&(&b.r#type, &b.name, &b.socket_path))
        });
        Ok(Response::new(pb::ListPluginsResponse { plugins }))
    }

    async fn list_sockets(
        &self,
        _: Request<pb::ListSocketsRequest>,
    ) -> Result<Response<pb::ListSocketsResponse>, Status> {
        let sockets = self
            .plugins
            .sockets()
            .await
            .map_err(stopped)?
            .iter()
            .map(socket_to_wire)
            .collect();
        Ok(Response::new(pb::ListSocketsResponse { sockets }))
    }

    async fn list_handlers(
        &self,
        _: Request<pb::ListHandlersRequest>,
    ) -> Result<Response<pb::ListHandlersResponse>, Status> {
        let status = self.handlers.status();
        Ok(Response::new(pb::ListHandlersResponse {
            handlers: status.slots.iter().map(handler_to_wire).collect(),
            last_change: status.last_change.as_ref().map(|c| change_to_wire(c, &[])),
        }))
    }

    async fn refresh_handlers(
        &self,
        request: Request<pb::RefreshHandlersRequest>,
    ) -> Result<Response<pb::RefreshHandlersResponse>, Status> {
        let request = request.into_inner();
        let which = match (request.plugin_type.is_empty(), request.resource.is_empty()) {
            (true, true) => None,
            (false, true) => {
                super::check_name("plugin_type", &request.plugin_type)?;
                Some(SlotKey::PluginType(request.plugin_type))
            }
            (true, false) => {
                super::check_name("resource", &request.resource)?;
                Some(SlotKey::Resource(request.resource))
            }
            (false, false) => {
                return Err(Status::invalid_argument(
                    "name at most one of plugin_type and resource",
                ));
            }
        };
        let handlers = self.handlers.clone();
        let selected = which.clone();
        let outcome = tokio::task::spawn_blocking(move || {
            handlers.refresh(&|slot| selected.as_ref().is_none_or(|s| s == slot))
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        let (outcome, reason) = match outcome {
            pluglet_handlers::ReloadOutcome::Applied(_) => ("applied", String::new()),
            pluglet_handlers::ReloadOutcome::Unchanged => ("unchanged", String::new()),
            pluglet_handlers::ReloadOutcome::Refused(why)
            | pluglet_handlers::ReloadOutcome::Waiting(why) => ("refused", why),
        };
        let status = self.handlers.status();
        let handlers = status
            .slots
            .iter()
            .filter(|s| which.as_ref().is_none_or(|w| *w == s.slot))
            .filter(|s| s.current.entry().is_some_and(|e| e.source.is_some()))
            .map(handler_to_wire)
            .collect();
        Ok(Response::new(pb::RefreshHandlersResponse {
            outcome: outcome.to_owned(),
            reason,
            handlers,
        }))
    }

    async fn rollback_handler(
        &self,
        request: Request<pb::RollbackHandlerRequest>,
    ) -> Result<Response<pb::RollbackHandlerResponse>, Status> {
        let request = request.into_inner();
        let slot = match (request.plugin_type.is_empty(), request.resource.is_empty()) {
            (false, true) => {
                super::check_name("plugin_type", &request.plugin_type)?;
                SlotKey::PluginType(request.plugin_type)
            }
            (true, false) => {
                super::check_name("resource", &request.resource)?;
                SlotKey::Resource(request.resource)
            }
            _ => {
                return Err(Status::invalid_argument(
                    "name exactly one of plugin_type and resource",
                ));
            }
        };
        let handlers = self.handlers.clone();
        let rolled = tokio::task::spawn_blocking(move || handlers.roll_back(&slot))
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        match rolled {
            Ok(served) => {
                let status = self.handlers.status();
                let handler = status
                    .slots
                    .iter()
                    .find(|s| std::sync::Arc::ptr_eq(&s.current, &served))
                    .map(handler_to_wire);
                Ok(Response::new(pb::RollbackHandlerResponse { handler }))
            }
            Err(e @ pluglet_handlers::RollbackError::NoSuchSlot(_)) => {
                Err(Status::not_found(e.to_string()))
            }
            Err(e) => Err(Status::failed_precondition(e.to_string())),
        }
    }

    // Device manager RPCs: see `admin::devices`.

    async fn list_resources(
        &self,
        _: Request<pb::ListResourcesRequest>,
    ) -> Result<Response<pb::ListResourcesResponse>, Status> {
        let devices = self.devices("ListResources")?;
        Ok(Response::new(crate::admin::devices::list_resources(
            devices,
        )))
    }

    async fn allocate(
        &self,
        request: Request<pb::AllocateRequest>,
    ) -> Result<Response<pb::AllocateResponse>, Status> {
        let devices = self.devices("Allocate")?;
        crate::admin::devices::allocate(devices, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let devices = self.devices("Release")?;
        crate::admin::devices::release(devices, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn list_allocations(
        &self,
        _: Request<pb::ListAllocationsRequest>,
    ) -> Result<Response<pb::ListAllocationsResponse>, Status> {
        let devices = self.devices("ListAllocations")?;
        Ok(Response::new(crate::admin::devices::list_allocations(
            devices,
        )))
    }

    async fn sync_pods(
        &self,
        request: Request<pb::SyncPodsRequest>,
    ) -> Result<Response<pb::SyncPodsResponse>, Status> {
        let devices = self.devices("SyncPods")?;
        crate::admin::devices::sync_pods(devices, request.into_inner())
            .await
            .map(Response::new)
    }
}

/// The status of a device RPC while no device manager is wired in.
fn device_manager_missing(rpc: &str) -> Status {
    Status::unimplemented(format!("{rpc}: this daemon runs without a device manager"))
}
