//! The pods a sync of pods keeps: their UIDs sorted, each once.
//!
//! A sync walks the held pods (sorted) beside this list in one pass
//! ([`PodDevices::not_kept`](crate::pod_devices::PodDevices::not_kept)). A sorted vector is
//! made from the request's own strings with one sort, and makes each step of that walk an index
//! increment and each jump a binary search, where a tree set is built node by node and its
//! iterator climbs them (docs/performance.md has the counts).
//!
//! The walk's comparisons are [`KeptCursor`]'s: one per held entry while the two lists go in
//! step. A pod UID is short (a kubelet's are 36-byte UUIDs), and a `memcmp` call costs more
//! than comparing it, so equality is compared in line, a word at a time. The standard library's
//! slice equality calls `memcmp`, and no maintained crate offers an inline one for short
//! strings.

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

    /// A cursor that answers, for pods asked in ascending order, whether each is kept.
    pub fn ascending(&self) -> KeptCursor<'_> {
        KeptCursor {
            kept: &self.sorted,
            next: 0,
            matched: None,
        }
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

/// Answers whether pods are kept, one pass beside the list: each question's pod must not sort
/// before the one asked last (see [`KeepList::ascending`]).
#[derive(Debug)]
pub struct KeptCursor<'a> {
    kept: &'a [PodUid],
    /// The first kept pod not passed yet.
    next: usize,
    /// The kept pod matched last: the next questions may ask for it again (its other entries).
    matched: Option<&'a [u8]>,
}

impl KeptCursor<'_> {
    /// Steps over kept pods before jumping with a binary search.
    const STEPS: usize = 8;

    /// Whether the pod whose UID is `pod` (its bytes) is kept. One comparison when the list and
    /// the questions go in step (every pod asked is kept); where the list runs far ahead of
    /// them, a jump by binary search.
    #[inline]
    pub fn contains(&mut self, pod: &[u8]) -> bool {
        match self.kept.get(self.next) {
            Some(candidate) if same(candidate.as_str().as_bytes(), pod) => {
                self.matched = Some(candidate.as_str().as_bytes());
                self.next += 1;
                true
            }
            _ => self.passing(pod),
        }
    }

    /// Whether `pod` is kept, when it is not the next kept pod: passes the kept pods before it.
    fn passing(&mut self, pod: &[u8]) -> bool {
        let mut steps = 0;
        loop {
            let Some(candidate) = self.kept.get(self.next).map(|k| k.as_str().as_bytes()) else {
                return self.matched.is_some_and(|m| same(m, pod));
            };
            if same(candidate, pod) {
                self.matched = Some(candidate);
                self.next += 1;
                return true;
            }
            if candidate > pod {
                return self.matched.is_some_and(|m| same(m, pod));
            }
            steps += 1;
            if steps == Self::STEPS {
                self.next +=
                    self.kept[self.next..].partition_point(|k| k.as_str().as_bytes() < pod);
                steps = 0;
            } else {
                self.next += 1;
            }
        }
    }
}

/// Whether `a` and `b` are the same bytes, compared in line a word at a time rather than by a
/// `memcmp` call: sixteen bytes at a time with the last sixteen overlapping the ones before
/// them, or from 8 to 15 bytes as two overlapping eight-byte words.
#[inline]
fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    // Integers, not arrays: an array comparison may still call `memcmp`.
    let wide = |bytes: &[u8; 16]| u128::from_ne_bytes(*bytes);
    let narrow = |bytes: &[u8; 8]| u64::from_ne_bytes(*bytes);
    if let (Some(a_last), Some(b_last)) = (a.last_chunk::<16>(), b.last_chunk::<16>()) {
        let mut words = a.as_chunks::<16>().0.iter().zip(b.as_chunks::<16>().0);
        return wide(a_last) == wide(b_last) && words.all(|(a, b)| wide(a) == wide(b));
    }
    match (
        a.first_chunk(),
        a.last_chunk(),
        b.first_chunk(),
        b.last_chunk(),
    ) {
        (Some(a_first), Some(a_last), Some(b_first), Some(b_last)) => {
            narrow(a_last) == narrow(b_last) && narrow(a_first) == narrow(b_first)
        }
        _ => a == b,
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

    #[test]
    fn same_compares_every_byte_of_any_length() {
        for len in 0..40 {
            let a: String = (0..len)
                .map(|i| char::from(b'a' + (i % 26) as u8))
                .collect();
            assert!(same(a.as_bytes(), a.clone().as_bytes()), "{a}");
            for at in 0..len {
                let mut b = a.clone().into_bytes();
                b[at] = b'-';
                let b = String::from_utf8(b).unwrap();
                assert!(!same(a.as_bytes(), b.as_bytes()), "{a} against {b}");
            }
            assert!(!same(a.as_bytes(), format!("{a}x").as_bytes()));
        }
    }

    proptest::proptest! {
        #[test]
        fn a_cursor_answers_as_contains_does_for_pods_asked_in_order(
            kept in proptest::collection::vec(0u16..300, 0..120),
            asked in proptest::collection::vec(0u16..320, 0..200),
        ) {
            // Of every length from 8 to 44 bytes, so that the comparison's words and its last
            // overlapping word are all exercised.
            let uid = |p: &u16| format!("pod-{p:03}-{}", "u".repeat(usize::from(p % 37)));
            let keep: KeepList = kept.iter().map(uid).collect();
            let mut asked: Vec<String> = asked.iter().map(uid).collect();
            asked.sort();
            let mut cursor = keep.ascending();
            for pod in &asked {
                proptest::prop_assert_eq!(
                    cursor.contains(pod.as_bytes()),
                    keep.contains(pod),
                    "{}",
                    pod
                );
            }
        }
    }
}
