//! Exponential backoff: the delay after a run of failures, doubling from a first delay up to a
//! cap (the kubelet's retry shape). Used for registrations and for publishing to an API server.

use std::time::Duration;

/// Exponential backoff parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffPolicy {
    /// Delay after the first failure (kubelet `initialDurationBeforeRetry` = 500 ms).
    pub initial: Duration,
    /// Cap (kubelet `maxDurationBeforeRetry` = 2 min 2 s).
    pub max: Duration,
}

impl BackoffPolicy {
    /// Delay after `failures` consecutive failures (`failures >= 1`).
    pub fn delay(&self, failures: u32) -> Duration {
        let shift = failures.saturating_sub(1).min(31);
        self.initial
            .checked_mul(1u32 << shift)
            .unwrap_or(self.max)
            .min(self.max)
    }
}
