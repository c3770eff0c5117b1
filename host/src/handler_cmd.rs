//! `pluglet handler`: try a handler module without a node.
//!
//! - `pluglet handler check MODULE`: compiles and admits the module, prints the contract version
//!   and the hook families read from the component, its sha256 and the compile time; a file that
//!   is not a component, a component of another contract or one with forbidden imports is refused
//!   with the reason (non-zero exit).
//! - `pluglet handler test MODULE --hook validate|register|deregister|allocate --event FILE.json
//!   [--setting k=v]... [--node-name N] [-o json|text]`: runs one hook on the event and prints the
//!   outcome, the compile time and the call time separately, and the guest's log lines.
//!
//! `MODULE` is a `.wasm` path, or `builtin:csi` / `builtin:device-plugin` for the handlers
//! embedded in this binary. Event JSON (the shape `pluglet ctl plugins -o json` prints):
//! - validate/register/deregister: `{"name": .., "type": "CSIPlugin", "endpoint": .., "versions":
//!   [..], "existing": {same shape + "version"}?, "node_id": ..?, "max_volumes_per_node": ..?,
//!   "topology": {..}?}`
//! - allocate: `{"resource": "vendor.com/gpu", "available": [{"id": "d0", "numa": [0]}],
//!   "must_include": [], "count": 1, "preferred": ["d0"]?}`

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use pluglet_handler_runtime::{
    AllocationRequest, CallContext, Device, GuestLog, Handler, Limits, ModuleSource, PluginInfo,
    RegisteredPlugin, RegistrationFacts, Runtime, RuntimeConfig,
};
use serde::{Deserialize, Serialize};

/// Arguments of `pluglet handler`.
#[derive(Debug, Clone, clap::Args)]
pub struct HandlerArgs {
    /// What to do with the module.
    #[command(subcommand)]
    pub command: HandlerCommand,
}

/// `pluglet handler` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum HandlerCommand {
    /// Compile and admit a module; print its contract version, hook families and sha256.
    Check(CheckArgs),
    /// Run one hook of a module on an event read from JSON.
    Test(TestArgs),
}

/// Arguments of `pluglet handler check`.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    /// The module: a `.wasm` component file, or `builtin:csi` / `builtin:device-plugin`.
    pub module: String,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

/// Arguments of `pluglet handler test`.
#[derive(Debug, Clone, clap::Args)]
pub struct TestArgs {
    /// The module: a `.wasm` component file, or `builtin:csi` / `builtin:device-plugin`.
    pub module: String,
    /// The hook to run.
    #[arg(long, value_enum)]
    pub hook: HookArg,
    /// JSON file holding the plugin record (validate/register/deregister) or the allocation
    /// request (allocate).
    #[arg(long)]
    pub event: PathBuf,
    /// A setting of the handler, `key=value` (repeatable).
    #[arg(long = "setting", value_parser = parse_setting)]
    pub settings: Vec<(String, String)>,
    /// Node name the `node-name` import answers.
    #[arg(long, default_value = "test-node")]
    pub node_name: String,
    /// CPU deadline of the call in milliseconds (default: the daemon's, 50).
    #[arg(long)]
    pub deadline_ms: Option<u64>,
    /// Memory cap of the call in MiB (default: the daemon's, 16).
    #[arg(long)]
    pub memory_mib: Option<u32>,
    /// Fuel budget of the call (default: the daemon's, 50000000).
    #[arg(long)]
    pub fuel: Option<u64>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

/// A hook to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HookArg {
    /// `registration.validate`.
    Validate,
    /// `registration.register`.
    Register,
    /// `registration.deregister`.
    Deregister,
    /// `allocation-policy.allocate`.
    Allocate,
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// For people.
    Text,
    /// One JSON object.
    Json,
}

fn parse_setting(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(format!("setting {text:?} is not key=value")),
    }
}

/// Runs `pluglet handler`. A refused module (`check`) or a failed hook call (`test`: trap,
/// deadline, memory cap) is an error; a guest's refusal is a normal outcome of `test`.
pub fn run(args: HandlerArgs) -> anyhow::Result<()> {
    match args.command {
        HandlerCommand::Check(args) => check(args),
        HandlerCommand::Test(args) => test(args),
    }
}

fn module_source(module: &str) -> anyhow::Result<ModuleSource> {
    Ok(match module {
        "builtin:csi" => ModuleSource::Builtin {
            name: "csi".into(),
            bytes: pluglet_wasm_guests::CSI,
        },
        "builtin:device-plugin" => ModuleSource::Builtin {
            name: "device-plugin".into(),
            bytes: pluglet_wasm_guests::DEVICE_PLUGIN,
        },
        other if other.starts_with("builtin:") => {
            bail!(
                "unknown built-in handler {other}; built-ins are builtin:csi and builtin:device-plugin"
            )
        }
        path => ModuleSource::File(PathBuf::from(path)),
    })
}

fn runtime(limits: Limits) -> anyhow::Result<Runtime> {
    // One call at a time: a small pool keeps the address-space reservation small.
    Ok(Runtime::new(RuntimeConfig {
        pool_size: 2,
        default_limits: limits,
        ..RuntimeConfig::default()
    })?)
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[derive(Serialize)]
struct CheckReport<'a> {
    module: &'a str,
    contract_version: &'a str,
    families: Vec<String>,
    sha256: &'a str,
    compile_ms: f64,
}

fn check(args: CheckArgs) -> anyhow::Result<()> {
    let runtime = runtime(Limits::default())?;
    let handler = runtime.load(module_source(&args.module)?, BTreeMap::new(), None)?;
    let report = CheckReport {
        module: handler.module(),
        contract_version: handler.contract_version(),
        families: handler.families().iter().map(|f| f.to_string()).collect(),
        sha256: handler.sha256(),
        compile_ms: millis(handler.compile_time()),
    };
    match args.output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        OutputFormat::Text => {
            println!("module:    {}", report.module);
            println!("contract:  pluglet:handler@{}", report.contract_version);
            println!("families:  {}", report.families.join(", "));
            println!("sha256:    {}", report.sha256);
            println!("compiled:  {:.1} ms", report.compile_ms);
            println!("ok: the module can be used as a handler");
        }
    }
    Ok(())
}

/// A plugin record as `pluglet ctl plugins -o json` prints it.
#[derive(Debug, Clone, Deserialize)]
struct PluginRecord {
    name: String,
    #[serde(rename = "type")]
    plugin_type: String,
    #[serde(default)]
    endpoint: String,
    #[serde(default)]
    versions: Vec<String>,
    #[serde(default)]
    version: Option<String>,
}

impl PluginRecord {
    fn info(&self) -> PluginInfo {
        PluginInfo {
            plugin_type: self.plugin_type.clone(),
            name: self.name.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: self.versions.clone(),
        }
    }
}

/// The event of validate/register/deregister.
#[derive(Debug, Deserialize)]
struct PluginEvent {
    #[serde(flatten)]
    plugin: PluginRecord,
    #[serde(default)]
    existing: Option<PluginRecord>,
    #[serde(default)]
    node_id: Option<String>,
    #[serde(default)]
    max_volumes_per_node: Option<i64>,
    #[serde(default)]
    topology: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
struct DeviceRecord {
    id: String,
    #[serde(default)]
    numa: Vec<i64>,
}

/// The event of allocate.
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

/// What a hook answered.
#[derive(Debug, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
enum Outcome {
    Accepted { version: Option<String> },
    Refused { kind: String, message: String },
    Ok,
    Allocated { devices: Vec<String> },
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Accepted { version: Some(v) } => write!(f, "accepted (version {v})"),
            Outcome::Accepted { version: None } => write!(f, "accepted"),
            Outcome::Refused { kind, message } => write!(f, "refused ({kind}): {message}"),
            Outcome::Ok => write!(f, "ok"),
            Outcome::Allocated { devices } => write!(f, "allocated: {}", devices.join(", ")),
        }
    }
}

#[derive(Serialize)]
struct TestReport<'a> {
    module: &'a str,
    contract_version: &'a str,
    families: Vec<String>,
    sha256: &'a str,
    hook: &'static str,
    outcome: Outcome,
    compile_ms: f64,
    call_ms: f64,
    logs: Vec<GuestLog>,
}

fn test(args: TestArgs) -> anyhow::Result<()> {
    let mut limits = Limits::default();
    if let Some(ms) = args.deadline_ms {
        limits.deadline = Duration::from_millis(ms);
    }
    if let Some(mib) = args.memory_mib {
        limits.memory_mib = mib;
    }
    if let Some(fuel) = args.fuel {
        limits.fuel = Some(fuel);
    }
    let text = std::fs::read_to_string(&args.event)
        .with_context(|| format!("cannot read the event file {}", args.event.display()))?;
    let runtime = runtime(limits)?;
    let settings: BTreeMap<String, String> = args.settings.iter().cloned().collect();
    let handler = runtime.load(module_source(&args.module)?, settings, None)?;
    let cx = CallContext {
        node_name: args.node_name.clone(),
    };
    let (hook, outcome, elapsed, logs) = run_hook(&handler, &cx, args.hook, &text)
        .with_context(|| format!("event file {}", args.event.display()))?;
    let report = TestReport {
        module: handler.module(),
        contract_version: handler.contract_version(),
        families: handler.families().iter().map(|f| f.to_string()).collect(),
        sha256: handler.sha256(),
        hook,
        outcome,
        compile_ms: millis(handler.compile_time()),
        call_ms: millis(elapsed),
        logs,
    };
    match args.output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        OutputFormat::Text => {
            println!(
                "module:    {} (pluglet:handler@{})",
                report.module, report.contract_version
            );
            println!("hook:      {}", report.hook);
            println!("outcome:   {}", report.outcome);
            println!("compiled:  {:.1} ms", report.compile_ms);
            println!("call:      {:.3} ms", report.call_ms);
            if report.logs.is_empty() {
                println!("logs:      (none)");
            } else {
                println!("logs:");
                for line in &report.logs {
                    println!("  {:<5} {}", line.level, line.message);
                }
            }
        }
    }
    Ok(())
}

type HookRun = (&'static str, Outcome, Duration, Vec<GuestLog>);

fn run_hook(
    handler: &Handler,
    cx: &CallContext,
    hook: HookArg,
    text: &str,
) -> anyhow::Result<HookRun> {
    let refused = |r: pluglet_handler_runtime::Refusal| Outcome::Refused {
        kind: r.kind.to_string(),
        message: r.message,
    };
    if hook == HookArg::Allocate {
        let event: AllocateEvent = serde_json::from_str(text).context(
            "not an allocation request: expected {\"resource\", \"available\": [{\"id\", \"numa\"}], \
             \"must_include\", \"count\", \"preferred\"?}",
        )?;
        let request = AllocationRequest {
            resource: event.resource,
            available: event
                .available
                .into_iter()
                .map(|d| Device {
                    id: d.id,
                    numa_nodes: d.numa,
                })
                .collect(),
            must_include: event.must_include,
            count: event.count,
            preferred: event.preferred,
        };
        let call = handler.allocate(cx, &request)?;
        let outcome = match call.value {
            Ok(devices) => Outcome::Allocated { devices },
            Err(r) => refused(r),
        };
        return Ok(("allocate", outcome, call.elapsed, call.logs));
    }
    let event: PluginEvent = serde_json::from_str(text).context(
        "not a plugin record: expected {\"name\", \"type\", \"endpoint\", \"versions\", \
         \"existing\"?, \"node_id\"?, \"max_volumes_per_node\"?, \"topology\"?}",
    )?;
    let plugin = event.plugin.info();
    Ok(match hook {
        HookArg::Validate => {
            let existing = event.existing.as_ref().map(|e| RegisteredPlugin {
                info: e.info(),
                version: e.version.clone(),
            });
            let call = handler.validate(cx, &plugin, existing.as_ref())?;
            let outcome = match call.value {
                Ok(a) => Outcome::Accepted { version: a.version },
                Err(r) => refused(r),
            };
            ("validate", outcome, call.elapsed, call.logs)
        }
        HookArg::Register => {
            let facts = RegistrationFacts {
                node_id: event.node_id,
                max_volumes_per_node: event.max_volumes_per_node,
                topology: event.topology,
            };
            let call = handler.register(cx, &plugin, &facts)?;
            let outcome = match call.value {
                Ok(()) => Outcome::Ok,
                Err(r) => refused(r),
            };
            ("register", outcome, call.elapsed, call.logs)
        }
        HookArg::Deregister => {
            let call = handler.deregister(cx, &plugin)?;
            ("deregister", Outcome::Ok, call.elapsed, call.logs)
        }
        HookArg::Allocate => unreachable!("handled above"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_as_key_value() {
        assert_eq!(parse_setting("mode=ok"), Ok(("mode".into(), "ok".into())));
        assert_eq!(parse_setting("a=b=c"), Ok(("a".into(), "b=c".into())));
        assert!(parse_setting("novalue").is_err());
        assert!(parse_setting("=x").is_err());
    }

    #[test]
    fn plugin_events_parse_in_the_ctl_shape() {
        let event: PluginEvent = serde_json::from_str(
            r#"{"name":"csi.example.com","type":"CSIPlugin","endpoint":"/x.sock",
                "versions":["1.0.0"],"state":"registered",
                "existing":{"name":"csi.example.com","type":"CSIPlugin","endpoint":"/y.sock",
                            "versions":["1.0.0"],"version":"1.0.0"},
                "node_id":"n1","topology":{"zone":"a"}}"#,
        )
        .unwrap();
        assert_eq!(event.plugin.info().supported_versions, vec!["1.0.0"]);
        assert_eq!(event.existing.unwrap().version.as_deref(), Some("1.0.0"));
        assert_eq!(event.node_id.as_deref(), Some("n1"));
        assert_eq!(event.topology.get("zone").map(String::as_str), Some("a"));
    }

    #[test]
    fn builtin_names_map_to_embedded_modules() {
        assert!(matches!(
            module_source("builtin:csi").unwrap(),
            ModuleSource::Builtin { .. }
        ));
        assert!(module_source("builtin:nope").is_err());
        assert_eq!(
            module_source("x.wasm").unwrap(),
            ModuleSource::File("x.wasm".into())
        );
    }
}
