//! What an operator runs and watches the daemon by: its health and readiness ([`health`]), the
//! supervision of its stages ([`supervise`]), the Prometheus metrics ([`metrics`]) and the HTTP
//! endpoint that serves them with `/healthz` and `/readyz` ([`http`]), and systemd's
//! notifications ([`notify`]); the allocator, which returns what a burst of work freed once the
//! thread goes idle ([`memory`]). With the `test-hooks` feature (the test build only), the hooks the
//! end-to-end tests steer it by ([`test_hooks`]).
pub mod health;
pub mod http;
pub mod memory;
pub mod metrics;
pub mod notify;
pub mod supervise;
#[cfg(feature = "test-hooks")]
pub mod test_hooks;
