//! Operations as data ([`Operation`]) and the steps each one runs (the kubelet's
//! `operation_generator.go`).
//!
//! Register, in the kubelet's order (see `docs/kubelet-compatibility.md`, "Plugin
//! registration"): dial (quick retries within the dial timeout) → GetInfo (deadline) → the
//! registration pipeline (validate hook → the plugin type's facts → register hook → the plugin
//! type's activation) → NotifyRegistrationStatus (deadline). Dial, GetInfo, no-handler and
//! validate failures are [`RegisterOutcome::Failed`] (retried with backoff, the plugin told
//! `false` each time it can be); anything failing from the facts step on is
//! [`RegisterOutcome::Refused`], which stands until the socket is re-created. Deregister ends
//! the registration in the pipeline (deactivation, deregister hook) without dialing.

use std::sync::Arc;

use chrono::Utc;
use pluglet_core::error_chain;
use pluglet_handler_runtime::PluginInfo;
use pluglet_registration::{Candidate, Door, EndReason, Pipeline, Stage};
use tracing::{Instrument as _, debug, warn};

use super::plugin::{Generation, PluginType, SocketPath, SocketPlugin};
use super::registration::RegistrationClient;
use crate::timings::PluginManagerTimings;

/// Something the reconciler asks the executor to do for one socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Operation {
    /// Register the plugin behind this incarnation of the socket.
    Register {
        /// The socket.
        socket: SocketPath,
        /// Its incarnation.
        generation: Generation,
    },
    /// Deregister what was registered from this incarnation of the socket (it is gone or was
    /// re-created).
    Deregister {
        /// The socket.
        socket: SocketPath,
        /// The incarnation that registered.
        generation: Generation,
    },
}

impl Operation {
    /// The socket it is about (the executor's key).
    pub fn socket(&self) -> &SocketPath {
        match self {
            Operation::Register { socket, .. } | Operation::Deregister { socket, .. } => socket,
        }
    }

    /// The incarnation it is about.
    pub fn generation(&self) -> Generation {
        match self {
            Operation::Register { generation, .. } | Operation::Deregister { generation, .. } => {
                *generation
            }
        }
    }
}

/// Everything a register or deregister operation needs; shared by all operations.
#[derive(Clone)]
pub struct OperationContext {
    /// The registration pipeline (handler hooks and the plugin types' steps).
    pub pipeline: Pipeline,
    /// Deadlines.
    pub timings: Arc<PluginManagerTimings>,
    /// Socket seen → plugin notified, per plugin type.
    pub latency: super::metrics::RegistrationLatency,
}

/// How a register operation ended.
#[derive(Debug)]
pub enum RegisterOutcome {
    /// Registered; the plugin was told `true` (or telling it failed: `notify_error`).
    Registered {
        /// The new plugin record.
        record: SocketPlugin,
        /// Why NotifyRegistrationStatus failed, if it did (the plugin stays registered).
        notify_error: Option<String>,
    },
    /// The register step refused it; the refusal stands until the socket is re-created.
    Refused {
        /// What is known about the plugin.
        record: SocketPlugin,
        /// Why (also sent to the plugin).
        reason: String,
    },
    /// Failed before the register step; retried with backoff.
    Failed {
        /// GetInfo's answer, when it came.
        info: Option<PluginInfo>,
        /// Why (also sent to the plugin where possible).
        reason: String,
    },
}

/// Runs one register operation for `socket` at `generation`, in a `registration` span with the
/// socket, and the plugin's name and type once GetInfo told them.
pub async fn register(
    cx: OperationContext,
    socket: SocketPath,
    generation: Generation,
) -> RegisterOutcome {
    let span = tracing::info_span!(
        "registration",
        %socket,
        plugin_name = tracing::field::Empty,
        plugin_type = tracing::field::Empty,
    );
    run_register(cx, socket, generation).instrument(span).await
}

async fn run_register(
    cx: OperationContext,
    socket: SocketPath,
    generation: Generation,
) -> RegisterOutcome {
    let t = &cx.timings;
    let start = std::time::Instant::now();
    let mut client = match RegistrationClient::connect(&socket, t.dial_timeout).await {
        Ok(c) => c,
        Err(e) => {
            return RegisterOutcome::Failed {
                info: None,
                reason: error_chain(&e),
            };
        }
    };
    let dialed = start.elapsed();
    let wire = match client.get_info(t.get_info_timeout).await {
        Ok(info) => info,
        Err(e) => {
            let reason = error_chain(&e);
            notify(&mut client, &cx, &socket, false, &reason).await;
            return RegisterOutcome::Failed { info: None, reason };
        }
    };
    if wire.r#type.is_empty() {
        let reason = format!(
            "GetInfo on socket {socket} answered an empty plugin type; a plugin must name its \
             type ({}, {}, {} or one handlers.toml maps)",
            pluglet_core::names::CSI_PLUGIN,
            pluglet_core::names::DEVICE_PLUGIN,
            pluglet_core::names::DRA_PLUGIN
        );
        notify(&mut client, &cx, &socket, false, &reason).await;
        return RegisterOutcome::Failed { info: None, reason };
    }
    let endpoint = if wire.endpoint.is_empty() {
        socket.to_string()
    } else {
        wire.endpoint
    };
    let plugin = PluginInfo {
        plugin_type: wire.r#type,
        name: wire.name,
        endpoint,
        supported_versions: wire.supported_versions,
    };
    let got_info = start.elapsed();
    let span = tracing::Span::current();
    span.record("plugin_name", plugin.name.as_str());
    span.record("plugin_type", plugin.plugin_type.as_str());
    debug!(%socket, plugin_type = %plugin.plugin_type, name = %plugin.name, "GetInfo answered");

    let candidate = Candidate {
        info: plugin.clone(),
        door: Door::Registry {
            socket: socket.clone(),
            generation,
        },
        connection: Some(client.channel()),
    };
    let registered = cx.pipeline.register(candidate).await;
    let mut record = SocketPlugin {
        socket: socket.clone(),
        generation,
        plugin_type: PluginType::parse(&plugin.plugin_type),
        info: plugin,
        registered_at: Utc::now(),
        registration: None,
    };
    let piped = start.elapsed();
    let outcome = match registered {
        Ok(registration) => {
            record.registration = Some(registration);
            let notify_error = notify(&mut client, &cx, &socket, true, "").await;
            RegisterOutcome::Registered {
                record,
                notify_error,
            }
        }
        Err(err) => {
            // The kubelet's wording, so that plugins and people see the usual prefixes.
            let reason = match err.stage() {
                Stage::Handler => error_chain(&err),
                Stage::Validate => {
                    format!("plugin validation failed with err: {}", error_chain(&err))
                }
                _ => format!("plugin registration failed with err: {}", error_chain(&err)),
            };
            notify(&mut client, &cx, &socket, false, &reason).await;
            match err.stage() {
                Stage::Handler | Stage::Validate => RegisterOutcome::Failed {
                    info: Some(record.info),
                    reason,
                },
                _ => RegisterOutcome::Refused { record, reason },
            }
        }
    };
    let us = |d: std::time::Duration| d.as_micros() as u64;
    debug!(
        %socket,
        dial_us = us(dialed),
        get_info_us = us(got_info - dialed),
        pipeline_us = us(piped - got_info),
        notify_us = us(start.elapsed() - piped),
        "registration operation steps"
    );
    outcome
}

/// Runs one deregister operation: ends the plugin's registration in the pipeline (its plugin
/// type's deactivation, then the deregister hook). No socket I/O (the socket is gone).
pub async fn deregister(cx: OperationContext, record: SocketPlugin) {
    match &record.registration {
        Some(registration) => {
            cx.pipeline
                .deregister(registration, EndReason::SocketGone)
                .await
        }
        None => debug!(socket = %record.socket, "forgetting refused plugin"),
    }
}

/// Tells the plugin the outcome; returns why that failed, if it did.
async fn notify(
    client: &mut RegistrationClient,
    cx: &OperationContext,
    socket: &SocketPath,
    registered: bool,
    error: &str,
) -> Option<String> {
    if !registered {
        warn!(%socket, reason = error, "registration failed");
    }
    match client
        .notify(registered, error, cx.timings.notify_timeout)
        .await
    {
        Ok(()) => None,
        Err(e) => {
            let e = error_chain(&e);
            warn!(%socket, error = %e, "failed to send registration status");
            Some(e)
        }
    }
}
