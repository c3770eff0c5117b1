//! One hook run on an event read from JSON, and what it answered: the event of
//! `pluglet handler test --event` and of a case in a vectors file, and the outcome `handler test`
//! prints and a case expects.
//!
//! Event JSON:
//! - validate/register/deregister: a plugin as `pluglet ctl plugins -o json` prints it
//!   (`{"name", "type", "endpoint", "versions", "node_id"?, "max_volumes_per_node"?,
//!   "topology"?}`; other keys are ignored), plus `"existing": {same shape + "version"}?`; its
//!   CSI keys are the facts of register;
//! - allocate: `{"resource", "available": [{"id", "numa"}], "must_include", "count",
//!   "preferred"?}` (devices as `pluglet ctl resources -o json` prints them).

use std::collections::BTreeMap;

use pluglet_handler_runtime::{
    AllocationRequest, Call, CallContext, CandidateDevice, Handler, HandlerError, Hook, PluginInfo,
    Refusal, RegisteredPlugin, RegistrationFacts,
};
use serde::{Deserialize, Serialize};

/// The shape of the event of validate, register and deregister, for error messages.
pub const PLUGIN_EVENT_SHAPE: &str = "a plugin record: {\"name\", \"type\", \"endpoint\", \
     \"versions\", \"existing\"?, \"node_id\"?, \"max_volumes_per_node\"?, \"topology\"?}";

/// The shape of the event of allocate, for error messages.
pub const ALLOCATE_EVENT_SHAPE: &str = "an allocation request: {\"resource\", \"available\": \
     [{\"id\", \"numa\"}], \"must_include\", \"count\", \"preferred\"?}";

/// A plugin in an event, in the shape `pluglet ctl plugins -o json` prints.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct PluginRecord {
    /// Plugin name.
    pub name: String,
    /// Wire type string: `CSIPlugin`, `DevicePlugin`, ...
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// The plugin's endpoint.
    #[serde(default)]
    pub endpoint: String,
    /// Supported versions.
    #[serde(default)]
    pub versions: Vec<String>,
    /// Version chosen by the handler (of `existing`).
    #[serde(default)]
    pub version: Option<String>,
    /// CSI: NodeGetInfo's node id.
    #[serde(default)]
    pub node_id: Option<String>,
    /// CSI: NodeGetInfo's max volumes per node.
    #[serde(default)]
    pub max_volumes_per_node: Option<i64>,
    /// CSI: NodeGetInfo's accessible topology.
    #[serde(default)]
    pub topology: Option<BTreeMap<String, String>>,
}

impl PluginRecord {
    /// The plugin as the hooks see it.
    pub fn info(&self) -> PluginInfo {
        PluginInfo {
            plugin_type: self.plugin_type.clone(),
            name: self.name.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: self.versions.clone(),
        }
    }
}

/// The event of validate/register/deregister: the plugin, and the plugin already registered
/// under its type and name.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct PluginEvent {
    /// The plugin.
    #[serde(flatten)]
    pub plugin: PluginRecord,
    /// The plugin registered under the same type and name (validate).
    #[serde(default)]
    pub existing: Option<PluginRecord>,
}

/// An available device of an allocate event.
#[derive(Debug, Deserialize)]
struct DeviceRecord {
    id: String,
    #[serde(default)]
    numa: Vec<i64>,
}

/// The event of allocate, as read.
#[derive(Debug, Deserialize)]
struct AllocateEvent {
    resource: String,
    available: Vec<DeviceRecord>,
    #[serde(default)]
    must_include: Vec<String>,
    count: u32,
    #[serde(default)]
    preferred: Option<Vec<String>>,
}

/// A parsed event of one hook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Of validate, register or deregister.
    Plugin(Box<PluginEvent>),
    /// Of allocate.
    Allocate(AllocationRequest),
}

impl Event {
    /// The shape of the event `hook` takes, for error messages.
    pub fn shape(hook: Hook) -> &'static str {
        match hook {
            Hook::Allocate => ALLOCATE_EVENT_SHAPE,
            _ => PLUGIN_EVENT_SHAPE,
        }
    }

    /// Parses JSON text as the event `hook` takes. A syntax error and a wrong shape are told
    /// apart by [`serde_json::Error::is_data`].
    pub fn parse(hook: Hook, text: &str) -> Result<Event, serde_json::Error> {
        let value: serde_json::Value = serde_json::from_str(text)?;
        Event::from_value(hook, value)
    }

    /// Reads a JSON value as the event `hook` takes.
    pub fn from_value(hook: Hook, value: serde_json::Value) -> Result<Event, serde_json::Error> {
        if hook == Hook::Allocate {
            let event: AllocateEvent = serde_json::from_value(value)?;
            return Ok(Event::Allocate(AllocationRequest {
                resource: event.resource,
                available: event
                    .available
                    .into_iter()
                    .map(|d| CandidateDevice {
                        id: d.id,
                        numa_nodes: d.numa,
                    })
                    .collect(),
                must_include: event.must_include,
                count: event.count,
                preferred: event.preferred,
            }));
        }
        Ok(Event::Plugin(Box::new(serde_json::from_value(value)?)))
    }
}

/// What a hook answered, as `pluglet handler test -o json` prints it under `outcome`, and what
/// a case of a vectors file expects (where the optional fields left out are not compared, and
/// `message` never is).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case", deny_unknown_fields)]
pub enum Outcome {
    /// validate accepted the plugin.
    Accepted {
        /// The version chosen.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        version: Option<String>,
    },
    /// The hook refused.
    Refused {
        /// The refusal's kind, e.g. `unsatisfiable`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kind: Option<String>,
        /// The guest's message.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
    },
    /// register or deregister returned.
    Ok,
    /// allocate chose these device ids, in order.
    Allocated {
        /// The ids.
        devices: Vec<String>,
    },
    /// The call failed: a trap, the deadline, the memory cap or the fuel budget.
    Error {
        /// What failed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
    },
}

impl Outcome {
    /// The `result` tag.
    pub fn result(&self) -> &'static str {
        match self {
            Outcome::Accepted { .. } => "accepted",
            Outcome::Refused { .. } => "refused",
            Outcome::Ok => "ok",
            Outcome::Allocated { .. } => "allocated",
            Outcome::Error { .. } => "error",
        }
    }

    /// Whether `hook` can answer this outcome.
    pub fn fits(&self, hook: Hook) -> bool {
        match self {
            Outcome::Accepted { .. } => hook == Hook::Validate,
            Outcome::Refused { .. } => hook != Hook::Deregister,
            Outcome::Ok => matches!(hook, Hook::Register | Hook::Deregister),
            Outcome::Allocated { .. } => hook == Hook::Allocate,
            Outcome::Error { .. } => true,
        }
    }

    /// Whether `got` is what this expectation asks for: the same result, and the version, kind
    /// and devices (exact ids, in order) where the expectation gives them.
    pub fn matches(&self, got: &Outcome) -> bool {
        match (self, got) {
            (Outcome::Accepted { version: want }, Outcome::Accepted { version }) => {
                want.is_none() || want == version
            }
            (Outcome::Refused { kind: want, .. }, Outcome::Refused { kind, .. }) => {
                want.is_none() || want == kind
            }
            (Outcome::Ok, Outcome::Ok) => true,
            (Outcome::Allocated { devices: want }, Outcome::Allocated { devices }) => {
                want == devices
            }
            (Outcome::Error { .. }, Outcome::Error { .. }) => true,
            _ => false,
        }
    }

    fn refused(refusal: Refusal) -> Outcome {
        Outcome::Refused {
            kind: Some(refusal.kind.to_string()),
            message: Some(refusal.message),
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Accepted { version: Some(v) } => write!(f, "accepted (version {v})"),
            Outcome::Accepted { version: None } => write!(f, "accepted"),
            Outcome::Refused { kind, message } => {
                f.write_str("refused")?;
                if let Some(kind) = kind {
                    write!(f, " ({kind})")?;
                }
                if let Some(message) = message {
                    write!(f, ": {message}")?;
                }
                Ok(())
            }
            Outcome::Ok => write!(f, "ok"),
            Outcome::Allocated { devices } => write!(f, "allocated [{}]", devices.join(", ")),
            Outcome::Error { message: Some(m) } => write!(f, "error: {m}"),
            Outcome::Error { message: None } => write!(f, "error"),
        }
    }
}

/// Runs `hook` of `handler` on `event`. A guest's refusal is an outcome; a failed call (trap,
/// deadline, memory cap, fuel, a family the module lacks) is the error. An event of the other
/// kind than `hook` takes is answered as [`Outcome::Error`] without a call.
pub fn run_hook(
    handler: &Handler,
    cx: &CallContext,
    hook: Hook,
    event: &Event,
) -> Result<Call<Outcome>, HandlerError> {
    fn map<T>(call: Call<T>, f: impl FnOnce(T) -> Outcome) -> Call<Outcome> {
        Call {
            value: f(call.value),
            logs: call.logs,
            elapsed: call.elapsed,
            fuel_used: call.fuel_used,
        }
    }
    let event = match (hook, event) {
        (Hook::Allocate, Event::Allocate(request)) => {
            let call = handler.allocate(cx, request)?;
            return Ok(map(call, |v| match v {
                Ok(devices) => Outcome::Allocated { devices },
                Err(r) => Outcome::refused(r),
            }));
        }
        (Hook::Allocate, Event::Plugin(_)) | (_, Event::Allocate(_)) => {
            return Ok(Call {
                value: Outcome::Error {
                    message: Some(format!(
                        "hook {hook} takes {}; the event given is another",
                        Event::shape(hook)
                    )),
                },
                logs: Vec::new(),
                elapsed: std::time::Duration::ZERO,
                fuel_used: 0,
            });
        }
        (_, Event::Plugin(event)) => event,
    };
    let plugin = event.plugin.info();
    Ok(match hook {
        Hook::Validate => {
            let existing = event.existing.as_ref().map(|e| RegisteredPlugin {
                info: e.info(),
                version: e.version.clone(),
            });
            let call = handler.validate(cx, &plugin, existing.as_ref())?;
            map(call, |v| match v {
                Ok(a) => Outcome::Accepted { version: a.version },
                Err(r) => Outcome::refused(r),
            })
        }
        Hook::Register => {
            let facts = RegistrationFacts {
                node_id: event.plugin.node_id.clone(),
                max_volumes_per_node: event.plugin.max_volumes_per_node,
                topology: event.plugin.topology.clone().unwrap_or_default(),
            };
            let call = handler.register(cx, &plugin, &facts)?;
            map(call, |v| match v {
                Ok(()) => Outcome::Ok,
                Err(r) => Outcome::refused(r),
            })
        }
        Hook::Deregister => map(handler.deregister(cx, &plugin)?, |()| Outcome::Ok),
        Hook::Allocate => unreachable!("allocate is answered above"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(json: &str) -> Outcome {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn outcomes_read_with_optional_fields() {
        assert_eq!(
            outcome(r#"{"result": "accepted"}"#),
            Outcome::Accepted { version: None }
        );
        assert_eq!(
            outcome(r#"{"result": "refused", "kind": "unsatisfiable"}"#),
            Outcome::Refused {
                kind: Some("unsatisfiable".into()),
                message: None
            }
        );
        assert_eq!(outcome(r#"{"result": "ok"}"#), Outcome::Ok);
        assert_eq!(
            outcome(r#"{"result": "error"}"#),
            Outcome::Error { message: None }
        );
        assert!(serde_json::from_str::<Outcome>(r#"{"result": "maybe"}"#).is_err());
        assert!(serde_json::from_str::<Outcome>(r#"{"result": "allocated"}"#).is_err());
        let err = serde_json::from_str::<Outcome>(r#"{"result": "accepted", "versions": []}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `versions`"), "{err}");
    }

    #[test]
    fn printed_outcomes_read_back_as_themselves() {
        for o in [
            Outcome::Accepted {
                version: Some("1.5.0".into()),
            },
            Outcome::Refused {
                kind: Some("other".into()),
                message: Some("no".into()),
            },
            Outcome::Ok,
            Outcome::Allocated {
                devices: vec!["b".into(), "a".into()],
            },
            Outcome::Error {
                message: Some("trapped".into()),
            },
        ] {
            let text = serde_json::to_string(&o).unwrap();
            assert_eq!(outcome(&text), o, "{text}");
            assert!(o.matches(&o), "{o}");
        }
    }

    #[test]
    fn left_out_fields_and_messages_are_not_compared() {
        let got = Outcome::Refused {
            kind: Some("unsatisfiable".into()),
            message: Some("only 1 device".into()),
        };
        assert!(outcome(r#"{"result": "refused"}"#).matches(&got));
        assert!(
            outcome(r#"{"result": "refused", "kind": "unsatisfiable", "message": "other text"}"#)
                .matches(&got)
        );
        assert!(!outcome(r#"{"result": "refused", "kind": "other"}"#).matches(&got));
        assert!(!outcome(r#"{"result": "ok"}"#).matches(&got));

        let accepted = Outcome::Accepted {
            version: Some("1.5.0".into()),
        };
        assert!(outcome(r#"{"result": "accepted"}"#).matches(&accepted));
        assert!(outcome(r#"{"result": "accepted", "version": "1.5.0"}"#).matches(&accepted));
        assert!(!outcome(r#"{"result": "accepted", "version": "1.4.0"}"#).matches(&accepted));
        assert!(
            outcome(r#"{"result": "error", "message": "x"}"#).matches(&Outcome::Error {
                message: Some("y".into())
            })
        );
    }

    #[test]
    fn devices_are_compared_exactly_and_in_order() {
        let got = Outcome::Allocated {
            devices: vec!["a".into(), "b".into()],
        };
        assert!(outcome(r#"{"result": "allocated", "devices": ["a", "b"]}"#).matches(&got));
        assert!(!outcome(r#"{"result": "allocated", "devices": ["b", "a"]}"#).matches(&got));
        assert!(!outcome(r#"{"result": "allocated", "devices": ["a"]}"#).matches(&got));
    }

    #[test]
    fn outcomes_fit_their_hooks() {
        assert!(Outcome::Ok.fits(Hook::Register));
        assert!(!Outcome::Ok.fits(Hook::Validate));
        assert!(!Outcome::Allocated { devices: vec![] }.fits(Hook::Validate));
        assert!(Outcome::Error { message: None }.fits(Hook::Deregister));
        assert!(
            !Outcome::Refused {
                kind: None,
                message: None
            }
            .fits(Hook::Deregister)
        );
    }

    #[test]
    fn events_parse_by_hook() {
        let event = Event::parse(
            Hook::Validate,
            r#"{"name":"csi.example.com","type":"CSIPlugin","endpoint":"/x.sock",
                "versions":["1.0.0"],"state":"registered",
                "existing":{"name":"csi.example.com","type":"CSIPlugin","endpoint":"/y.sock",
                            "versions":["1.0.0"],"version":"1.0.0"},
                "node_id":"n1","topology":{"zone":"a"}}"#,
        )
        .unwrap();
        let Event::Plugin(event) = event else {
            panic!("a plugin event")
        };
        assert_eq!(event.plugin.info().supported_versions, vec!["1.0.0"]);
        assert_eq!(event.existing.unwrap().version.as_deref(), Some("1.0.0"));
        assert_eq!(event.plugin.node_id.as_deref(), Some("n1"));

        let event = Event::parse(
            Hook::Allocate,
            r#"{"resource":"vendor.com/gpu","available":[{"id":"d0","numa":[1],"health":"Healthy"}],
                "count":1}"#,
        )
        .unwrap();
        let Event::Allocate(request) = event else {
            panic!("an allocate event")
        };
        assert_eq!(request.available.iter().next().unwrap().1, [1]);
        assert!(request.must_include.is_empty() && request.preferred.is_none());

        let err = Event::parse(Hook::Validate, r#"{"resource": "x"}"#).unwrap_err();
        assert!(err.is_data(), "{err}");
        let err = Event::parse(Hook::Allocate, r#"{"resource": "#).unwrap_err();
        assert!(!err.is_data(), "{err}");
    }
}
