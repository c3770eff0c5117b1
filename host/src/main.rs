//! The `pluglet` binary: parse the command line, dispatch, map errors to exit codes
//! (64 = bad usage, as EX_USAGE; 1 = any other failure). Nothing else lives here. Under
//! `-o json` an error is one JSON object on stderr (kind `Error`), as the text would say it.

use std::process::ExitCode;

use clap::{CommandFactory as _, FromArgMatches as _};
use pluglet::cli::{Cli, Command, LogFormat, OutputFormat, UsageError};
use pluglet::config::{Config, ConfigError, LogConfig, hostname, log_level, to_toml};

/// mimalloc: a ListAndWatch update of 10,000 devices is tens of thousands of small allocations,
/// several times cheaper than with the system allocator (BENCHMARKS.md). Built with `no_thp`:
/// otherwise it advises its arenas `MADV_HUGEPAGE`, and every 2 MiB range touched once stays
/// resident as a whole huge page (57 of the 86 MiB of heap at idle; BENCHMARKS.md, "Memory").
/// Wrapped to hand back what a burst of work freed once its thread goes idle
/// ([`pluglet::ops::memory`]).
#[global_allocator]
static GLOBAL: pluglet::ops::memory::Trimming = pluglet::ops::memory::Trimming::new();

/// EX_USAGE: the command was used incorrectly.
const EXIT_USAGE: u8 = 64;

fn main() -> ExitCode {
    let matches = Cli::command().try_get_matches();
    let parsed = matches.and_then(|m| Cli::from_arg_matches(&m).map(|cli| (cli, m)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            let e = e.format(&mut Cli::command());
            if e.use_stderr() && asks_for_json(std::env::args().skip(1)) {
                let text = e.to_string();
                let message = text.trim().strip_prefix("error: ").unwrap_or(text.trim());
                print_json_error(message, EXIT_USAGE);
                return ExitCode::from(EXIT_USAGE);
            }
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let json = match &cli.command {
        Command::Ctl(args) => args.output == OutputFormat::Json,
        Command::Handler(args) => args.output == OutputFormat::Json,
        Command::Run(_) | Command::CompileHandler => false,
    };
    let rust_log = std::env::var("RUST_LOG").ok();
    match cli.command {
        Command::Run(args) => {
            // The configuration decides how to log, so it is read before logging starts; its
            // errors go to stderr directly.
            let Some(run_matches) = matches.subcommand_matches("run") else {
                unreachable!("clap parsed the run subcommand")
            };
            let config = match Config::load(&args, run_matches, hostname, rust_log.as_deref()) {
                Ok(c) => c,
                Err(e) => return usage_error(&e),
            };
            if args.print_config {
                print!("{}", to_toml(&config));
                return ExitCode::SUCCESS;
            }
            init_tracing(&config.log);
            finish(
                tokio_runtime().and_then(|rt| rt.block_on(pluglet::daemon::run(config))),
                false,
            )
        }
        Command::Ctl(args) => {
            init_tracing(&default_log(rust_log.as_deref()));
            finish(
                tokio_runtime().and_then(|rt| rt.block_on(pluglet::admin::ctl::run(args))),
                json,
            )
        }
        Command::Handler(args) => {
            init_tracing(&default_log(rust_log.as_deref()));
            finish(pluglet::handler_cmd::run(args), json)
        }
        Command::CompileHandler => {
            init_tracing(&default_log(rust_log.as_deref()));
            pluglet::compile_child::run()
        }
    }
}

/// Logging of the commands other than `run`: text, filtered by `RUST_LOG` (default `info`).
fn default_log(rust_log: Option<&str>) -> LogConfig {
    LogConfig {
        format: LogFormat::Text,
        level: log_level(None, rust_log).unwrap_or_else(|_| "info".to_owned()),
    }
}

fn usage_error(e: &ConfigError) -> ExitCode {
    eprintln!("error: {}", pluglet_core::error_chain(e));
    ExitCode::from(EXIT_USAGE)
}

fn finish(result: anyhow::Result<()>, json: bool) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = if e.is::<UsageError>() { EXIT_USAGE } else { 1 };
            if json {
                print_json_error(&format!("{e:#}"), code);
            } else {
                eprintln!("error: {e:#}");
            }
            ExitCode::from(code)
        }
    }
}

/// An error as one JSON object on stderr: `{"api_version", "kind": "Error", "error",
/// "exit_code"}`, `error` being what the text form prints after `error: `.
fn print_json_error(message: &str, exit_code: u8) {
    let value = serde_json::json!({
        "api_version": pluglet::admin::view::API_VERSION,
        "kind": "Error",
        "error": message,
        "exit_code": exit_code,
    });
    eprintln!("{value}");
}

/// Whether raw arguments ask for JSON output (`-o json`, `-ojson`, `--output json`,
/// `--output=json`), for an error found while parsing them.
fn asks_for_json(args: impl Iterator<Item = String>) -> bool {
    let args: Vec<String> = args.collect();
    args.iter().enumerate().any(|(i, a)| {
        let next_is_json = || args.get(i + 1).is_some_and(|n| n == "json");
        match a.as_str() {
            "-o" | "--output" => next_is_json(),
            "-ojson" | "--output=json" => true,
            _ => false,
        }
    })
}

/// Threads of tokio's blocking pool, which also takes over a worker's queue while a handler hook
/// runs in place (`block_in_place`). Unbounded (tokio's default is 512), a node whose plugins
/// register and deregister without pause grew to hundreds of threads, each keeping the stack a
/// handler call touched and its own allocator heap: the soak in `benches/registration.rs` went
/// from 64 to 250 MB. Past this many, the hand-over waits for a free thread instead.
const MAX_BLOCKING_THREADS: usize = 16;

/// How long an idle blocking thread is kept before it exits (tokio's default is 10 s).
const BLOCKING_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(2);

fn tokio_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    pluglet_core::idle::set_hook(|| {
        pluglet::ops::memory::going_idle();
    });
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(MAX_BLOCKING_THREADS)
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .on_thread_park(|| {
            pluglet::ops::memory::going_idle();
        })
        .build()?)
}

/// Logs to stderr, filtered by `log.level`: text lines, or one JSON object per line carrying
/// the current span's fields and the list of spans it is in.
fn init_tracing(log: &LogConfig) {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(log.filter())
        .with_writer(std::io::stderr);
    match log.format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .init(),
    }
}
