//! Counters of one served version: calls, refusals, failures by kind, call time, last failure.
//! Lock-free counters; the latency histogram (`hdrhistogram`) sits behind a short mutex.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use hdrhistogram::Histogram;
use pluglet_handler_runtime::HandlerFault;
use serde::{Deserialize, Serialize};

/// What kind of failure a failed call was. A guest's refusal is an answer, not a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The guest trapped, panicked, exited, overflowed its stack or answered more than the host
    /// accepts.
    Trap,
    /// The call ran past its deadline.
    Deadline,
    /// The guest grew its memory past the cap.
    Memory,
    /// The call used up its fuel.
    Fuel,
    /// The host could not run the call (no instance slot, a family the module lacks, its slot
    /// busy with as many calls as it may run): not counted against the module's probation.
    Other,
}

impl FailureKind {
    /// The kind of a fault.
    pub fn of(fault: &HandlerFault) -> FailureKind {
        match fault {
            HandlerFault::Trapped { .. }
            | HandlerFault::Failed { .. }
            | HandlerFault::StackOverflow { .. }
            | HandlerFault::AnswerTooLarge { .. } => FailureKind::Trap,
            HandlerFault::Deadline { .. } => FailureKind::Deadline,
            HandlerFault::MemoryCap { .. } => FailureKind::Memory,
            HandlerFault::Fuel { .. } => FailureKind::Fuel,
            HandlerFault::MissingFamily { .. }
            | HandlerFault::Instantiate { .. }
            | HandlerFault::Busy { .. }
            | HandlerFault::HandedOff => FailureKind::Other,
        }
    }

    /// Whether the module itself is to blame (counts against its probation).
    pub fn is_the_modules(self) -> bool {
        self != FailureKind::Other
    }

    fn index(self) -> usize {
        self as usize
    }

    /// Lower-case name, as in `ctl handlers`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Trap => "trap",
            FailureKind::Deadline => "deadline",
            FailureKind::Memory => "memory",
            FailureKind::Fuel => "fuel",
            FailureKind::Other => "other",
        }
    }
}

/// The last failed call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LastFailure {
    /// When it failed.
    pub at: SystemTime,
    /// Its kind.
    pub kind: FailureKind,
    /// The handler's error, whole.
    pub message: String,
}

/// Failures by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureCounts {
    /// Traps (panics, `unreachable`, guest exits).
    pub trap: u64,
    /// Deadlines exceeded.
    pub deadline: u64,
    /// Memory caps exceeded.
    pub memory: u64,
    /// Fuel budgets used up.
    pub fuel: u64,
    /// Calls the host could not run.
    pub other: u64,
}

/// A copy of the counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StatsSnapshot {
    /// Calls answered or failed.
    pub calls: u64,
    /// Calls the guest answered with a refusal.
    pub refusals: u64,
    /// Failed calls by kind.
    pub failures: FailureCounts,
    /// Mean call time, µs (`None` before the first call).
    pub mean_us: Option<f64>,
    /// 99th percentile call time, µs.
    pub p99_us: Option<u64>,
    /// The last failure.
    pub last_failure: Option<LastFailure>,
}

/// Counters since a version was applied.
#[derive(Debug)]
pub struct CallStats {
    calls: AtomicU64,
    refusals: AtomicU64,
    failures: [AtomicU64; 5],
    total_ns: AtomicU64,
    latency_us: Mutex<Histogram<u64>>,
    last_failure: Mutex<Option<LastFailure>>,
}

impl Default for CallStats {
    fn default() -> CallStats {
        CallStats {
            calls: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
            failures: Default::default(),
            total_ns: AtomicU64::new(0),
            // 1 µs .. 1 h, 2 significant digits: about 2 KiB per histogram.
            latency_us: Mutex::new(
                Histogram::new_with_bounds(1, 3_600_000_000, 2).expect("valid histogram bounds"),
            ),
            last_failure: Mutex::new(None),
        }
    }
}

impl CallStats {
    /// Counts one answered call.
    pub fn answered(&self, elapsed: Duration, refused: bool) {
        self.timed(elapsed);
        if refused {
            self.refusals.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts one failed call.
    pub fn failed(&self, elapsed: Duration, kind: FailureKind, message: String) {
        self.timed(elapsed);
        self.failures[kind.index()].fetch_add(1, Ordering::Relaxed);
        *self.last_failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(LastFailure {
            at: SystemTime::now(),
            kind,
            message,
        });
    }

    fn timed(&self, elapsed: Duration) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.total_ns.fetch_add(ns, Ordering::Relaxed);
        let us = (ns / 1_000).max(1);
        self.latency_us
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .saturating_record(us);
    }

    /// The call times as a cumulative histogram over `bounds` (seconds, ascending): the sum of
    /// all call times in seconds, the count, and per bound the calls that took at most that
    /// long (to the histogram's precision, two significant digits).
    pub fn cumulative(&self, bounds: &[f64]) -> (f64, u64, Vec<(f64, u64)>) {
        let h = self.latency_us.lock().unwrap_or_else(|e| e.into_inner());
        let buckets = bounds
            .iter()
            .map(|&bound| {
                let us = (bound * 1e6) as u64;
                let count = if h.is_empty() || us < 1 {
                    0
                } else {
                    h.count_between(1, us.min(h.high()))
                };
                (bound, count)
            })
            .collect();
        let sum = self.total_ns.load(Ordering::Relaxed) as f64 / 1e9;
        (sum, h.len(), buckets)
    }

    /// A copy of the counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let calls = self.calls.load(Ordering::Relaxed);
        let failure = |kind: FailureKind| self.failures[kind.index()].load(Ordering::Relaxed);
        let p99_us = {
            let h = self.latency_us.lock().unwrap_or_else(|e| e.into_inner());
            (!h.is_empty()).then(|| h.value_at_quantile(0.99))
        };
        StatsSnapshot {
            calls,
            refusals: self.refusals.load(Ordering::Relaxed),
            failures: FailureCounts {
                trap: failure(FailureKind::Trap),
                deadline: failure(FailureKind::Deadline),
                memory: failure(FailureKind::Memory),
                fuel: failure(FailureKind::Fuel),
                other: failure(FailureKind::Other),
            },
            mean_us: (calls > 0)
                .then(|| self.total_ns.load(Ordering::Relaxed) as f64 / calls as f64 / 1_000.0),
            p99_us,
            last_failure: self
                .last_failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_percentiles() {
        let stats = CallStats::default();
        for i in 1..=100u64 {
            stats.answered(Duration::from_micros(i * 10), i % 10 == 0);
        }
        stats.failed(
            Duration::from_micros(5),
            FailureKind::Deadline,
            "too slow".into(),
        );
        let s = stats.snapshot();
        assert_eq!(s.calls, 101);
        assert_eq!(s.refusals, 10);
        assert_eq!(s.failures.deadline, 1);
        assert_eq!(s.failures.trap, 0);
        let p99 = s.p99_us.unwrap();
        assert!((980..=1010).contains(&p99), "{p99}");
        let mean = s.mean_us.unwrap();
        assert!((500.0..=501.0).contains(&mean), "{mean}");
        assert_eq!(s.last_failure.unwrap().kind, FailureKind::Deadline);
        let (sum, count, buckets) = stats.cumulative(&[0.000_005, 0.000_1, 0.01]);
        assert_eq!(count, 101);
        assert!((sum - 0.050_505).abs() < 1e-9, "{sum}");
        assert_eq!(buckets, [(0.000_005, 1), (0.000_1, 11), (0.01, 101)]);
    }
}
