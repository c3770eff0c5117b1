//! What an operator runs and watches the daemon by: its health and readiness ([`health`]), the
//! supervision of its stages ([`supervise`]), the Prometheus metrics ([`metrics`]) and the HTTP
//! endpoint that serves them with `/healthz` and `/readyz` ([`http`]), and systemd's
//! notifications ([`notify`]).
pub mod health;
pub mod http;
pub mod metrics;
pub mod notify;
pub mod supervise;
