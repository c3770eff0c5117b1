//! Wave membership: which nodes a wave opens for. Every daemon and every coordinator computes
//! the same answer without talking: the selected nodes are ordered by the sha256 of the
//! rollout's UID and the node's name, and wave `i` holds the next nodes of that order up to
//! its cumulative percent of them, rounded up, at least one node. A wave's members are written
//! to the rollout's status when it opens and never recomputed (a node that joins later waits
//! for a later wave).

use std::collections::BTreeSet;

use sha2::{Digest as _, Sha256};

/// `nodes` in the rollout's order: by sha256 of `uid`, a NUL and the node's name (then by name,
/// which two distinct names never need).
pub fn order<'a>(uid: &str, nodes: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut keyed: Vec<([u8; 32], &str)> = nodes
        .into_iter()
        .map(|node| {
            let mut digest = Sha256::new();
            digest.update(uid.as_bytes());
            digest.update([0]);
            digest.update(node.as_bytes());
            (digest.finalize().into(), node)
        })
        .collect();
    keyed.sort_unstable();
    keyed.dedup_by(|a, b| a.1 == b.1);
    keyed.into_iter().map(|(_, node)| node.to_owned()).collect()
}

/// How many of `total` nodes the waves of `percents` hold once each has opened: cumulative,
/// rounded up, each at least one more than the one before, never more than `total`.
pub fn cumulative(percents: &[u32], total: usize) -> Vec<usize> {
    let mut counts = Vec::with_capacity(percents.len());
    let mut before = 0usize;
    for &percent in percents {
        let share = (total * percent.min(100) as usize).div_ceil(100);
        let count = share.max(before + 1).min(total);
        counts.push(count);
        before = count;
    }
    counts
}

/// The members of wave `index` (from 0) when it opens: the next nodes of the order among
/// `selected` that no earlier wave holds (`frozen`), up to the wave's cumulative count of
/// every node taking part (`selected` and `frozen`), at least one while any is left.
pub fn next_members(
    uid: &str,
    percents: &[u32],
    index: usize,
    selected: &[String],
    frozen: &BTreeSet<String>,
) -> Vec<String> {
    let waiting: Vec<&str> = selected
        .iter()
        .map(String::as_str)
        .filter(|n| !frozen.contains(*n))
        .collect();
    let total = frozen.len() + waiting.len();
    let Some(&target) = cumulative(percents, total).get(index) else {
        return Vec::new();
    };
    let take = target.saturating_sub(frozen.len()).max(1);
    let mut members = order(uid, waiting);
    members.truncate(take);
    members
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("node-{i}")).collect()
    }

    #[test]
    fn percents_are_cumulative_rounded_up_and_at_least_one_node_each() {
        assert_eq!(cumulative(&[5, 25, 100], 1000), [50, 250, 1000]);
        assert_eq!(cumulative(&[5, 25, 100], 5), [1, 2, 5]);
        assert_eq!(cumulative(&[1, 2, 3, 100], 5), [1, 2, 3, 5]);
        assert_eq!(cumulative(&[34, 67, 100], 3), [2, 3, 3]);
        assert_eq!(cumulative(&[100], 0), [0]);
    }

    #[test]
    fn the_order_is_the_same_whoever_computes_it_and_differs_by_rollout() {
        let nodes = names(50);
        let a = order("uid-a", nodes.iter().map(String::as_str));
        let reversed = order("uid-a", nodes.iter().rev().map(String::as_str));
        assert_eq!(a, reversed);
        assert_eq!(a.iter().collect::<BTreeSet<_>>().len(), 50);
        let b = order("uid-b", nodes.iter().map(String::as_str));
        assert_ne!(a, b, "another rollout starts on other nodes");
    }

    #[test]
    fn waves_open_on_disjoint_members_that_cover_every_node() {
        let nodes = names(5);
        let percents = [20, 60, 100];
        let mut frozen = BTreeSet::new();
        let mut sizes = Vec::new();
        for index in 0..percents.len() {
            let members = next_members("uid", &percents, index, &nodes, &frozen);
            assert!(members.iter().all(|m| !frozen.contains(m)));
            sizes.push(members.len());
            frozen.extend(members);
        }
        assert_eq!(sizes, [1, 2, 2]);
        assert_eq!(frozen.len(), 5);
        assert!(next_members("uid", &percents, 3, &nodes, &frozen).is_empty());
    }

    #[test]
    fn a_node_that_joins_after_a_wave_opened_waits_for_a_later_one() {
        let mut nodes = names(4);
        let percents = [50, 100];
        let first = next_members("uid", &percents, 0, &nodes, &BTreeSet::new());
        assert_eq!(first.len(), 2);
        nodes.push("late".into());
        let frozen: BTreeSet<String> = first.iter().cloned().collect();
        let second = next_members("uid", &percents, 1, &nodes, &frozen);
        assert_eq!(second.len(), 3);
        assert!(second.contains(&"late".to_owned()));
    }
}
