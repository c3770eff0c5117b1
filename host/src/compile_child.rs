//! The child side of compiling a handler module out of the daemon's process
//! (`pluglet_handler_runtime::compiler`): `pluglet compile-handler` reads a component on stdin
//! and writes wasmtime's artifact for the daemon's engine on stdout. The daemon starts it as
//! `/proc/self/exe compile-handler`; it is no command for people, and hidden from `--help`.

use std::io::{Read as _, Write as _};
use std::process::ExitCode;

use pluglet_handler_runtime::LoadError;
use pluglet_handler_runtime::compiler::{EXIT_DOES_NOT_COMPILE, precompile};

use crate::daemon::runtime_config;

/// The arguments that make this executable the compiler child.
pub const ARGS: [&str; 1] = ["compile-handler"];

/// Compiles stdin to stdout; exit status 0, [`EXIT_DOES_NOT_COMPILE`] with the reason on stderr
/// when the module does not compile, 1 on any other failure.
pub fn run() -> ExitCode {
    let mut wasm = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut wasm) {
        eprintln!("cannot read the module from stdin: {e}");
        return ExitCode::FAILURE;
    }
    let artifact = match precompile(&runtime_config(), &wasm) {
        Ok(artifact) => artifact,
        Err(LoadError::Compile { source, .. }) => {
            eprintln!("{}", pluglet_core::error_chain(source.as_ref()));
            return ExitCode::from(EXIT_DOES_NOT_COMPILE as u8);
        }
        Err(e) => {
            eprintln!("{}", pluglet_core::error_chain(&e));
            return ExitCode::FAILURE;
        }
    };
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(&artifact).and_then(|()| stdout.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cannot write the artifact to stdout: {e}");
            ExitCode::FAILURE
        }
    }
}
