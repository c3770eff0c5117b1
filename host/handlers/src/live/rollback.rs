//! Rollbacks: by hand, of a failing new module (reported by its [`Served`] once its probation
//! fails), and those still in force at start. A rollback is recorded as a decision, kept across
//! restarts, so the version rolled back is not applied again until its file or entry changes.

use std::sync::Arc;
use std::time::SystemTime;

use pluglet_core::events::EventKind;

use super::shared::Shared;
use super::status::{ChangeRecord, ChangeState, HandlersEvent, change_message, short};
use crate::served::{Origin, Served};
use crate::set::{HandlerSet, SlotState};
use crate::slot::SlotKey;
use crate::state::{Decision, Version};

/// Why a rollback could not be done.
#[derive(Debug, thiserror::Error)]
pub enum RollbackError {
    /// The set has no such slot.
    #[error("no handler serves {0}; `pluglet ctl handlers` lists the slots")]
    NoSuchSlot(SlotKey),
    /// Nothing to go back to.
    #[error("{0} has no previous version and no built-in to go back to")]
    NothingToRollBackTo(SlotKey),
    /// The slot is on its built-in already.
    #[error("{0} is already served by its built-in; there is nothing to roll back")]
    AlreadyBuiltin(SlotKey),
}

impl Shared {
    /// At start, once `handlers.toml` is applied: every slot a rollback decision still holds on
    /// the version it restored says so, as when the rollback happened (`ctl handlers`, the
    /// log, an event).
    pub(super) fn rollbacks_in_force(&self) {
        let set = self.set.load_full();
        let decisions = self.lock_writer().decisions.clone();
        for decision in decisions.iter().filter(|d| next_names(&set, d)) {
            let Some(state) = set.slot(&decision.slot) else {
                continue;
            };
            // Restored by this start's own change: said already.
            if self.lock_changes().slots.contains_key(&decision.slot) {
                continue;
            }
            let reason = decision.describe();
            let record = ChangeRecord {
                state: ChangeState::RolledBack,
                at: SystemTime::now(),
                reason,
                module: Some(state.current.module().to_owned()),
                sha256: Some(state.current.sha256().to_owned()),
            };
            tracing::warn!(
                slot = %decision.slot,
                module = state.current.module(),
                reason = %record.reason,
                "serving the version a rollback restored"
            );
            self.record(
                EventKind::HandlerRolledBack,
                || decision.slot.id(),
                || change_message(&record),
            );
            self.lock_changes()
                .slots
                .entry(decision.slot.clone())
                .or_insert(record);
        }
    }

    /// A failing new module reached `rollback_after`: roll it back if it is still in force.
    pub(super) fn roll_back_failing(&self, served: &Served, reason: String) {
        let in_force = self
            .set
            .load()
            .slot(served.slot())
            .is_some_and(|s| std::ptr::eq(Arc::as_ptr(&s.current), served));
        if !in_force {
            return;
        }
        if let Err(e) = self.roll_back(served.slot(), Some(served), &reason) {
            tracing::warn!(slot = %served.slot(), module = served.module(), error = %e, reason, "failing handler not rolled back");
        }
    }

    /// Puts back the previous version of `slot` (or its built-in). `expected`: only if that
    /// version is still in force.
    pub(super) fn roll_back(
        &self,
        slot: &SlotKey,
        expected: Option<&Served>,
        reason: &str,
    ) -> Result<Arc<Served>, RollbackError> {
        let mut writer = self.lock_writer();
        let base = self.set.load_full();
        let state = base
            .slot(slot)
            .ok_or_else(|| RollbackError::NoSuchSlot(slot.clone()))?;
        if expected.is_some_and(|e| !std::ptr::eq(Arc::as_ptr(&state.current), e)) {
            return Ok(state.current.clone());
        }
        let builtin = self.builtins.for_slot(slot);
        let (handler, origin, signature) = match &state.previous {
            Some(previous) => (
                previous.handler().clone(),
                previous.origin().clone(),
                previous.signature().cloned(),
            ),
            None => match (builtin, state.current.origin()) {
                (Some(b), Origin::Configured { .. }) => (b.clone(), Origin::Builtin, None),
                (_, Origin::Builtin) => return Err(RollbackError::AlreadyBuiltin(slot.clone())),
                _ => return Err(RollbackError::NothingToRollBackTo(slot.clone())),
            },
        };
        let restored = Arc::new(
            self.served(slot.clone(), handler, origin.clone(), builtin, false)
                .with_signature(signature),
        );
        let next = base.with_slot(
            slot,
            Some(SlotState {
                current: restored.clone(),
                previous: None,
            }),
        );
        if let Origin::Configured { entry, sha256 } = state.current.origin() {
            writer.decisions.retain(|d| d.slot != *slot);
            writer.decisions.push(Decision {
                slot: slot.clone(),
                rejected: Version {
                    sha256: sha256.clone(),
                    entry: entry.clone(),
                },
                restored: match &origin {
                    Origin::Configured { entry, sha256 } => Some(Version {
                        sha256: sha256.clone(),
                        entry: entry.clone(),
                    }),
                    Origin::Builtin => None,
                },
                reason: reason.to_owned(),
                at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            });
        }
        self.persist(&mut writer, true, &next);
        // Published with its change record under one lock, as a transaction is.
        let mut changes = self.lock_changes();
        self.set.store(Arc::new(next));
        drop(writer);
        tracing::warn!(
            %slot,
            from = state.current.module(),
            from_sha256 = state.current.sha256(),
            to = restored.module(),
            to_sha256 = restored.sha256(),
            reason,
            "handler rolled back"
        );
        changes.slots.insert(
            slot.clone(),
            ChangeRecord {
                state: ChangeState::RolledBack,
                at: SystemTime::now(),
                reason: format!(
                    "{} (sha256 {}) rolled back to {} (sha256 {}): {reason}",
                    state.current.module(),
                    state.current.sha256(),
                    restored.module(),
                    restored.sha256()
                ),
                module: Some(restored.module().to_owned()),
                sha256: Some(restored.sha256().to_owned()),
            },
        );
        drop(changes);
        self.record(
            EventKind::HandlerRolledBack,
            || slot.id(),
            || {
                format!(
                    "{} (sha256 {}) rolled back to {} (sha256 {}): {reason}",
                    state.current.module(),
                    short(state.current.sha256()),
                    restored.module(),
                    short(restored.sha256())
                )
            },
        );
        let _ = self.events.send(HandlersEvent::RolledBack {
            slot: slot.clone(),
            reason: reason.to_owned(),
        });
        Ok(restored)
    }
}

/// Whether the slot of `decision` is still served by what the decision restored (else the
/// decision is void: the operator changed something since).
pub(super) fn next_names(set: &HandlerSet, decision: &Decision) -> bool {
    set.slot(&decision.slot)
        .is_some_and(|s| match (&decision.restored, s.current.origin()) {
            (None, Origin::Builtin) => true,
            (Some(v), Origin::Configured { entry, sha256 }) => {
                v.entry == *entry && v.sha256 == *sha256
            }
            _ => false,
        })
}
