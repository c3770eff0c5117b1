//! `pluglet handler`: try a handler module without a node.
//!
//! - `pluglet handler check MODULE`: compiles and admits the module, prints the contract version
//!   and the hook families read from the component, its sha256 and the compile time; a file that
//!   is not a component, a component of another contract or one with forbidden imports is refused
//!   with the reason (non-zero exit).
//! - `pluglet handler test MODULE --hook validate|register|deregister|allocate --event FILE.json
//!   [--setting k=v]... [--node-name N] [-o table|json]`: runs one hook on the event and prints the
//!   outcome, the compile time and the call time separately, and the guest's log lines.
//! - `pluglet handler test MODULE --vectors FILE.vectors.json [--setting k=v]...`: runs every
//!   case of a vectors file ([`pluglet_handlers::Vectors`]) and prints each (passed or failed,
//!   expected and got, call time, fuel used), then `N passed, N failed`; exit status 1 when a
//!   case fails.
//! - `pluglet handler verify MODULE --key PUB [--signature FILE]`: verifies the module's detached
//!   minisign signature (`MODULE.minisig` unless given) with the public key, as the daemon does
//!   with `--trusted-key`; prints the key id and the trusted comment, or fails with the reason.
//! - `pluglet handler push` / `pluglet handler pull`: a module to and from an OCI registry
//!   ([`crate::handler_oci`]).
//!
//! `MODULE` is a `.wasm` path, or `builtin:csi` / `builtin:device-plugin` for the handlers
//! embedded in this binary. The event JSON is [`pluglet_handlers::Event`]'s: a plugin as an item
//! of `pluglet ctl plugins -o json` (validate/register/deregister, plus `"existing"`), or an
//! allocation request with devices as an item of `pluglet ctl resources -o json` has them
//! (allocate). With `-o json` (before or after the subcommand) each subcommand prints one object
//! in the envelope of [`crate::admin::view`] (kinds `HandlerCheck`, `HandlerTest`, `HandlerPush`, `HandlerPull`,
//! `HandlerVectors`, `HandlerVerify`).
//!
//! A bad event file ([`EventError`]) and a failing handler ([`HandlerRunError`]: refused at load,
//! trap, deadline, memory cap) are separate errors: the first names the file, the second the
//! module and the hook. A bad vectors file is the vectors file's error, naming the case.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use pluglet_handler_runtime::{
    CallContext, GuestLog, HandlerError, Hook, Limits, LoadError, ModuleSource, Runtime,
    RuntimeConfig,
};
use pluglet_handlers::{CaseResult, Event, Outcome, TrustedKey, Vectors, run_hook};
use serde::Serialize;

use crate::admin::view::{self, Kind};
use crate::cli::OutputFormat;

/// Arguments of `pluglet handler`.
#[derive(Debug, Clone, clap::Args)]
pub struct HandlerArgs {
    /// Output format (before or after the subcommand).
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Table, global = true)]
    pub output: OutputFormat,
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
    /// Verify a module's minisign signature with a public key; print the key id and the
    /// trusted comment.
    Verify(VerifyArgs),
    /// Push a module to an OCI registry (the wasm artifact layout), with its signature and
    /// vectors attached as referrers; print the digests.
    Push(crate::handler_oci::PushArgs),
    /// Pull a module and what is attached to it from an OCI registry into a directory.
    Pull(crate::handler_oci::PullArgs),
}

/// Arguments of `pluglet handler verify`.
#[derive(Debug, Clone, clap::Args)]
pub struct VerifyArgs {
    /// The module file.
    pub module: PathBuf,
    /// A minisign public key file (as `minisign -G` writes it); repeat to accept any of several.
    #[arg(long = "key", value_name = "PUB", required = true)]
    pub keys: Vec<PathBuf>,
    /// The signature file [default: MODULE.minisig].
    #[arg(long, value_name = "FILE")]
    pub signature: Option<PathBuf>,
}

/// Arguments of `pluglet handler check`.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    /// The module: a `.wasm` component file, or `builtin:csi` / `builtin:device-plugin`.
    pub module: String,
}

/// Arguments of `pluglet handler test`.
#[derive(Debug, Clone, clap::Args)]
pub struct TestArgs {
    /// The module: a `.wasm` component file, or `builtin:csi` / `builtin:device-plugin`.
    pub module: String,
    /// The hook to run.
    #[arg(long, value_enum, required_unless_present = "vectors")]
    pub hook: Option<HookArg>,
    /// JSON file holding the plugin record (validate/register/deregister) or the allocation
    /// request (allocate).
    #[arg(long, required_unless_present = "vectors")]
    pub event: Option<PathBuf>,
    /// Run every case of a vectors file (`NAME.vectors.json`) instead of one hook.
    #[arg(long, conflicts_with_all = ["hook", "event"])]
    pub vectors: Option<PathBuf>,
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
    /// Fuel budget of the call (default: the daemon's, 50000000); an allocate call gets 2000 more
    /// per device offered, as in the daemon.
    #[arg(long)]
    pub fuel: Option<u64>,
    /// Run the vectors' cases one after another in the instance of the case before, as an entry
    /// with `reuse_instances = true` is run (default: a fresh instance each call).
    #[arg(long)]
    pub reuse_instances: bool,
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

/// A `--setting` that is not `key=value`.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("setting {text:?} is not key=value")]
pub struct SettingError {
    /// What was given.
    pub text: String,
}

fn parse_setting(text: &str) -> Result<(String, String), SettingError> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(SettingError {
            text: text.to_owned(),
        }),
    }
}

/// Runs `pluglet handler`. A refused module (`check`) or a failed hook call (`test`: trap,
/// deadline, memory cap) is an error; a guest's refusal is a normal outcome of `test`.
pub fn run(args: HandlerArgs) -> anyhow::Result<()> {
    match args.command {
        HandlerCommand::Check(check_args) => check(check_args, args.output),
        HandlerCommand::Test(test_args) => test(test_args, args.output),
        HandlerCommand::Verify(verify_args) => verify(verify_args, args.output),
        HandlerCommand::Push(push_args) => crate::handler_oci::push(push_args, args.output),
        HandlerCommand::Pull(pull_args) => crate::handler_oci::pull(pull_args, args.output),
    }
}

#[derive(Serialize)]
struct VerifyReport {
    module: String,
    signature: String,
    key_id: String,
    trusted_comment: String,
}

impl Kind for VerifyReport {
    const KIND: &'static str = "HandlerVerify";
}

fn verify(args: VerifyArgs, output: OutputFormat) -> anyhow::Result<()> {
    let keys = args
        .keys
        .iter()
        .map(|path| TrustedKey::read(path))
        .collect::<Result<Vec<_>, _>>()?;
    let bytes = std::fs::read(&args.module)
        .with_context(|| format!("cannot read the module {}", args.module.display()))?;
    let signature_path = args
        .signature
        .unwrap_or_else(|| pluglet_handlers::signature_path(&args.module));
    let signature = std::fs::read_to_string(&signature_path).with_context(|| {
        format!(
            "cannot read the signature {}; sign the module with `minisign -Sm {}`",
            signature_path.display(),
            args.module.display()
        )
    })?;
    let info = pluglet_handlers::verify(&keys, &bytes, &signature).with_context(|| {
        format!(
            "{} does not vouch for {}",
            signature_path.display(),
            args.module.display()
        )
    })?;
    let report = VerifyReport {
        module: args.module.display().to_string(),
        signature: signature_path.display().to_string(),
        key_id: info.key_id,
        trusted_comment: info.trusted_comment,
    };
    match output {
        OutputFormat::Json => print!("{}", view::json_of(&report)),
        OutputFormat::Table => {
            println!("signature verified: {}", report.module);
            println!("key id:           {}", report.key_id);
            println!("trusted comment:  {}", report.trusted_comment);
        }
    }
    Ok(())
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

/// Milliseconds, to the microsecond.
fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

#[derive(Serialize)]
struct CheckReport<'a> {
    module: &'a str,
    contract_version: &'a str,
    families: Vec<String>,
    sha256: &'a str,
    compile_ms: f64,
}

impl Kind for CheckReport<'_> {
    const KIND: &'static str = "HandlerCheck";
}

fn check(args: CheckArgs, output: OutputFormat) -> anyhow::Result<()> {
    let runtime = runtime(Limits::default())?;
    let handler = runtime.load(module_source(&args.module)?, BTreeMap::new(), None)?;
    let report = CheckReport {
        module: handler.module(),
        contract_version: handler.contract_version(),
        families: handler.families().iter().map(|f| f.to_string()).collect(),
        sha256: handler.sha256(),
        compile_ms: millis(handler.compile_time()),
    };
    match output {
        OutputFormat::Json => print!("{}", view::json_of(&report)),
        OutputFormat::Table => {
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

/// What is wrong with the event file of `pluglet handler test`.
#[derive(Debug, thiserror::Error)]
pub enum EventError {
    /// The file could not be read.
    #[error("cannot read the event file {path}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not JSON.
    #[error("event file {path} is not valid JSON")]
    NotJson {
        /// The file.
        path: PathBuf,
        /// Where the parser stopped.
        #[source]
        source: serde_json::Error,
    },
    /// The JSON is not the event the hook takes.
    #[error("event file {path} is not what hook {hook} takes; expected {expected}")]
    WrongShape {
        /// The file.
        path: PathBuf,
        /// The hook.
        hook: &'static str,
        /// The shape the hook takes.
        expected: &'static str,
        /// The first mismatch.
        #[source]
        source: serde_json::Error,
    },
}

/// Why the handler of `pluglet handler test` gave no outcome. The messages name the module
/// (and the hook), never the event file.
#[derive(Debug, thiserror::Error)]
pub enum HandlerRunError {
    /// The module was refused at load (unreadable, not a component, forbidden imports, ...).
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The hook call failed: trap, deadline, fuel, memory cap, or a family the module lacks.
    #[error(transparent)]
    Hook(#[from] HandlerError),
}

/// Reads the event file and parses it as the event `hook` takes.
fn read_event(path: &std::path::Path, hook: Hook) -> Result<Event, EventError> {
    let text = std::fs::read_to_string(path).map_err(|source| EventError::Unreadable {
        path: path.to_owned(),
        source,
    })?;
    Event::parse(hook, &text).map_err(|source| {
        if source.is_data() {
            EventError::WrongShape {
                path: path.to_owned(),
                hook: hook.as_str(),
                expected: Event::shape(hook),
                source,
            }
        } else {
            EventError::NotJson {
                path: path.to_owned(),
                source,
            }
        }
    })
}

#[derive(Serialize)]
struct TestReport<'a> {
    module: &'a str,
    contract_version: &'a str,
    families: Vec<String>,
    sha256: &'a str,
    hook: Hook,
    outcome: Outcome,
    compile_ms: f64,
    call_ms: f64,
    fuel_used: u64,
    logs: Vec<GuestLog>,
}

impl Kind for TestReport<'_> {
    const KIND: &'static str = "HandlerTest";
}

/// One case in the report of `handler test --vectors`.
#[derive(Serialize)]
struct CaseReport {
    name: String,
    hook: Hook,
    passed: bool,
    expected: Outcome,
    got: Outcome,
    call_ms: f64,
    fuel_used: Option<u64>,
}

impl From<CaseResult> for CaseReport {
    fn from(r: CaseResult) -> CaseReport {
        CaseReport {
            name: r.name,
            hook: r.hook,
            passed: r.passed,
            expected: r.expected,
            got: r.got,
            call_ms: millis(r.elapsed),
            fuel_used: r.fuel_used,
        }
    }
}

/// The report of `handler test --vectors`.
#[derive(Serialize)]
struct VectorsReport<'a> {
    module: &'a str,
    sha256: &'a str,
    vectors: String,
    compile_ms: f64,
    cases: Vec<CaseReport>,
    passed: usize,
    failed: usize,
}

impl Kind for VectorsReport<'_> {
    const KIND: &'static str = "HandlerVectors";
}

impl From<HookArg> for Hook {
    fn from(hook: HookArg) -> Hook {
        match hook {
            HookArg::Validate => Hook::Validate,
            HookArg::Register => Hook::Register,
            HookArg::Deregister => Hook::Deregister,
            HookArg::Allocate => Hook::Allocate,
        }
    }
}

fn test(args: TestArgs, output: OutputFormat) -> anyhow::Result<()> {
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
    limits.reuse_instances = args.reuse_instances;
    let cx = CallContext {
        node_name: args.node_name.clone(),
    };
    let settings: BTreeMap<String, String> = args.settings.iter().cloned().collect();
    if let Some(path) = &args.vectors {
        let vectors = Vectors::read(path)?;
        let handler = runtime(limits)?
            .load(module_source(&args.module)?, settings, None)
            .map_err(HandlerRunError::from)?;
        let cases: Vec<CaseReport> = pluglet_handlers::run_all(&handler, &cx, &vectors)
            .into_iter()
            .map(CaseReport::from)
            .collect();
        let failed = cases.iter().filter(|c| !c.passed).count();
        let report = VectorsReport {
            module: handler.module(),
            sha256: handler.sha256(),
            vectors: path.display().to_string(),
            compile_ms: millis(handler.compile_time()),
            passed: cases.len() - failed,
            failed,
            cases,
        };
        print_vectors(&report, output)?;
        if failed > 0 {
            bail!(
                "{failed} of {} cases of {} failed",
                report.cases.len(),
                report.vectors
            );
        }
        return Ok(());
    }
    let (Some(hook), Some(event_path)) = (args.hook, &args.event) else {
        bail!("give --hook and --event, or --vectors");
    };
    let hook = Hook::from(hook);
    let event = read_event(event_path, hook)?;
    let handler = runtime(limits)?
        .load(module_source(&args.module)?, settings, None)
        .map_err(HandlerRunError::from)?;
    let call = run_hook(&handler, &cx, hook, &event).map_err(HandlerRunError::from)?;
    let report = TestReport {
        module: handler.module(),
        contract_version: handler.contract_version(),
        families: handler.families().iter().map(|f| f.to_string()).collect(),
        sha256: handler.sha256(),
        hook,
        outcome: call.value,
        compile_ms: millis(handler.compile_time()),
        call_ms: millis(call.elapsed),
        fuel_used: call.fuel_used,
        logs: call.logs,
    };
    match output {
        OutputFormat::Json => print!("{}", view::json_of(&report)),
        OutputFormat::Table => {
            println!(
                "module:    {} (pluglet:handler@{})",
                report.module, report.contract_version
            );
            println!("hook:      {}", report.hook);
            println!("outcome:   {}", report.outcome);
            println!("compiled:  {:.1} ms", report.compile_ms);
            println!("call:      {:.3} ms", report.call_ms);
            println!("fuel:      {}", report.fuel_used);
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

fn print_vectors(report: &VectorsReport<'_>, output: OutputFormat) -> anyhow::Result<()> {
    if output == OutputFormat::Json {
        print!("{}", view::json_of(report));
        return Ok(());
    }
    println!("module:    {}", report.module);
    println!("vectors:   {}", report.vectors);
    println!("compiled:  {:.1} ms", report.compile_ms);
    for case in &report.cases {
        let fuel = case
            .fuel_used
            .map_or_else(|| "-".to_owned(), |f| f.to_string());
        println!(
            "{} {} ({}): {:.3} ms, fuel {fuel}",
            if case.passed { "pass" } else { "FAIL" },
            case.name,
            case.hook,
            case.call_ms,
        );
        if case.passed {
            println!("     got:      {}", case.got);
        } else {
            println!("     expected: {}", case.expected);
            println!("     got:      {}", case.got);
        }
    }
    println!("{} passed, {} failed", report.passed, report.failed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_as_key_value() {
        assert_eq!(parse_setting("mode=ok"), Ok(("mode".into(), "ok".into())));
        assert_eq!(parse_setting("a=b=c"), Ok(("a".into(), "b=c".into())));
        assert_eq!(
            parse_setting("novalue"),
            Err(SettingError {
                text: "novalue".into()
            })
        );
        assert!(parse_setting("=x").is_err());
    }

    #[test]
    fn every_example_event_parses() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/events");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let hook = if path.file_name().unwrap() == "allocate.json" {
                Hook::Allocate
            } else {
                Hook::Validate
            };
            if let Err(e) = read_event(&path, hook) {
                panic!("{}: {:#}", path.display(), anyhow::Error::from(e));
            }
            seen += 1;
        }
        assert!(seen >= 4, "{seen} example events");
    }

    #[test]
    fn a_ctl_plugins_record_is_an_event() {
        let view = crate::admin::view::PluginView {
            name: "hostpath.csi.k8s.io".into(),
            plugin_type: "CSIPlugin".into(),
            endpoint: "/csi.sock".into(),
            versions: vec!["1.5.0".into()],
            version: Some("1.5.0".into()),
            handler: "builtin:csi".into(),
            registered_at: "2026-11-29T16:00:00.000Z".into(),
            socket_path: "/reg.sock".into(),
            door: "registry".into(),
            node_id: Some("node-1".into()),
            max_volumes_per_node: Some(3),
            topology: Some([("zone".to_string(), "a".to_string())].into()),
        };
        let text = serde_json::to_string(&view).unwrap();
        let Event::Plugin(event) = Event::parse(Hook::Register, &text).unwrap() else {
            panic!("a plugin event");
        };
        let p = &event.plugin;
        assert_eq!(
            (
                &p.name,
                &p.plugin_type,
                &p.endpoint,
                &p.versions,
                &p.version
            ),
            (
                &view.name,
                &view.plugin_type,
                &view.endpoint,
                &view.versions,
                &view.version
            )
        );
        assert_eq!(
            (&p.node_id, p.max_volumes_per_node, &p.topology),
            (&view.node_id, view.max_volumes_per_node, &view.topology)
        );
        assert!(event.existing.is_none());
    }

    #[test]
    fn event_errors_say_which_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let bad_json = dir.path().join("bad.json");
        std::fs::write(&bad_json, "{\"name\": ").unwrap();
        let err = read_event(&bad_json, Hook::Validate).err().unwrap();
        assert!(matches!(err, EventError::NotJson { .. }), "{err}");
        let shape = dir.path().join("shape.json");
        std::fs::write(&shape, r#"{"resource": "vendor.com/gpu"}"#).unwrap();
        let err = read_event(&shape, Hook::Validate).err().unwrap();
        assert!(
            matches!(
                err,
                EventError::WrongShape {
                    hook: "validate",
                    ..
                }
            ),
            "{err}"
        );
        let err = read_event(&dir.path().join("missing.json"), Hook::Allocate)
            .err()
            .unwrap();
        assert!(matches!(err, EventError::Unreadable { .. }), "{err}");
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
