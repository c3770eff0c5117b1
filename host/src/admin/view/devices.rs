//! The device manager's views: resources and their devices (`ctl resources`), allocations
//! (`ctl allocations`), and what allocate, release and sync-pods did.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use pluglet_proto::admin::v1 as pb;
use serde::{Deserialize, Serialize};

use super::{Kind, Listed, Table, columns, dash, non_empty, sorted, table};

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

impl TryFrom<&pb::AllocateResponse> for AllocateResultView {
    type Error = prost::DecodeError;

    /// Fails when the plugin's answer in it does not decode.
    fn try_from(a: &pb::AllocateResponse) -> Result<AllocateResultView, prost::DecodeError> {
        let r = match &a.response {
            Some(r) => r.decode()?,
            None => Default::default(),
        };
        Ok(AllocateResultView {
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
        })
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

impl Kind for AllocateResultView {
    const KIND: &'static str = "AllocateResult";
}

impl Kind for ReleaseResultView {
    const KIND: &'static str = "ReleaseResult";
}

impl Kind for SyncPodsView {
    const KIND: &'static str = "SyncPodsResult";
}

impl Listed for ResourceView {
    const LIST_KIND: &'static str = "ResourceList";
}

impl Listed for AllocationView {
    const LIST_KIND: &'static str = "AllocationList";
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
