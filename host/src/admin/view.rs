//! What the admin API shows, as people and scripts see it: one serde type per kind of row,
//! built from the admin API's protobuf messages. `pluglet ctl -o json` serialises these types,
//! the tables are rendered from them ([`Table`]), and `pluglet handler test --event` reads
//! [`PluginView`] back.
//!
//! JSON conventions: wire strings as the daemon reports them (`CSIPlugin`, `Healthy`),
//! snake_case keys, `null` for a value the daemon leaves empty, maps sorted by key. Every JSON
//! output is one [`Envelope`]: `api_version` ([`API_VERSION`]) and `kind` first, then the
//! object's own fields; a list's kind ends in `List` and its rows are in `items`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use pluglet_proto::admin::v1 as pb;
use serde::{Deserialize, Serialize};

/// The version every JSON output carries, as `api_version`.
pub const API_VERSION: &str = "pluglet/v1";

/// What every `-o json` output is: the version and the kind, then the fields of `body` (flat,
/// as `kubectl -o json` prints `apiVersion` and `kind` next to an object's own fields).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Envelope<T> {
    /// [`API_VERSION`].
    pub api_version: String,
    /// What the body is: `PluginList`, `Status`, `Event`, ...
    pub kind: String,
    /// The object's own fields.
    #[serde(flatten)]
    pub body: T,
}

/// A view printed on its own as JSON, with the kind its envelope names.
pub trait Kind {
    /// The envelope's `kind`.
    const KIND: &'static str;
}

/// A row type whose list is printed as JSON, with the kind of that list.
pub trait Listed {
    /// The list's `kind` (`PluginList` for plugins, ...).
    const LIST_KIND: &'static str;
}

/// The body of a list: its rows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Items<T> {
    /// The rows.
    pub items: Vec<T>,
}

impl<T: Listed> Kind for Items<T> {
    const KIND: &'static str = T::LIST_KIND;
}

impl<T: Kind> Envelope<T> {
    /// `body` in its envelope.
    pub fn new(body: T) -> Envelope<T> {
        Envelope {
            api_version: API_VERSION.to_owned(),
            kind: T::KIND.to_owned(),
            body,
        }
    }
}

/// `value` in its envelope as pretty JSON with a final newline.
pub fn json_of<T: Serialize + Kind>(value: &T) -> String {
    json(&enveloped(value))
}

fn enveloped<T: Kind>(value: &T) -> Envelope<&T> {
    Envelope {
        api_version: API_VERSION.to_owned(),
        kind: T::KIND.to_owned(),
        body: value,
    }
}

/// `value` in its envelope as one line of JSON (JSON lines), with a final newline.
pub fn json_line_of<T: Serialize + Kind>(value: &T) -> String {
    let mut s = serde_json::to_string(&enveloped(value)).unwrap_or_else(|_| "null".to_owned());
    s.push('\n');
    s
}

/// `items` as a list in its envelope (pretty JSON).
pub fn json_list<T: Serialize + Listed>(items: Vec<T>) -> String {
    json_of(&Items { items })
}

/// `None` for an empty string: the wire's "unset".
fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

fn sorted(map: &HashMap<String, String>) -> BTreeMap<String, String> {
    map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// `-` for an empty cell.
fn dash(s: &str) -> String {
    if s.is_empty() {
        "-".to_owned()
    } else {
        s.to_owned()
    }
}

/// A registered plugin (`ctl plugins`), and the plugin record of `handler test --event`. CSI
/// facts are flat keys, present only for CSI drivers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginView {
    /// Plugin name.
    pub name: String,
    /// Wire type string: `CSIPlugin`, `DevicePlugin`, ...
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// The plugin's endpoint.
    #[serde(default)]
    pub endpoint: String,
    /// Supported versions as GetInfo reported them.
    #[serde(default)]
    pub versions: Vec<String>,
    /// Version chosen by the handler.
    #[serde(default)]
    pub version: Option<String>,
    /// Handler module in force (empty in an event file).
    #[serde(default)]
    pub handler: String,
    /// RFC 3339, UTC (empty in an event file).
    #[serde(default)]
    pub registered_at: String,
    /// Registration socket the plugin was found at (empty in an event file, and for a device
    /// plugin registered through `kubelet.sock`).
    #[serde(default)]
    pub socket_path: String,
    /// How it registered: `registry` (a socket in the plugin registry) or `kubelet.sock` (a
    /// device plugin's `Register`); empty in an event file.
    #[serde(default)]
    pub door: String,
    /// CSI: NodeGetInfo's node id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// CSI: NodeGetInfo's max volumes per node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_volumes_per_node: Option<i64>,
    /// CSI: NodeGetInfo's accessible topology.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<BTreeMap<String, String>>,
}

impl From<&pb::Plugin> for PluginView {
    fn from(p: &pb::Plugin) -> PluginView {
        PluginView {
            name: p.name.clone(),
            plugin_type: p.r#type.clone(),
            endpoint: p.endpoint.clone(),
            versions: p.versions.clone(),
            version: non_empty(&p.version),
            handler: p.handler.clone(),
            registered_at: p.registered_at.clone(),
            socket_path: p.socket_path.clone(),
            door: p.door.clone(),
            node_id: p.csi.as_ref().map(|c| c.node_id.clone()),
            max_volumes_per_node: p.csi.as_ref().map(|c| c.max_volumes_per_node),
            topology: p.csi.as_ref().map(|c| sorted(&c.topology)),
        }
    }
}

/// A socket the watcher knows (`ctl sockets`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SocketView {
    /// The socket's path.
    pub path: String,
    /// `registered`, `refused`, `retrying`, `in_progress`, `pending`, or `ignored` (named `*.sock`
    /// but not a socket; `last_error` says why).
    pub state: String,
    /// Registration attempts so far.
    pub attempts: u32,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// From GetInfo, once known.
    pub plugin_type: Option<String>,
    /// From GetInfo, once known.
    pub plugin_name: Option<String>,
    /// Milliseconds until the next attempt when retrying; 0 otherwise.
    pub next_retry_ms: u64,
}

impl From<&pb::SocketStatus> for SocketView {
    fn from(s: &pb::SocketStatus) -> SocketView {
        SocketView {
            path: s.path.clone(),
            state: s.state.clone(),
            attempts: s.attempts,
            last_error: non_empty(&s.last_error),
            plugin_type: non_empty(&s.plugin_type),
            plugin_name: non_empty(&s.plugin_name),
            next_retry_ms: s.next_retry_ms,
        }
    }
}

/// A handler slot and the module in force (`ctl handlers`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HandlerView {
    /// The slot's name, as in `ctl status`, metric labels and events: `plugin_type/<type>`,
    /// `resource/<name>` or `default_policy`.
    #[serde(default)]
    pub slot: String,
    /// Plugin type it serves; `None` for an allocation policy.
    pub plugin_type: Option<String>,
    /// Resource it governs as an allocation policy; `None` for the default policy and for
    /// plugin types.
    pub resource: Option<String>,
    /// `builtin:<name>` or the module's path.
    pub module: String,
    /// The module's sha256, hex.
    pub sha256: String,
    /// Contract version it implements.
    pub contract_version: String,
    /// Hook families it exports.
    pub families: Vec<String>,
    /// When this version was put in force (RFC 3339).
    pub applied_at: Option<String>,
    /// The previous version, kept loaded for a rollback.
    pub previous: Option<ModuleRef>,
    /// Calls since applied.
    pub calls: u64,
    /// Calls the guest answered with a refusal.
    pub refusals: u64,
    /// Failed calls by kind.
    pub failures: FailuresView,
    /// Mean call time, µs.
    pub mean_us: Option<f64>,
    /// 99th percentile call time, µs.
    pub p99_us: Option<u64>,
    /// The last failed call.
    pub last_failure: Option<FailureView>,
    /// The last change of the slot when one was applied, refused or rolled back.
    pub last_change: Option<ChangeView>,
    /// `rollback_after` of the entry (`None` for a built-in).
    pub rollback_after: Option<u32>,
    /// `on_failure` of the entry (`None` for a built-in).
    pub on_failure: Option<String>,
    /// Whether the module is still on probation.
    pub on_probation: bool,
    /// The minisign signature that vouched for the module when it was applied (`None`: none
    /// was checked).
    pub signature: Option<SignatureView>,
    /// Calls of the slot running now (absent for a built-in: not counted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_calls: Option<u32>,
    /// How many calls of the slot may run at once (absent for a built-in: not limited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_calls: Option<u32>,
    /// A short digest of the entry's settings, to tell versions of one module apart (absent
    /// without settings).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings_sha256: Option<String>,
}

/// A minisign signature that verified.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignatureView {
    /// The id of the key that made it, hex, as minisign prints it.
    pub key_id: String,
    /// Its trusted comment.
    pub trusted_comment: String,
}

/// A module and its digest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleRef {
    /// `builtin:<name>` or the module's path.
    pub module: String,
    /// sha256, hex.
    pub sha256: String,
}

/// Failed calls by kind.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailuresView {
    /// Traps (panics, `unreachable`, guest exits).
    pub trap: u64,
    /// Deadlines exceeded.
    pub deadline: u64,
    /// Memory caps exceeded.
    pub memory: u64,
    /// Fuel budgets used up.
    pub fuel: u64,
    /// Calls the host could not run (not the module's failure).
    pub other: u64,
}

/// The last failed call of a handler.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureView {
    /// RFC 3339.
    pub at: String,
    /// `trap`, `deadline`, `memory`, `fuel` or `other`.
    pub kind: String,
    /// The handler's error.
    pub message: String,
}

/// The last change of a slot, or of `handlers.toml` as a whole.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeView {
    /// `applied`, `refused` or `rolled_back`.
    pub state: String,
    /// RFC 3339.
    pub at: String,
    /// Why.
    pub reason: String,
    /// The module concerned.
    pub module: Option<String>,
    /// Its sha256.
    pub sha256: Option<String>,
}

impl From<&pb::HandlerChange> for ChangeView {
    fn from(c: &pb::HandlerChange) -> ChangeView {
        ChangeView {
            state: c.state.clone(),
            at: c.at.clone(),
            reason: c.reason.clone(),
            module: non_empty(&c.module),
            sha256: non_empty(&c.sha256),
        }
    }
}

impl From<&pb::HandlerInfo> for HandlerView {
    fn from(h: &pb::HandlerInfo) -> HandlerView {
        let failures = h.failures.unwrap_or_default();
        HandlerView {
            slot: match (h.plugin_type.as_str(), h.resource.as_str()) {
                ("", "") => "default_policy".to_owned(),
                ("", r) => format!("resource/{r}"),
                (t, _) => format!("plugin_type/{t}"),
            },
            plugin_type: non_empty(&h.plugin_type),
            resource: non_empty(&h.resource),
            module: h.module.clone(),
            sha256: h.sha256.clone(),
            contract_version: h.contract_version.clone(),
            families: h.families.clone(),
            applied_at: non_empty(&h.applied_at),
            previous: (!h.previous_module.is_empty()).then(|| ModuleRef {
                module: h.previous_module.clone(),
                sha256: h.previous_sha256.clone(),
            }),
            calls: h.calls,
            refusals: h.refusals,
            failures: FailuresView {
                trap: failures.trap,
                deadline: failures.deadline,
                memory: failures.memory,
                fuel: failures.fuel,
                other: failures.other,
            },
            mean_us: h.has_timing.then_some(h.mean_us),
            p99_us: h.has_timing.then_some(h.p99_us),
            last_failure: h.last_failure.as_ref().map(|f| FailureView {
                at: f.at.clone(),
                kind: f.kind.clone(),
                message: f.message.clone(),
            }),
            last_change: h.last_change.as_ref().map(ChangeView::from),
            rollback_after: (!h.on_failure.is_empty()).then_some(h.rollback_after),
            on_failure: non_empty(&h.on_failure),
            on_probation: h.on_probation,
            signature: h.signature.as_ref().map(|sig| SignatureView {
                key_id: sig.key_id.clone(),
                trusted_comment: sig.trusted_comment.clone(),
            }),
            running_calls: (h.max_concurrent_calls > 0).then_some(h.running_calls),
            max_concurrent_calls: (h.max_concurrent_calls > 0).then_some(h.max_concurrent_calls),
            settings_sha256: non_empty(&h.settings_sha256),
        }
    }
}

/// `ctl handlers`: the slots, and a refusal of `handlers.toml` as a whole above them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HandlersView {
    /// One row per slot.
    pub items: Vec<HandlerView>,
    /// A refusal of the whole file (syntax, unknown key) until the next successful change.
    pub last_change: Option<ChangeView>,
}

impl From<&pb::ListHandlersResponse> for HandlersView {
    fn from(r: &pb::ListHandlersResponse) -> HandlersView {
        HandlersView {
            items: r.handlers.iter().map(HandlerView::from).collect(),
            last_change: r.last_change.as_ref().map(ChangeView::from),
        }
    }
}

impl HandlersView {
    /// The table, with a refusal of the whole file above it and each slot's refusal or
    /// rollback below it.
    pub fn table(&self) -> String {
        let mut out = String::new();
        if let Some(change) = &self.last_change {
            let _ = writeln!(
                out,
                "handlers.toml {} at {}: {}\n",
                change.state.replace('_', " "),
                change.at,
                change.reason
            );
        }
        out.push_str(&table(&self.items));
        let notes: Vec<String> = self
            .items
            .iter()
            .filter_map(|h| {
                let change = h.last_change.as_ref()?;
                (change.state != "applied").then(|| {
                    format!(
                        "{}: {} at {}: {}",
                        h.key(),
                        change.state.replace('_', " "),
                        change.at,
                        change.reason
                    )
                })
            })
            .collect();
        if !notes.is_empty() {
            out.push('\n');
            for note in notes {
                out.push_str(&note);
                out.push('\n');
            }
        }
        out
    }
}

impl HandlerView {
    fn key(&self) -> String {
        self.slot.clone()
    }
}

/// One device of a resource (in `ctl resources`); an available device of an allocate event of
/// `handler test` has the same shape.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceView {
    /// Device id.
    pub id: String,
    /// `Healthy` or `Unhealthy` (`Healthy` when an event file leaves it out).
    #[serde(default = "healthy")]
    pub health: String,
    /// NUMA nodes; empty without topology.
    #[serde(default)]
    pub numa: Vec<i64>,
}

fn healthy() -> String {
    pluglet_proto::constants::HEALTHY.to_owned()
}

impl From<&pb::DeviceInfo> for DeviceView {
    fn from(d: &pb::DeviceInfo) -> DeviceView {
        DeviceView {
            id: d.id.clone(),
            health: d.health.clone(),
            numa: d.numa.clone(),
        }
    }
}

/// A device plugin resource (`ctl resources`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceView {
    /// Extended resource name.
    pub resource: String,
    /// Every device.
    pub capacity: i64,
    /// Healthy devices.
    pub allocatable: i64,
    /// The devices in plugin order.
    pub devices: Vec<DeviceView>,
    /// Allocation policy module in force.
    pub policy: String,
    /// Plugin endpoint; `None` while no plugin is connected.
    pub endpoint: Option<String>,
    /// Whether a plugin's ListAndWatch stream is live.
    pub connected: bool,
    /// What was wrong with the plugin's last device list, or why it disconnected.
    pub last_error: Option<String>,
}

impl From<&pb::Resource> for ResourceView {
    fn from(r: &pb::Resource) -> ResourceView {
        ResourceView {
            resource: r.resource.clone(),
            capacity: r.capacity,
            allocatable: r.allocatable,
            devices: r.devices.iter().map(DeviceView::from).collect(),
            policy: r.policy.clone(),
            endpoint: non_empty(&r.endpoint),
            connected: r.connected,
            last_error: non_empty(&r.last_error),
        }
    }
}

/// Devices one container holds of one resource (`ctl allocations`, and each entry `ctl
/// sync-pods` frees).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationView {
    /// The pod's UID.
    pub pod_uid: String,
    /// The container.
    pub container: String,
    /// The resource.
    pub resource: String,
    /// The devices.
    pub device_ids: Vec<String>,
    /// CDI device names to give a container runtime (see [`AllocateResultView::cdi_names`]).
    pub cdi_names: Vec<String>,
    /// The pod's name, as the pod-resources API shows it (its UID when none was given).
    pub pod_name: String,
    /// The pod's namespace (`default` when none was given).
    pub pod_namespace: String,
}

impl From<&pb::Allocation> for AllocationView {
    fn from(a: &pb::Allocation) -> AllocationView {
        AllocationView {
            pod_uid: a.pod_uid.clone(),
            container: a.container.clone(),
            resource: a.resource.clone(),
            device_ids: a.device_ids.clone(),
            cdi_names: a.cdi_names.clone(),
            pod_name: a.pod_name.clone(),
            pod_namespace: a.pod_namespace.clone(),
        }
    }
}

/// A mount the plugin asked for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountView {
    /// Path in the container.
    pub container_path: String,
    /// Path on the host.
    pub host_path: String,
    /// Read-only mount.
    pub read_only: bool,
}

/// A device node the plugin asked for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSpecView {
    /// Path in the container.
    pub container_path: String,
    /// Path on the host.
    pub host_path: String,
    /// cgroup permissions (`r`, `w`, `m`).
    pub permissions: String,
}

/// What an allocation gave one container (`ctl allocate`): the devices and the plugin's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocateResultView {
    /// The devices chosen.
    pub device_ids: Vec<String>,
    /// Environment variables.
    pub envs: BTreeMap<String, String>,
    /// Mounts.
    pub mounts: Vec<MountView>,
    /// Device nodes.
    pub device_specs: Vec<DeviceSpecView>,
    /// Annotations.
    pub annotations: BTreeMap<String, String>,
    /// The plugin's own CDI device names (its `cdi_devices`), as it answered them.
    pub cdi_devices: Vec<String>,
    /// Every CDI device name to give a container runtime: the plugin's `cdi_devices`, then the
    /// one of the spec Pluglet wrote (none with CDI off).
    pub cdi_names: Vec<String>,
}

impl From<&pb::AllocateResponse> for AllocateResultView {
    fn from(a: &pb::AllocateResponse) -> AllocateResultView {
        let r = a.response.clone().unwrap_or_default();
        AllocateResultView {
            device_ids: a.device_ids.clone(),
            envs: sorted(&r.envs),
            mounts: r
                .mounts
                .iter()
                .map(|m| MountView {
                    container_path: m.container_path.clone(),
                    host_path: m.host_path.clone(),
                    read_only: m.read_only,
                })
                .collect(),
            device_specs: r
                .devices
                .iter()
                .map(|d| DeviceSpecView {
                    container_path: d.container_path.clone(),
                    host_path: d.host_path.clone(),
                    permissions: d.permissions.clone(),
                })
                .collect(),
            annotations: sorted(&r.annotations),
            cdi_devices: r.cdi_devices.iter().map(|c| c.name.clone()).collect(),
            cdi_names: a.cdi_names.clone(),
        }
    }
}

impl AllocateResultView {
    /// One `WHAT  VALUE` row per device list, env, mount, device node, annotation and CDI
    /// name (the plugin's own CDI names without a spec of Pluglet's when CDI is off).
    pub fn table(&self) -> String {
        let mut rows = vec![vec!["devices".to_owned(), self.device_ids.join(",")]];
        rows.extend(
            self.envs
                .iter()
                .map(|(k, v)| vec!["env".to_owned(), format!("{k}={v}")]),
        );
        rows.extend(self.mounts.iter().map(|m| {
            let ro = if m.read_only { " (ro)" } else { "" };
            vec![
                "mount".to_owned(),
                format!("{} -> {}{ro}", m.host_path, m.container_path),
            ]
        }));
        rows.extend(self.device_specs.iter().map(|d| {
            vec![
                "device".to_owned(),
                format!(
                    "{} -> {} ({})",
                    d.host_path, d.container_path, d.permissions
                ),
            ]
        }));
        rows.extend(
            self.annotations
                .iter()
                .map(|(k, v)| vec!["annotation".to_owned(), format!("{k}={v}")]),
        );
        let cdi = if self.cdi_names.is_empty() {
            &self.cdi_devices
        } else {
            &self.cdi_names
        };
        rows.extend(cdi.iter().map(|c| vec!["cdi".to_owned(), c.clone()]));
        columns(&["WHAT", "VALUE"], rows)
    }
}

/// What a release freed (`ctl release`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseResultView {
    /// Number of (container, resource) entries released.
    pub released: u32,
    /// The entries released, in the shape of `ctl allocations` items.
    #[serde(default)]
    pub freed: Vec<AllocationView>,
}

impl From<&pb::ReleaseResponse> for ReleaseResultView {
    fn from(r: &pb::ReleaseResponse) -> ReleaseResultView {
        ReleaseResultView {
            released: r.released,
            freed: r.freed.iter().map(AllocationView::from).collect(),
        }
    }
}

impl ReleaseResultView {
    /// One line naming the pod released, or saying it held nothing (so a script can tell a
    /// release that freed devices from one that found none).
    pub fn text(&self, pod_uid: &str, container: Option<&str>) -> String {
        if self.released == 0 {
            match container {
                Some(c) => {
                    format!("nothing released: container {c} of pod {pod_uid} holds no devices\n")
                }
                None => format!("nothing released: pod {pod_uid} holds no devices\n"),
            }
        } else {
            let entries = if self.released == 1 {
                "entry"
            } else {
                "entries"
            };
            let listed = if self.freed.is_empty() {
                String::new()
            } else {
                table(&self.freed)
            };
            format!(
                "{listed}released {} {entries} of pod {pod_uid}\n",
                self.released
            )
        }
    }
}

/// What `ctl sync-pods` freed, or would free with `--dry-run`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncPodsView {
    /// True when nothing was freed: `freed` is what would have been.
    pub dry_run: bool,
    /// One entry per (pod, container, resource), sorted.
    pub freed: Vec<AllocationView>,
}

impl From<&pb::SyncPodsResponse> for SyncPodsView {
    fn from(r: &pb::SyncPodsResponse) -> SyncPodsView {
        SyncPodsView {
            dry_run: r.dry_run,
            freed: r.freed.iter().map(AllocationView::from).collect(),
        }
    }
}

impl SyncPodsView {
    /// The entries as the `ctl allocations` table, then one line saying what happened.
    pub fn table(&self) -> String {
        let mut out = table(&self.freed);
        let entries = self.freed.len();
        let pods = self
            .freed
            .iter()
            .map(|a| a.pod_uid.as_str())
            .collect::<BTreeSet<_>>()
            .len();
        let what = format!(
            "{entries} {} of {pods} {}",
            if entries == 1 { "entry" } else { "entries" },
            if pods == 1 { "pod" } else { "pods" }
        );
        let _ = match (self.dry_run, entries) {
            (true, 0) => writeln!(out, "dry run: nothing would be freed"),
            (true, _) => writeln!(out, "dry run: would free {what}; nothing was freed"),
            (false, 0) => writeln!(out, "nothing to free"),
            (false, _) => writeln!(out, "freed {what}"),
        };
        out
    }
}

/// What `ctl handlers rollback` did: the slot as it is served after the rollback.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HandlerRollbackView {
    /// The slot after the rollback (`None` when the daemon did not say).
    pub handler: Option<HandlerView>,
}

/// Something that happened in the daemon (`ctl events`; the last errors of `ctl status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventView {
    /// Its number in the daemon's log; 0 for a `missed` marker.
    pub seq: u64,
    /// When it happened (RFC 3339, UTC).
    pub at: String,
    /// What happened: `registered`, `refused`, `allocated`, ... (`missed`: the follower fell
    /// behind). Named `type` because `kind` is the envelope's.
    #[serde(rename = "type")]
    pub event_type: String,
    /// What it happened to: a plugin (`TYPE NAME`), a resource, a handler slot.
    pub subject: String,
    /// A short message.
    pub message: String,
    /// For a `missed` marker: how many events went by unseen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missed: Option<u64>,
}

impl From<&pb::Event> for EventView {
    fn from(e: &pb::Event) -> EventView {
        EventView {
            seq: e.seq,
            at: e.at.clone(),
            event_type: e.kind.clone(),
            subject: e.subject.clone(),
            message: e.message.clone(),
            missed: (e.kind == "missed").then_some(e.missed),
        }
    }
}

impl EventView {
    /// One line for `ctl events --watch` (columns cannot be aligned on rows not seen yet).
    pub fn line(&self) -> String {
        format!(
            "{}  {:<19}  {}  {}\n",
            self.at,
            self.event_type,
            dash(&self.subject),
            self.message
        )
    }
}

/// A stage of the daemon (`ctl status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageView {
    /// Its name.
    pub name: String,
    /// Why it ended; `None` while it runs.
    pub ended: Option<String>,
}

/// Plugins of one type by state (`ctl status`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginCountView {
    /// Wire type string.
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// Registered.
    pub registered: u32,
    /// Refused or retrying.
    pub failing: u32,
    /// Pending or in progress.
    pub waiting: u32,
}

/// One resource's numbers (`ctl status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceSummaryView {
    /// Extended resource name.
    pub resource: String,
    /// Every device.
    pub capacity: i64,
    /// Healthy devices.
    pub allocatable: i64,
    /// Devices held by containers.
    pub allocated: i64,
    /// Whether a plugin's ListAndWatch stream is live.
    pub connected: bool,
    /// Why it is not connected, or what was wrong with the plugin's last device list (absent
    /// while all is well).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// A handler slot's module in force (`ctl status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandlerSummaryView {
    /// The slot's name: `plugin_type/CSIPlugin`, `resource/vendor.com/gpu` or
    /// `default_policy`.
    pub slot: String,
    /// `builtin:<name>` or the module's path.
    pub module: String,
    /// The module's sha256, hex.
    pub sha256: String,
}

/// The daemon on one screen (`ctl status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusView {
    /// The daemon's version.
    pub version: String,
    /// When it started (RFC 3339, UTC).
    pub started_at: String,
    /// Milliseconds since it started.
    pub uptime_ms: u64,
    /// No stage has ended.
    pub live: bool,
    /// Live and every readiness condition met.
    pub ready: bool,
    /// Readiness conditions not met yet.
    pub waiting_for: Vec<String>,
    /// The stages started so far.
    pub stages: Vec<StageView>,
    /// Plugins per type, by state, sorted by type.
    pub plugins: Vec<PluginCountView>,
    /// Device plugin resources; `None` when the daemon runs without a device manager.
    pub resources: Option<Vec<ResourceSummaryView>>,
    /// The handler module in force per slot.
    pub handlers: Vec<HandlerSummaryView>,
    /// The newest refusals and failures, newest last.
    pub last_errors: Vec<EventView>,
    /// Publishing to a Kubernetes API server; `None` when off.
    pub publishing: Option<PublishingView>,
}

/// Where publishing to a Kubernetes API server stands (`ctl status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishingView {
    /// The Node's name.
    pub node: String,
    /// The API server's URL.
    pub server: String,
    /// `starting`, `synced`, `pending`, `failing` or `waiting-for-node`.
    pub state: String,
    /// When the API objects last matched (RFC 3339, UTC); `None`: never.
    pub last_sync: Option<String>,
    /// The last round's error while failing.
    pub last_error: Option<String>,
    /// Inventory changes not yet published.
    pub pending_changes: u64,
    /// Rounds finished.
    pub rounds: u64,
    /// Rounds that failed.
    pub failures: u64,
    /// Writes sent.
    pub writes: u64,
    /// Conflicts (409) retried.
    pub conflicts: u64,
    /// What could not be published because others' data disagrees.
    pub warnings: Vec<String>,
    /// Resources published.
    pub resources: u32,
    /// CSI drivers published.
    pub csi_drivers: u32,
}

impl From<&pb::Publishing> for PublishingView {
    fn from(p: &pb::Publishing) -> PublishingView {
        PublishingView {
            node: p.node.clone(),
            server: p.server.clone(),
            state: p.state.clone(),
            last_sync: non_empty(&p.last_sync),
            last_error: non_empty(&p.last_error),
            pending_changes: p.pending_changes,
            rounds: p.rounds,
            failures: p.failures,
            writes: p.writes,
            conflicts: p.conflicts,
            warnings: p.warnings.clone(),
            resources: p.resources,
            csi_drivers: p.csi_drivers,
        }
    }
}

impl From<&pb::GetStatusResponse> for StatusView {
    fn from(r: &pb::GetStatusResponse) -> StatusView {
        let mut plugins: BTreeMap<String, PluginCountView> = BTreeMap::new();
        for c in &r.plugins {
            let row = plugins
                .entry(c.r#type.clone())
                .or_insert_with(|| PluginCountView {
                    plugin_type: c.r#type.clone(),
                    ..PluginCountView::default()
                });
            match c.state.as_str() {
                "registered" => row.registered += c.count,
                "failing" => row.failing += c.count,
                _ => row.waiting += c.count,
            }
        }
        StatusView {
            version: r.version.clone(),
            started_at: r.started_at.clone(),
            uptime_ms: r.uptime_ms,
            live: r.live,
            ready: r.ready,
            waiting_for: r.waiting_for.clone(),
            stages: r
                .stages
                .iter()
                .map(|s| StageView {
                    name: s.name.clone(),
                    ended: non_empty(&s.ended),
                })
                .collect(),
            plugins: plugins.into_values().collect(),
            resources: r.devices.then(|| {
                r.resources
                    .iter()
                    .map(|x| ResourceSummaryView {
                        resource: x.resource.clone(),
                        capacity: x.capacity,
                        allocatable: x.allocatable,
                        allocated: x.allocated,
                        connected: x.connected,
                        last_error: non_empty(&x.last_error),
                    })
                    .collect()
            }),
            handlers: r
                .handlers
                .iter()
                .map(|h| HandlerSummaryView {
                    slot: h.slot.clone(),
                    module: h.module.clone(),
                    sha256: h.sha256.clone(),
                })
                .collect(),
            last_errors: r.last_errors.iter().map(EventView::from).collect(),
            publishing: r.publishing.as_ref().map(PublishingView::from),
        }
    }
}

impl StatusView {
    /// The screen: version and uptime, readiness, then one table per part.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let uptime = std::time::Duration::from_secs(self.uptime_ms / 1000);
        let _ = writeln!(
            out,
            "pluglet {}, up {} (since {})",
            self.version,
            humantime::format_duration(uptime),
            self.started_at
        );
        let ended: Vec<String> = self
            .stages
            .iter()
            .filter_map(|s| Some(format!("{} ended: {}", s.name, s.ended.as_deref()?)))
            .collect();
        let readiness = match (self.live, self.ready) {
            (true, true) => "ready".to_owned(),
            (true, false) => format!("not ready: waiting for {}", self.waiting_for.join(", ")),
            (false, _) => format!("not live: {}", ended.join("; ")),
        };
        let _ = writeln!(out, "{readiness}");

        out.push_str("\nPLUGINS\n");
        if self.plugins.is_empty() {
            out.push_str("none\n");
        } else {
            out.push_str(&columns(
                &["TYPE", "REGISTERED", "FAILING", "WAITING"],
                self.plugins
                    .iter()
                    .map(|p| {
                        vec![
                            p.plugin_type.clone(),
                            p.registered.to_string(),
                            p.failing.to_string(),
                            p.waiting.to_string(),
                        ]
                    })
                    .collect(),
            ));
        }

        out.push_str("\nRESOURCES\n");
        match &self.resources {
            None => out.push_str("no device manager\n"),
            Some(r) if r.is_empty() => out.push_str("none\n"),
            Some(resources) => out.push_str(&columns(
                &[
                    "RESOURCE",
                    "CAPACITY",
                    "ALLOCATABLE",
                    "ALLOCATED",
                    "CONNECTED",
                ],
                resources
                    .iter()
                    .map(|r| {
                        vec![
                            r.resource.clone(),
                            r.capacity.to_string(),
                            r.allocatable.to_string(),
                            r.allocated.to_string(),
                            r.connected.to_string(),
                        ]
                    })
                    .collect(),
            )),
        }
        for r in self.resources.iter().flatten() {
            if let Some(why) = &r.last_error {
                let _ = writeln!(out, "{}: {why}", r.resource);
            }
        }

        out.push_str("\nHANDLERS\n");
        out.push_str(&columns(
            &["SLOT", "MODULE", "SHA256"],
            self.handlers
                .iter()
                .map(|h| {
                    vec![
                        h.slot.clone(),
                        h.module.clone(),
                        h.sha256.chars().take(12).collect(),
                    ]
                })
                .collect(),
        ));

        if let Some(p) = &self.publishing {
            out.push_str("\nPUBLISHING\n");
            let _ = writeln!(
                out,
                "node {} to {}: {}, last sync {}; {} resources, {} CSI drivers; {} pending \
                 changes, {} writes, {} conflicts, {} of {} rounds failed",
                p.node,
                p.server,
                p.state,
                p.last_sync.as_deref().unwrap_or("never"),
                p.resources,
                p.csi_drivers,
                p.pending_changes,
                p.writes,
                p.conflicts,
                p.failures,
                p.rounds,
            );
            if let Some(e) = &p.last_error {
                let _ = writeln!(out, "error: {e}");
            }
            for w in &p.warnings {
                let _ = writeln!(out, "warning: {w}");
            }
        }

        out.push_str("\nLAST ERRORS\n");
        if self.last_errors.is_empty() {
            out.push_str("none\n");
        } else {
            out.push_str(&table(&self.last_errors));
        }
        out
    }
}

impl Kind for StatusView {
    const KIND: &'static str = "Status";
}

impl Kind for EventView {
    const KIND: &'static str = "Event";
}

impl Kind for HandlersView {
    const KIND: &'static str = "HandlerList";
}

impl Kind for HandlerRollbackView {
    const KIND: &'static str = "HandlerRollback";
}

impl Kind for AllocateResultView {
    const KIND: &'static str = "AllocateResult";
}

impl Kind for ReleaseResultView {
    const KIND: &'static str = "ReleaseResult";
}

impl Kind for SyncPodsView {
    const KIND: &'static str = "SyncPodsResult";
}

impl Listed for PluginView {
    const LIST_KIND: &'static str = "PluginList";
}

impl Listed for SocketView {
    const LIST_KIND: &'static str = "SocketList";
}

impl Listed for ResourceView {
    const LIST_KIND: &'static str = "ResourceList";
}

impl Listed for AllocationView {
    const LIST_KIND: &'static str = "AllocationList";
}

impl Listed for EventView {
    const LIST_KIND: &'static str = "EventList";
}

/// A view listed one per row by `pluglet ctl`.
pub trait Table {
    /// Column titles.
    const HEADER: &'static [&'static str];
    /// The cells of this row, one per column.
    fn row(&self) -> Vec<String>;
}

impl Table for PluginView {
    const HEADER: &'static [&'static str] = &[
        "NAME",
        "TYPE",
        "DOOR",
        "VERSION",
        "NODE ID",
        "ENDPOINT",
        "HANDLER",
        "REGISTERED AT",
    ];
    fn row(&self) -> Vec<String> {
        vec![
            self.name.clone(),
            self.plugin_type.clone(),
            dash(&self.door),
            dash(self.version.as_deref().unwrap_or_default()),
            dash(self.node_id.as_deref().unwrap_or_default()),
            self.endpoint.clone(),
            self.handler.clone(),
            self.registered_at.clone(),
        ]
    }
}

impl Table for SocketView {
    const HEADER: &'static [&'static str] =
        &["PATH", "STATE", "ATTEMPTS", "TYPE", "NAME", "LAST ERROR"];
    fn row(&self) -> Vec<String> {
        vec![
            self.path.clone(),
            self.state.clone(),
            self.attempts.to_string(),
            dash(self.plugin_type.as_deref().unwrap_or_default()),
            dash(self.plugin_name.as_deref().unwrap_or_default()),
            dash(self.last_error.as_deref().unwrap_or_default()),
        ]
    }
}

impl Table for HandlerView {
    const HEADER: &'static [&'static str] = &[
        "SLOT", "MODULE", "SHA256", "CALLS", "RUNNING", "FAILED", "P99", "PREVIOUS", "CHANGE",
    ];
    fn row(&self) -> Vec<String> {
        let failed = self.failures.trap
            + self.failures.deadline
            + self.failures.memory
            + self.failures.fuel
            + self.failures.other;
        vec![
            self.key(),
            self.module.clone(),
            {
                let mut version: String = self.sha256.chars().take(12).collect();
                if let Some(sig) = &self.signature {
                    version.push_str(&format!(
                        " signed:{} \"{}\"",
                        sig.key_id, sig.trusted_comment
                    ));
                }
                if let Some(hash) = &self.settings_sha256 {
                    version.push_str(&format!(" settings:{hash}"));
                }
                version
            },
            self.calls.to_string(),
            match (self.running_calls, self.max_concurrent_calls) {
                (Some(running), Some(limit)) => format!("{running}/{limit}"),
                _ => "-".to_owned(),
            },
            failed.to_string(),
            self.p99_us
                .map_or_else(|| "-".to_owned(), |us| format!("{us}µs")),
            self.previous.as_ref().map_or_else(
                || "-".to_owned(),
                |p| {
                    format!(
                        "{} ({})",
                        p.module,
                        p.sha256.chars().take(12).collect::<String>()
                    )
                },
            ),
            self.last_change
                .as_ref()
                .map_or_else(|| "-".to_owned(), |c| c.state.clone()),
        ]
    }
}

impl Table for ResourceView {
    const HEADER: &'static [&'static str] = &[
        "RESOURCE",
        "CAPACITY",
        "ALLOCATABLE",
        "CONNECTED",
        "POLICY",
        "LAST ERROR",
    ];
    fn row(&self) -> Vec<String> {
        vec![
            self.resource.clone(),
            self.capacity.to_string(),
            self.allocatable.to_string(),
            self.connected.to_string(),
            self.policy.clone(),
            dash(self.last_error.as_deref().unwrap_or_default()),
        ]
    }
}

impl Table for AllocationView {
    const HEADER: &'static [&'static str] = &["POD", "CONTAINER", "RESOURCE", "DEVICES", "CDI"];
    fn row(&self) -> Vec<String> {
        vec![
            self.pod_uid.clone(),
            self.container.clone(),
            self.resource.clone(),
            self.device_ids.join(","),
            dash(&self.cdi_names.join(",")),
        ]
    }
}

impl Table for EventView {
    const HEADER: &'static [&'static str] = &["TIME", "KIND", "SUBJECT", "MESSAGE"];
    fn row(&self) -> Vec<String> {
        vec![
            self.at.clone(),
            self.event_type.clone(),
            dash(&self.subject),
            self.message.clone(),
        ]
    }
}

/// `items` as aligned columns under `T::HEADER`.
pub fn table<T: Table>(items: &[T]) -> String {
    columns(T::HEADER, items.iter().map(Table::row).collect())
}

/// Left-aligned columns separated by two spaces; the last column is not padded.
pub fn columns(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(&rows) {
        let last = row.len().saturating_sub(1);
        for (i, (cell, w)) in row.iter().zip(&widths).enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                let _ = write!(out, "{cell:<w$}  ");
            }
        }
        out.push('\n');
    }
    out
}

/// `value` as pretty JSON with a final newline.
pub fn json<T: Serialize + ?Sized>(value: &T) -> String {
    let mut s = serde_json::to_string_pretty(value).unwrap_or_else(|_| "null".to_owned());
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use pluglet_proto::v1beta1;
    use serde::de::DeserializeOwned;
    use serde_json::{Value, json};

    fn csi_plugin() -> pb::Plugin {
        pb::Plugin {
            name: "hostpath.csi.k8s.io".into(),
            r#type: "CSIPlugin".into(),
            endpoint: "/r/csi.sock".into(),
            versions: vec!["1.0.0".into()],
            version: "1.0.0".into(),
            handler: "builtin:csi".into(),
            registered_at: "2026-11-29T16:00:00.000Z".into(),
            socket_path: "/r/plugins_registry/reg.sock".into(),
            door: "registry".into(),
            csi: Some(pb::CsiNodeInfo {
                node_id: "node-1".into(),
                max_volumes_per_node: 16,
                topology: [("topology.kubernetes.io/zone".to_owned(), "z1".to_owned())].into(),
            }),
        }
    }

    fn plugins() -> Vec<PluginView> {
        let mut dp = csi_plugin();
        dp.name = "vendor.com/gpu".into();
        dp.r#type = "DevicePlugin".into();
        dp.csi = None;
        dp.version = String::new();
        vec![(&csi_plugin()).into(), (&dp).into()]
    }

    fn sockets() -> Vec<SocketView> {
        let registered = pb::SocketStatus {
            path: "/r/plugins_registry/a.sock".into(),
            state: "registered".into(),
            attempts: 1,
            last_error: String::new(),
            plugin_type: "CSIPlugin".into(),
            plugin_name: "a".into(),
            next_retry_ms: 0,
        };
        let retrying = pb::SocketStatus {
            path: "/r/plugins_registry/b.sock".into(),
            state: "retrying".into(),
            attempts: 3,
            last_error: "GetInfo failed: connection refused".into(),
            next_retry_ms: 400,
            ..Default::default()
        };
        vec![(&registered).into(), (&retrying).into()]
    }

    fn handlers() -> Vec<HandlerView> {
        let csi = pb::HandlerInfo {
            plugin_type: "CSIPlugin".into(),
            resource: String::new(),
            module: "builtin:csi".into(),
            sha256: "ab".repeat(32),
            contract_version: "1.2.0".into(),
            families: vec!["registration".into()],
            applied_at: "2026-12-01T00:00:00.000Z".into(),
            calls: 12,
            has_timing: true,
            mean_us: 40.5,
            p99_us: 90,
            ..Default::default()
        };
        let policy = pb::HandlerInfo {
            plugin_type: String::new(),
            resource: "vendor.com/gpu".into(),
            module: "/h/spread.wasm".into(),
            sha256: "cd".repeat(32),
            contract_version: "1.1.0".into(),
            families: vec!["allocation-policy".into()],
            applied_at: "2026-12-01T00:00:00.000Z".into(),
            previous_module: "/h/old.wasm".into(),
            previous_sha256: "ef".repeat(32),
            calls: 3,
            failures: Some(pb::HandlerFailures {
                trap: 1,
                ..Default::default()
            }),
            last_failure: Some(pb::HandlerFailure {
                at: "2026-12-01T00:00:01.000Z".into(),
                kind: "trap".into(),
                message: "trapped".into(),
            }),
            last_change: Some(pb::HandlerChange {
                state: "refused".into(),
                at: "2026-12-01T00:00:02.000Z".into(),
                reason: "the module file is missing".into(),
                module: "/h/spread.wasm".into(),
                sha256: String::new(),
            }),
            rollback_after: 3,
            on_failure: "fail".into(),
            on_probation: true,
            running_calls: 1,
            max_concurrent_calls: 2,
            ..Default::default()
        };
        let default = pb::HandlerInfo {
            resource: String::new(),
            module: "builtin:device-plugin".into(),
            ..policy.clone()
        };
        vec![(&csi).into(), (&policy).into(), (&default).into()]
    }

    fn resources() -> Vec<ResourceView> {
        let connected = pb::Resource {
            resource: "vendor.com/gpu".into(),
            capacity: 2,
            allocatable: 1,
            devices: vec![
                pb::DeviceInfo {
                    id: "d0".into(),
                    health: "Healthy".into(),
                    numa: vec![0],
                },
                pb::DeviceInfo {
                    id: "d1".into(),
                    health: "Unhealthy".into(),
                    numa: vec![],
                },
            ],
            policy: "builtin:device-plugin".into(),
            endpoint: "/r/device-plugins/gpu.sock".into(),
            connected: true,
            last_error: String::new(),
        };
        let gone = pb::Resource {
            resource: "vendor.com/nic".into(),
            endpoint: String::new(),
            connected: false,
            last_error: "disconnected: ListAndWatch stream ended".into(),
            ..connected.clone()
        };
        vec![(&connected).into(), (&gone).into()]
    }

    fn allocations() -> Vec<AllocationView> {
        [
            ("pod-1", "a", &["d0", "d2"][..]),
            ("pod-2", "b", &["d1"][..]),
        ]
        .into_iter()
        .map(|(pod, container, ids)| {
            (&pb::Allocation {
                pod_uid: pod.into(),
                container: container.into(),
                resource: "vendor.com/gpu".into(),
                device_ids: ids.iter().map(|s| s.to_string()).collect(),
                cdi_names: vec![format!("vendor.com/gpu=pluglet-{pod}_{container}")],
                pod_name: pod.into(),
                pod_namespace: "default".into(),
            })
                .into()
        })
        .collect()
    }

    fn allocate_answer() -> pb::AllocateResponse {
        pb::AllocateResponse {
            device_ids: vec!["d0".into()],
            response: Some(v1beta1::ContainerAllocateResponse {
                envs: [("A".to_string(), "1".to_string())].into(),
                mounts: vec![v1beta1::Mount {
                    container_path: "/c".into(),
                    host_path: "/h".into(),
                    read_only: true,
                }],
                devices: vec![v1beta1::DeviceSpec {
                    container_path: "/dev/x".into(),
                    host_path: "/dev/null".into(),
                    permissions: "rw".into(),
                }],
                annotations: [("k".to_string(), "v".to_string())].into(),
                cdi_devices: vec![v1beta1::CdiDevice {
                    name: "vendor.com/gpu=d0".into(),
                }],
            }),
            cdi_names: vec![
                "vendor.com/gpu=d0".into(),
                "vendor.com/gpu=pluglet-p_c".into(),
            ],
        }
    }

    fn sync_pods(dry_run: bool) -> SyncPodsView {
        let freed = allocations()
            .iter()
            .map(|a| pb::Allocation {
                pod_uid: a.pod_uid.clone(),
                container: a.container.clone(),
                resource: a.resource.clone(),
                device_ids: a.device_ids.clone(),
                cdi_names: a.cdi_names.clone(),
                pod_name: a.pod_name.clone(),
                pod_namespace: a.pod_namespace.clone(),
            })
            .collect();
        (&pb::SyncPodsResponse { freed, dry_run }).into()
    }

    /// What a reader of the writer's JSON gets back.
    fn round_trip<T: Serialize + DeserializeOwned>(value: &T) -> T {
        let text = json(value);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }

    /// Every list view: JSON parses back to the same views, and the table rendered from what
    /// the JSON says is the table rendered from the views, one row per item.
    fn check_list<T>(items: Vec<T>)
    where
        T: Serialize + DeserializeOwned + Table + PartialEq + std::fmt::Debug,
    {
        let back: Vec<T> = round_trip(&items);
        assert_eq!(back, items);
        let text = table(&items);
        assert_eq!(table(&back), text);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), items.len() + 1, "{text}");
        assert!(lines[0].starts_with(T::HEADER[0]), "{text}");
        for (line, item) in lines[1..].iter().zip(&items) {
            let row = item.row();
            let cells: Vec<&str> = line.split("  ").filter(|c| !c.is_empty()).collect();
            let cells: Vec<&str> = cells.iter().map(|c| c.trim()).collect();
            assert_eq!(cells, row, "{text}");
        }
    }

    #[test]
    fn list_views_round_trip_and_tables_show_the_json_rows() {
        check_list(plugins());
        check_list(sockets());
        check_list(handlers());
        check_list(resources());
        check_list(allocations());
        let devices = resources().remove(0).devices;
        assert_eq!(round_trip(&devices), devices);
    }

    #[test]
    fn result_views_round_trip_and_tables_show_the_json_rows() {
        let allocated = AllocateResultView::from(&allocate_answer());
        let back = round_trip(&allocated);
        assert_eq!(back, allocated);
        assert_eq!(back.table(), allocated.table());
        assert_eq!(
            allocated.table(),
            "WHAT        VALUE\n\
             devices     d0\n\
             env         A=1\n\
             mount       /h -> /c (ro)\n\
             device      /dev/null -> /dev/x (rw)\n\
             annotation  k=v\n\
             cdi         vendor.com/gpu=d0\n\
             cdi         vendor.com/gpu=pluglet-p_c\n"
        );

        let released = ReleaseResultView {
            released: 2,
            freed: Vec::new(),
        };
        assert_eq!(round_trip(&released), released);
        assert_eq!(released.text("p", None), "released 2 entries of pod p\n");
        let nothing = ReleaseResultView {
            released: 0,
            freed: Vec::new(),
        };
        assert_eq!(
            nothing.text("p", None),
            "nothing released: pod p holds no devices\n"
        );
        assert_eq!(
            nothing.text("p", Some("c")),
            "nothing released: container c of pod p holds no devices\n"
        );

        for dry_run in [false, true] {
            let synced = sync_pods(dry_run);
            let back = round_trip(&synced);
            assert_eq!(back, synced);
            assert_eq!(back.table(), synced.table());
            let text = synced.table();
            let rows: Vec<&str> = text.lines().collect();
            assert_eq!(rows.len(), synced.freed.len() + 2, "{text}");
            assert_eq!(&text[..table(&synced.freed).len()], table(&synced.freed));
        }
    }

    #[test]
    fn sync_pods_table_says_what_happened() {
        let freed = sync_pods(false).table();
        assert!(freed.ends_with("\nfreed 2 entries of 2 pods\n"), "{freed}");
        assert!(
            freed.contains(
                "pod-1  a          vendor.com/gpu  d0,d2    vendor.com/gpu=pluglet-pod-1_a\n"
            ),
            "{freed}"
        );
        let dry = sync_pods(true).table();
        assert!(
            dry.ends_with("\ndry run: would free 2 entries of 2 pods; nothing was freed\n"),
            "{dry}"
        );
        let nothing = SyncPodsView {
            dry_run: false,
            freed: Vec::new(),
        };
        assert_eq!(
            nothing.table(),
            "POD  CONTAINER  RESOURCE  DEVICES  CDI\nnothing to free\n"
        );
        assert_eq!(
            serde_json::to_value(&nothing).unwrap(),
            json!({"dry_run": false, "freed": []})
        );
    }

    #[test]
    fn plugin_json_has_flat_csi_keys_and_wire_strings() {
        let v = serde_json::to_value(PluginView::from(&csi_plugin())).unwrap();
        assert_eq!(v["type"], "CSIPlugin");
        assert_eq!(v["node_id"], "node-1");
        assert_eq!(v["max_volumes_per_node"], 16);
        assert_eq!(v["topology"]["topology.kubernetes.io/zone"], "z1");
        assert_eq!(v["versions"], json!(["1.0.0"]));
        let mut dp = csi_plugin();
        dp.csi = None;
        dp.version = String::new();
        let v = serde_json::to_value(PluginView::from(&dp)).unwrap();
        assert!(v.get("node_id").is_none());
        assert_eq!(v["version"], Value::Null);
    }

    #[test]
    fn allocate_json_has_the_documented_keys() {
        assert_eq!(
            serde_json::to_value(AllocateResultView::from(&allocate_answer())).unwrap(),
            json!({
                "device_ids": ["d0"],
                "envs": {"A": "1"},
                "mounts": [{"container_path": "/c", "host_path": "/h", "read_only": true}],
                "device_specs": [{"container_path": "/dev/x", "host_path": "/dev/null", "permissions": "rw"}],
                "annotations": {"k": "v"},
                "cdi_devices": ["vendor.com/gpu=d0"],
                "cdi_names": ["vendor.com/gpu=d0", "vendor.com/gpu=pluglet-p_c"],
            })
        );
    }

    /// The keys scripts read: exactly the ones `pluglet ctl -o json` has always printed.
    #[test]
    fn json_keys_are_the_ones_scripts_read() {
        fn keys<T: Serialize>(value: &T) -> Vec<String> {
            match serde_json::to_value(value).unwrap() {
                Value::Object(map) => {
                    let mut keys: Vec<String> = map.keys().cloned().collect();
                    keys.sort();
                    keys
                }
                other => panic!("not an object: {other}"),
            }
        }
        assert_eq!(
            keys(&plugins()[0]),
            [
                "door",
                "endpoint",
                "handler",
                "max_volumes_per_node",
                "name",
                "node_id",
                "registered_at",
                "socket_path",
                "topology",
                "type",
                "version",
                "versions"
            ]
        );
        assert_eq!(
            keys(&sockets()[1]),
            [
                "attempts",
                "last_error",
                "next_retry_ms",
                "path",
                "plugin_name",
                "plugin_type",
                "state"
            ]
        );
        assert_eq!(
            serde_json::to_value(&sockets()[1]).unwrap()["plugin_type"],
            Value::Null
        );
        assert_eq!(
            keys(&handlers()[0]),
            [
                "applied_at",
                "calls",
                "contract_version",
                "failures",
                "families",
                "last_change",
                "last_failure",
                "mean_us",
                "module",
                "on_failure",
                "on_probation",
                "p99_us",
                "plugin_type",
                "previous",
                "refusals",
                "resource",
                "rollback_after",
                "sha256",
                "signature",
                "slot"
            ]
        );
        assert_eq!(
            serde_json::to_value(&handlers()[0]).unwrap()["max_concurrent_calls"],
            Value::Null,
            "a built-in is not limited"
        );
        let text = table(&handlers());
        let cells = |line: usize| -> Vec<String> {
            let line = text.lines().nth(line).unwrap();
            line.split("  ")
                .filter(|c| !c.is_empty())
                .map(|c| c.trim().to_owned())
                .collect()
        };
        assert_eq!(cells(2)[4], "1/2", "running / max_concurrent_calls: {text}");
        assert_eq!(cells(1)[4], "-", "a built-in: {text}");
        assert_eq!(
            keys(&resources()[1]),
            [
                "allocatable",
                "capacity",
                "connected",
                "devices",
                "endpoint",
                "last_error",
                "policy",
                "resource"
            ]
        );
        assert_eq!(
            serde_json::to_value(&resources()[1]).unwrap()["endpoint"],
            Value::Null
        );
        assert_eq!(keys(&resources()[0].devices[0]), ["health", "id", "numa"]);
        assert_eq!(
            keys(&allocations()[0]),
            [
                "cdi_names",
                "container",
                "device_ids",
                "pod_name",
                "pod_namespace",
                "pod_uid",
                "resource"
            ]
        );
        assert_eq!(
            keys(&ReleaseResultView {
                released: 1,
                freed: Vec::new()
            }),
            ["freed", "released"]
        );
    }

    #[test]
    fn table_aligns_columns() {
        let t = columns(&["A", "LONG"], vec![vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "A    LONG\nxyz  1\n");
    }

    #[test]
    fn handler_table_names_what_each_module_is_for() {
        let text = table(&handlers());
        let first: Vec<&str> = text
            .lines()
            .skip(1)
            .map(|l| l.split("  ").next().unwrap())
            .collect();
        assert_eq!(
            first,
            [
                "plugin_type/CSIPlugin",
                "resource/vendor.com/gpu",
                "default_policy"
            ]
        );
    }

    #[test]
    fn a_verified_signature_shows_its_key_id_and_trusted_comment() {
        let signed = pb::HandlerInfo {
            resource: "vendor.com/gpu".into(),
            module: "/h/spread.wasm".into(),
            sha256: "cd".repeat(32),
            signature: Some(pb::HandlerSignature {
                key_id: "745C5BF2302F34A".into(),
                trusted_comment: "spread-policy 1.2.0".into(),
            }),
            ..Default::default()
        };
        let view = HandlerView::from(&signed);
        assert_eq!(
            serde_json::to_value(&view).unwrap()["signature"],
            serde_json::json!({"key_id": "745C5BF2302F34A", "trusted_comment": "spread-policy 1.2.0"})
        );
        assert!(
            table(&[view]).contains("cdcdcdcdcdcd signed:745C5BF2302F34A"),
            "{}",
            table(&[HandlerView::from(&signed)])
        );
        assert_eq!(
            serde_json::to_value(&handlers()[0]).unwrap()["signature"],
            Value::Null
        );
    }

    fn event(seq: u64, kind: &str, subject: &str) -> pb::Event {
        pb::Event {
            seq,
            at: format!("2026-12-01T00:00:0{seq}.000Z"),
            kind: kind.into(),
            subject: subject.into(),
            message: format!("{kind} {subject}"),
            missed: 0,
        }
    }

    #[test]
    fn every_json_output_carries_the_version_and_its_kind() {
        let list: Value = serde_json::from_str(&json_list(plugins())).unwrap();
        assert_eq!(list["api_version"], "pluglet/v1");
        assert_eq!(list["kind"], "PluginList");
        assert_eq!(list["items"].as_array().unwrap().len(), 2);
        assert_eq!(list["items"][0]["name"], "hostpath.csi.k8s.io");
        let kinds = [
            serde_json::from_str::<Value>(&json_list(sockets())).unwrap()["kind"].clone(),
            serde_json::from_str::<Value>(&json_list(resources())).unwrap()["kind"].clone(),
            serde_json::from_str::<Value>(&json_list(allocations())).unwrap()["kind"].clone(),
            serde_json::from_str::<Value>(&json_list(Vec::<EventView>::new())).unwrap()["kind"]
                .clone(),
        ];
        assert_eq!(
            kinds,
            ["SocketList", "ResourceList", "AllocationList", "EventList"]
        );

        let released: Value = serde_json::from_str(&json_of(&ReleaseResultView {
            released: 2,
            freed: Vec::new(),
        }))
        .unwrap();
        assert_eq!(
            released,
            json!({"api_version": "pluglet/v1", "kind": "ReleaseResult", "released": 2, "freed": []})
        );
        let handlers = HandlersView {
            items: handlers(),
            last_change: None,
        };
        let back: Envelope<HandlersView> = serde_json::from_str(&json_of(&handlers)).unwrap();
        assert_eq!(back, Envelope::new(handlers));
        assert_eq!(back.kind, "HandlerList");
    }

    #[test]
    fn a_json_line_is_one_enveloped_object_on_one_line() {
        let view = EventView::from(&event(1, "allocated", "vendor.com/gpu"));
        let line = json_line_of(&view);
        assert!(
            line.ends_with('\n') && line.trim_end().lines().count() == 1,
            "{line}"
        );
        assert_eq!(
            serde_json::from_str::<Value>(&line).unwrap(),
            json!({
                "api_version": "pluglet/v1",
                "kind": "Event",
                "seq": 1,
                "at": "2026-12-01T00:00:01.000Z",
                "type": "allocated",
                "subject": "vendor.com/gpu",
                "message": "allocated vendor.com/gpu",
            })
        );
        let missed = EventView::from(&pb::Event {
            kind: "missed".into(),
            missed: 7,
            ..event(0, "missed", "")
        });
        assert_eq!(serde_json::to_value(&missed).unwrap()["missed"], 7);
    }

    #[test]
    fn events_list_newest_last_as_a_table() {
        let events: Vec<EventView> = [
            event(1, "registered", "DevicePlugin gpu"),
            event(2, "allocated", "vendor.com/gpu"),
        ]
        .iter()
        .map(EventView::from)
        .collect();
        check_list(events.clone());
        let text = table(&events);
        assert!(text.starts_with("TIME"), "{text}");
        assert!(text.lines().nth(2).unwrap().contains("allocated"), "{text}");
    }

    fn status() -> pb::GetStatusResponse {
        pb::GetStatusResponse {
            version: "0.1.0".into(),
            started_at: "2026-12-01T00:00:00.000Z".into(),
            uptime_ms: 3_723_000,
            live: true,
            ready: false,
            waiting_for: vec!["registry-scanned".into()],
            stages: vec![pb::StageStatus {
                name: "watcher".into(),
                ended: String::new(),
            }],
            plugins: vec![
                pb::PluginCount {
                    r#type: "CSIPlugin".into(),
                    state: "registered".into(),
                    count: 2,
                },
                pb::PluginCount {
                    r#type: "CSIPlugin".into(),
                    state: "failing".into(),
                    count: 1,
                },
                pb::PluginCount {
                    r#type: "DevicePlugin".into(),
                    state: "waiting".into(),
                    count: 1,
                },
            ],
            resources: vec![pb::ResourceSummary {
                resource: "vendor.com/gpu".into(),
                capacity: 4,
                allocatable: 3,
                allocated: 2,
                connected: true,
                last_error: String::new(),
            }],
            handlers: vec![pb::HandlerSummary {
                slot: "CSIPlugin".into(),
                module: "builtin:csi".into(),
                sha256: "ab".repeat(32),
            }],
            last_errors: vec![event(3, "refused", "CSIPlugin bad")],
            devices: true,
            publishing: Some(pb::Publishing {
                node: "node-a".into(),
                server: "https://10.0.0.1:6443/".into(),
                state: "failing".into(),
                last_sync: "2026-12-01T00:00:01.000Z".into(),
                last_error: "patch Node status node-a: 403".into(),
                pending_changes: 2,
                rounds: 9,
                failures: 3,
                writes: 6,
                conflicts: 1,
                warnings: vec!["Node label zone is \"a\"".into()],
                resources: 1,
                csi_drivers: 1,
            }),
        }
    }

    #[test]
    fn status_counts_plugins_per_type_and_shows_every_part() {
        let view = StatusView::from(&status());
        assert_eq!(round_trip(&view), view);
        let v: Value = serde_json::from_str(&json_of(&view)).unwrap();
        assert_eq!(v["kind"], "Status");
        assert_eq!(v["api_version"], "pluglet/v1");
        assert_eq!(
            v["plugins"],
            json!([
                {"type": "CSIPlugin", "registered": 2, "failing": 1, "waiting": 0},
                {"type": "DevicePlugin", "registered": 0, "failing": 0, "waiting": 1},
            ])
        );
        assert_eq!(v["resources"][0]["allocated"], 2);
        assert_eq!(v["last_errors"][0]["type"], "refused");
        let text = view.text();
        assert!(
            text.starts_with("pluglet 0.1.0, up 1h 2m 3s (since 2026-12-01T00:00:00.000Z)\n"),
            "{text}"
        );
        assert!(
            text.contains("not ready: waiting for registry-scanned\n"),
            "{text}"
        );
        assert!(
            text.contains("\nCSIPlugin     2           1        0\n"),
            "{text}"
        );
        assert!(
            text.contains("vendor.com/gpu  4         3            2"),
            "{text}"
        );
        assert!(text.contains("builtin:csi  abababababab\n"), "{text}");
        assert!(text.contains("refused  CSIPlugin bad"), "{text}");
        assert_eq!(v["publishing"]["state"], "failing");
        assert_eq!(v["publishing"]["pending_changes"], 2);
        assert!(
            text.contains(
                "PUBLISHING\nnode node-a to https://10.0.0.1:6443/: failing, last sync \
                 2026-12-01T00:00:01.000Z; 1 resources, 1 CSI drivers; 2 pending changes, 6 \
                 writes, 1 conflicts, 3 of 9 rounds failed\nerror: patch Node status node-a: \
                 403\nwarning: Node label zone is \"a\"\n"
            ),
            "{text}"
        );

        let bare = StatusView::from(&pb::GetStatusResponse {
            devices: false,
            resources: Vec::new(),
            publishing: None,
            ..status()
        });
        assert!(!bare.text().contains("PUBLISHING"));
        assert_eq!(
            serde_json::to_value(&bare).unwrap()["resources"],
            Value::Null
        );
        assert!(bare.text().contains("RESOURCES\nno device manager\n"));
    }
}
