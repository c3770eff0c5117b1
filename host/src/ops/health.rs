//! The daemon's own health: which of its stages run and which of the conditions readiness waits
//! for are met.
//!
//! One [`Health`] per daemon, shared by the stages (which report themselves), the HTTP endpoints
//! (`/healthz`, `/readyz`), the admin API's status and systemd's notification. Live = no stage
//! has ended; a stage that ends while the daemon runs stops the daemon (it never runs
//! half-alive). Ready = live and every [`Condition`] met.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::watch;

/// What readiness waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Condition {
    /// The handler modules are loaded (built-ins and `handlers.toml`).
    HandlersLoaded,
    /// The device manager's checkpoint is restored.
    CheckpointRestored,
    /// `kubelet.sock` accepts device plugin registrations.
    KubeletSocketServing,
    /// The registry directory's start-up scan is done.
    RegistryScanned,
    /// The admin socket accepts `pluglet ctl`.
    AdminSocketServing,
}

impl Condition {
    /// Every condition, in the order the daemon meets them.
    pub const ALL: [Condition; 5] = [
        Condition::HandlersLoaded,
        Condition::CheckpointRestored,
        Condition::KubeletSocketServing,
        Condition::RegistryScanned,
        Condition::AdminSocketServing,
    ];

    /// Its name in `/readyz` and `ctl status`.
    pub fn name(self) -> &'static str {
        match self {
            Condition::HandlersLoaded => "handlers-loaded",
            Condition::CheckpointRestored => "checkpoint-restored",
            Condition::KubeletSocketServing => "kubelet-socket-serving",
            Condition::RegistryScanned => "registry-scanned",
            Condition::AdminSocketServing => "admin-socket-serving",
        }
    }
}

/// One stage of the daemon as health sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageStatus {
    /// The stage's name (`watcher`, `reconciler`, `device-manager`, ...).
    pub name: &'static str,
    /// Why it ended; `None` while it runs.
    pub ended: Option<String>,
}

/// A point-in-time view of the daemon's health.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthReport {
    /// Since the daemon started.
    pub uptime: Duration,
    /// When it started.
    pub started_at: SystemTime,
    /// No stage has ended.
    pub live: bool,
    /// Live and every condition met.
    pub ready: bool,
    /// Conditions not met yet.
    pub waiting_for: Vec<Condition>,
    /// Every stage started so far.
    pub stages: Vec<StageStatus>,
}

/// The daemon's health, shared by its stages; cheap to clone.
#[derive(Clone, Debug)]
pub struct Health(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    started: Instant,
    started_at: SystemTime,
    state: Mutex<State>,
    ready: watch::Sender<bool>,
}

#[derive(Debug, Default)]
struct State {
    met: Vec<Condition>,
    stages: BTreeMap<&'static str, Option<String>>,
}

impl Default for Health {
    fn default() -> Health {
        Health::new()
    }
}

impl Health {
    /// Health at start: live, nothing met.
    pub fn new() -> Health {
        Health(Arc::new(Inner {
            started: Instant::now(),
            started_at: SystemTime::now(),
            state: Mutex::default(),
            ready: watch::Sender::new(false),
        }))
    }

    /// Marks `condition` met.
    pub fn met(&self, condition: Condition) {
        let mut state = self.state();
        if !state.met.contains(&condition) {
            state.met.push(condition);
        }
        self.publish(&state);
    }

    /// A stage started (or is watched from now on).
    pub fn stage_started(&self, name: &'static str) {
        self.state().stages.insert(name, None);
    }

    /// A stage ended, with why.
    pub fn stage_ended(&self, name: &'static str, cause: impl Into<String>) {
        let mut state = self.state();
        state.stages.insert(name, Some(cause.into()));
        self.publish(&state);
    }

    /// No stage has ended.
    pub fn is_live(&self) -> bool {
        self.state().stages.values().all(Option::is_none)
    }

    /// Live and every condition met.
    pub fn is_ready(&self) -> bool {
        *self.0.ready.borrow()
    }

    /// Follows readiness (for systemd's `READY=1`).
    pub fn subscribe_ready(&self) -> watch::Receiver<bool> {
        self.0.ready.subscribe()
    }

    /// The health as of now.
    pub fn report(&self) -> HealthReport {
        let state = self.state();
        let live = state.stages.values().all(Option::is_none);
        let waiting_for: Vec<Condition> = Condition::ALL
            .into_iter()
            .filter(|c| !state.met.contains(c))
            .collect();
        HealthReport {
            uptime: self.0.started.elapsed(),
            started_at: self.0.started_at,
            live,
            ready: live && waiting_for.is_empty(),
            waiting_for,
            stages: state
                .stages
                .iter()
                .map(|(name, ended)| StageStatus {
                    name,
                    ended: ended.clone(),
                })
                .collect(),
        }
    }

    fn publish(&self, state: &State) {
        let ready = state.stages.values().all(Option::is_none)
            && Condition::ALL.iter().all(|c| state.met.contains(c));
        self.0
            .ready
            .send_if_modified(|r| std::mem::replace(r, ready) != ready);
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_once_every_condition_is_met_and_no_longer_once_a_stage_ends() {
        let health = Health::new();
        let ready = health.subscribe_ready();
        health.stage_started("watcher");
        for c in Condition::ALL {
            assert!(!health.is_ready(), "ready before {}", c.name());
            health.met(c);
        }
        assert!(health.is_ready() && *ready.borrow());
        assert!(health.report().waiting_for.is_empty());
        health.stage_ended("watcher", "the inotify watch failed");
        let report = health.report();
        assert!(!report.live && !report.ready && !health.is_ready());
        assert_eq!(
            report.stages,
            [StageStatus {
                name: "watcher",
                ended: Some("the inotify watch failed".into())
            }]
        );
    }
}
