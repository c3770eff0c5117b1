//! The plugin manager's deadlines and backoff, which every stage reads.

use std::time::Duration;

/// The plugin manager's deadlines and backoff (the kubelet's values are the daemon's defaults).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginManagerTimings {
    /// First retry delay after a failed operation.
    pub backoff_initial: Duration,
    /// Cap of the doubling retry delay.
    pub backoff_max: Duration,
    /// Connecting to a plugin socket, with quick retries while it is not listening yet.
    pub dial_timeout: Duration,
    /// GetInfo deadline.
    pub get_info_timeout: Duration,
    /// NotifyRegistrationStatus deadline.
    pub notify_timeout: Duration,
    /// Safety-net rescan of the registry directory.
    pub resync_period: Duration,
}
