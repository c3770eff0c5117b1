//! The vocabulary every part of Pluglet shares, with no dependencies beyond serde, tokio's
//! channels and libc's error numbers:
//!
//! - [`names`]: typed names for what crosses module boundaries (resources, pods, containers,
//!   sockets, plugin types, generations), so a pod UID cannot be passed where a resource name
//!   is expected;
//! - [`error_chain`]: the one formatter of an error with its sources, used by every log line
//!   and every message that leaves the daemon;
//! - [`events`]: the daemon's bounded log of recent events, which every stage records into and
//!   the admin API reads and follows;
//! - [`backoff`]: the doubling retry delay;
//! - [`idle`]: the hook a thread calls once a burst of work is over (the binary's allocator
//!   returns freed memory there);
//! - [`inotify`]: the per-user inotify limits and the advice every watcher gives when a watch
//!   runs into one.

pub mod backoff;
pub mod events;
pub mod idle;
pub mod inotify;
pub mod names;

pub use backoff::BackoffPolicy;
pub use names::{
    ContainerName, Generation, PluginKey, PluginType, PodUid, ResourceName, SocketPath,
};

use std::fmt::Write as _;

/// Formats an error with its chain of sources, `outer: inner: innermost`. A source whose text
/// the message already contains (errors that print their source themselves) is not repeated.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        if !text.is_empty() && !out.contains(&text) {
            let _ = write!(out, ": {text}");
        }
        source = inner.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    #[test]
    fn every_cause_is_named_once_in_order() {
        let e = Layer(
            "cannot write the checkpoint",
            Some(Box::new(Layer(
                "rename failed",
                Some(Box::new(Layer("No space left on device", None))),
            ))),
        );
        assert_eq!(
            error_chain(&e),
            "cannot write the checkpoint: rename failed: No space left on device"
        );
        let repeats = Layer(
            "dial failed: refused",
            Some(Box::new(Layer("refused", None))),
        );
        assert_eq!(error_chain(&repeats), "dial failed: refused");
    }
}
