//! The `pluglet` binary: parse the command line, dispatch, map errors to exit codes
//! (64 = bad usage, as EX_USAGE; 1 = any other failure). Nothing else lives here.

use std::process::ExitCode;

use clap::Parser as _;
use pluglet::cli::{Cli, Command, UsageError};
use pluglet::config::{Config, ConfigError, hostname};

/// mimalloc: a ListAndWatch update of 10,000 devices is tens of thousands of small allocations,
/// several times cheaper than with the system allocator (BENCHMARKS.md). Built with `no_thp`:
/// otherwise it advises its arenas `MADV_HUGEPAGE`, and every 2 MiB range touched once stays
/// resident as a whole huge page (57 of the 86 MiB of heap at idle; BENCHMARKS.md, "Memory").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// EX_USAGE: the command was used incorrectly.
const EXIT_USAGE: u8 = 64;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    init_tracing();
    match cli.command {
        Command::Run(args) => {
            let config = match Config::from_args(&args, hostname) {
                Ok(c) => c,
                Err(e) => return usage_error(&e),
            };
            finish(tokio_runtime().and_then(|rt| rt.block_on(pluglet::daemon::run(config))))
        }
        Command::Ctl(args) => {
            finish(tokio_runtime().and_then(|rt| rt.block_on(pluglet::admin::ctl::run(args))))
        }
        Command::Handler(args) => finish(pluglet::handler_cmd::run(args)),
        Command::CompileHandler => pluglet::compile_child::run(),
    }
}

fn usage_error(e: &ConfigError) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::from(EXIT_USAGE)
}

fn finish(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.is::<UsageError>() {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn tokio_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// Logs to stderr; `RUST_LOG` filters (default `info`).
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}
