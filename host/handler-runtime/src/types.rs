//! Plain Rust mirrors of the WIT types of `pluglet:handler` (guest-sdk/wit/handler.wit).
//!
//! The records that cross the boundary unchanged derive wasmtime's `ComponentType`, `Lift` and
//! `Lower` with the WIT names, so a call lowers them straight from the caller's references (no copy
//! into generated types). [`RegistrationFacts`] differs from its WIT form (a map instead of a sorted
//! list of key-values) and is converted in [`crate::handler`].

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use wasmtime::component::{ComponentType, Lift, Lower};

use crate::columns::{ListColumn, ListRun, TextColumn, TextRun};

/// What a plugin said about itself in GetInfo (or in a device plugin Register).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ComponentType, Lift, Lower)]
#[component(record)]
pub struct PluginInfo {
    /// Wire type string, for example `CSIPlugin` or `DevicePlugin`.
    #[component(name = "plugin-type")]
    pub plugin_type: String,
    /// Name, unique per type (CSI driver name, extended resource name).
    pub name: String,
    /// Socket serving the type-specific API.
    pub endpoint: String,
    /// Versions of the type-specific API the plugin supports.
    #[component(name = "supported-versions")]
    pub supported_versions: Vec<String>,
}

/// A plugin already registered under the same type and name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ComponentType, Lift, Lower)]
#[component(record)]
pub struct RegisteredPlugin {
    /// What it said when it registered.
    pub info: PluginInfo,
    /// The version its handler chose, if any.
    pub version: Option<String>,
}

/// What a handler decided when it accepted a plugin.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ComponentType, Lift, Lower)]
#[component(record)]
pub struct Accepted {
    /// The chosen version of the type-specific API, if the handler chooses one.
    pub version: Option<String>,
}

/// Why a handler refused. `Display` gives the WIT (kebab-case) name.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ComponentType, Lift, Lower,
)]
#[serde(rename_all = "snake_case")]
#[component(enum)]
#[repr(u8)]
pub enum RefusalKind {
    /// No supported version is acceptable.
    #[component(name = "unsupported-version")]
    UnsupportedVersion,
    /// The plugin's or resource's name is not acceptable.
    #[component(name = "invalid-name")]
    InvalidName,
    /// Another plugin already holds the name and may not be replaced.
    #[component(name = "already-registered")]
    AlreadyRegistered,
    /// The endpoint is not acceptable.
    #[component(name = "invalid-endpoint")]
    InvalidEndpoint,
    /// Facts the host gathered (for example NodeGetInfo) are not acceptable.
    #[component(name = "invalid-facts")]
    InvalidFacts,
    /// The request cannot be met (for example too few devices).
    #[component(name = "unsatisfiable")]
    Unsatisfiable,
    /// Anything else.
    #[component(name = "other")]
    Other,
}

impl RefusalKind {
    /// The WIT (kebab-case) name of this kind.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalKind::UnsupportedVersion => "unsupported-version",
            RefusalKind::InvalidName => "invalid-name",
            RefusalKind::AlreadyRegistered => "already-registered",
            RefusalKind::InvalidEndpoint => "invalid-endpoint",
            RefusalKind::InvalidFacts => "invalid-facts",
            RefusalKind::Unsatisfiable => "unsatisfiable",
            RefusalKind::Other => "other",
        }
    }
}

impl fmt::Display for RefusalKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// A refusal: a normal outcome of a hook, not a fault. `Display` gives the message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ComponentType, Lift, Lower)]
#[component(record)]
pub struct Refusal {
    /// What kind of refusal this is.
    pub kind: RefusalKind,
    /// A message for people: what was wrong and what to do.
    pub message: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Refusal {}

/// What the host learned natively while registering a plugin (for CSI: NodeGetInfo).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistrationFacts {
    /// CSI: NodeGetInfo's node id.
    pub node_id: Option<String>,
    /// CSI: NodeGetInfo's maximum volumes per node (0: no limit given).
    pub max_volumes_per_node: Option<i64>,
    /// CSI: NodeGetInfo's accessible topology segments.
    #[serde(default)]
    pub topology: BTreeMap<String, String>,
}

/// A device offered to an allocation policy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ComponentType, Lift, Lower)]
#[component(record)]
pub struct CandidateDevice {
    /// Device id as the plugin reported it.
    pub id: String,
    /// NUMA nodes the device is attached to; empty when it has no topology.
    #[component(name = "numa-nodes")]
    #[serde(default)]
    pub numa_nodes: Vec<i64>,
}

/// The devices offered to an allocation policy, in order, kept in columns: every id one after
/// another in one string with where each ends, and the NUMA nodes likewise. This is the form
/// `allocate-packed` (contract 1.2.0) takes, so a request crosses into the guest as a few
/// copies of memory, and building one costs no allocation per device.
///
/// Serialized (conformance vectors, `pluglet handler test` events) as a list of [`CandidateDevice`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "Vec<CandidateDevice>", into = "Vec<CandidateDevice>")]
pub struct Candidates {
    ids: TextColumn,
    numa: ListColumn<i64>,
}

impl Candidates {
    /// Room for `devices` devices whose ids take about `id_bytes` bytes in all (and one NUMA
    /// node each).
    pub fn with_capacity(devices: usize, id_bytes: usize) -> Candidates {
        Candidates {
            ids: TextColumn::with_capacity(devices, id_bytes),
            numa: ListColumn::with_capacity(devices, devices),
        }
    }

    /// Adds a device.
    pub fn push(&mut self, id: &str, numa_nodes: &[i64]) {
        self.ids.push(id);
        self.numa.push(numa_nodes);
    }

    /// Adds the devices of `run`, cut from columns of this same form: one copy per column
    /// instead of one per device.
    pub fn extend_from_columns(&mut self, run: ColumnRun<'_>) {
        self.ids.extend_from(run.ids);
        self.numa.extend_from(run.numa);
    }

    /// How many devices.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Each device's id and NUMA nodes, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &[i64])> + '_ {
        (0..self.len()).map(|at| (self.ids.get(at), self.numa.get(at)))
    }

    /// The ids, in order.
    pub fn ids(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.len()).map(|at| self.ids.get(at))
    }
}

/// Consecutive devices cut from columns in the form [`Candidates`] holds, for
/// [`Candidates::extend_from_columns`]: their ids and their NUMA nodes, one run of each.
#[derive(Clone, Copy, Debug)]
pub struct ColumnRun<'a> {
    /// The devices' ids.
    pub ids: TextRun<'a>,
    /// Each device's NUMA nodes (one list per id).
    pub numa: ListRun<'a, i64>,
}

impl FromIterator<CandidateDevice> for Candidates {
    fn from_iter<I: IntoIterator<Item = CandidateDevice>>(devices: I) -> Candidates {
        let mut candidates = Candidates::default();
        for device in devices {
            candidates.push(&device.id, &device.numa_nodes);
        }
        candidates
    }
}

impl From<Vec<CandidateDevice>> for Candidates {
    fn from(devices: Vec<CandidateDevice>) -> Candidates {
        devices.into_iter().collect()
    }
}

impl From<Candidates> for Vec<CandidateDevice> {
    fn from(candidates: Candidates) -> Vec<CandidateDevice> {
        candidates
            .iter()
            .map(|(id, numa)| CandidateDevice {
                id: id.to_owned(),
                numa_nodes: numa.to_vec(),
            })
            .collect()
    }
}

/// One container's request for devices of one resource.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationRequest {
    /// Extended resource name.
    pub resource: String,
    /// Healthy devices held by no other container.
    pub available: Candidates,
    /// Ids that must be part of the answer.
    #[serde(default)]
    pub must_include: Vec<String>,
    /// How many ids to choose.
    pub count: u32,
    /// The plugin's GetPreferredAllocation answer, when it offers one.
    #[serde(default)]
    pub preferred: Option<Vec<String>>,
}

/// [`AllocationRequest`] as `allocate` (contract 1.1.0) takes it: a string and a list per
/// device. Made only for components built before `allocate-packed` existed.
#[derive(Clone, Debug, PartialEq, Eq, ComponentType, Lower)]
#[component(record)]
pub(crate) struct ListedRequest {
    resource: String,
    available: Vec<CandidateDevice>,
    #[component(name = "must-include")]
    must_include: Vec<String>,
    count: u32,
    preferred: Option<Vec<String>>,
}

impl From<&AllocationRequest> for ListedRequest {
    fn from(request: &AllocationRequest) -> ListedRequest {
        ListedRequest {
            resource: request.resource.clone(),
            available: request.available.clone().into(),
            must_include: request.must_include.clone(),
            count: request.count,
            preferred: request.preferred.clone(),
        }
    }
}

/// [`AllocationRequest`] as `allocate-packed` (contract 1.2.0) takes it: the candidates'
/// columns, borrowed, so lowering it copies each column once, straight into the guest.
#[derive(Clone, Copy, Debug, ComponentType, Lower)]
#[component(record)]
pub(crate) struct PackedRequest<'a> {
    resource: &'a str,
    ids: &'a str,
    #[component(name = "id-ends")]
    id_ends: &'a [u32],
    #[component(name = "numa-nodes")]
    numa_nodes: &'a [i64],
    #[component(name = "numa-ends")]
    numa_ends: &'a [u32],
    #[component(name = "must-include")]
    must_include: &'a [String],
    count: u32,
    preferred: Option<&'a [String]>,
}

impl<'a> From<&'a AllocationRequest> for PackedRequest<'a> {
    fn from(request: &'a AllocationRequest) -> PackedRequest<'a> {
        let columns = &request.available;
        PackedRequest {
            resource: &request.resource,
            ids: columns.ids.text(),
            id_ends: columns.ids.ends(),
            numa_nodes: columns.numa.items(),
            numa_ends: columns.numa.ends(),
            must_include: &request.must_include,
            count: request.count,
            preferred: request.preferred.as_deref(),
        }
    }
}

/// A hook family: one exported interface of the contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// `validate`, `register`, `deregister`.
    Registration,
    /// `allocate`.
    AllocationPolicy,
}

impl Family {
    /// The interface name in the WIT package (`registration`, `allocation-policy`).
    pub fn interface(self) -> &'static str {
        match self {
            Family::Registration => "registration",
            Family::AllocationPolicy => "allocation-policy",
        }
    }

    /// The family that an interface name of the contract denotes, if any.
    pub fn from_interface(name: &str) -> Option<Family> {
        match name {
            "registration" => Some(Family::Registration),
            "allocation-policy" => Some(Family::AllocationPolicy),
            _ => None,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.interface())
    }
}

/// A hook: one function of a family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Hook {
    /// `registration.validate`.
    Validate,
    /// `registration.register`.
    Register,
    /// `registration.deregister`.
    Deregister,
    /// `allocation-policy.allocate`.
    Allocate,
}

impl Hook {
    /// The WIT function name.
    pub fn as_str(self) -> &'static str {
        match self {
            Hook::Validate => "validate",
            Hook::Register => "register",
            Hook::Deregister => "deregister",
            Hook::Allocate => "allocate",
        }
    }

    /// The family this hook belongs to.
    pub fn family(self) -> Family {
        match self {
            Hook::Validate | Hook::Register | Hook::Deregister => Family::Registration,
            Hook::Allocate => Family::AllocationPolicy,
        }
    }
}

impl fmt::Display for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// Per-call context the host passes to a hook (read by the guest through host imports).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CallContext {
    /// The node's name, answered by the `node-name` import.
    pub node_name: String,
}

/// The result of one hook call, with what the guest logged and how long the call took.
#[derive(Clone, Debug, PartialEq)]
pub struct Call<T> {
    /// What the hook returned.
    pub value: T,
    /// Lines the guest logged during the call, in order.
    pub logs: Vec<GuestLog>,
    /// Wall time of the call: instantiation plus the hook itself.
    pub elapsed: std::time::Duration,
    /// Fuel the call used (instantiation plus the hook itself).
    pub fuel_used: u64,
}

/// Level of a guest log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogLevel {
    /// Very verbose.
    Trace,
    /// Verbose.
    Debug,
    /// Normal.
    Info,
    /// Something looks wrong.
    Warn,
    /// Something failed.
    Error,
}

impl fmt::Display for LogLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            LogLevel::Trace => "trace",
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
        })
    }
}

/// One line a guest logged through the `log` import (also emitted via tracing, target
/// `pluglet::guest`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestLog {
    /// Its level.
    pub level: LogLevel,
    /// Its text.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(id: &str, numa: &[i64]) -> CandidateDevice {
        CandidateDevice {
            id: id.into(),
            numa_nodes: numa.to_vec(),
        }
    }

    #[test]
    fn columns_are_added_as_the_same_devices_one_by_one() {
        let devices: [(&str, &[i64]); 5] = [
            ("a", &[0]),
            ("bb", &[]),
            ("é", &[1, 2]),
            ("", &[3]),
            ("dd", &[]),
        ];
        let mut source = Candidates::with_capacity(0, 0);
        for (id, numa) in devices {
            source.push(id, numa);
        }
        // Cut devices 1..4 out of the source's columns, and add them after one pushed device.
        let run = ColumnRun {
            ids: source.ids.run(1..4),
            numa: source.numa.run(1..4),
        };
        let mut candidates = Candidates::with_capacity(0, 0);
        candidates.push("x", &[9]);
        candidates.extend_from_columns(run);
        let mut expected = Candidates::with_capacity(0, 0);
        expected.push("x", &[9]);
        for (id, numa) in &devices[1..4] {
            expected.push(id, numa);
        }
        assert_eq!(
            candidates.iter().collect::<Vec<_>>(),
            expected.iter().collect::<Vec<_>>()
        );
        assert_eq!(candidates.len(), 4);
    }

    #[test]
    fn candidates_give_back_each_device_as_pushed() {
        let devices = vec![
            device("gpu-0", &[0]),
            device("g", &[]),
            device("long-device-name-2", &[0, 1]),
            device("x", &[]),
            device("y", &[3]),
        ];
        let candidates = Candidates::from(devices.clone());
        assert_eq!(candidates.len(), 5);
        let listed: Vec<(&str, &[i64])> = candidates.iter().collect();
        let expected: Vec<(&str, &[i64])> = devices
            .iter()
            .map(|d| (d.id.as_str(), d.numa_nodes.as_slice()))
            .collect();
        assert_eq!(listed, expected);
        assert_eq!(Vec::<CandidateDevice>::from(candidates), devices);
        assert!(Candidates::default().is_empty());
        assert_eq!(Candidates::default().iter().count(), 0);
    }

    #[test]
    fn candidates_read_and_write_as_a_list_of_devices() {
        let text = r#"[{"id":"a","numa_nodes":[0]},{"id":"b"}]"#;
        let candidates: Candidates = serde_json::from_str(text).unwrap();
        assert_eq!(
            candidates,
            Candidates::from(vec![device("a", &[0]), device("b", &[])])
        );
        assert_eq!(
            serde_json::to_string(&candidates).unwrap(),
            r#"[{"id":"a","numa_nodes":[0]},{"id":"b","numa_nodes":[]}]"#
        );
    }
}
