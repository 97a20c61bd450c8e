//! Where a conversation without a session lands: rendezvous hashing with bounded loads, so router replicas agree on a node without talking.
//!
//! Every replica scores each candidate node by a hash of (conversation key,
//! node name) and takes the best-scoring node; the same key and node set give
//! the same node everywhere, and a node joining or leaving moves only the
//! conversations it wins or held (Thaler & Ravishankar's highest random
//! weight). Bounded loads (Mirrokni, Thorup & Zadimoghaddam, "Consistent
//! Hashing with Bounded Loads", 2018) skip a node already carrying more than
//! `c` times the mean load, so a hot key range cannot pile onto one node.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The load bound of HAProxy's and Vimeo's bounded-load consistent hashing:
/// no node takes more than 1.25 × the mean.
pub const DEFAULT_LOAD_BOUND: f64 = 1.25;

/// One node that may take the conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate<'a> {
    /// Its name as every replica knows it (its URL): never a per-process id,
    /// or replicas would score different nodes.
    pub name: &'a str,
    /// Its load as this replica sees it (requests in flight).
    pub load: u64,
}

/// The score of `name` for `key`: XXH3, stable across processes and
/// versions, seeded with the key so each key orders the nodes afresh.
pub fn score(key: u64, name: &str) -> u64 {
    xxh3_64_with_seed(name.as_bytes(), key)
}

/// The best-scoring candidate for `key` (a tie goes to the smaller name, so
/// it too is the same everywhere).
pub fn rendezvous(key: u64, nodes: &[Candidate<'_>]) -> Option<usize> {
    best(key, nodes.len(), |i| nodes[i], |_| true)
}

/// The most load any node may carry when one more conversation arrives:
/// `c` × the mean load after it, rounded up (at least 1, so an idle cluster
/// places by score alone... once each node holds one, then the next).
pub fn capacity(nodes: &[Candidate<'_>], c: f64) -> u64 {
    capacity_of(nodes.iter().map(|n| n.load).sum(), nodes.len(), c)
}

/// [`capacity`] from the candidates' total load and number, for a caller
/// that keeps the total as loads change (the simulator's check of every
/// placement against the true loads).
pub fn capacity_of(total_load: u64, nodes: usize, c: f64) -> u64 {
    let mean_after = (total_load + 1) as f64 / nodes.max(1) as f64;
    ((c.max(1.0) * mean_after).ceil() as u64).max(1)
}

/// The best-scoring candidate whose load is under [`capacity`]: the first
/// node in the key's score order with room. One pass, no allocation. Some
/// node always has room, since the mean is under the capacity.
pub fn bounded(key: u64, nodes: &[Candidate<'_>], c: f64) -> Option<usize> {
    let total = nodes.iter().map(|n| n.load).sum();
    bounded_by(key, nodes.len(), |i| nodes[i], total, c)
}

/// [`bounded`] over `n` candidates given by `candidate(i)` whose loads sum
/// to `total_load`, for a caller that keeps names and loads apart and the
/// total as loads change (the simulator, placing hundreds of thousands of
/// conversations over a thousand nodes: no slice to build, one pass).
pub fn bounded_by<'a>(
    key: u64,
    n: usize,
    candidate: impl Fn(usize) -> Candidate<'a>,
    total_load: u64,
    c: f64,
) -> Option<usize> {
    let cap = capacity_of(total_load, n, c);
    best(key, n, candidate, |x| x.load < cap)
}

fn best<'a>(
    key: u64,
    n: usize,
    candidate: impl Fn(usize) -> Candidate<'a>,
    room: impl Fn(&Candidate<'a>) -> bool,
) -> Option<usize> {
    (0..n)
        .map(|i| (i, candidate(i)))
        .filter(|(_, x)| room(x))
        // One hash per node (a comparator would hash both sides of every
        // comparison): at a thousand nodes placement is this loop.
        .max_by_key(|(_, x)| (score(key, x.name), std::cmp::Reverse(x.name)))
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn idle(names: &[String]) -> Vec<Candidate<'_>> {
        names
            .iter()
            .map(|n| Candidate { name: n, load: 0 })
            .collect()
    }

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("http://10.0.0.{i}:8000")).collect()
    }

    proptest! {
        #[test]
        fn the_same_key_and_nodes_give_the_same_node_in_any_order(
            key in any::<u64>(),
            n in 1usize..40,
            rot in 0usize..40,
        ) {
            let ns = names(n);
            let a = idle(&ns);
            let mut b = a.clone();
            b.rotate_left(rot % n);
            b.reverse();
            let pa = a[rendezvous(key, &a).unwrap()].name;
            let pb = b[rendezvous(key, &b).unwrap()].name;
            prop_assert_eq!(pa, pb);
        }

        #[test]
        fn a_node_leaving_moves_only_its_own_keys(key in any::<u64>(), n in 2usize..30, gone in 0usize..30) {
            let ns = names(n);
            let all = idle(&ns);
            let before = all[rendezvous(key, &all).unwrap()].name;
            let gone = all[gone % n].name;
            let rest: Vec<_> = all.iter().copied().filter(|c| c.name != gone).collect();
            let after = rest[rendezvous(key, &rest).unwrap()].name;
            if before != gone {
                prop_assert_eq!(before, after);
            }
        }

        #[test]
        fn bounded_by_picks_what_bounded_picks(
            key in any::<u64>(),
            loads in proptest::collection::vec(0u64..50, 1..40),
        ) {
            let ns = names(loads.len());
            let nodes: Vec<_> = ns.iter().zip(&loads).map(|(n, &l)| Candidate { name: n, load: l }).collect();
            let total = loads.iter().sum();
            prop_assert_eq!(
                bounded_by(key, nodes.len(), |i| nodes[i], total, DEFAULT_LOAD_BOUND),
                bounded(key, &nodes, DEFAULT_LOAD_BOUND)
            );
        }

        #[test]
        fn a_bounded_pick_never_exceeds_the_capacity(
            key in any::<u64>(),
            loads in proptest::collection::vec(0u64..50, 1..20),
        ) {
            let ns = names(loads.len());
            let nodes: Vec<_> = ns.iter().zip(&loads).map(|(n, &l)| Candidate { name: n, load: l }).collect();
            let i = bounded(key, &nodes, DEFAULT_LOAD_BOUND).unwrap();
            prop_assert!(nodes[i].load < capacity(&nodes, DEFAULT_LOAD_BOUND));
        }
    }

    #[test]
    fn no_candidates_give_no_node() {
        assert_eq!(rendezvous(1, &[]), None);
        assert_eq!(bounded(1, &[], DEFAULT_LOAD_BOUND), None);
    }

    #[test]
    fn a_new_node_takes_about_its_share_of_new_keys_and_moves_no_old_one() {
        let ns = names(4);
        let three = idle(&ns[..3]);
        let four = idle(&ns);
        let keys = 20_000u64;
        let mut taken = 0;
        for key in 0..keys {
            let k = crate::identity::hash_id(&key.to_string());
            let before = three[rendezvous(k, &three).unwrap()].name;
            let after = four[rendezvous(k, &four).unwrap()].name;
            if after == ns[3] {
                taken += 1;
            } else {
                assert_eq!(before, after, "key {key} moved between old nodes");
            }
        }
        let share = f64::from(taken) / keys as f64;
        assert!((0.22..0.28).contains(&share), "the new node took {share}");
    }

    #[test]
    fn a_loaded_favourite_is_skipped_for_the_next_in_the_keys_order() {
        let ns = names(4);
        let mut nodes = idle(&ns);
        let key = 42;
        let fav = rendezvous(key, &nodes).unwrap();
        nodes[fav].load = 10;
        let next = bounded(key, &nodes, DEFAULT_LOAD_BOUND).unwrap();
        assert_ne!(next, fav);
        // The runner-up in the key's order, not any idle node.
        let without: Vec<_> = nodes
            .iter()
            .copied()
            .filter(|c| c.name != nodes[fav].name)
            .collect();
        assert_eq!(
            nodes[next].name,
            without[rendezvous(key, &without).unwrap()].name
        );
    }

    #[test]
    fn bounded_loads_keep_every_node_near_the_mean() {
        let ns = names(8);
        let mut nodes = idle(&ns);
        for key in 0..8_000u64 {
            let i = bounded(
                crate::identity::hash_id(&key.to_string()),
                &nodes,
                DEFAULT_LOAD_BOUND,
            )
            .unwrap();
            nodes[i].load += 1;
        }
        let max = nodes.iter().map(|n| n.load).max().unwrap();
        assert!(max <= 1_250, "a node took {max} of 8000 over 8 nodes");
    }
}
