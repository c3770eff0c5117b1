//! Operations as data ([`Operation`]) and the steps each one runs (the kubelet's
//! `operation_generator.go`).
//!
//! Register, in the kubelet's order (facts §1, §6): dial (quick retries within the dial timeout) →
//! GetInfo (deadline) → handler by type → validate (with the plugin already registered under that
//! type and name) → type-specific facts (CSI NodeGetInfo) → register hook → type-specific activation
//! (device plugin: [`crate::plugin_types::device_plugin::DevicePluginSink::connect`]) →
//! NotifyRegistrationStatus (deadline). Dial, GetInfo, no-handler and validate failures are
//! [`RegisterOutcome::Failed`] (retried with backoff, the plugin told `false` each time it can be);
//! anything failing from the facts step on is [`RegisterOutcome::Refused`], which stands until the
//! socket is re-created. Deregister runs the deregister hook and deactivation without dialing.

use std::fmt::Write as _;
use std::sync::Arc;

use chrono::Utc;
use pluglet_handler_runtime::{CallContext, HandlerSet, PluginInfo, run_in_place};
use tracing::{debug, info, warn};

use super::actual_state::RegisteredNames;
use super::plugin::{Generation, PluginRecord, PluginType, SocketPath};
use super::registration::RegistrationClient;
use crate::config::Timings;
use crate::plugin_types::PluginTypes;

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
    /// Handler modules by plugin type.
    pub handlers: Arc<HandlerSet>,
    /// Type-specific steps (CSI NodeGetInfo, device plugin hand-off).
    pub plugin_types: Arc<PluginTypes>,
    /// Plugins registered by (type, name), for validate's `existing`.
    pub names: RegisteredNames,
    /// Deadlines.
    pub timings: Timings,
    /// Node name for handler calls.
    pub node_name: String,
}

/// How a register operation ended.
#[derive(Debug)]
pub enum RegisterOutcome {
    /// Registered; the plugin was told `true` (or telling it failed: `notify_error`).
    Registered {
        /// The new plugin record.
        record: PluginRecord,
        /// Why NotifyRegistrationStatus failed, if it did (the plugin stays registered).
        notify_error: Option<String>,
    },
    /// The register step refused it; the refusal stands until the socket is re-created.
    Refused {
        /// What is known about the plugin.
        record: PluginRecord,
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

/// Formats an error with its chain of sources, `outer: inner: innermost`.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        if !s.contains(&text) {
            let _ = write!(s, ": {text}");
        }
        source = inner.source();
    }
    s
}

/// Runs one register operation for `socket` at `generation`.
pub async fn register(
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
    let endpoint = if wire.endpoint.is_empty() {
        socket.to_string()
    } else {
        wire.endpoint.clone()
    };
    let plugin = PluginInfo {
        plugin_type: wire.r#type.clone(),
        name: wire.name.clone(),
        endpoint,
        supported_versions: wire.supported_versions.clone(),
    };
    let plugin_type = PluginType::parse(&plugin.plugin_type);
    let got_info = start.elapsed();
    debug!(%socket, plugin_type = %plugin_type, name = %plugin.name, "GetInfo answered");

    let Some(handler) = cx.handlers.for_plugin_type(&plugin.plugin_type) else {
        let reason = format!(
            "no handler registered for plugin type {}",
            plugin.plugin_type
        );
        notify(&mut client, &cx, &socket, false, &reason).await;
        return RegisterOutcome::Failed {
            info: Some(plugin),
            reason,
        };
    };

    // Validate: may be retried (the kubelet re-runs GetInfo and validate after backoff).
    let existing = cx.names.get(&plugin.plugin_type, &plugin.name);
    let call_cx = CallContext {
        node_name: cx.node_name.clone(),
    };
    let validated = {
        let handler = handler.clone();
        let plugin = plugin.clone();
        let call_cx = call_cx.clone();
        run_in_place(move || handler.validate(&call_cx, &plugin, existing.as_ref()))
    };
    let version = match validated {
        Ok(call) => match call.value {
            Ok(accepted) => accepted.version,
            Err(refusal) => {
                let reason = format!("plugin validation failed with err: {refusal}");
                notify(&mut client, &cx, &socket, false, &reason).await;
                return RegisterOutcome::Failed {
                    info: Some(plugin),
                    reason,
                };
            }
        },
        Err(e) => {
            let reason = format!("plugin validation failed with err: {}", error_chain(&e));
            notify(&mut client, &cx, &socket, false, &reason).await;
            return RegisterOutcome::Failed {
                info: Some(plugin),
                reason,
            };
        }
    };

    let validated_at = start.elapsed();
    let mut record = PluginRecord {
        socket: socket.clone(),
        generation,
        plugin_type: plugin_type.clone(),
        info: plugin.clone(),
        version,
        handler: handler.clone(),
        registered_at: Utc::now(),
        csi: None,
    };

    // Register step: from here on a failure stands until the socket is re-created.
    let refused = |record: PluginRecord, why: String| {
        let reason = format!("plugin registration failed with err: {why}");
        (record, reason)
    };
    let same_socket = (crate::plugin_types::csi::endpoint_path(&plugin.endpoint)
        == socket.as_path())
    .then(|| client.channel());
    let facts = match cx
        .plugin_types
        .gather_facts(&plugin_type, &plugin, same_socket)
        .await
    {
        Ok(f) => f,
        Err(e) => {
            let (record, reason) = refused(record, error_chain(&e));
            notify(&mut client, &cx, &socket, false, &reason).await;
            return RegisterOutcome::Refused { record, reason };
        }
    };
    record.csi = facts.csi.clone();
    let facts_at = start.elapsed();
    let registered = {
        let handler = handler.clone();
        let plugin = plugin.clone();
        let call_cx = call_cx.clone();
        let facts = facts.facts.clone();
        run_in_place(move || handler.register(&call_cx, &plugin, &facts))
    };
    let why = match registered {
        Ok(call) => call.value.err().map(|r| r.to_string()),
        Err(e) => Some(error_chain(&e)),
    };
    if let Some(why) = why {
        let (record, reason) = refused(record, why);
        notify(&mut client, &cx, &socket, false, &reason).await;
        return RegisterOutcome::Refused { record, reason };
    }
    if let Err(e) = cx.plugin_types.activate(&plugin_type, &plugin).await {
        // Undo the register hook before refusing.
        run_deregister_hook(&cx, &record).await;
        let (record, reason) = refused(record, error_chain(&e));
        notify(&mut client, &cx, &socket, false, &reason).await;
        return RegisterOutcome::Refused { record, reason };
    }

    record.registered_at = Utc::now();
    let registered_at = start.elapsed();
    let notify_error = notify(&mut client, &cx, &socket, true, "").await;
    let us = |d: std::time::Duration| d.as_micros() as u64;
    info!(
        %socket,
        plugin_type = %plugin_type,
        name = %plugin.name,
        version = record.version.as_deref().unwrap_or(""),
        handler = handler.module(),
        "plugin registered"
    );
    debug!(
        %socket,
        dial_us = us(dialed),
        get_info_us = us(got_info - dialed),
        validate_us = us(validated_at - got_info),
        facts_us = us(facts_at - validated_at),
        register_us = us(registered_at - facts_at),
        notify_us = us(start.elapsed() - registered_at),
        "registration steps"
    );
    RegisterOutcome::Registered {
        record,
        notify_error,
    }
}

/// Runs one deregister operation: type-specific deactivation and the deregister hook for a plugin
/// that was registered. No socket I/O (the socket is gone).
pub async fn deregister(cx: OperationContext, record: PluginRecord, was_registered: bool) {
    if !was_registered {
        debug!(socket = %record.socket, "forgetting refused plugin");
        return;
    }
    cx.plugin_types
        .deactivate(&record.plugin_type, &record.info)
        .await;
    run_deregister_hook(&cx, &record).await;
    info!(
        socket = %record.socket,
        plugin_type = %record.plugin_type,
        name = %record.info.name,
        "plugin deregistered"
    );
}

async fn run_deregister_hook(cx: &OperationContext, record: &PluginRecord) {
    let handler = record.handler.clone();
    let plugin = record.info.clone();
    let call_cx = CallContext {
        node_name: cx.node_name.clone(),
    };
    if let Err(e) = run_in_place(move || handler.deregister(&call_cx, &plugin)) {
        warn!(socket = %record.socket, error = %error_chain(&e), "deregister hook failed")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn error_chain_joins_sources_once() {
        let e = Outer(std::io::Error::other("inner"));
        assert_eq!(error_chain(&e), "outer: inner");
    }
}
