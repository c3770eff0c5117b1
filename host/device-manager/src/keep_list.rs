//! The pods a sync of pods keeps: their UIDs sorted, each once.
//!
//! A sync walks the held entries (sorted by pod) beside this list in one pass
//! ([`PodDevices::not_kept`](crate::pod_devices::PodDevices::not_kept)). A sorted vector is
//! made from the request's own strings with one sort, and makes each step of that walk an index
//! increment and each jump a binary search, where a tree set is built node by node and its
//! iterator climbs them (docs/performance.md has the counts).

use pluglet_core::PodUid;

/// Pod UIDs, sorted and without repeats.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeepList {
    sorted: Vec<PodUid>,
}

impl KeepList {
    /// Whether `pod_uid` is kept.
    pub fn contains(&self, pod_uid: &str) -> bool {
        self.sorted
            .binary_search_by(|kept| kept.as_str().cmp(pod_uid))
            .is_ok()
    }

    /// The kept UIDs, sorted.
    pub fn as_slice(&self) -> &[PodUid] {
        &self.sorted
    }

    /// How many pods are kept.
    pub fn len(&self) -> usize {
        self.sorted.len()
    }

    /// Whether no pod is kept.
    pub fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }
}

impl From<Vec<PodUid>> for KeepList {
    fn from(mut uids: Vec<PodUid>) -> KeepList {
        uids.sort_unstable();
        uids.dedup();
        KeepList { sorted: uids }
    }
}

impl<T: Into<PodUid>> FromIterator<T> for KeepList {
    fn from_iter<I: IntoIterator<Item = T>>(uids: I) -> KeepList {
        KeepList::from(uids.into_iter().map(Into::into).collect::<Vec<_>>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_sorted_once_whatever_order_it_came_in() {
        let keep: KeepList = ["b", "a", "c", "a"].into_iter().collect();
        let uids: Vec<&str> = keep.as_slice().iter().map(PodUid::as_str).collect();
        assert_eq!(uids, ["a", "b", "c"]);
        assert!(keep.contains("b"));
        assert!(!keep.contains("ab"));
        assert_eq!(keep.len(), 3);
        assert!(KeepList::default().is_empty());
    }
}
