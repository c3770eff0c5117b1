//! Pluglet: the kubelet's plugin manager and device manager as a node daemon, with the
//! per-plugin-type decisions in sandboxed WASM handler modules.
//!
//! Start at [`daemon::run`] (what `pluglet run` does), which wires the stages' crates together.
//! Data flow:
//!
//! ```text
//!  plugins_registry/ ─inotify─▶ pluglet-plugin-manager: watcher ─▶ desired_state ─▶ reconciler ─plan()─▶ executor
//!                                                                              │ owns actual_state
//!                                      one task per socket: operation::register / deregister
//!                                        │ registration (GetInfo, NotifyRegistrationStatus over uds)
//!                                        ▼
//!  kubelet.sock Register ──▶ pluglet-registration Pipeline: validate hook → facts → register hook
//!   (pluglet-device-manager)   → activate; deactivate → deregister hook (WASM)
//!                              kinds: pluglet-csi (NodeGetInfo) · the device manager (endpoints)
//!
//!  handlers/ ─inotify─▶ pluglet-handlers: handlers.toml → transaction → ArcSwap set ──▶ every hook
//!                       call (the pipeline's, the allocator's policy); probation and rollback
//!
//!  admin::server (pluglet.sock, gRPC) ◀── PluginManagerHandle queries ──  reconciler
//!  admin::ctl (`pluglet ctl`) ──gRPC──▶ admin::server ──▶ DeviceManager
//!
//!  Pipeline · allocator · device registry · handler set ─record()─▶ pluglet_core::events::EventLog
//!    (ring of the last 1,000 + broadcast) ──▶ admin::server ListEvents / WatchEvents / GetStatus
//!  ops::health::Health (stages, readiness) ──▶ admin::server GetStatus
//! ```
//!
//! Modules: [`cli`] (clap types), [`config`] (paths and timings), [`daemon`] (wiring, lock,
//! signals), [`admin`], [`ops`] (metrics, health, supervision), [`fleet`], [`rollout`]
//! (fleet rollouts of handlers), [`handler_cmd`]
//! (`pluglet handler`), [`handler_oci`] (`pluglet handler push` and `pull`). The stages are crates of their own: `pluglet-plugin-manager`,
//! `pluglet-registration`, `pluglet-csi`, `pluglet-device-manager`, `pluglet-handlers`.

pub mod admin;
pub mod cli;
pub mod compile_child;
pub mod config;
pub mod daemon;
pub mod fleet;
pub mod handler_cmd;
pub mod handler_oci;
pub mod ops;
pub mod rollout;
