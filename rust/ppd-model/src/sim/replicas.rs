//! The router replicas of a simulated cluster: each with its own arrival-rate estimate, cost-model corrections and delayed view of node load, placing new conversations by ppd-core's bounded-load rendezvous.
//!
//! What a replica knows of load, and when:
//! * its own requests in flight on each node, exactly (its own bookkeeping);
//! * the other replicas' requests in flight on each node as they were at its
//!   last refresh (the live router's metrics scrape or shared state), taken
//!   every `view_delay_s`, the replicas' refreshes staggered evenly over that
//!   period as independent timers would be;
//! * each node's engine state — sequences decoding, prompt work queued, KV in
//!   use — as that refresh saw it (the live router's scrape of the node's
//!   `/metrics`), which the cost model of `ppd-live` and the anchors' load
//!   gates read;
//! * the fleet's conversation rate: its own, exactly, plus the others' at
//!   that refresh (the live router's `fleet_rate.rs`), the rate on the
//!   decision's QPS axis;
//! * with `view_delay_s` = 0, every node's true load and state at the moment
//!   it decides.
//!
//! Load is the router's count (requests routed to a node and not yet
//! answered), the load `ppd_core::placement` is defined on. KV residency is
//! not part of the view: every replica subscribes to every node's KV events,
//! so a conversation's D is the same truth at every replica.

use ppd_core::placement::{self, Candidate, DEFAULT_LOAD_BOUND};
use ppd_core::qps::QpsEstimator;
use ppd_core::{DecisionEngine, NodeView};

use crate::engine::mix64;

/// One router replica's own state.
pub(super) struct Replica {
    pub(super) router: DecisionEngine,
    pub(super) qps: QpsEstimator,
    /// Round-robin positions over P, D (one router only) and R nodes.
    pub(super) rr_p: usize,
    pub(super) rr_d: usize,
    pub(super) rr_r: usize,
    /// Requests this replica has in flight, per node.
    mine: Vec<u32>,
    /// The other replicas' requests in flight per node at the last refresh.
    others: Vec<u32>,
    /// The load this replica sees summed over the decoding nodes.
    seen_d_total: u64,
    /// The other replicas' conversation rate at the last refresh.
    others_rate: f64,
    /// Every node's engine state at the last refresh; empty before the first.
    views: Vec<NodeView>,
}

impl Replica {
    pub(super) fn new(router: DecisionEngine, qps: QpsEstimator, nodes: usize) -> Replica {
        Replica {
            router,
            qps,
            rr_p: 0,
            rr_d: 0,
            rr_r: 0,
            mine: vec![0; nodes],
            others: vec![0; nodes],
            seen_d_total: 0,
            others_rate: 0.0,
            views: Vec::new(),
        }
    }

    /// Takes in the other replicas' load as it is now (`truth`: every
    /// replica's requests in flight per node; `truth_d_total`: their sum
    /// over the decoding nodes).
    pub(super) fn refresh(&mut self, truth: &[u32], truth_d_total: u64) {
        for ((o, &t), &m) in self.others.iter_mut().zip(truth).zip(&self.mine) {
            *o = t - m;
        }
        self.seen_d_total = truth_d_total;
    }

    /// Takes in what the refresh read besides load: the other replicas'
    /// conversation rate and every node's engine state (by node index).
    pub(super) fn refresh_state(&mut self, others_rate: f64, views: &[NodeView]) {
        self.others_rate = others_rate;
        self.views.clear();
        self.views.extend_from_slice(views);
    }

    /// The conversation rate the decision uses at `now_ms`: this replica's
    /// own and the others' as last refreshed (with one router, its own).
    pub(super) fn fleet_rate(&mut self, now_ms: u64) -> f64 {
        self.qps.rate(now_ms) + self.others_rate
    }

    /// `node`'s engine state as the last refresh saw it; `None` before the
    /// first (or when views are exact).
    pub(super) fn view(&self, node: usize) -> Option<NodeView> {
        self.views.get(node).copied()
    }

    /// One more request of this replica's on `node` (a decoding node or not).
    pub(super) fn sent(&mut self, node: usize, decodes: bool) {
        self.mine[node] += 1;
        self.seen_d_total += u64::from(decodes);
    }

    pub(super) fn answered(&mut self, node: usize, decodes: bool) {
        self.mine[node] -= 1;
        self.seen_d_total -= u64::from(decodes);
    }

    /// [`Replica::seen`] summed over the decoding nodes.
    pub(super) fn seen_d_total(&self) -> u64 {
        self.seen_d_total
    }

    /// The load of `node` as this replica sees it between refreshes.
    pub(super) fn seen(&self, node: usize) -> u32 {
        self.others[node] + self.mine[node]
    }
}

/// Which replica a conversation's turn reaches: the load balancer in front of
/// the replicas spreads requests uniformly at random, each turn afresh (a
/// Turn 2 rarely returns to its Turn 1's replica), seeded by the
/// conversation so a point is reproducible.
pub(super) fn replica_for(key: u64, turn: u32, routers: u32) -> usize {
    if routers <= 1 {
        return 0;
    }
    let draw = mix64(key ^ mix64(u64::from(turn) ^ 0x5EB1_1CA5));
    (draw % u64::from(routers)) as usize
}

/// The node names every replica scores (a node's position in the layout:
/// the same at every replica, as the live router's URLs are).
pub(super) fn node_names(nodes: usize) -> Vec<String> {
    (0..nodes).map(|i| format!("node{i}")).collect()
}

/// A new conversation's D: ppd-core's rendezvous hashing with bounded loads
/// (the live router's rule) over the decoding nodes `ds`, with `load(node)`
/// as the deciding replica sees it and `total` its sum over `ds`. Returns a
/// node index.
pub(super) fn place(
    key: u64,
    ds: &[usize],
    names: &[String],
    load: impl Fn(usize) -> u32,
    total: u64,
) -> usize {
    let candidate = |i: usize| Candidate {
        name: &names[ds[i]],
        load: u64::from(load(ds[i])),
    };
    let i = placement::bounded_by(key, ds.len(), candidate, total, DEFAULT_LOAD_BOUND)
        .expect("a deployment with a pd path has a decoding node");
    ds[i]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn replicas_with_the_same_view_pick_the_same_node(
            key in any::<u64>(),
            loads in proptest::collection::vec(0u32..20, 1..64),
        ) {
            let names = node_names(loads.len());
            let ds: Vec<usize> = (0..loads.len()).collect();
            let total = loads.iter().map(|&l| u64::from(l)).sum();
            let a = place(key, &ds, &names, |n| loads[n], total);
            // Another replica lists the nodes in another order.
            let rev: Vec<usize> = ds.iter().rev().copied().collect();
            let b = place(key, &rev, &names, |n| loads[n], total);
            prop_assert_eq!(a, b);
        }

        #[test]
        fn a_refreshed_replica_sees_the_true_load(
            truth_mine in proptest::collection::vec((0u32..50, 0u32..50), 1..32),
        ) {
            let truth: Vec<u32> = truth_mine.iter().map(|&(o, m)| o + m).collect();
            let mut r = Replica::new(test_router(), QpsEstimator::new(1000, 10).unwrap(), truth.len());
            for (n, &(_, m)) in truth_mine.iter().enumerate() {
                for _ in 0..m {
                    r.sent(n, true);
                }
            }
            let total = truth.iter().map(|&t| u64::from(t)).sum();
            r.refresh(&truth, total);
            for (n, &t) in truth.iter().enumerate() {
                prop_assert_eq!(r.seen(n), t);
            }
            prop_assert_eq!(r.seen_d_total(), total);
        }
    }

    fn test_router() -> DecisionEngine {
        let table = super::super::placeholder_table().unwrap();
        DecisionEngine::new(
            table,
            ppd_core::PolicyKind::Local,
            ppd_core::Weights::new(1.0, 1.0).unwrap(),
        )
    }

    #[test]
    fn between_refreshes_a_replica_sees_its_own_sends_but_not_the_others() {
        let mut r = Replica::new(test_router(), QpsEstimator::new(1000, 10).unwrap(), 2);
        r.refresh(&[3, 0], 3);
        r.sent(1, true);
        assert_eq!((r.seen(0), r.seen(1), r.seen_d_total()), (3, 1, 4));
        r.answered(1, true);
        assert_eq!((r.seen(1), r.seen_d_total()), (0, 3));
    }

    #[test]
    fn a_refreshed_replica_decides_with_the_fleets_rate_and_the_node_state_it_read() {
        let mut r = Replica::new(test_router(), QpsEstimator::new(10_000, 100).unwrap(), 2);
        for t in [0, 500, 1000, 1500] {
            r.qps.record(t);
        }
        let own = r.qps.rate(2000);
        assert!(own > 0.0);
        assert_eq!(r.view(1), None, "no state before the first refresh");
        let busy = NodeView {
            running: 40,
            waiting: 3,
            ..NodeView::default()
        };
        r.refresh_state(6.0, &[NodeView::default(), busy]);
        assert_eq!(r.fleet_rate(2000), own + 6.0);
        assert_eq!(r.view(1), Some(busy));
        // Until the next refresh, whatever the nodes do since.
        assert_eq!(r.view(0), Some(NodeView::default()));
    }

    #[test]
    fn one_router_takes_every_turn_and_several_share_them_evenly() {
        assert!((0..100u64).all(|k| replica_for(k, 1, 1) == 0));
        let mut hits = [0u32; 3];
        for k in 0..30_000u64 {
            hits[replica_for(mix64(k), 1 + (k % 2) as u32, 3)] += 1;
        }
        assert!(
            hits.iter().all(|&h| (9_500..10_500).contains(&h)),
            "{hits:?}"
        );
    }
}
