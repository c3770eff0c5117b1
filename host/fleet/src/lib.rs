//! Publishing a node to a Kubernetes API server: the node's device plugin resources in
//! `Node.status` and its CSI drivers in the `CSINode` object, the node id annotation and the
//! topology labels, as the kubelet's device manager and CSI plugin publish them, so that an
//! ordinary scheduler sees what a fleet of Pluglet machines offers. Pluglet does not become a
//! kubelet: it runs no pods and writes no Node conditions or lease.
//!
//! Data flow, one module per stage:
//!
//! ```text
//!  device manager (resource counts) ──┐
//!  CSI registrations (NodeGetInfo) ───┤► publisher::Publisher ── desired Inventory, one
//!                                     │   generation counter (never waits for the API server)
//!                                     ▼
//!                        publisher::run (the single writer task): coalesce, rate-limit,
//!                        back off; per round:
//!                          node::plan    ── Node metadata, then Node status (merge patches
//!                                           with the resourceVersion read: 409 → fresh read)
//!                          csinode::plan ── CSINode drivers (create, remove, replace)
//!                          node::plan    ── the ownership record narrowed last
//! ```
//!
//! What Pluglet owns on the Node is recorded on the Node itself (annotation
//! [`node::PUBLISHED_ANNOTATION`]), so a restarted daemon removes what it published before and
//! never touches cpu, memory or another agent's resources, labels or drivers. The rules followed
//! are in `docs/fleet.md`.

pub mod client;
pub mod csinode;
pub mod inventory;
pub mod node;
pub mod publisher;
pub mod rollout;

pub use client::{ClientError, Connection, Source};
pub use inventory::{Counts, CsiDriver, Inventory};
pub use publisher::{Publisher, PublisherConfig, State, SyncStatus};
