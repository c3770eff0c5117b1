//! A change of `handlers.toml` as one transaction: every module it names is read and hashed,
//! its pin and signature checked, every entry whose module or entry changed compiled and
//! admitted (imports, contract, the slot's family, the vectors beside it), and only when every
//! entry passes is the next set swapped in. Otherwise nothing changes and the refusal is kept.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use pluglet_core::events::EventKind;
use pluglet_handler_runtime::{Handler, ModuleSource};
use sha2::{Digest, Sha256};

use super::rollback::next_names;
use super::shared::{ChangeLog, Shared};
use super::status::{ChangeRecord, ChangeState, EntryRefusal, HandlersEvent, change_message};
use crate::file::{HANDLERS_FILE, HandlersFile, SlotEntry};
use crate::integrity::{SignatureInfo, Trust, signature_path, verify};
use crate::served::{Origin, Served};
use crate::set::{HandlerSet, SlotState};
use crate::slot::SlotKey;
use crate::state::{Decision, Version};
use crate::vectors::check_module;

/// How one slot is to be served after a change.
enum Plan {
    /// As it is.
    Keep,
    /// As it is, with a change waiting (recorded as pending).
    Pending(ChangeRecord),
    /// By a newly loaded (or reused) handler.
    Apply {
        handler: Arc<Handler>,
        version: Version,
        bytes: Option<Arc<[u8]>>,
        signature: Option<SignatureInfo>,
    },
    /// By the version a rollback decision restored.
    Restore {
        handler: Arc<Handler>,
        origin: Origin,
        signature: Option<SignatureInfo>,
        reason: String,
    },
    /// By the built-in (the entry was removed).
    Builtin,
}

pub(super) enum TransactionError {
    Entries(Vec<EntryRefusal>),
}

impl Shared {
    /// Plans `file` against the set in force (compiling what changed, without the writer
    /// lock), then swaps the result in under the lock if the set has not changed meanwhile
    /// (else plans again; compiled modules are reused).
    pub(super) fn transaction(
        &self,
        file: HandlersFile,
        at_start: bool,
    ) -> Result<Vec<SlotKey>, TransactionError> {
        let path = self.dir.join(HANDLERS_FILE);
        let mut compiled: HashMap<(String, SlotEntry), Arc<Handler>> = HashMap::new();
        loop {
            let base = self.set.load_full();
            let decisions = self.lock_writer().decisions.clone();
            let mut plans: BTreeMap<SlotKey, Plan> = BTreeMap::new();
            let mut refusals = Vec::new();
            let mut pending = Vec::new();
            for (slot, entry) in &file.entries {
                match self.plan(&path, &base, &decisions, slot, entry, &mut compiled) {
                    Ok(Plan::Pending(record)) => {
                        pending.push((slot.clone(), record));
                        plans.insert(slot.clone(), Plan::Keep);
                    }
                    Ok(plan) => {
                        plans.insert(slot.clone(), plan);
                    }
                    Err(refusal) => refusals.push(*refusal),
                }
            }
            for (slot, state) in base.slots() {
                if !file.entries.contains_key(&slot)
                    && slot != SlotKey::DefaultPolicy
                    && state.current.entry().is_some()
                {
                    plans.insert(slot, Plan::Builtin);
                }
            }
            if !refusals.is_empty() {
                self.refused(&refusals);
                return Err(TransactionError::Entries(refusals));
            }

            let mut writer = self.lock_writer();
            if self.set.load().generation != base.generation {
                continue;
            }
            let (next, changed) = self.build(&base, plans);
            // Decisions whose slot no longer names the rejected version are void.
            let decided = writer.decisions.len();
            writer.decisions.retain(|d| {
                file.entries
                    .get(&d.slot)
                    .is_some_and(|e| *e == d.rejected.entry && next_names(&next, d))
            });
            let decisions_changed = writer.decisions.len() != decided;
            self.persist(&mut writer, decisions_changed, &next);
            let generation = next.generation;
            // The set and its change records are published under the change log's lock, so
            // a status never shows the new set with the old records.
            let mut changes = self.lock_changes();
            self.set.store(Arc::new(next));
            drop(writer);
            self.applied(&mut changes, &changed, at_start);
            for (slot, record) in pending {
                let same = changes
                    .slots
                    .get(&slot)
                    .is_some_and(|r| r.state == ChangeState::Pending && r.sha256 == record.sha256);
                if !same {
                    changes.slots.insert(slot, record);
                }
            }
            drop(changes);
            if !changed.is_empty() {
                let _ = self.events.send(HandlersEvent::Applied {
                    generation,
                    slots: changed.iter().map(|(s, _)| s.clone()).collect(),
                });
            }
            return Ok(changed.into_iter().map(|(slot, _)| slot).collect());
        }
    }

    fn plan(
        &self,
        path: &Path,
        base: &HandlerSet,
        decisions: &[Decision],
        slot: &SlotKey,
        entry: &SlotEntry,
        compiled: &mut HashMap<(String, SlotEntry), Arc<Handler>>,
    ) -> Result<Plan, Box<EntryRefusal>> {
        let refuse = |sha256: Option<String>, reason: String| {
            Box::new(EntryRefusal {
                file: path.to_path_buf(),
                slot: slot.clone(),
                module: entry.module.clone(),
                sha256,
                reason,
            })
        };
        let bytes: Arc<[u8]> = match std::fs::read(&entry.module) {
            Ok(bytes) => bytes.into(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(refuse(
                    None,
                    "the module file is missing; put it back or change the entry".to_owned(),
                ));
            }
            Err(e) => {
                return Err(refuse(
                    None,
                    format!("cannot read the module file: {e}; check its permissions"),
                ));
            }
        };
        let sha256 = hex::encode(Sha256::digest(&bytes));
        let in_force = base.slot(slot).map(|s| s.current.origin());
        let signature = match check_integrity(&self.trust, entry, &bytes, &sha256, in_force) {
            Ok(Verdict::Pass(signature)) => signature,
            Ok(Verdict::KeepInForce(reason)) => {
                return Ok(Plan::Pending(ChangeRecord {
                    state: ChangeState::Pending,
                    at: SystemTime::now(),
                    reason,
                    module: Some(entry.module.display().to_string()),
                    sha256: Some(sha256),
                }));
            }
            Err(reason) => return Err(refuse(Some(sha256), reason)),
        };
        let version = Version {
            sha256: sha256.clone(),
            entry: entry.clone(),
        };
        let state = base.slot(slot);
        let is = |served: &Served| matches!(served.origin(), Origin::Configured { entry: e, sha256: s } if *e == version.entry && *s == version.sha256);
        if let Some(decision) = decisions
            .iter()
            .find(|d| d.slot == *slot && d.rejected == version)
        {
            // Rolled back: not applied again until its file or entry changes.
            let restored_in_force =
                state.is_some_and(|s| match (&decision.restored, s.current.origin()) {
                    (None, Origin::Builtin) => true,
                    (Some(v), Origin::Configured { entry, sha256 }) => {
                        v.entry == *entry && v.sha256 == *sha256
                    }
                    _ => false,
                });
            if restored_in_force {
                return Ok(Plan::Keep);
            }
            return self.restore(path, slot, decision);
        }
        if state.is_some_and(|s| is(&s.current)) {
            return Ok(Plan::Keep);
        }
        let warm = state
            .and_then(|s| s.previous.as_ref())
            .filter(|p| is(p))
            .map(|p| p.handler().clone());
        let key = (sha256.clone(), entry.clone());
        let limits = entry.limits(self.runtime.config().default_limits);
        // The same bytes already compiled (in force, kept warm, or earlier in this transaction)
        // under another entry: bind the new settings and limits without compiling again.
        let same_bytes = || {
            state
                .into_iter()
                .flat_map(|s| std::iter::once(&s.current).chain(s.previous.iter()))
                .map(|served| served.handler().clone())
                .chain(compiled.values().cloned())
                .find(|h| h.sha256() == sha256)
        };
        let handler = match warm.or_else(|| compiled.get(&key).cloned()) {
            Some(handler) => handler,
            None if let Some(same) = same_bytes() => {
                let handler = same
                    .reconfigured(
                        entry.module.display().to_string(),
                        entry.settings.clone(),
                        Some(limits),
                    )
                    .map_err(|e| refuse(Some(sha256.clone()), pluglet_core::error_chain(&e)))?;
                compiled.insert(key, handler.clone());
                handler
            }
            None => {
                let handler = self
                    .runtime
                    .load(
                        ModuleSource::Bytes {
                            id: entry.module.display().to_string(),
                            bytes: bytes.clone(),
                        },
                        entry.settings.clone(),
                        Some(limits),
                    )
                    .map_err(|e| refuse(Some(sha256.clone()), pluglet_core::error_chain(&e)))?;
                compiled.insert(key, handler.clone());
                handler
            }
        };
        let family = slot.family();
        if !handler.implements(family) {
            return Err(refuse(
                Some(sha256),
                format!(
                    "the module does not export the {family} family this entry needs; point the \
                     entry at a handler that implements it"
                ),
            ));
        }
        check_module(&handler, &entry.module)
            .map_err(|e| refuse(Some(sha256.clone()), pluglet_core::error_chain(&e)))?;
        Ok(Plan::Apply {
            handler,
            version,
            bytes: Some(bytes),
            signature,
        })
    }

    /// The version a decision restored, loaded from the kept bytes (or the built-in).
    fn restore(
        &self,
        path: &Path,
        slot: &SlotKey,
        decision: &Decision,
    ) -> Result<Plan, Box<EntryRefusal>> {
        let reason = decision.describe();
        let Some(restored) = &decision.restored else {
            return match self.builtins.for_slot(slot) {
                Some(builtin) => Ok(Plan::Restore {
                    handler: builtin.clone(),
                    origin: Origin::Builtin,
                    signature: None,
                    reason,
                }),
                None => Err(Box::new(EntryRefusal {
                    file: path.to_path_buf(),
                    slot: slot.clone(),
                    module: decision.rejected.entry.module.clone(),
                    sha256: Some(decision.rejected.sha256.clone()),
                    reason: format!("{reason}; there is no built-in for it"),
                })),
            };
        };
        let refuse = |why: String| {
            Box::new(EntryRefusal {
                file: path.to_path_buf(),
                slot: slot.clone(),
                module: decision.rejected.entry.module.clone(),
                sha256: Some(decision.rejected.sha256.clone()),
                reason: format!("{reason}; the version it restored cannot be loaded: {why}"),
            })
        };
        let bytes = self
            .store
            .as_ref()
            .ok_or_else(|| refuse("no state directory".into()))?
            .module(&restored.sha256)
            .map_err(|e| refuse(format!("kept module sha256 {}: {e}", restored.sha256)))?;
        let limits = restored.entry.limits(self.runtime.config().default_limits);
        let handler = self
            .runtime
            .load(
                ModuleSource::Bytes {
                    id: restored.entry.module.display().to_string(),
                    bytes: bytes.into(),
                },
                restored.entry.settings.clone(),
                Some(limits),
            )
            .map_err(|e| refuse(pluglet_core::error_chain(&e)))?;
        // Its signature, as recorded when it was last put in force.
        let signature = self
            .lock_writer()
            .applied
            .iter()
            .flatten()
            .find(|a| a.slot == *slot && a.version == *restored)
            .and_then(|a| a.signature.clone());
        Ok(Plan::Restore {
            handler,
            origin: Origin::Configured {
                entry: restored.entry.clone(),
                sha256: restored.sha256.clone(),
            },
            signature,
            reason,
        })
    }

    /// The next set from `base` and the plans; returns it and the slots that changed, each
    /// with the change to record.
    fn build(
        &self,
        base: &HandlerSet,
        plans: BTreeMap<SlotKey, Plan>,
    ) -> (HandlerSet, Vec<(SlotKey, ChangeRecord)>) {
        let mut next = base.clone();
        next.generation += 1;
        let mut changed = Vec::new();
        for (slot, plan) in plans {
            let old = base.slot(&slot).cloned();
            let builtin = self.builtins.for_slot(&slot);
            let (state, record) = match plan {
                Plan::Keep | Plan::Pending(_) => continue,
                Plan::Apply {
                    handler,
                    version,
                    bytes,
                    signature,
                } => {
                    if let (Some(store), Some(bytes)) = (&self.store, bytes)
                        && let Err(e) = store.keep_module(&version.sha256, &bytes)
                    {
                        tracing::warn!(module = %version.entry.module.display(), error = %e, "cannot keep a copy of the module in the state directory; a rollback of it will not survive a restart");
                    }
                    let previous = old.map(|o| o.current);
                    let has_target = previous.is_some() || builtin.is_some();
                    let mut reason = match &previous {
                        Some(p) => format!("replaces {} (sha256 {})", p.module(), p.sha256()),
                        None => "new entry".to_owned(),
                    };
                    if let Some(signature) = &signature {
                        reason.push_str(&format!("; signed \"{}\"", signature.trusted_comment));
                    }
                    if let Some(hash) = version.entry.settings_hash() {
                        reason.push_str(&format!("; settings {hash}"));
                    }
                    let record = ChangeRecord {
                        state: ChangeState::Applied,
                        at: SystemTime::now(),
                        reason,
                        module: Some(version.entry.module.display().to_string()),
                        sha256: Some(version.sha256.clone()),
                    };
                    let served = self
                        .served(
                            slot.clone(),
                            handler,
                            Origin::Configured {
                                entry: version.entry,
                                sha256: version.sha256,
                            },
                            builtin,
                            has_target,
                        )
                        .with_signature(signature);
                    (
                        Some(SlotState {
                            current: Arc::new(served),
                            previous,
                        }),
                        record,
                    )
                }
                Plan::Restore {
                    handler,
                    origin,
                    signature,
                    reason,
                } => {
                    let served = self
                        .served(slot.clone(), handler, origin, builtin, false)
                        .with_signature(signature);
                    let record = ChangeRecord {
                        state: ChangeState::RolledBack,
                        at: SystemTime::now(),
                        reason,
                        module: Some(served.module().to_owned()),
                        sha256: Some(served.sha256().to_owned()),
                    };
                    (
                        Some(SlotState {
                            current: Arc::new(served),
                            previous: None,
                        }),
                        record,
                    )
                }
                Plan::Builtin => {
                    let previous = old.map(|o| o.current);
                    let state = builtin.map(|b| SlotState {
                        current: Arc::new(self.served(
                            slot.clone(),
                            b.clone(),
                            Origin::Builtin,
                            None,
                            false,
                        )),
                        previous: previous.clone(),
                    });
                    let record = ChangeRecord {
                        state: ChangeState::Applied,
                        at: SystemTime::now(),
                        reason: match &previous {
                            Some(p) => format!(
                                "entry removed; {} (sha256 {}) no longer serves",
                                p.module(),
                                p.sha256()
                            ),
                            None => "entry removed".to_owned(),
                        },
                        module: builtin.map(|b| b.module().to_owned()),
                        sha256: builtin.map(|b| b.sha256().to_owned()),
                    };
                    (state, record)
                }
            };
            next = next.with_slot(&slot, state);
            next.generation = base.generation + 1;
            changed.push((slot, record));
        }
        (next, changed)
    }

    /// Refuses the entries whose module could not be pulled, as a transaction refuses entries.
    pub(super) fn refuse_unpulled(
        &self,
        file: &HandlersFile,
        unpulled: Vec<crate::source::Unpulled>,
    ) -> Vec<EntryRefusal> {
        let path = self.dir.join(HANDLERS_FILE);
        let refusals: Vec<EntryRefusal> = unpulled
            .into_iter()
            .map(|(slot, reason)| EntryRefusal {
                file: path.clone(),
                module: file
                    .entries
                    .get(&slot)
                    .and_then(|e| e.source.clone())
                    .unwrap_or_default()
                    .into(),
                slot,
                sha256: None,
                reason,
            })
            .collect();
        self.refused(&refusals);
        refusals
    }

    fn refused(&self, refusals: &[EntryRefusal]) {
        let mut changes = self.lock_changes();
        // The file itself parsed: a refusal of it as a whole is over.
        changes.file = None;
        for refusal in refusals {
            tracing::warn!(
                file = %refusal.module.display(),
                sha256 = refusal.sha256.as_deref().unwrap_or("-"),
                slot = %refusal.slot,
                reason = %refusal.reason,
                "handler change refused; the handler in force keeps serving"
            );
            self.record(
                EventKind::HandlerRefused,
                || refusal.slot.id(),
                || format!("{}: {}", refusal.module.display(), refusal.reason),
            );
            changes.slots.insert(
                refusal.slot.clone(),
                ChangeRecord {
                    state: ChangeState::Refused,
                    at: SystemTime::now(),
                    reason: refusal.reason.clone(),
                    module: Some(refusal.module.display().to_string()),
                    sha256: refusal.sha256.clone(),
                },
            );
        }
        drop(changes);
        let _ = self.events.send(HandlersEvent::Refused {
            reason: refusals
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n"),
        });
    }

    /// Records the slots `changed` in `changes` (held since the set was swapped).
    fn applied(
        &self,
        changes: &mut ChangeLog,
        changed: &[(SlotKey, ChangeRecord)],
        at_start: bool,
    ) {
        // A successful change ends every refusal and wait before it.
        changes.file = None;
        changes.slots.retain(|_, record| {
            record.state != ChangeState::Refused && record.state != ChangeState::Pending
        });
        for (slot, record) in changed {
            match record.state {
                ChangeState::RolledBack => tracing::warn!(
                    %slot,
                    module = record.module.as_deref().unwrap_or("-"),
                    reason = %record.reason,
                    "serving the version a rollback restored"
                ),
                _ => tracing::info!(
                    %slot,
                    module = record.module.as_deref().unwrap_or("-"),
                    sha256 = record.sha256.as_deref().unwrap_or("-"),
                    change = %record.reason,
                    "handler applied"
                ),
            }
            if at_start && record.state == ChangeState::Applied {
                continue;
            }
            let kind = match record.state {
                ChangeState::RolledBack => EventKind::HandlerRolledBack,
                _ => EventKind::HandlerApplied,
            };
            self.record(kind, || slot.id(), || change_message(record));
            changes.slots.insert(slot.clone(), record.clone());
        }
    }
}

/// What the checks decided for one entry.
#[derive(Debug)]
enum Verdict {
    /// The module may be applied; the signature that vouched for it, if any.
    Pass(Option<SignatureInfo>),
    /// The version in force keeps serving while the change waits (the reason): the module file
    /// changed but the pin still names the version in force, or the signature file changed
    /// but the module did not (a signature installed before its module).
    KeepInForce(String),
}

/// The pin and signature checks of `entry`, whose module file holds `bytes` (digest `sha256`);
/// `in_force` is where the version serving the slot came from. `Err`: the reason to refuse the
/// entry.
///
/// For a pinned entry `handlers.toml` is the commit point: a module file that changes while the
/// pin still names the version in force is not a refusal, the version in force keeps serving
/// until the pin names the new digest.
fn check_integrity(
    trust: &Trust,
    entry: &SlotEntry,
    bytes: &[u8],
    sha256: &str,
    in_force: Option<&Origin>,
) -> Result<Verdict, String> {
    if let Some(pin) = &entry.sha256
        && pin != sha256
    {
        let pin_in_force = in_force.is_some_and(|origin| {
            matches!(origin, Origin::Configured { entry: e, sha256: digest } if e == entry && digest == pin)
        });
        if pin_in_force {
            tracing::info!(
                module = %entry.module.display(),
                file_sha256 = sha256,
                "module file changed but handlers.toml still pins sha256 {pin}; keeping the \
                 version in force until the pin names the new digest"
            );
            return Ok(Verdict::KeepInForce(format!(
                "the module file changed (now sha256 {sha256}) but handlers.toml still pins the \
                 version in force; it is served once the pin names it"
            )));
        }
        return Err(format!(
            "module sha256 {sha256} does not match the pin {pin} in handlers.toml; if this module \
             is the one to run, set sha256 = \"{sha256}\" in the entry, else put back the module \
             the pin names"
        ));
    }
    if trust.keys.is_empty() && !trust.require {
        return Ok(Verdict::Pass(None));
    }
    let path = signature_path(&entry.module);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if trust.require {
                return Err(format!(
                    "no signature: {} is missing and signatures are required \
                     (--require-signatures); sign the module with a trusted key \
                     (`minisign -S -s <key> -m {}`)",
                    path.display(),
                    entry.module.display()
                ));
            }
            return Ok(Verdict::Pass(None));
        }
        Err(e) => {
            return Err(format!(
                "cannot read the signature file {}: {e}; check its permissions",
                path.display()
            ));
        }
    };
    // The version in force is this very entry and these very bytes: it was checked when it was
    // applied, so a signature that does not vouch for it is one installed ahead of its module.
    let is_in_force = in_force.is_some_and(|origin| {
        matches!(origin, Origin::Configured { entry: e, sha256: digest } if e == entry && digest == sha256)
    });
    match verify(&trust.keys, bytes, &text) {
        Ok(info) => Ok(Verdict::Pass(Some(info))),
        Err(e) if is_in_force => {
            tracing::info!(
                module = %entry.module.display(),
                signature = %path.display(),
                "the signature file does not vouch for the module in force ({e}); keeping the \
                 version in force until its module arrives"
            );
            Ok(Verdict::KeepInForce(format!(
                "{} does not vouch for the module in force ({e}); it waits for the module it \
                 signs",
                path.display()
            )))
        }
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODULE: &[u8] = include_bytes!("../../tests/fixtures/module.bin");
    const TRUSTED_PUB: &str = include_str!("../../tests/fixtures/trusted.pub");
    const SIGNED_BY_TRUSTED: &str = include_str!("../../tests/fixtures/module.bin.minisig");
    const SIGNED_BY_OTHER: &str = include_str!("../../tests/fixtures/other.minisig");

    fn trusted() -> Vec<crate::integrity::TrustedKey> {
        vec![crate::integrity::TrustedKey::decode(TRUSTED_PUB).unwrap()]
    }

    #[test]
    fn a_pin_that_differs_is_refused_with_both_digests() {
        let entry = entry(Some("b".repeat(64)), Path::new("/nonexistent/m.wasm"));
        let actual = "c".repeat(64);
        let err = check_integrity(&Trust::default(), &entry, b"x", &actual, None).unwrap_err();
        assert!(
            err.starts_with(&format!(
                "module sha256 {actual} does not match the pin {} in handlers.toml;",
                "b".repeat(64)
            )),
            "{err}"
        );
        let same = entry.sha256.clone().unwrap();
        assert!(matches!(
            check_integrity(&Trust::default(), &entry, b"x", &same, None),
            Ok(Verdict::Pass(None))
        ));
    }

    #[test]
    fn signatures_are_required_only_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let module = dir.path().join("m.wasm");
        std::fs::write(&module, MODULE).unwrap();
        let entry = entry(None, &module);
        let sha = "0".repeat(64);
        let keys_only = Trust {
            keys: trusted(),
            require: false,
        };
        assert!(matches!(
            check_integrity(&keys_only, &entry, MODULE, &sha, None),
            Ok(Verdict::Pass(None))
        ));
        let required = Trust {
            keys: trusted(),
            require: true,
        };
        let err = check_integrity(&required, &entry, MODULE, &sha, None).unwrap_err();
        assert!(err.starts_with("no signature:"), "{err}");
        std::fs::write(signature_path(&module), SIGNED_BY_OTHER).unwrap();
        let err = check_integrity(&keys_only, &entry, MODULE, &sha, None).unwrap_err();
        assert!(err.contains("which is not trusted"), "{err}");
        std::fs::write(signature_path(&module), SIGNED_BY_TRUSTED).unwrap();
        match check_integrity(&required, &entry, MODULE, &sha, None) {
            Ok(Verdict::Pass(Some(info))) => {
                assert_eq!(info.trusted_comment, "spread-policy 1.2.0")
            }
            other => panic!("{other:?}"),
        }
    }

    fn entry(sha256: Option<String>, module: &Path) -> SlotEntry {
        SlotEntry {
            module: module.to_path_buf(),
            sha256,
            deadline_ms: None,
            memory_mib: None,
            max_concurrent_calls: None,
            reuse_instances: None,
            fuel: None,
            settings: Default::default(),
            rollback_after: 3,
            on_failure: Default::default(),
            source: None,
            digest: None,
            rollout: None,
        }
    }
}
