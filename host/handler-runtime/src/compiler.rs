//! Where a module that is not in the compile cache gets compiled: in this process, or in a child
//! process running this same executable.
//!
//! Compiling with cranelift needs tens of MiB for a moment, spread over wasmtime's compile
//! threads; once freed, the allocator keeps most of it resident for as long as the process lives
//! (per-thread caches the idle daemon never touches again). A daemon that compiles its built-in
//! handlers at first start, or a vendor's module at a live swap, would carry that for the rest of
//! its life: measured, 38 MiB idle after a first start against 19 MiB after a start from the
//! cache (BENCHMARKS.md, "Memory"). [`Compiler::ThisExecutable`] moves the compile into a child
//! that exits when done, so the daemon only ever holds the compiled code, exactly as after a
//! start from the cache. The price is one process start per module compiled (a few ms), paid
//! only when the cache does not have it.
//!
//! The child protocol (the host binary implements the child side with [`precompile`]): the
//! component's bytes on stdin; wasmtime's precompiled artifact on stdout and exit status 0; or
//! the reason on stderr and exit status [`EXIT_DOES_NOT_COMPILE`] when the module itself does not
//! compile. Anything else (the child cannot start, dies, or answers otherwise) is the compiler's
//! failure, not the module's: the caller compiles in this process instead, with a warning.

use std::ffi::OsString;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use wasmtime::Engine;
use wasmtime::component::Component;

use crate::config::{RuntimeConfig, engine_config};
use crate::error::LoadError;

/// Exit status of the child when the module does not compile (sysexits' `EX_DATAERR`).
pub const EXIT_DOES_NOT_COMPILE: i32 = 65;

/// Where [`crate::Runtime::load`] compiles modules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Compiler {
    /// On the calling thread and wasmtime's compile threads (tools and tests: short-lived).
    #[default]
    InProcess,
    /// In a child process: this process's own executable (`/proc/self/exe`, the very binary
    /// running, even if the file was replaced since) run with `args`, which must make it serve
    /// [`precompile`] on stdin and stdout.
    ThisExecutable {
        /// Arguments selecting the child side of the protocol.
        args: Vec<OsString>,
    },
}

/// The child side: compiles `wasm` with an engine configured exactly as a [`crate::Runtime`] of
/// `config` and returns wasmtime's artifact for that runtime to deserialise.
pub fn precompile(config: &RuntimeConfig, wasm: &[u8]) -> Result<Vec<u8>, LoadError> {
    let engine = Engine::new(&engine_config(config)?).map_err(|e| LoadError::Engine {
        reason: "wasmtime refused the configuration".into(),
        source: Some(e.into()),
    })?;
    engine
        .precompile_component(wasm)
        .map_err(|e| LoadError::Compile {
            module: "stdin".into(),
            source: e.into(),
        })
}

/// What asking the child gave.
pub(crate) enum ChildOutcome {
    /// The compiled component.
    Compiled(Component),
    /// The module does not compile: the child's reason.
    DoesNotCompile(String),
    /// The child could not do it (it did not start, died, or its answer was refused).
    Failed(String),
}

/// Compiles `wasm` in a child running this executable with `args`.
pub(crate) fn compile_in_child(engine: &Engine, args: &[OsString], wasm: &[u8]) -> ChildOutcome {
    let exe = PathBuf::from("/proc/self/exe");
    let mut child = match Command::new(&exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => return ChildOutcome::Failed(format!("cannot start {}: {e}", exe.display())),
    };
    let Some(mut stdin) = child.stdin.take() else {
        return ChildOutcome::Failed("the child has no stdin".into());
    };
    // The child reads all of stdin before it writes anything, but a child that dies early must
    // not leave this thread blocked on a full pipe: write from a thread of its own.
    let bytes = wasm.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&bytes));
    let output = match child.wait_with_output() {
        Ok(output) => output,
        Err(e) => return ChildOutcome::Failed(format!("cannot read the child's answer: {e}")),
    };
    let written = writer.join();
    let stderr = String::from_utf8_lossy(&output.stderr).trim().to_owned();
    match output.status.code() {
        Some(0) => {}
        Some(EXIT_DOES_NOT_COMPILE) => return ChildOutcome::DoesNotCompile(stderr),
        _ => {
            return ChildOutcome::Failed(format!(
                "the child ended with {}: {stderr}",
                output.status
            ));
        }
    }
    match written {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return ChildOutcome::Failed(format!("cannot send the module: {e}")),
        Err(_) => return ChildOutcome::Failed("the writer thread panicked".into()),
    }
    match deserialize_own(engine, &output.stdout) {
        Ok(component) => ChildOutcome::Compiled(component),
        Err(e) => ChildOutcome::Failed(format!("its artifact was refused by wasmtime: {e}")),
    }
}

/// Deserialises what the child wrote on its stdout.
#[allow(unsafe_code)]
fn deserialize_own(engine: &Engine, artifact: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: `Component::deserialize` trusts its bytes to be an artifact wasmtime produced. These
    // are the whole stdout of a child this function's caller started from `/proc/self/exe`, the
    // executable of this very process, which in the child side of the protocol writes to stdout
    // nothing but `Engine::precompile_component` output (`precompile`). The pipe is private to
    // the two processes; no file is read. An artifact of another wasmtime version or another
    // engine configuration is refused by wasmtime with an error, not undefined behaviour.
    unsafe { Component::deserialize(engine, artifact) }
}
