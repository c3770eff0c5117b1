//! The event log's view: one event (`ctl events`, `ctl events --follow`).

use pluglet_proto::admin::v1 as pb;
use serde::{Deserialize, Serialize};

use super::{Kind, Listed, Table, dash};

/// Something that happened in the daemon (`ctl events`; the last errors of `ctl status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventView {
    /// Its number in the daemon's log; 0 for a `missed` marker.
    pub seq: u64,
    /// When it happened (RFC 3339, UTC).
    pub at: String,
    /// What happened: `registered`, `refused`, `allocated`, ... (`missed`: the follower fell
    /// behind). Named `type` because `kind` is the envelope's.
    #[serde(rename = "type")]
    pub event_type: String,
    /// What it happened to: a plugin (`TYPE NAME`), a resource, a handler slot.
    pub subject: String,
    /// A short message.
    pub message: String,
    /// For a `missed` marker: how many events went by unseen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missed: Option<u64>,
}

impl From<&pb::Event> for EventView {
    fn from(e: &pb::Event) -> EventView {
        EventView {
            seq: e.seq,
            at: e.at.clone(),
            event_type: e.kind.clone(),
            subject: e.subject.clone(),
            message: e.message.clone(),
            missed: (e.kind == "missed").then_some(e.missed),
        }
    }
}

impl EventView {
    /// One line for `ctl events --watch` (columns cannot be aligned on rows not seen yet).
    pub fn line(&self) -> String {
        format!(
            "{}  {:<19}  {}  {}\n",
            self.at,
            self.event_type,
            dash(&self.subject),
            self.message
        )
    }
}

impl Kind for EventView {
    const KIND: &'static str = "Event";
}

impl Listed for EventView {
    const LIST_KIND: &'static str = "EventList";
}

impl Table for EventView {
    const HEADER: &'static [&'static str] = &["TIME", "KIND", "SUBJECT", "MESSAGE"];
    fn row(&self) -> Vec<String> {
        vec![
            self.at.clone(),
            self.event_type.clone(),
            dash(&self.subject),
            self.message.clone(),
        ]
    }
}
