//! Runtime hand-off: every allocation as a Container Device Interface (CDI) device that a
//! container runtime (podman, containerd, CRI-O, Docker) injects by name.
//!
//! For each allocation whose plugin answered envs, mounts or device specs, [`Handoff`] writes
//! one spec file, `pluglet-<vendor>=<class>=<device>.json`, defining one device named for the
//! container (`vendor.com/gpu=pluglet-<pod uid>_<container>`: see [`names`]) whose edits are
//! the plugin's answer ([`spec`]). One file per allocation, not per resource: an allocation is
//! written, replaced and removed on its own, with no read-modify-write of a file others share,
//! and a runtime never sees one allocation's file half-changed because another changed. The
//! plugin's own `cdi_devices` names are passed through untouched.
//!
//! The allocator checks and renders the spec once the plugin answered (an answer that cannot be
//! a CDI device refuses the allocation), writes the file while the allocation's journal record
//! is written (a spec that cannot be written refuses the allocation: it is undone), and removes
//! it once a release is durable. At start, [`Handoff::reconcile`] converges the directory to the
//! restored allocations: Pluglet's files of allocations that no longer exist are removed,
//! missing or different ones rewritten. `docs/cdi.md` shows the
//! commands.

pub mod dir;
pub mod names;
pub mod spec;
mod writer;

use std::path::{Path, PathBuf};

use crate::answer::{AnswerView, PluginAnswer};
use crate::pod_devices::{HolderKey, HoldingState, PodDevices};
use dir::SpecDir;
use spec::{Spec, SpecError};

/// Why an allocation could not be handed to a runtime.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// The plugin's answer cannot be expressed as a CDI spec a runtime would accept.
    #[error(
        "the plugin's Allocate answer cannot be given to a container runtime as a CDI device: {0}"
    )]
    Spec(#[from] SpecError),
    /// The spec file could not be written.
    #[error("cannot write the CDI spec {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// What an allocation is to a runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned<'a> {
    /// The spec file name in the directory.
    pub file: String,
    /// Its content.
    pub spec: Spec<'a>,
    /// The fully qualified name of the device it defines.
    pub name: String,
}

/// The spec of the allocation `key` holds with the plugin's `answer`, if it has edits.
pub fn plan<'a>(
    key: &HolderKey,
    answer: &AnswerView<'a>,
) -> Result<Option<Planned<'a>>, SpecError> {
    let (kind, device) = identity(key);
    let Some(spec) = Spec::for_allocation(&kind, &device, answer)? else {
        return Ok(None);
    };
    Ok(Some(Planned {
        file: dir::file_name(&kind, &device),
        name: kind.qualified(&device),
        spec,
    }))
}

/// Every CDI name a runtime should be given for the allocation of `key`: the plugin's own
/// `cdi_devices`, then, with CDI on (`handoff`), the one Pluglet's spec defines when the answer
/// has edits.
pub fn names(handoff: Option<&Handoff>, key: &HolderKey, answer: &PluginAnswer) -> Vec<String> {
    let mut all = answer.cdi_devices().to_vec();
    if handoff.is_some() && answer.has_edits() {
        let (kind, device) = identity(key);
        all.push(kind.qualified(&device));
    }
    all
}

/// The kind and device name of the allocation `key` holds.
fn identity(key: &HolderKey) -> (names::Kind, String) {
    (
        names::kind_of(key.resource.as_str()),
        names::device_name(key.pod_uid.as_str(), key.container.as_str()),
    )
}

/// A rendered spec not yet written ([`Handoff::prepare`]).
#[derive(Debug)]
pub struct PendingSpec {
    dir: SpecDir,
    file: String,
    content: Vec<u8>,
}

impl PendingSpec {
    /// The file it is written to.
    pub fn path(&self) -> PathBuf {
        self.dir.path().join(&self.file)
    }

    /// Writes the file (replacing it whole, see [`dir::SpecDir::write`]).
    pub fn write(self) -> Result<(), CdiError> {
        self.dir
            .write(&self.file, &self.content)
            .map_err(|source| CdiError::Write {
                path: self.path(),
                source,
            })
    }
}

/// What start-up reconciliation did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Specs written because they were missing or different.
    pub written: usize,
    /// Pluglet's files of allocations that no longer exist, removed.
    pub removed: usize,
    /// Specs already right.
    pub kept: usize,
    /// What could not be done, one line each.
    pub errors: Vec<String>,
}

/// Pluglet's specs in one CDI directory. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Handoff {
    dir: SpecDir,
    writer: writer::SpecWriter,
}

impl Handoff {
    /// Specs written to `dir` (created at the first write).
    pub fn new(dir: PathBuf) -> Handoff {
        Handoff {
            dir: SpecDir::new(dir),
            writer: writer::SpecWriter::default(),
        }
    }

    /// The spec directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Writes the spec of the allocation of `key` (none when the answer has no edits) and
    /// returns every CDI name of the allocation.
    pub fn write(&self, key: &HolderKey, answer: &AnswerView<'_>) -> Result<Vec<String>, CdiError> {
        let (names, pending) = self.prepare(key, answer)?;
        if let Some(pending) = pending {
            pending.write()?;
        }
        Ok(names)
    }

    /// Everything of [`Handoff::write`] but the file write: checks the answer can be a CDI
    /// device and renders its spec (failing as `write` would for an answer that cannot), and
    /// returns every CDI name of the allocation with the spec still to be written (none when
    /// the answer has no edits). The write can then run beside other work.
    pub fn prepare(
        &self,
        key: &HolderKey,
        answer: &AnswerView<'_>,
    ) -> Result<(Vec<String>, Option<PendingSpec>), CdiError> {
        let mut names = passed_through(answer);
        let Some(planned) = plan(key, answer)? else {
            return Ok((names, None));
        };
        names.push(planned.name);
        let pending = PendingSpec {
            dir: self.dir.clone(),
            content: render(&planned.spec),
            file: planned.file,
        };
        Ok((names, Some(pending)))
    }

    /// Writes `spec` on the hand-off's writer thread (`cdi/writer.rs`); the future is the
    /// write's outcome, so that an allocation can wait for it beside its journal record.
    pub fn write_later(
        &self,
        spec: PendingSpec,
    ) -> impl std::future::Future<Output = Result<(), CdiError>> + Send + 'static {
        self.writer.write(spec)
    }

    /// Removes the spec of the allocation of `key`, if Pluglet wrote one.
    pub fn remove(&self, key: &HolderKey) -> std::io::Result<()> {
        let (kind, device) = identity(key);
        self.dir.remove(&dir::file_name(&kind, &device))
    }

    /// Makes the directory hold exactly the specs of `pods`' allocations: Pluglet's files of
    /// allocations that no longer exist (and temporary files a crash left) are removed, missing
    /// or different ones written. Other files are not touched.
    pub fn reconcile(&self, pods: &PodDevices) -> Reconciled {
        let mut report = Reconciled::default();
        if let Err(err) = self.dir.create() {
            report.errors.push(format!(
                "cannot create {}: {err}; allocations are refused until it can be written \
                 (give a writable --cdi-spec-dir, or --no-cdi to write no CDI specs)",
                self.dir.path().display()
            ));
        }
        // Read first: the specs planned below borrow from the answers.
        let answers: Vec<_> = pods
            .iter()
            .filter_map(|(key, entry)| match &entry.state {
                HoldingState::Allocated { answer } if answer.has_edits() => {
                    Some((key, answer.view()))
                }
                _ => None,
            })
            .collect();
        let mut wanted = std::collections::BTreeMap::new();
        for (key, answer) in &answers {
            match plan(key, answer) {
                Ok(Some(planned)) => {
                    wanted.insert(planned.file.clone(), planned);
                }
                Ok(None) => {}
                Err(err) => report.errors.push(format!(
                    "pod {} container {} resource {}: {err}",
                    key.pod_uid, key.container, key.resource
                )),
            }
        }
        let (files, temps) = match self.dir.own_files() {
            Ok(found) => found,
            Err(err) => {
                report
                    .errors
                    .push(format!("cannot list {}: {err}", self.dir.path().display()));
                Default::default()
            }
        };
        for file in files.iter().chain(&temps) {
            if wanted.contains_key(file) {
                continue;
            }
            match self.dir.remove(file) {
                Ok(()) => report.removed += usize::from(!file.starts_with('.')),
                Err(err) => report.errors.push(format!("cannot remove {file}: {err}")),
            }
        }
        for (file, planned) in &wanted {
            let content = render(&planned.spec);
            match self.dir.read(file) {
                Ok(Some(now)) if now == content => {
                    report.kept += 1;
                    continue;
                }
                _ => {}
            }
            let pending = PendingSpec {
                dir: self.dir.clone(),
                file: file.clone(),
                content,
            };
            match pending.write() {
                Ok(()) => report.written += 1,
                Err(err) => report.errors.push(pluglet_core::error_chain(&err)),
            }
        }
        report
    }
}

/// The plugin's own CDI device names in `answer`.
pub(crate) fn passed_through(answer: &AnswerView<'_>) -> Vec<String> {
    answer
        .cdi_devices
        .iter()
        .map(|&name| name.to_owned())
        .collect()
}

fn render(spec: &Spec<'_>) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(spec.json_len_hint() + 1);
    spec.write_json(&mut bytes);
    bytes.push(b'\n');
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pod_devices::Holding;
    use pluglet_proto::v1beta1::{CdiDevice, ContainerAllocateResponse};

    fn response(env: &str) -> ContainerAllocateResponse {
        ContainerAllocateResponse {
            envs: [("E".to_owned(), env.to_owned())].into(),
            cdi_devices: vec![CdiDevice {
                name: "vendor.com/gpu=d0".into(),
            }],
            ..Default::default()
        }
    }

    fn allocated(pods: &mut PodDevices, pod: &str, env: &str) -> HolderKey {
        let key = HolderKey::new(pod, "c", "vendor.com/gpu");
        pods.insert(
            key.clone(),
            Holding {
                devices: vec!["d0".into()].into(),
                numa: Default::default(),
                state: HoldingState::Allocated {
                    answer: PluginAnswer::of(&response(env)),
                },
                pod: None,
            },
        );
        key
    }

    #[test]
    fn names_pass_the_plugins_through_and_add_pluglets() {
        let tmp = tempfile::tempdir().unwrap();
        let handoff = Handoff::new(tmp.path().to_owned());
        let key = HolderKey::new("p1", "c", "vendor.com/gpu");
        let names = handoff
            .write(&key, &AnswerView::of(&response("x")))
            .unwrap();
        assert_eq!(names, ["vendor.com/gpu=d0", "vendor.com/gpu=pluglet-p1_c"]);
        let answer = PluginAnswer::of(&response("x"));
        assert_eq!(super::names(Some(&handoff), &key, &answer), names);
        assert_eq!(super::names(None, &key, &answer), ["vendor.com/gpu=d0"]);
        let only_cdi = ContainerAllocateResponse {
            cdi_devices: response("x").cdi_devices,
            ..Default::default()
        };
        let other = HolderKey::new("p2", "c", "vendor.com/gpu");
        assert_eq!(
            handoff.write(&other, &AnswerView::of(&only_cdi)).unwrap(),
            ["vendor.com/gpu=d0"]
        );
        let (files, _) = SpecDir::new(tmp.path().to_owned()).own_files().unwrap();
        assert_eq!(files, ["pluglet-vendor.com=gpu=p1_c.json"]);
        handoff.remove(&key).unwrap();
        handoff.remove(&other).unwrap();
        assert!(
            SpecDir::new(tmp.path().to_owned())
                .own_files()
                .unwrap()
                .0
                .is_empty()
        );
    }

    #[test]
    fn reconcile_converges_on_the_allocations_and_leaves_other_files() {
        let tmp = tempfile::tempdir().unwrap();
        let handoff = Handoff::new(tmp.path().to_owned());
        let mut pods = PodDevices::default();
        let kept = allocated(&mut pods, "kept", "1");
        let changed = allocated(&mut pods, "changed", "new");
        handoff
            .write(&kept, &AnswerView::of(&response("1")))
            .unwrap();
        handoff
            .write(&changed, &AnswerView::of(&response("old")))
            .unwrap();
        handoff
            .write(
                &HolderKey::new("gone", "c", "vendor.com/gpu"),
                &AnswerView::of(&response("1")),
            )
            .unwrap();
        allocated(&mut pods, "missing", "1");
        std::fs::write(tmp.path().join("vendor.json"), "{}").unwrap();
        std::fs::write(tmp.path().join(".pluglet-x.json.tmp"), "").unwrap();

        let report = handoff.reconcile(&pods);
        assert_eq!(
            report,
            Reconciled {
                written: 2,
                removed: 1,
                kept: 1,
                errors: vec![]
            }
        );
        let (files, temps) = SpecDir::new(tmp.path().to_owned()).own_files().unwrap();
        assert_eq!(
            files,
            [
                "pluglet-vendor.com=gpu=changed_c.json",
                "pluglet-vendor.com=gpu=kept_c.json",
                "pluglet-vendor.com=gpu=missing_c.json"
            ]
        );
        assert!(temps.is_empty());
        let text = std::fs::read_to_string(tmp.path().join(&files[0])).unwrap();
        assert!(text.contains("E=new"), "{text}");
        assert!(tmp.path().join("vendor.json").exists());
        assert_eq!(handoff.reconcile(&pods).kept, 3, "nothing left to do");
    }
}
