//! The one registration pipeline. A plugin comes in by one of two doors — a registration
//! socket the plugin watcher found in `plugins_registry`, or a device plugin's `Register` on
//! `kubelet.sock` — and whichever it used, it goes through the same typed steps:
//!
//! ```text
//!             ┌──────────── same type and name: one at a time ────────────┐
//!  Candidate ─┤ validate hook ─▶ facts ─▶ register hook ─▶ activate        ├─▶ Registration
//!             └─ (kind)        (kind)                    (kind) ───────────┘        │
//!                                                                                   │ socket gone,
//!                                                                                   │ grace period over,
//!                                                                                   │ or replaced
//!                                                                                   ▼
//!                                                        deactivate (kind) ─▶ deregister hook (once)
//! ```
//!
//! The hooks belong to the handler module in force for the plugin type (WASM, in
//! `pluglet-handler-runtime`); the native steps around them belong to the plugin type's
//! [`PluginKind`] (CSI asks the driver's `NodeGetInfo`; a device plugin is connected to the
//! device manager); a kind whose facts need nothing the validate hook decides has them gathered
//! while the hook runs ([`PluginKind::facts_alongside_validate`]). The pipeline knows neither: it orders the steps, keeps the plugin
//! registered under each type and name (the `existing` its validate hook is shown), and ends
//! every registration exactly once.
//!
//! The kubelet behaviour this follows is written down in `docs/kubelet-compatibility.md`
//! ("Registration order" and "Register on the kubelet socket").

pub mod kind;
pub mod metrics;
pub mod pipeline;

pub use kind::{Facts, KindError, NoNativeSteps, PluginKind};
pub use pipeline::{
    Candidate, Door, EndReason, Pipeline, PipelineEvent, RegisterError, Registration, Stage,
};
