//! The coordinator's Lease `pluglet-system/pluglet-rollout-coordinator`: every candidate
//! watches it (a list by name, then a watch from its resourceVersion, made again when the API
//! server ends it), so at rest the API server sees one watch per daemon and the holder's
//! renewals, nothing else. A candidate that does not hold it acts only when what it saw changes
//! or when the Lease would expire by its own clock: the expiry is counted from the moment this
//! daemon saw the holder's last renewal (as client-go's leader election does), so clocks that
//! differ between nodes do not matter. Every write is a compare-and-swap on the resourceVersion
//! the candidate last saw or wrote: of two takers, one wins.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::types::NAMESPACE;
use super::watch::{Change, Stopped, list_then_watch};
use crate::client::Connection;
use crate::publisher::FIELD_MANAGER;

/// The Lease's name.
pub const LEASE_NAME: &str = "pluglet-rollout-coordinator";

/// The first wait after a failed list or watch (doubled up to 30 s).
const RETRY: Duration = Duration::from_millis(500);
const SLOW_RETRY: Duration = Duration::from_secs(30);

/// The Lease as this daemon last saw it through its watch.
#[derive(Clone, Debug)]
pub struct Seen {
    /// Whether the Lease was listed at least once (before that, nothing is known).
    pub listed: bool,
    /// The Lease, if it exists.
    pub lease: Option<Lease>,
    /// When its holder or renewal last changed, by this daemon's clock.
    pub changed_at: Instant,
}

impl Default for Seen {
    fn default() -> Seen {
        Seen {
            listed: false,
            lease: None,
            changed_at: Instant::now(),
        }
    }
}

/// What to do with the Lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseStep {
    /// No Lease: create it, holding it.
    Create,
    /// Held by this node: renew it.
    Renew,
    /// Held by nobody, or its holder let it expire: take it.
    Take,
    /// Another node holds it; it expires after this long unless renewed.
    Wait(Duration),
}

/// What `me` does with `lease`, whose holder or renewal this daemon saw change `since` ago.
pub fn lease_step(lease: Option<&Lease>, me: &str, since: Duration) -> LeaseStep {
    let Some(lease) = lease else {
        return LeaseStep::Create;
    };
    let spec = lease.spec.clone().unwrap_or_default();
    match spec.holder_identity.as_deref() {
        Some(holder) if holder == me => return LeaseStep::Renew,
        None | Some("") => return LeaseStep::Take,
        Some(_) => {}
    }
    let duration =
        Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0));
    match duration.checked_sub(since) {
        Some(left) if !left.is_zero() => LeaseStep::Wait(left),
        _ => LeaseStep::Take,
    }
}

/// Keeps `out` up to date with the Lease until `cancel` fires.
pub async fn follow(connection: Connection, out: watch::Sender<Seen>, cancel: CancellationToken) {
    let list_api: Api<Lease> = Api::namespaced(connection.client.clone(), NAMESPACE);
    let watch_api: Api<Lease> = Api::namespaced(connection.watch_client.clone(), NAMESPACE);
    let mut retry = RETRY;
    loop {
        let error = tokio::select! {
            _ = cancel.cancelled() => return,
            error = follow_once(&list_api, &watch_api, &out, &mut retry) => error,
        };
        debug!(error = %error, "the coordinator Lease watch ended; listing again");
        tokio::select! {
            _ = cancel.cancelled() => return,
            () = tokio::time::sleep(retry) => {}
        }
        retry = (retry * 2).min(SLOW_RETRY);
    }
}

/// One list and the watches that follow it; returns why it stopped.
async fn follow_once(
    list_api: &Api<Lease>,
    watch_api: &Api<Lease>,
    out: &watch::Sender<Seen>,
    retry: &mut Duration,
) -> String {
    let by_name = format!("metadata.name={LEASE_NAME}");
    let stopped = list_then_watch(list_api, watch_api, &by_name, |change| match change {
        Change::Listed(items) => {
            *retry = RETRY;
            publish(out, items.into_iter().next());
        }
        Change::Applied(lease) => publish(out, Some(lease)),
        Change::Deleted(_) => publish(out, None),
    })
    .await;
    match stopped {
        Stopped::Request(e) => e.to_string(),
        Stopped::Ended(message) => message,
    }
}

/// Publishes what was seen; the clock restarts only when the holder or its renewal changed.
fn publish(out: &watch::Sender<Seen>, lease: Option<Lease>) {
    let moved = |l: Option<&Lease>| {
        l.and_then(|l| l.spec.as_ref())
            .map(|s| (s.holder_identity.clone(), s.renew_time.clone()))
    };
    out.send_modify(|seen| {
        if !seen.listed || moved(seen.lease.as_ref()) != moved(lease.as_ref()) {
            seen.changed_at = Instant::now();
        }
        seen.listed = true;
        seen.lease = lease;
    });
}

/// The writes of one candidate, named `node`, with a Lease of `duration`.
pub struct Candidate {
    api: Api<Lease>,
    node: String,
    seconds: i32,
    /// The last failure said at warn level, so a lasting one is said once.
    said: Option<String>,
}

impl Candidate {
    /// A candidate writing through `connection`.
    pub fn new(connection: &Connection, node: String, duration: Duration) -> Candidate {
        Candidate {
            api: Api::namespaced(connection.client.clone(), NAMESPACE),
            node,
            seconds: i32::try_from(duration.as_secs()).unwrap_or(i32::MAX),
            said: None,
        }
    }

    /// Creates the Lease, holding it; the Lease as written.
    pub async fn create(&mut self) -> Option<Lease> {
        let now = MicroTime(Timestamp::now());
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(LEASE_NAME.into()),
                namespace: Some(NAMESPACE.into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.node.clone()),
                lease_duration_seconds: Some(self.seconds),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        let written = self.api.create(&params(), &lease).await;
        self.outcome(written, "create")
    }

    /// Takes `seen` (held by nobody, or expired), or renews it when `seen` is this node's own;
    /// the Lease as written.
    pub async fn take_or_renew(&mut self, seen: &Lease) -> Option<Lease> {
        let mut lease = seen.clone();
        let now = MicroTime(Timestamp::now());
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(self.node.as_str()) {
            spec.holder_identity = Some(self.node.clone());
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.lease_duration_seconds = Some(self.seconds);
        spec.renew_time = Some(now);
        let written = self.api.replace(LEASE_NAME, &params(), &lease).await;
        self.outcome(written, "update")
    }

    /// Gives `mine` up, so another candidate takes it at once.
    pub async fn release(&mut self, mine: &Lease) {
        let mut lease = mine.clone();
        if let Some(spec) = lease.spec.as_mut() {
            spec.holder_identity = None;
        }
        if let Err(e) = self.api.replace(LEASE_NAME, &params(), &lease).await {
            debug!(error = %e, "the coordinator Lease was not released");
        }
    }

    fn outcome(&mut self, written: Result<Lease, kube::Error>, verb: &str) -> Option<Lease> {
        match written {
            Ok(lease) => {
                self.said = None;
                Some(lease)
            }
            // Another candidate wrote first: the watch shows who.
            Err(kube::Error::Api(s)) if s.code == 409 => None,
            Err(e) => {
                let why = e.to_string();
                if self.said.as_deref() != Some(why.as_str()) {
                    match &e {
                        kube::Error::Api(s) if s.code == 404 => {
                            warn!(error = %e, "cannot {verb} the coordinator Lease {NAMESPACE}/{LEASE_NAME}: does the namespace {NAMESPACE} exist? (kubectl create namespace {NAMESPACE}); handler rollouts wait for a coordinator until it does")
                        }
                        kube::Error::Api(s) if s.code == 403 => {
                            warn!(error = %e, "not allowed to {verb} the coordinator Lease (see examples/deploy/rbac.yaml); handler rollouts wait for a coordinator until it is")
                        }
                        _ => warn!(error = %e, "cannot {verb} the coordinator Lease; trying again"),
                    }
                    self.said = Some(why);
                }
                None
            }
        }
    }
}

fn params() -> PostParams {
    PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PostParams::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: &str, seconds: i32) -> Lease {
        Lease {
            metadata: ObjectMeta::default(),
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                lease_duration_seconds: Some(seconds),
                renew_time: Some(MicroTime("2026-01-01T00:00:00Z".parse().unwrap())),
                ..LeaseSpec::default()
            }),
        }
    }

    #[test]
    fn the_lease_is_created_renewed_waited_for_and_taken_once_expired() {
        let s = Duration::from_secs;
        let held = lease("n1", 15);
        assert_eq!(lease_step(None, "n2", s(0)), LeaseStep::Create);
        assert_eq!(lease_step(Some(&held), "n1", s(30)), LeaseStep::Renew);
        assert_eq!(lease_step(Some(&held), "n2", s(14)), LeaseStep::Wait(s(1)));
        assert_eq!(lease_step(Some(&held), "n2", s(15)), LeaseStep::Take);
        assert_eq!(lease_step(Some(&held), "n2", s(16)), LeaseStep::Take);
        assert_eq!(
            lease_step(Some(&lease("", 15)), "n2", s(1)),
            LeaseStep::Take
        );
    }
}
