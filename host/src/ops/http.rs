//! The operator's HTTP endpoint (`--metrics-addr`): `/metrics`, `/healthz`, `/readyz`.
//!
//! - `/metrics`: the Prometheus text format 0.0.4 (`text/plain; version=0.0.4`), what the
//!   kubelet serves; OpenMetrics 1.0 (`application/openmetrics-text; version=1.0.0`) when the
//!   request's `Accept` asks for `application/openmetrics-text`, as Prometheus does.
//! - `/healthz`: 200 `ok` while every stage runs, 500 naming the stage that ended otherwise.
//! - `/readyz`: 200 `ok` once ready, 503 listing what it still waits for; `?verbose` lists
//!   every check either way, in the style of the Kubernetes components' health endpoints.

use std::fmt::Write as _;

use axum::Router;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::encoding::{prometheus_text, text};
use tokio_util::sync::CancellationToken;

use super::health::{Condition, Health};
use super::metrics::LateRegistry;

/// The OpenMetrics `Content-Type`.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone)]
struct Served {
    registry: LateRegistry,
    health: Health,
}

/// Serves the endpoints on `listener` until `cancel` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: LateRegistry,
    health: Health,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/livez", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(Served { registry, health });
    axum::serve(listener, app)
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await
}

async fn metrics(State(served): State<Served>, headers: HeaderMap) -> Response {
    let openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    let Some(registry) = served.registry.get() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "the daemon is starting: no metrics yet\n",
        )
            .into_response();
    };
    let mut body = String::with_capacity(16 * 1024);
    let (encoded, content_type) = if openmetrics {
        (text::encode(&mut body, registry), OPENMETRICS_CONTENT_TYPE)
    } else {
        (
            prometheus_text::encode(&mut body, registry),
            prometheus_text::CONTENT_TYPE,
        )
    };
    match encoded {
        Ok(()) => ([(header::CONTENT_TYPE, content_type)], body).into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "cannot encode the metrics\n",
        )
            .into_response(),
    }
}

async fn healthz(State(served): State<Served>, RawQuery(query): RawQuery) -> Response {
    let report = served.health.report();
    let mut body = String::new();
    let verbose = query.is_some_and(|q| q.split('&').any(|p| p == "verbose"));
    for stage in &report.stages {
        match &stage.ended {
            Some(cause) => {
                let _ = writeln!(body, "[-]{} failed: {cause}", stage.name);
            }
            None if verbose => {
                let _ = writeln!(body, "[+]{} ok", stage.name);
            }
            None => {}
        }
    }
    if report.live {
        body.push_str("ok\n");
        (StatusCode::OK, body).into_response()
    } else {
        body.push_str("healthz check failed\n");
        (StatusCode::INTERNAL_SERVER_ERROR, body).into_response()
    }
}

async fn readyz(State(served): State<Served>, RawQuery(query): RawQuery) -> Response {
    let report = served.health.report();
    let verbose = query.is_some_and(|q| q.split('&').any(|p| p == "verbose"));
    let mut body = String::new();
    for condition in Condition::ALL {
        let waiting = report.waiting_for.contains(&condition);
        if waiting {
            let _ = writeln!(body, "[-]{} waiting", condition.name());
        } else if verbose {
            let _ = writeln!(body, "[+]{} ok", condition.name());
        }
    }
    for stage in report.stages.iter().filter(|s| s.ended.is_some()) {
        let _ = writeln!(body, "[-]{} stopped", stage.name);
    }
    if report.ready {
        body.push_str("ok\n");
        (StatusCode::OK, body).into_response()
    } else {
        body.push_str("readyz check failed\n");
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    }
}
