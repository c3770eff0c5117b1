//! The daemon's one watch of HandlerRollouts: a list, then a watch from its resourceVersion,
//! made again when the API server ends it, and listed again after an error or a `410 Gone`.
//! What it holds is published whole on a `tokio::sync::watch` channel that the node agent and
//! the coordinator read. A missing CRD (404) or a refusal (403) is logged once and retried
//! slowly; anything else is retried with a backoff.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use tokio::sync::watch;
use tokio_stream::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::types::HandlerRollout;
use crate::client::{Connection, WATCH_TIMEOUT};

/// Every HandlerRollout, by name.
pub type Rollouts = Arc<BTreeMap<String, HandlerRollout>>;

/// The wait before listing again after a 404 (no CRD) or a 403 (no permission).
pub const SLOW_RETRY: Duration = Duration::from_secs(30);
/// The first wait after another failure (doubled up to [`SLOW_RETRY`]).
const RETRY: Duration = Duration::from_millis(500);

/// Why a list or watch failed, for the log: said once per kind of failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Failure {
    NoCrd,
    Forbidden,
    Other,
}

/// Keeps `out` up to date with the API server's HandlerRollouts until `cancel` fires.
pub async fn run(connection: Connection, out: watch::Sender<Rollouts>, cancel: CancellationToken) {
    let list_api: Api<HandlerRollout> = Api::all(connection.client.clone());
    let watch_api: Api<HandlerRollout> = Api::all(connection.watch_client.clone());
    let mut said: Option<Failure> = None;
    let mut retry = RETRY;
    loop {
        let failure = tokio::select! {
            _ = cancel.cancelled() => return,
            failure = follow(&list_api, &watch_api, &out, &mut said, &mut retry) => failure,
        };
        let wait = match failure {
            Failure::NoCrd | Failure::Forbidden => SLOW_RETRY,
            Failure::Other => retry,
        };
        retry = (retry * 2).min(SLOW_RETRY);
        tokio::select! {
            _ = cancel.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// What one list-then-watch saw.
pub(super) enum Change<K> {
    /// Every object, from a list.
    Listed(Vec<K>),
    /// An object added or modified.
    Applied(K),
    /// An object deleted.
    Deleted(K),
}

/// Why a list-then-watch stopped.
pub(super) enum Stopped {
    /// The list or a watch request failed.
    Request(kube::Error),
    /// The API server ended the watch with an error event (e.g. `410 Gone`): list again.
    Ended(String),
}

/// One list (with `fields` as its field selector; empty: every object) and the watches that
/// follow it from its resourceVersion, each made again when the API server ends it; `on` sees
/// the list, then every event. Returns why it stopped.
pub(super) async fn list_then_watch<K>(
    list_api: &Api<K>,
    watch_api: &Api<K>,
    fields: &str,
    mut on: impl FnMut(Change<K>),
) -> Stopped
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let list = match list_api.list(&ListParams::default().fields(fields)).await {
        Ok(list) => list,
        Err(e) => return Stopped::Request(e),
    };
    let mut version = list.metadata.resource_version.unwrap_or_default();
    on(Change::Listed(list.items));
    loop {
        let params = WatchParams::default()
            .fields(fields)
            .timeout(WATCH_TIMEOUT)
            .disable_bookmarks();
        let stream = match watch_api.watch(&params, &version).await {
            Ok(stream) => stream,
            Err(e) => return Stopped::Request(e),
        };
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(WatchEvent::Added(o) | WatchEvent::Modified(o)) => {
                    version = o.meta().resource_version.clone().unwrap_or(version);
                    on(Change::Applied(o));
                }
                Ok(WatchEvent::Deleted(o)) => {
                    version = o.meta().resource_version.clone().unwrap_or(version);
                    on(Change::Deleted(o));
                }
                Ok(WatchEvent::Bookmark(b)) => version = b.metadata.resource_version,
                Ok(WatchEvent::Error(e)) => return Stopped::Ended(e.message),
                Err(e) => return Stopped::Request(e),
            }
        }
    }
}

/// One list and the watches that follow it; returns why it stopped.
async fn follow(
    list_api: &Api<HandlerRollout>,
    watch_api: &Api<HandlerRollout>,
    out: &watch::Sender<Rollouts>,
    said: &mut Option<Failure>,
    retry: &mut Duration,
) -> Failure {
    let mut held: BTreeMap<String, HandlerRollout> = BTreeMap::new();
    let stopped = list_then_watch(list_api, watch_api, "", |change| {
        match change {
            Change::Listed(items) => {
                if said.take().is_some() {
                    info!("HandlerRollouts can be read again");
                }
                *retry = RETRY;
                held = items
                    .into_iter()
                    .map(|r| (r.name().to_owned(), r))
                    .collect();
                // Always sent: the node agent waits for the first list, even an empty one.
                out.send_replace(Arc::new(held.clone()));
                return;
            }
            Change::Applied(r) => {
                held.insert(r.name().to_owned(), r);
            }
            Change::Deleted(r) => {
                held.remove(r.name());
            }
        }
        out.send_if_modified(|now| {
            if **now == held {
                false
            } else {
                *now = Arc::new(held.clone());
                true
            }
        });
    })
    .await;
    match stopped {
        Stopped::Request(e) => failed(&e, said),
        Stopped::Ended(message) => {
            debug!(%message, "the HandlerRollout watch ended; listing again");
            Failure::Other
        }
    }
}

fn failed(error: &kube::Error, said: &mut Option<Failure>) -> Failure {
    // By code: a group the API server does not serve answers a bare "404 page not found".
    let failure = match error {
        kube::Error::Api(s) if s.code == 404 => Failure::NoCrd,
        kube::Error::Api(s) if s.code == 403 => Failure::Forbidden,
        _ => Failure::Other,
    };
    if *said != Some(failure) {
        match failure {
            Failure::NoCrd => warn!(
                "the HandlerRollout CRD is not installed (kubectl apply -f examples/deploy/handlerrollout-crd.yaml); handler rollouts are off until it is, checked every {}s",
                SLOW_RETRY.as_secs()
            ),
            Failure::Forbidden => {
                warn!(error = %error, "not allowed to read HandlerRollouts (see examples/deploy/rbac.yaml); checked every {}s", SLOW_RETRY.as_secs())
            }
            Failure::Other => warn!(error = %error, "cannot watch HandlerRollouts; retrying"),
        }
        *said = Some(failure);
    }
    failure
}
