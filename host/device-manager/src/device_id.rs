//! [`DeviceId`]: a device's id as its plugin reported it, held as its own type everywhere in the
//! device manager. The wire forms (protobuf messages to and from plugins, the admin API, the
//! kubelet checkpoint) carry plain strings; they are converted where they are read and written.

use std::borrow::Borrow;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A device id, unique within its resource. Wraps the wire string and adds nothing but its
/// meaning: `Display` prints it, `Borrow<str>` lets maps and sets keyed by ids be looked up with
/// a plain `&str`, serde reads and writes the bare string, and converting from or to a `String`
/// moves it (no copy).
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DeviceId(String);

impl DeviceId {
    /// Wraps a wire string.
    pub fn new(id: impl Into<String>) -> DeviceId {
        DeviceId(id.into())
    }

    /// The wire string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The wire string, owned.
    pub fn into_string(self) -> String {
        self.0
    }

    /// Whether the id is empty (a plugin's mistake: such a device is not served).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The ids as the wire carries them (a copy of each).
    pub fn to_wire(ids: &[DeviceId]) -> Vec<String> {
        ids.iter().map(|id| id.0.clone()).collect()
    }

    /// Wire strings as ids (moved, not copied).
    pub fn from_wire(ids: Vec<String>) -> Vec<DeviceId> {
        ids.into_iter().map(DeviceId).collect()
    }

    /// Ids as wire strings (moved, not copied).
    pub fn into_wire(ids: Vec<DeviceId>) -> Vec<String> {
        ids.into_iter().map(DeviceId::into_string).collect()
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Borrow<str> for DeviceId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for DeviceId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl From<String> for DeviceId {
    fn from(id: String) -> DeviceId {
        DeviceId(id)
    }
}

impl From<&str> for DeviceId {
    fn from(id: &str) -> DeviceId {
        DeviceId(id.to_owned())
    }
}

impl From<DeviceId> for String {
    fn from(id: DeviceId) -> String {
        id.0
    }
}

impl PartialEq<str> for DeviceId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for DeviceId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use super::*;

    #[test]
    fn ids_look_up_by_str_sort_as_strings_and_serialise_bare() {
        let map = HashMap::from([(DeviceId::from("gpu-0"), 1)]);
        assert_eq!(map.get("gpu-0"), Some(&1));
        let sorted: Vec<String> =
            BTreeMap::from([(DeviceId::from("b"), ()), (DeviceId::from("B"), ())])
                .into_keys()
                .map(String::from)
                .collect();
        assert_eq!(sorted, ["B", "b"], "byte order, as Go sorts strings");
        assert_eq!(
            serde_json::to_string(&vec![DeviceId::from("d0")]).unwrap(),
            r#"["d0"]"#
        );
        let back: DeviceId = serde_json::from_str(r#""d1""#).unwrap();
        assert_eq!(back, "d1");
        let wire = vec!["a".to_owned(), "b".to_owned()];
        let ids = DeviceId::from_wire(wire.clone());
        assert_eq!(ids.join(","), "a,b");
        assert_eq!(DeviceId::to_wire(&ids), wire);
        assert_eq!(DeviceId::into_wire(ids), wire);
    }
}
