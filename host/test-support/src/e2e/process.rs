//! Child processes that never outlive their test: the daemon and the example plugins all run
//! under a [`ChildGuard`].

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A spawned process, SIGTERMed on drop and SIGKILLed if it has not exited within its grace
/// period. Once it has exited (or was waited for) the guard holds nothing.
pub struct ChildGuard {
    child: Option<Child>,
    grace: Duration,
}

impl ChildGuard {
    /// Spawns `command` with no stdin, no stdout and stderr to `log`; `grace` is how long drop
    /// waits after SIGTERM.
    pub fn spawn(command: &mut Command, log: &Path, grace: Duration) -> ChildGuard {
        let stderr =
            File::create(log).unwrap_or_else(|e| panic!("create log {}: {e}", log.display()));
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {:?}: {e}", command.get_program()));
        ChildGuard {
            child: Some(child),
            grace,
        }
    }

    /// The process id; 0 once the process is gone.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Sends `signal`; panics if the process is gone.
    pub fn signal(&self, signal: Signal) {
        let child = self.child.as_ref().expect("process running");
        kill(Pid::from_raw(child.id() as i32), signal).expect("signal the process");
    }

    /// The exit status if the process has exited on its own.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.child = None;
        Some(status)
    }

    /// Waits up to `timeout` for the process to exit; `None` if it is still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let status = wait_exit(self.child.as_mut().expect("process running"), timeout)?;
        self.child = None;
        Some(status)
    }

    /// Sends SIGTERM and waits up to `timeout` for the exit status.
    pub fn terminate(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let child = self.child.as_ref().expect("process running");
        let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
        self.wait_exit(timeout)
    }

    /// SIGKILLs the process and reaps it (nothing of its own clean-up runs).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if self.child.is_some() && self.terminate(self.grace).is_none() {
            self.kill();
        }
    }
}

/// Waits up to `timeout` for `child` to exit.
pub fn wait_exit(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if start.elapsed() > timeout {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
