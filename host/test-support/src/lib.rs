//! What Pluglet's tests and benchmarks share; a dev-dependency only, never part of a shipped
//! binary.
//!
//! - [`stub`]: an in-process device plugin (the kubelet's `stub.go`) and a wait for an event;
//! - [`guests`]: a guest under a new sha256 and the allocation request benchmarks call with;
//! - [`pipeline`]: the built-in handlers and a registration from the pipeline, for a part of the
//!   device manager tested without the others;
//! - [`e2e`]: the end-to-end harness: a temporary root, the real `pluglet` daemon built with the
//!   test hooks, the example plugins as separate processes, `pluglet ctl`, a Kubernetes API
//!   server, an OCI registry, and condition waits with deadlines.

pub mod e2e;
pub mod guests;
pub mod pipeline;
pub mod stub;
