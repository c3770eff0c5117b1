//! Fleet rollouts of a handler: a `HandlerRollout` on the API server puts one module on one
//! slot of the selected nodes, wave by wave, and halts and rolls back the fleet when too many
//! nodes roll it back (`docs/fleet.md`, "Rolling out a handler").
//!
//! Data flow, one module per stage:
//!
//! ```text
//!  API server ── watch (one per daemon: list, watch, resume) ──▶ every HandlerRollout
//!     ├─▶ agent (every daemon): the rollouts naming this node in an opened wave
//!     │     ─▶ NodeHandlers::apply (the handler set's transaction, off the reactor)
//!     │     ─▶ soak followed ─▶ NodeHandlerStatus/<node> written (its own object only)
//!     └─▶ coordinator (the Lease holder; every daemon watches the Lease): Nodes selected + every node's report
//!           ─▶ decide (pure; waves for membership) ─▶ HandlerRollout status
//! ```
//!
//! `types` holds the API objects; `waves` and `decide` are pure and tested without an API
//! server.

pub mod agent;
pub mod coordinator;
pub mod decide;
pub mod lease;
pub mod types;
pub mod watch;
pub mod waves;

pub use agent::{Agent, AgentView, NodeHandlers, Observation, Wanted};
pub use coordinator::{Coordinator, CoordinatorStats, DEFAULT_LEASE_DURATION};
pub use lease::LEASE_NAME;
pub use types::{HandlerRollout, NodeRollout, NodeState, Phase, RolloutSpec};
