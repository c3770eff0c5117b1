//! The daemon's recent events: registrations, deregistrations, refusals, allocations, releases
//! and handler changes, each with a wall-clock time, a kind, a subject and a short message.
//!
//! One [`EventLog`] per daemon, handed to every producer (the registration pipeline, the device
//! manager, the handler set) and read by the admin API. It keeps the last `capacity` events in
//! a ring (memory stays bounded) and broadcasts each new one to followers. Recording takes a
//! short lock and never waits or does I/O, so it is fit for the allocation path.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use tokio::sync::broadcast;

/// How many events a log keeps unless told otherwise.
pub const DEFAULT_CAPACITY: usize = 1000;

/// How many events a follower may fall behind before it is told it missed some.
const FOLLOWER_BACKLOG: usize = 256;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A plugin registered.
    Registered,
    /// A registration ended.
    Deregistered,
    /// A registration was refused (by a handler, or a step of its plugin type failed).
    Refused,
    /// A device plugin's endpoint became its resource's endpoint.
    Connected,
    /// A resource's endpoint went away; its grace period started.
    Disconnected,
    /// A resource's grace period ended.
    GraceEnded,
    /// Devices were allocated to a container.
    Allocated,
    /// An allocation failed or was refused.
    AllocateFailed,
    /// Devices a container held were released.
    Released,
    /// A release could not be made durable and was refused: the devices stay held.
    ReleaseFailed,
    /// A corrupt state file was found at start and kept aside; the message says what was
    /// wrong, where the copy is, and what was recovered and lost.
    StateSetAside,
    /// A handler change was applied.
    HandlerApplied,
    /// A handler change was refused; the handlers in force keep serving.
    HandlerRefused,
    /// A handler slot was rolled back.
    HandlerRolledBack,
}

impl EventKind {
    /// Every kind.
    pub const ALL: [EventKind; 14] = [
        EventKind::Registered,
        EventKind::Deregistered,
        EventKind::Refused,
        EventKind::Connected,
        EventKind::Disconnected,
        EventKind::GraceEnded,
        EventKind::Allocated,
        EventKind::AllocateFailed,
        EventKind::Released,
        EventKind::ReleaseFailed,
        EventKind::StateSetAside,
        EventKind::HandlerApplied,
        EventKind::HandlerRefused,
        EventKind::HandlerRolledBack,
    ];

    /// Its snake_case name, as the admin API and `pluglet ctl events` show it.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Registered => "registered",
            EventKind::Deregistered => "deregistered",
            EventKind::Refused => "refused",
            EventKind::Connected => "connected",
            EventKind::Disconnected => "disconnected",
            EventKind::GraceEnded => "grace_ended",
            EventKind::Allocated => "allocated",
            EventKind::AllocateFailed => "allocate_failed",
            EventKind::Released => "released",
            EventKind::ReleaseFailed => "release_failed",
            EventKind::StateSetAside => "state_set_aside",
            EventKind::HandlerApplied => "handler_applied",
            EventKind::HandlerRefused => "handler_refused",
            EventKind::HandlerRolledBack => "handler_rolled_back",
        }
    }

    /// Whether it reports something that went wrong (what `ctl status` lists as errors).
    pub fn is_error(self) -> bool {
        matches!(
            self,
            EventKind::Refused
                | EventKind::AllocateFailed
                | EventKind::ReleaseFailed
                | EventKind::StateSetAside
                | EventKind::HandlerRefused
                | EventKind::HandlerRolledBack
        )
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// Its number in the log: 1 for the first, one more for each after.
    pub seq: u64,
    /// When it was recorded.
    pub at: SystemTime,
    /// What happened.
    pub kind: EventKind,
    /// What it happened to: a plugin (`TYPE NAME`), a resource, a pod's container, a handler
    /// slot.
    pub subject: String,
    /// A short message.
    pub message: String,
}

/// What a [`Follower`] gets next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Followed {
    /// The next event.
    Event(Event),
    /// The follower fell behind and this many events went by unseen.
    Missed(u64),
}

/// The daemon's event log: cheap to clone; every clone is the same log.
#[derive(Clone)]
pub struct EventLog {
    inner: Arc<Inner>,
}

struct Inner {
    capacity: usize,
    ring: Mutex<Ring>,
    sender: broadcast::Sender<Event>,
}

struct Ring {
    next_seq: u64,
    events: VecDeque<Event>,
}

impl fmt::Debug for EventLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventLog")
            .field("capacity", &self.inner.capacity)
            .finish_non_exhaustive()
    }
}

impl Default for EventLog {
    fn default() -> EventLog {
        EventLog::new(DEFAULT_CAPACITY)
    }
}

impl EventLog {
    /// A log keeping the last `capacity` events (at least one).
    pub fn new(capacity: usize) -> EventLog {
        let capacity = capacity.max(1);
        EventLog {
            inner: Arc::new(Inner {
                capacity,
                ring: Mutex::new(Ring {
                    next_seq: 1,
                    events: VecDeque::with_capacity(capacity),
                }),
                sender: broadcast::channel(FOLLOWER_BACKLOG).0,
            }),
        }
    }

    /// How many events it keeps.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Records an event now, dropping the oldest when the log is full, and hands it to the
    /// followers.
    pub fn record(&self, kind: EventKind, subject: impl Into<String>, message: impl Into<String>) {
        let mut ring = self.ring();
        let event = Event {
            seq: ring.next_seq,
            at: SystemTime::now(),
            kind,
            subject: subject.into(),
            message: message.into(),
        };
        ring.next_seq += 1;
        // Sent under the ring's lock, so a follower's backlog and its stream never overlap or
        // leave a gap.
        if self.inner.sender.receiver_count() > 0 {
            let _ = self.inner.sender.send(event.clone());
        }
        if ring.events.len() == self.inner.capacity {
            ring.events.pop_front();
        }
        ring.events.push_back(event);
    }

    /// The events kept, oldest first.
    pub fn recent(&self) -> Vec<Event> {
        self.ring().events.iter().cloned().collect()
    }

    /// A follower that gets the events kept, then each new one.
    pub fn follow(&self) -> Follower {
        let ring = self.ring();
        Follower {
            backlog: ring.events.clone(),
            receiver: self.inner.sender.subscribe(),
        }
    }

    fn ring(&self) -> MutexGuard<'_, Ring> {
        self.inner.ring.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Follows an [`EventLog`]: the events it kept when following started, then each new one.
#[derive(Debug)]
pub struct Follower {
    backlog: VecDeque<Event>,
    receiver: broadcast::Receiver<Event>,
}

impl Follower {
    /// The next event, or how many went by while this follower was behind; `None` once the
    /// log is gone.
    pub async fn next(&mut self) -> Option<Followed> {
        if let Some(event) = self.backlog.pop_front() {
            return Some(Followed::Event(event));
        }
        match self.receiver.recv().await {
            Ok(event) => Some(Followed::Event(event)),
            Err(broadcast::error::RecvError::Lagged(missed)) => Some(Followed::Missed(missed)),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subjects(events: &[Event]) -> Vec<String> {
        events.iter().map(|e| e.subject.clone()).collect()
    }

    #[test]
    fn keeps_the_newest_events_newest_last() {
        let log = EventLog::new(3);
        for n in 1..=5 {
            log.record(EventKind::Allocated, format!("pod-{n}"), "allocated");
        }
        let recent = log.recent();
        assert_eq!(subjects(&recent), ["pod-3", "pod-4", "pod-5"]);
        assert_eq!(recent.iter().map(|e| e.seq).collect::<Vec<_>>(), [3, 4, 5]);
        assert!(recent.windows(2).all(|w| w[0].at <= w[1].at));
    }

    #[test]
    fn capacity_is_at_least_one() {
        let log = EventLog::new(0);
        log.record(EventKind::Registered, "a", "m");
        log.record(EventKind::Registered, "b", "m");
        assert_eq!(log.capacity(), 1);
        assert_eq!(subjects(&log.recent()), ["b"]);
    }

    #[tokio::test]
    async fn a_follower_gets_the_backlog_then_new_events_in_order() {
        let log = EventLog::new(10);
        log.record(EventKind::Registered, "old", "m");
        let mut follower = log.follow();
        log.record(EventKind::Allocated, "new", "m");
        let mut got = Vec::new();
        for _ in 0..2 {
            match follower.next().await {
                Some(Followed::Event(e)) => got.push(e),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(subjects(&got), ["old", "new"]);
        assert_eq!(got[1].kind, EventKind::Allocated);
    }

    #[tokio::test]
    async fn a_follower_that_falls_behind_is_told_how_many_it_missed() {
        let log = EventLog::new(10);
        let mut follower = log.follow();
        let total = FOLLOWER_BACKLOG as u64 + 5;
        for n in 0..total {
            log.record(EventKind::Released, format!("pod-{n}"), "released");
        }
        assert_eq!(follower.next().await, Some(Followed::Missed(5)));
        let Some(Followed::Event(next)) = follower.next().await else {
            panic!("no event after the gap")
        };
        assert_eq!(next.seq, 6, "the first event after the gap");
    }

    #[tokio::test]
    async fn a_follower_ends_when_the_log_is_gone() {
        let log = EventLog::new(1);
        let mut follower = log.follow();
        drop(log);
        assert_eq!(follower.next().await, None);
    }

    #[test]
    fn errors_are_refusals_and_failures() {
        let errors: Vec<&str> = EventKind::ALL
            .into_iter()
            .filter(|k| k.is_error())
            .map(EventKind::as_str)
            .collect();
        assert_eq!(
            errors,
            [
                "refused",
                "allocate_failed",
                "release_failed",
                "state_set_aside",
                "handler_refused",
                "handler_rolled_back"
            ]
        );
    }
}
