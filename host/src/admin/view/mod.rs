//! What the admin API shows, as people and scripts see it: one serde type per kind of row,
//! built from the admin API's protobuf messages. `pluglet ctl -o json` serialises these types,
//! the tables are rendered from them ([`Table`]), and `pluglet handler test --event` reads
//! [`PluginView`] back.
//!
//! JSON conventions: wire strings as the daemon reports them (`CSIPlugin`, `Healthy`),
//! snake_case keys, `null` for a value the daemon leaves empty, maps sorted by key. Every JSON
//! output is one [`Envelope`]: `api_version` ([`API_VERSION`]) and `kind` first, then the
//! object's own fields; a list's kind ends in `List` and its rows are in `items`.
//!
//! One module per family of views: [`plugins`], [`handlers`], [`devices`] (resources,
//! allocations and what allocate, release and sync-pods did), [`events`], [`status`]. This
//! module holds what they share: the envelope, the JSON and table renderers.

pub mod devices;
pub mod events;
pub mod handlers;
pub mod plugins;
pub mod status;
#[cfg(test)]
mod tests;

pub use devices::{
    AllocateResultView, AllocationView, DeviceSpecView, DeviceView, MountView, ReleaseResultView,
    ResourceView, SyncPodsView,
};
pub use events::EventView;
pub use handlers::{
    ChangeView, FailureView, FailuresView, HandlerRefreshView, HandlerRollbackView, HandlerView,
    HandlersView, ModuleRef, SignatureView,
};
pub use plugins::{PluginView, SocketView};
pub use status::{
    HandlerSummaryView, PluginCountView, PublishingView, ResourceSummaryView, StageView, StatusView,
};

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// The version every JSON output carries, as `api_version`.
pub const API_VERSION: &str = "pluglet/v1";

/// What every `-o json` output is: the version and the kind, then the fields of `body` (flat,
/// as `kubectl -o json` prints `apiVersion` and `kind` next to an object's own fields).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Envelope<T> {
    /// [`API_VERSION`].
    pub api_version: String,
    /// What the body is: `PluginList`, `Status`, `Event`, ...
    pub kind: String,
    /// The object's own fields.
    #[serde(flatten)]
    pub body: T,
}

/// A view printed on its own as JSON, with the kind its envelope names.
pub trait Kind {
    /// The envelope's `kind`.
    const KIND: &'static str;
}

/// A row type whose list is printed as JSON, with the kind of that list.
pub trait Listed {
    /// The list's `kind` (`PluginList` for plugins, ...).
    const LIST_KIND: &'static str;
}

/// The body of a list: its rows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Items<T> {
    /// The rows.
    pub items: Vec<T>,
}

impl<T: Listed> Kind for Items<T> {
    const KIND: &'static str = T::LIST_KIND;
}

impl<T: Kind> Envelope<T> {
    /// `body` in its envelope.
    pub fn new(body: T) -> Envelope<T> {
        Envelope {
            api_version: API_VERSION.to_owned(),
            kind: T::KIND.to_owned(),
            body,
        }
    }
}

/// `value` in its envelope as pretty JSON with a final newline.
pub fn json_of<T: Serialize + Kind>(value: &T) -> String {
    json(&enveloped(value))
}

fn enveloped<T: Kind>(value: &T) -> Envelope<&T> {
    Envelope {
        api_version: API_VERSION.to_owned(),
        kind: T::KIND.to_owned(),
        body: value,
    }
}

/// `value` in its envelope as one line of JSON (JSON lines), with a final newline.
pub fn json_line_of<T: Serialize + Kind>(value: &T) -> String {
    let mut s = serde_json::to_string(&enveloped(value)).unwrap_or_else(|_| "null".to_owned());
    s.push('\n');
    s
}

/// `items` as a list in its envelope (pretty JSON).
pub fn json_list<T: Serialize + Listed>(items: Vec<T>) -> String {
    json_of(&Items { items })
}

/// `None` for an empty string: the wire's "unset".
fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

fn sorted(map: &HashMap<String, String>) -> BTreeMap<String, String> {
    map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// `-` for an empty cell.
fn dash(s: &str) -> String {
    if s.is_empty() {
        "-".to_owned()
    } else {
        s.to_owned()
    }
}

/// A view listed one per row by `pluglet ctl`.
pub trait Table {
    /// Column titles.
    const HEADER: &'static [&'static str];
    /// The cells of this row, one per column.
    fn row(&self) -> Vec<String>;
}

/// `items` as aligned columns under `T::HEADER`.
pub fn table<T: Table>(items: &[T]) -> String {
    columns(T::HEADER, items.iter().map(Table::row).collect())
}

/// Left-aligned columns separated by two spaces; the last column is not padded.
pub fn columns(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(&rows) {
        let last = row.len().saturating_sub(1);
        for (i, (cell, w)) in row.iter().zip(&widths).enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                let _ = write!(out, "{cell:<w$}  ");
            }
        }
        out.push('\n');
    }
    out
}

/// `value` as pretty JSON with a final newline.
pub fn json<T: Serialize + ?Sized>(value: &T) -> String {
    let mut s = serde_json::to_string_pretty(value).unwrap_or_else(|_| "null".to_owned());
    s.push('\n');
    s
}
