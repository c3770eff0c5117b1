//! A thread that has finished a burst of work and is about to wait: the place where the
//! binary's allocator hands back what the burst freed.
//!
//! The daemon's binary installs the hook ([`set_hook`]) and runs the same function in its tokio
//! runtime's park hook. Threads of their own (the device manager's checkpoint writer) call
//! [`going_idle`] before they wait for more work. Without a hook installed (the libraries'
//! tests, another binary), [`going_idle`] does nothing.

use std::sync::OnceLock;

static HOOK: OnceLock<fn()> = OnceLock::new();

/// Installs what [`going_idle`] runs; the first call wins. Returns whether this one did.
pub fn set_hook(hook: fn()) -> bool {
    HOOK.set(hook).is_ok()
}

/// Tells the process that this thread is done with a burst of work and about to wait.
pub fn going_idle() {
    if let Some(hook) = HOOK.get() {
        hook();
    }
}
