//! A CDI spec for one allocation, made from the device plugin's Allocate answer for the
//! container, and the checks a runtime makes of it.
//!
//! Mapping: each env becomes `KEY=VALUE`; each device spec a device node (`path` the container
//! path, `hostPath` only when it differs, `permissions` as the plugin gave them); each mount a
//! bind mount (`options` `bind`, plus `ro` when read-only: runc refuses a mount with no type
//! and no `bind`). Annotations have no container edit in CDI and device annotations need
//! cdiVersion 0.6.0, which the runtimes of Debian 12 refuse, so they are left out. The
//! plugin's own `cdi_devices` are names, not edits: they are passed through, not written.
//!
//! The rule of the hand-off: refuse only what a runtime cannot apply or CDI cannot express
//! (`docs/kubelet-compatibility.md`, "Allocate answers handed to a runtime"). Identical entries
//! are one edit: plugins that answer one spec per device often repeat the same node (one
//! `/dev/null` or one control device for every device), and the runtime a kubelet hands them
//! to creates that node once. What is refused names the entries involved: one container path
//! given two different host paths or permissions (or, for a mount, two host paths or two
//! read-only settings), a path that is not absolute, permissions other than `r`, `w` and `m`,
//! an env name that is empty or holds `=`.

use std::borrow::Cow;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::names::{self, Kind};
use crate::answer::AnswerView;
use crate::devices::IdHasher;

/// A CDI spec file's content. Its device nodes borrow the plugin's answer they were made from
/// (an allocation of 1,024 devices makes 1,024 of them), and own their strings when read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spec<'a> {
    /// The lowest CDI version that carries the content (see [`Spec::required_version`]).
    #[serde(rename = "cdiVersion")]
    pub cdi_version: String,
    /// `vendor/class`.
    pub kind: String,
    /// The devices of the kind this file defines.
    pub devices: Vec<SpecDevice<'a>>,
}

/// One named device of a spec (an entry of CDI's `devices`) and its edits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecDevice<'a> {
    /// The name after `=` in `vendor/class=name`.
    pub name: String,
    /// What the runtime adds to the container.
    #[serde(rename = "containerEdits")]
    pub container_edits: ContainerEdits<'a>,
}

/// The edits of one device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerEdits<'a> {
    /// `KEY=VALUE` entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes.
    #[serde(rename = "deviceNodes", default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode<'a>>,
    /// Mounts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount<'a>>,
}

impl ContainerEdits<'_> {
    /// True when there is nothing for a runtime to do.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.mounts.is_empty()
    }
}

/// A device node to create in the container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceNode<'a> {
    /// Path in the container.
    pub path: Cow<'a, str>,
    /// Path on the host, when it differs (cdiVersion 0.5.0).
    #[serde(rename = "hostPath", default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<Cow<'a, str>>,
    /// Cgroup permissions, some of `r`, `w` and `m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<Cow<'a, str>>,
}

impl DeviceNode<'_> {
    /// A runtime's checks of one node: absolute paths, permissions of `r`, `w` and `m`.
    fn check(&self) -> Result<(), SpecError> {
        absolute("device node container path", &self.path)?;
        if let Some(host) = &self.host_path {
            absolute("device node host path", host)?;
        }
        if let Some(p) = &self.permissions
            && (p.is_empty() || !p.chars().all(|c| matches!(c, 'r' | 'w' | 'm')))
        {
            return Err(SpecError::Permissions {
                path: self.path.to_string(),
                permissions: p.to_string(),
            });
        }
        Ok(())
    }

    /// The node as an error message of [`Spec::validate`] shows it.
    #[cfg(test)]
    fn describe(&self) -> String {
        format!(
            "{{path: {:?}, hostPath: {:?}, permissions: {:?}}}",
            self.path,
            self.host_path.as_deref().unwrap_or(&self.path),
            self.permissions.as_deref().unwrap_or("")
        )
    }
}

/// A bind mount.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mount<'a> {
    /// Path on the host.
    #[serde(rename = "hostPath")]
    pub host_path: Cow<'a, str>,
    /// Path in the container.
    #[serde(rename = "containerPath")]
    pub container_path: Cow<'a, str>,
    /// Mount options.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<Cow<'a, str>>,
}

impl Mount<'_> {
    /// A runtime's checks of one mount: absolute paths.
    fn check(&self) -> Result<(), SpecError> {
        absolute("mount host path", &self.host_path)?;
        absolute("mount container path", &self.container_path)
    }
}

/// Why an Allocate answer cannot be handed to a runtime as CDI.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// An env key is empty or holds `=` or NUL, or its value holds NUL.
    #[error(
        "env {0:?} cannot be set in a container (empty key, or '=' or NUL in the key, or NUL in the value)"
    )]
    Env(String),
    /// A path is empty or relative.
    #[error("{what} {path:?} is not an absolute path")]
    Path {
        /// Which path.
        what: &'static str,
        /// The path.
        path: String,
    },
    /// Device permissions other than `r`, `w`, `m`.
    #[error(
        "device {path:?} has permissions {permissions:?}; only the letters r, w and m are allowed"
    )]
    Permissions {
        /// The device's container path.
        path: String,
        /// The permissions.
        permissions: String,
    },
    /// Two different device specs at one container path.
    #[error(
        "two different device specs at {path:?} in the container: {first} and {second}; a container path can hold only one device node"
    )]
    DuplicateNode {
        /// The container path.
        path: String,
        /// The first spec, as the plugin gave it.
        first: String,
        /// The other one.
        second: String,
    },
    /// Two different mounts at one container path.
    #[error(
        "two different mounts at {path:?} in the container: {first} and {second}; a container path can be mounted from only one host path"
    )]
    DuplicateMount {
        /// The container path.
        path: String,
        /// The first mount, as the plugin gave it.
        first: String,
        /// The other one.
        second: String,
    },
    /// The kind or a device name breaks CDI's syntax (a bug in the naming).
    #[error("{0:?} is not a valid CDI name")]
    Name(String),
    /// Two devices of the file share a name.
    #[error("the device name {0:?} appears twice")]
    DuplicateDevice(String),
}

impl Spec<'_> {
    /// Appends the spec as compact JSON to `out`: the bytes `serde_json` writes for it (size
    /// `out` with [`Spec::json_len_hint`]).
    ///
    /// Written by hand because a spec is written on every allocation and `serde_json` looks
    /// at each byte of each string against its escape table (about 130 instructions per
    /// string of a spec); here a string that needs no escaping (paths, names, most env
    /// values) is checked in a pass the compiler vectorizes and copied whole, and the rest is
    /// escaped as `serde_json` escapes it. The bytes stay `serde_json`'s, so that the specs an
    /// earlier version wrote read as current at start and are not written again. A test holds
    /// the two to the same bytes.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"cdiVersion\":");
        put_str(out, &self.cdi_version);
        out.extend_from_slice(b",\"kind\":");
        put_str(out, &self.kind);
        out.extend_from_slice(b",\"devices\":");
        put_array(out, &self.devices, |out, device| {
            out.extend_from_slice(b"{\"name\":");
            put_str(out, &device.name);
            out.extend_from_slice(b",\"containerEdits\":");
            device.container_edits.put_json(out);
            out.push(b'}');
        });
        out.push(b'}');
    }
}

impl ContainerEdits<'_> {
    /// The edits as [`Spec::write_json`] writes them.
    fn put_json(&self, out: &mut Vec<u8>) {
        out.push(b'{');
        let mut first = true;
        let mut field = |out: &mut Vec<u8>, name: &[u8]| {
            if !first {
                out.push(b',');
            }
            first = false;
            out.extend_from_slice(name);
        };
        if !self.env.is_empty() {
            field(out, b"\"env\":");
            put_array(out, &self.env, |out, env| put_str(out, env));
        }
        if !self.device_nodes.is_empty() {
            field(out, b"\"deviceNodes\":");
            put_array(out, &self.device_nodes, |out, node| {
                out.extend_from_slice(b"{\"path\":");
                put_str(out, &node.path);
                if let Some(host) = &node.host_path {
                    out.extend_from_slice(b",\"hostPath\":");
                    put_str(out, host);
                }
                if let Some(permissions) = &node.permissions {
                    out.extend_from_slice(b",\"permissions\":");
                    put_str(out, permissions);
                }
                out.push(b'}');
            });
        }
        if !self.mounts.is_empty() {
            field(out, b"\"mounts\":");
            put_array(out, &self.mounts, |out, mount| {
                out.extend_from_slice(b"{\"hostPath\":");
                put_str(out, &mount.host_path);
                out.extend_from_slice(b",\"containerPath\":");
                put_str(out, &mount.container_path);
                if !mount.options.is_empty() {
                    out.extend_from_slice(b",\"options\":");
                    put_array(out, &mount.options, |out, option| put_str(out, option));
                }
                out.push(b'}');
            });
        }
        out.push(b'}');
    }
}

/// `items` as a JSON array, each written by `put`.
fn put_array<T>(out: &mut Vec<u8>, items: &[T], mut put: impl FnMut(&mut Vec<u8>, &T)) {
    out.push(b'[');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        put(out, item);
    }
    out.push(b']');
}

/// `s` as a JSON string, escaped as `serde_json` escapes it: `"` and `\` with a backslash,
/// the control characters below 0x20 by their short escape where JSON has one and as
/// `\u00XX` otherwise; everything else (all of UTF-8 above them) as it is.
fn put_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    // Every byte looked at, none skipped: a loop the compiler vectorizes.
    let plain = s.as_bytes().iter().fold(true, |plain, &b| {
        plain & (b >= 0x20) & (b != b'"') & (b != b'\\')
    });
    if plain {
        out.extend_from_slice(s.as_bytes());
    } else {
        for &b in s.as_bytes() {
            match b {
                b'"' => out.extend_from_slice(b"\\\""),
                b'\\' => out.extend_from_slice(b"\\\\"),
                0x08 => out.extend_from_slice(b"\\b"),
                b'\t' => out.extend_from_slice(b"\\t"),
                b'\n' => out.extend_from_slice(b"\\n"),
                0x0c => out.extend_from_slice(b"\\f"),
                b'\r' => out.extend_from_slice(b"\\r"),
                0..0x20 => {
                    const HEX: &[u8; 16] = b"0123456789abcdef";
                    out.extend_from_slice(b"\\u00");
                    out.push(HEX[usize::from(b >> 4)]);
                    out.push(HEX[usize::from(b & 0xf)]);
                }
                _ => out.push(b),
            }
        }
    }
    out.push(b'"');
}

impl<'a> Spec<'a> {
    /// About how many bytes the spec takes as JSON: its strings, and for each field its name,
    /// quotes and punctuation. An allocation of 1,024 devices writes a spec of hundreds of
    /// kilobytes; sized once, its buffer is not grown and copied a dozen times on the way.
    pub fn json_len_hint(&self) -> usize {
        /// A field's name with its quotes, colon and comma, and a value's quotes, at most.
        const FIELD: usize = 20;
        fn strings(list: &[impl AsRef<str>]) -> usize {
            list.iter().map(|s| s.as_ref().len() + 3).sum()
        }
        let optional = |s: &Option<Cow<'_, str>>| s.as_ref().map_or(0, |s| s.len() + FIELD);
        let devices: usize = self
            .devices
            .iter()
            .map(|device| {
                let edits = &device.container_edits;
                let nodes: usize = edits
                    .device_nodes
                    .iter()
                    .map(|n| {
                        FIELD + n.path.len() + optional(&n.host_path) + optional(&n.permissions)
                    })
                    .sum();
                let mounts: usize = edits
                    .mounts
                    .iter()
                    .map(|m| {
                        3 * FIELD + m.host_path.len() + m.container_path.len() + strings(&m.options)
                    })
                    .sum();
                5 * FIELD + device.name.len() + strings(&edits.env) + nodes + mounts
            })
            .sum();
        3 * FIELD + self.cdi_version.len() + self.kind.len() + devices
    }

    /// The spec of one allocation: `kind`, one device `name` with the edits of `answer`.
    /// `None` when the answer has nothing a runtime could apply (no envs, devices or mounts).
    pub fn for_allocation(
        kind: &Kind,
        name: &str,
        answer: &AnswerView<'a>,
    ) -> Result<Option<Spec<'a>>, SpecError> {
        let mut env: Vec<String> = answer
            .envs
            .iter()
            .map(|(k, v)| [k, "=", v].concat())
            .collect();
        env.sort();
        let device_nodes = merged(
            &answer.devices,
            |d| d.container_path,
            |d| {
                format!(
                    "{{container_path: {:?}, host_path: {:?}, permissions: {:?}}}",
                    d.container_path, d.host_path, d.permissions
                )
            },
            |path, first, second| SpecError::DuplicateNode {
                path,
                first,
                second,
            },
        )?
        .map(|d| {
            let node = DeviceNode {
                path: Cow::Borrowed(d.container_path),
                host_path: (d.host_path != d.container_path).then_some(Cow::Borrowed(d.host_path)),
                permissions: (!d.permissions.is_empty()).then_some(Cow::Borrowed(d.permissions)),
            };
            node.check()?;
            Ok(node)
        })
        .collect::<Result<_, SpecError>>()?;
        let mounts = merged(
            &answer.mounts,
            |m| m.container_path,
            |m| {
                format!(
                    "{{container_path: {:?}, host_path: {:?}, read_only: {}}}",
                    m.container_path, m.host_path, m.read_only
                )
            },
            |path, first, second| SpecError::DuplicateMount {
                path,
                first,
                second,
            },
        )?
        .map(|m| {
            let mount = Mount {
                host_path: Cow::Borrowed(m.host_path),
                container_path: Cow::Borrowed(m.container_path),
                options: if m.read_only {
                    vec![Cow::Borrowed("ro"), Cow::Borrowed("bind")]
                } else {
                    vec![Cow::Borrowed("bind")]
                },
            };
            mount.check()?;
            Ok(mount)
        })
        .collect::<Result<_, SpecError>>()?;
        let edits = ContainerEdits {
            env,
            device_nodes,
            mounts,
        };
        for (key, value) in &answer.envs {
            if key.is_empty() || key.contains(['=', '\0']) || value.contains('\0') {
                return Err(SpecError::Env(format!("{key}={value}")));
            }
        }
        if edits.is_empty() {
            return Ok(None);
        }
        let mut spec = Spec {
            cdi_version: String::new(),
            kind: [kind.vendor.as_str(), "/", &kind.class].concat(),
            devices: vec![SpecDevice {
                name: name.to_owned(),
                container_edits: edits,
            }],
        };
        spec.cdi_version = spec.required_version().to_owned();
        // The edits were checked as they were made (each container path once, by the merge).
        spec.validate_names()?;
        Ok(Some(spec))
    }

    /// The lowest cdiVersion that carries this spec: `0.5.0` when a device node has a host
    /// path or a device name starts with a digit, `0.6.0` when the class holds a `.`, else
    /// `0.3.0` (the oldest version runtimes still read).
    pub fn required_version(&self) -> &'static str {
        let class = self.kind.split_once('/').map_or("", |(_, c)| c);
        if class.contains('.') {
            return "0.6.0";
        }
        let v050 = self.devices.iter().any(|d| {
            d.name.starts_with(|c: char| !c.is_ascii_alphabetic())
                || d.container_edits
                    .device_nodes
                    .iter()
                    .any(|n| n.host_path.is_some())
        });
        if v050 { "0.5.0" } else { "0.3.0" }
    }

    /// The checks a CDI runtime makes of a spec file: valid kind and device names, no device
    /// name twice, absolute paths, device permissions of `r`, `w` and `m`, `KEY=VALUE` envs.
    /// The tests' judge of what [`Spec::for_allocation`] makes, which checks each part as it
    /// makes it instead.
    #[cfg(test)]
    pub(crate) fn validate(&self) -> Result<(), SpecError> {
        self.validate_names()?;
        for device in &self.devices {
            let edits = &device.container_edits;
            for env in &edits.env {
                match env.split_once('=') {
                    Some((key, value))
                        if !key.is_empty() && !key.contains('\0') && !value.contains('\0') => {}
                    _ => return Err(SpecError::Env(env.clone())),
                }
            }
            let mut paths = HashMap::with_hasher(IdHasher::default());
            for node in &edits.device_nodes {
                node.check()?;
                if let Some(first) = paths.insert(&*node.path, node) {
                    return Err(SpecError::DuplicateNode {
                        path: node.path.to_string(),
                        first: first.describe(),
                        second: node.describe(),
                    });
                }
            }
            for mount in &edits.mounts {
                mount.check()?;
            }
        }
        Ok(())
    }

    /// The name checks of [`Spec::validate`]: valid kind and device names, no device name twice.
    fn validate_names(&self) -> Result<(), SpecError> {
        let (vendor, class) = self
            .kind
            .split_once('/')
            .ok_or_else(|| SpecError::Name(self.kind.clone()))?;
        if !names::valid_vendor(vendor) || !names::valid_class(class, true) {
            return Err(SpecError::Name(self.kind.clone()));
        }
        // A spec of one allocation defines one device: no set of names to make for it.
        let mut seen = HashSet::with_hasher(IdHasher::default());
        for device in &self.devices {
            if !names::valid_device_name(&device.name) {
                return Err(SpecError::Name(format!("{}={}", self.kind, device.name)));
            }
            if self.devices.len() > 1 && !seen.insert(device.name.as_str()) {
                return Err(SpecError::DuplicateDevice(device.name.clone()));
            }
        }
        Ok(())
    }
}

/// The entries of `all` once each, in first-seen order: an entry equal to one before it is
/// dropped (one edit), one at the same container path (`at`) but different is refused with
/// `conflict(path, first, second)`, both as `show` renders them. A short list (what most
/// answers have) is compared pair by pair, without a map or a list of its own.
fn merged<T: PartialEq>(
    all: &[T],
    at: impl Fn(&T) -> &str,
    show: impl Fn(&T) -> String,
    conflict: impl Fn(String, String, String) -> SpecError,
) -> Result<impl Iterator<Item = &T>, SpecError> {
    let refuse = |first: &T, entry: &T| conflict(at(first).to_string(), show(first), show(entry));
    let dropped = if all.len() <= 64 {
        let mut dropped = 0u64;
        for (i, entry) in all.iter().enumerate() {
            let first = (0..i).find(|&j| dropped & (1 << j) == 0 && at(&all[j]) == at(entry));
            if let Some(j) = first {
                if all[j] != *entry {
                    return Err(refuse(&all[j], entry));
                }
                dropped |= 1 << i;
            }
        }
        Dropped::Bits(dropped)
    } else {
        let mut first_at: HashMap<&str, usize, IdHasher> =
            HashMap::with_capacity_and_hasher(all.len(), IdHasher::default());
        let mut dropped = vec![false; all.len()];
        for (i, entry) in all.iter().enumerate() {
            match first_at.entry(at(entry)) {
                Entry::Vacant(v) => {
                    v.insert(i);
                }
                Entry::Occupied(o) => {
                    let first = &all[*o.get()];
                    if first != entry {
                        return Err(refuse(first, entry));
                    }
                    dropped[i] = true;
                }
            }
        }
        Dropped::List(dropped)
    };
    Ok(all
        .iter()
        .enumerate()
        .filter(move |&(i, _)| !dropped.has(i))
        .map(|(_, e)| e))
}

/// Which entries [`merged`] dropped: a bit each for a short list.
enum Dropped {
    Bits(u64),
    List(Vec<bool>),
}

impl Dropped {
    fn has(&self, i: usize) -> bool {
        match self {
            Dropped::Bits(bits) => bits & (1 << i) != 0,
            Dropped::List(list) => list[i],
        }
    }
}

fn absolute(what: &'static str, path: &str) -> Result<(), SpecError> {
    if path.starts_with('/') {
        Ok(())
    } else {
        Err(SpecError::Path {
            what,
            path: path.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arbitrary_spec() -> impl proptest::strategy::Strategy<Value = Spec<'static>> {
        use proptest::prelude::*;
        let text = || any::<String>();
        let cow = || text().prop_map(Cow::Owned);
        let node = (
            cow(),
            proptest::option::of(cow()),
            proptest::option::of(cow()),
        )
            .prop_map(|(path, host_path, permissions)| DeviceNode {
                path,
                host_path,
                permissions,
            });
        let mount = (cow(), cow(), proptest::collection::vec(cow(), 0..3)).prop_map(
            |(host_path, container_path, options)| Mount {
                host_path,
                container_path,
                options,
            },
        );
        let edits = (
            proptest::collection::vec(text(), 0..3),
            proptest::collection::vec(node, 0..3),
            proptest::collection::vec(mount, 0..3),
        )
            .prop_map(|(env, device_nodes, mounts)| ContainerEdits {
                env,
                device_nodes,
                mounts,
            });
        let device = (text(), edits).prop_map(|(name, container_edits)| SpecDevice {
            name,
            container_edits,
        });
        (text(), text(), proptest::collection::vec(device, 0..3)).prop_map(
            |(cdi_version, kind, devices)| Spec {
                cdi_version,
                kind,
                devices,
            },
        )
    }

    proptest::proptest! {
        #[test]
        fn the_spec_s_json_is_the_bytes_serde_json_writes(spec in arbitrary_spec()) {
            let mut written = Vec::new();
            spec.write_json(&mut written);
            proptest::prop_assert_eq!(
                String::from_utf8(written).unwrap(),
                serde_json::to_string(&spec).unwrap()
            );
        }
    }

    #[test]
    fn every_ascii_byte_is_escaped_as_serde_json_escapes_it() {
        let all: String = (0u8..0x80)
            .map(char::from)
            .chain(['é', '€', '😀'])
            .collect();
        let mut written = Vec::new();
        put_str(&mut written, &all);
        assert_eq!(written, serde_json::to_vec(&all).unwrap());
    }
    use pluglet_proto::v1beta1::{
        CdiDevice, ContainerAllocateResponse, DeviceSpec, Mount as PluginMount,
    };

    fn answer() -> ContainerAllocateResponse {
        ContainerAllocateResponse {
            envs: [
                ("VENDOR_DEVICES".to_owned(), "d0,d1".to_owned()),
                ("A".to_owned(), "x=y".to_owned()),
            ]
            .into(),
            mounts: vec![
                PluginMount {
                    container_path: "/var/run/vendor".into(),
                    host_path: "/tmp/vendor".into(),
                    read_only: true,
                },
                PluginMount {
                    container_path: "/data".into(),
                    host_path: "/srv/data".into(),
                    read_only: false,
                },
            ],
            devices: vec![
                DeviceSpec {
                    container_path: "/dev/vendor/d0".into(),
                    host_path: "/dev/null".into(),
                    permissions: "rw".into(),
                },
                DeviceSpec {
                    container_path: "/dev/fuse".into(),
                    host_path: "/dev/fuse".into(),
                    permissions: String::new(),
                },
            ],
            annotations: [("vendor.com/devices".to_owned(), "d0,d1".to_owned())].into(),
            cdi_devices: vec![CdiDevice {
                name: "vendor.com/gpu=d0".into(),
            }],
        }
    }

    fn kind() -> Kind {
        names::kind_of("vendor.com/gpu")
    }

    #[test]
    fn an_answer_becomes_edits() {
        let answer = answer();
        let spec = Spec::for_allocation(&kind(), "pluglet-p_c", &AnswerView::of(&answer))
            .unwrap()
            .unwrap();
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "cdiVersion": "0.5.0",
                "kind": "vendor.com/gpu",
                "devices": [{
                    "name": "pluglet-p_c",
                    "containerEdits": {
                        "env": ["A=x=y", "VENDOR_DEVICES=d0,d1"],
                        "deviceNodes": [
                            {"path": "/dev/vendor/d0", "hostPath": "/dev/null", "permissions": "rw"},
                            {"path": "/dev/fuse"}
                        ],
                        "mounts": [
                            {"hostPath": "/tmp/vendor", "containerPath": "/var/run/vendor", "options": ["ro", "bind"]},
                            {"hostPath": "/srv/data", "containerPath": "/data", "options": ["bind"]}
                        ]
                    }
                }]
            })
        );
    }

    #[test]
    fn the_length_hint_covers_the_json_and_not_much_more() {
        let mut big = answer();
        for i in 0..1024 {
            big.envs.insert(format!("VENDOR_{i}"), format!("value-{i}"));
            big.devices.push(DeviceSpec {
                container_path: format!("/dev/vendor/big{i}"),
                host_path: format!("/dev/vendor/big{i}"),
                permissions: "rwm".into(),
            });
        }
        for answer in [answer(), big] {
            let spec = Spec::for_allocation(&kind(), "pluglet-p_c", &AnswerView::of(&answer))
                .unwrap()
                .unwrap();
            let written = serde_json::to_vec(&spec).unwrap().len();
            let hint = spec.json_len_hint();
            assert!(hint >= written, "hint {hint} < {written} bytes written");
            assert!(hint <= 2 * written, "hint {hint} > twice {written} bytes");
        }
    }

    #[test]
    fn annotations_and_cdi_names_are_not_written() {
        let answer = answer();
        let spec = Spec::for_allocation(&kind(), "pluglet-p_c", &AnswerView::of(&answer))
            .unwrap()
            .unwrap();
        let text = serde_json::to_string(&spec).unwrap();
        assert!(!text.contains("annotations"), "{text}");
        assert!(!text.contains("vendor.com/gpu=d0"), "{text}");
    }

    #[test]
    fn the_lowest_version_that_carries_the_content() {
        let mut only_env = answer();
        only_env.devices.clear();
        only_env.mounts.clear();
        let spec = Spec::for_allocation(&kind(), "pluglet-p_c", &AnswerView::of(&only_env))
            .unwrap()
            .unwrap();
        assert_eq!(spec.cdi_version, "0.3.0");
        let mut same_path = answer();
        same_path.devices.remove(0);
        let spec = Spec::for_allocation(&kind(), "pluglet-p_c", &AnswerView::of(&same_path))
            .unwrap()
            .unwrap();
        assert_eq!(spec.cdi_version, "0.3.0", "no host path, no 0.5.0");
        let digit = Spec::for_allocation(&kind(), "0abc", &AnswerView::of(&only_env))
            .unwrap()
            .unwrap();
        assert_eq!(digit.cdi_version, "0.5.0");
        let dotted = Kind {
            vendor: "v.com".into(),
            class: "a.b".into(),
        };
        let spec = Spec::for_allocation(&dotted, "n", &AnswerView::of(&only_env))
            .unwrap()
            .unwrap();
        assert_eq!(spec.cdi_version, "0.6.0");
    }

    #[test]
    fn nothing_to_apply_writes_no_spec() {
        let mut empty = answer();
        empty.envs.clear();
        empty.devices.clear();
        empty.mounts.clear();
        assert_eq!(
            Spec::for_allocation(&kind(), "pluglet-p_c", &AnswerView::of(&empty)),
            Ok(None)
        );
    }

    #[test]
    fn answers_no_runtime_could_apply_are_named() {
        type Edit = fn(&mut ContainerAllocateResponse);
        let cases: Vec<(Edit, &str)> = vec![
            (
                |a| a.mounts[0].container_path = "relative".into(),
                "mount container path \"relative\" is not an absolute path",
            ),
            (
                |a| a.mounts[1].host_path = String::new(),
                "mount host path \"\" is not an absolute path",
            ),
            (
                |a| a.devices[0].host_path = "dev/null".into(),
                "device node host path \"dev/null\"",
            ),
            (
                |a| a.devices[0].permissions = "rwx".into(),
                "permissions \"rwx\"",
            ),
            (
                |a| a.devices[1].container_path = "/dev/vendor/d0".into(),
                "two different device specs at \"/dev/vendor/d0\" in the container: {container_path: \"/dev/vendor/d0\", host_path: \"/dev/null\", permissions: \"rw\"} and {container_path: \"/dev/vendor/d0\", host_path: \"/dev/fuse\", permissions: \"\"}",
            ),
            (
                |a| {
                    let mut other = a.devices[0].clone();
                    other.permissions = "r".into();
                    a.devices.push(other);
                },
                "two different device specs at \"/dev/vendor/d0\"",
            ),
            (
                |a| {
                    let mut other = a.mounts[0].clone();
                    other.host_path = "/tmp/elsewhere".into();
                    a.mounts.push(other);
                },
                "two different mounts at \"/var/run/vendor\" in the container: {container_path: \"/var/run/vendor\", host_path: \"/tmp/vendor\", read_only: true} and {container_path: \"/var/run/vendor\", host_path: \"/tmp/elsewhere\", read_only: true}",
            ),
            (
                |a| {
                    let mut other = a.mounts[1].clone();
                    other.read_only = true;
                    a.mounts.push(other);
                },
                "two different mounts at \"/data\"",
            ),
            (
                |a| a.devices[0].container_path = "dev/vendor/d0".into(),
                "device node container path \"dev/vendor/d0\" is not an absolute path",
            ),
            (
                |a| {
                    a.envs.insert("BAD=KEY".into(), "v".into());
                },
                "env \"BAD=KEY=v\"",
            ),
            (
                |a| {
                    a.envs.insert(String::new(), "v".into());
                },
                "env \"=v\"",
            ),
        ];
        // Each also in an answer long enough to be merged through a map instead of pairwise.
        for (edit, expected) in cases {
            for pad in [0, 70] {
                let mut a = answer();
                edit(&mut a);
                padded(&mut a, pad);
                let err =
                    Spec::for_allocation(&kind(), "pluglet-p_c", &AnswerView::of(&a)).unwrap_err();
                assert!(err.to_string().contains(expected), "{err} ({expected})");
            }
        }
    }

    /// `a` with `n` more distinct device nodes and mounts.
    fn padded(a: &mut ContainerAllocateResponse, n: usize) {
        for i in 0..n {
            a.devices.push(DeviceSpec {
                container_path: format!("/dev/pad/{i}"),
                host_path: "/dev/null".into(),
                permissions: "rw".into(),
            });
            a.mounts.push(PluginMount {
                container_path: format!("/pad/{i}"),
                host_path: "/srv/pad".into(),
                read_only: false,
            });
        }
    }

    #[test]
    fn repeated_entries_are_one_edit_in_short_and_long_answers() {
        for pad in [0, 70] {
            let mut a = answer();
            padded(&mut a, pad);
            let once = Spec::for_allocation(&kind(), "pluglet-p_c", &AnswerView::of(&a))
                .unwrap()
                .unwrap();
            let mut twice = a.clone();
            twice.devices.extend(a.devices.iter().rev().cloned());
            twice.mounts.extend(a.mounts.iter().cloned());
            let merged = Spec::for_allocation(&kind(), "pluglet-p_c", &AnswerView::of(&twice))
                .unwrap()
                .unwrap();
            assert_eq!(merged, once, "padded by {pad}");
        }
    }

    #[test]
    fn identical_entries_are_one_edit() {
        // One /dev/null spec per device, as some plugins answer: one node in the container.
        let dev_null = DeviceSpec {
            container_path: "/dev/null".into(),
            host_path: "/dev/null".into(),
            permissions: "rw".into(),
        };
        let mut a = answer();
        a.devices = vec![dev_null.clone(); 8];
        a.devices.insert(1, answer().devices[1].clone());
        a.mounts.push(a.mounts[0].clone());
        a.mounts.push(a.mounts[1].clone());
        let spec = Spec::for_allocation(&kind(), "pluglet-p_c", &AnswerView::of(&a))
            .unwrap()
            .unwrap();
        let edits = &spec.devices[0].container_edits;
        let paths: Vec<&str> = edits.device_nodes.iter().map(|n| &*n.path).collect();
        assert_eq!(
            paths,
            ["/dev/null", "/dev/fuse"],
            "first-seen order, once each"
        );
        let mounts: Vec<&str> = edits.mounts.iter().map(|m| &*m.container_path).collect();
        assert_eq!(mounts, ["/var/run/vendor", "/data"]);
        spec.validate().unwrap();
    }

    #[test]
    fn bad_names_and_duplicates_are_refused() {
        let answer = answer();
        let mut spec = Spec::for_allocation(&kind(), "pluglet-p_c", &AnswerView::of(&answer))
            .unwrap()
            .unwrap();
        spec.devices.push(spec.devices[0].clone());
        assert_eq!(
            spec.validate(),
            Err(SpecError::DuplicateDevice("pluglet-p_c".into()))
        );
        spec.devices.truncate(1);
        spec.devices[0].name = "bad name".into();
        assert!(matches!(spec.validate(), Err(SpecError::Name(_))));
        spec.devices[0].name = "ok".into();
        spec.kind = "vendor.com".into();
        assert!(matches!(spec.validate(), Err(SpecError::Name(_))));
    }
}
