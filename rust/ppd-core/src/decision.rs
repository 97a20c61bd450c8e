//! The decision engine: features + table + weights + policy → a route with its reason (Algorithm 1, Phase 2).
//!
//! Every outcome is decided here, in [`DecisionEngine::decide`], in one fixed
//! order: replica-only policy, replica sessions, Turn 1 (hybrid share or pd),
//! no session, D unavailable, the policy, then the vetoes: decode-only and
//! overload on local; an edited history (prefix) and residency on local and
//! pull; a pull handle on pull. Table, weights and policy swap atomically while
//! requests are being decided.

use arc_swap::{ArcSwap, ArcSwapOption};
use std::sync::Arc;

use crate::cost::CostModel;
use crate::error::Error;
use crate::policy::fraction::unit_interval;
use crate::policy::{ppd::score, Context, Policy, PolicyKind, Slo};
use crate::route::{DecisionInput, Path, Reason, Route, Scored, Weights};
use crate::table::Table;

pub struct DecisionEngine {
    table: ArcSwap<Table>,
    weights: ArcSwap<Weights>,
    policy: ArcSwap<Box<dyn Policy>>,
    /// The cost model of policies that predict (`ppd-live`); none: they use the table.
    cost: ArcSwapOption<CostModel>,
    /// SLO mode of `ppd-live` (none: Equation 1 with the weights).
    slo: ArcSwap<Option<Slo>>,
}

impl DecisionEngine {
    pub fn new(table: Table, policy: PolicyKind, weights: Weights) -> Self {
        DecisionEngine {
            table: ArcSwap::from_pointee(table),
            weights: ArcSwap::from_pointee(weights),
            policy: ArcSwap::from_pointee(policy.build()),
            cost: ArcSwapOption::empty(),
            slo: ArcSwap::from_pointee(None),
        }
    }

    /// The cost model `ppd-live` predicts with (the same one for the whole
    /// engine's life: its corrections accumulate in it).
    pub fn set_cost_model(&self, m: Arc<CostModel>) {
        self.cost.store(Some(m));
    }
    pub fn cost_model(&self) -> Option<Arc<CostModel>> {
        self.cost.load_full()
    }
    pub fn set_slo(&self, slo: Option<Slo>) {
        self.slo.store(Arc::new(slo));
    }
    pub fn slo(&self) -> Option<Slo> {
        **self.slo.load()
    }

    pub fn table(&self) -> Arc<Table> {
        self.table.load_full()
    }
    pub fn weights(&self) -> Weights {
        **self.weights.load()
    }
    pub fn policy(&self) -> PolicyKind {
        self.policy.load().kind()
    }

    /// Takes effect for the next decision; no reload, no lock.
    pub fn set_weights(&self, w: Weights) {
        self.weights.store(Arc::new(w));
    }
    pub fn set_table(&self, t: Table) {
        self.table.store(Arc::new(t));
    }
    pub fn set_policy(&self, p: PolicyKind) {
        self.policy.store(Arc::new(p.build()));
    }

    /// Cell and score of Turn 2+ features, whatever the policy.
    pub fn score(&self, input: &DecisionInput) -> Scored {
        let table = self.table.load();
        let w = **self.weights.load();
        score_in(&table, input, w)
    }

    pub fn decide(&self, input: &DecisionInput) -> Result<Route, Error> {
        input.validate()?;
        let policy = self.policy.load();
        if policy.replica_only() {
            return Ok(Route {
                path: Path::Replica,
                reason: Reason::ReplicaPolicy,
                scored: None,
                forecast: None,
            });
        }
        let unscored = |path, reason| {
            Ok(Route {
                path,
                reason,
                scored: None,
                forecast: None,
            })
        };
        if input.session_on_replica && input.turn > 1 {
            return unscored(Path::Replica, Reason::ReplicaSession);
        }
        if input.turn == 1 {
            if unit_interval(input.conv_hash) < input.replica_share {
                return unscored(Path::Replica, Reason::HybridReplica);
            }
            return unscored(Path::Pd, Reason::Turn1);
        }
        let w = **self.weights.load();
        let scored = score_in(&self.table.load(), input, w);
        let forecast = match (
            policy.kind().predicts(),
            input.live,
            self.cost.load().as_deref(),
        ) {
            (true, Some(live), Some(m)) => Some(m.forecast(input.n_ctx, input.n_in, &live)),
            _ => None,
        };
        let early = |reason| {
            Ok(Route {
                path: Path::Pd,
                reason,
                scored: Some(scored),
                forecast,
            })
        };
        if !input.has_session {
            return early(Reason::NoSession);
        }
        if !input.d_available {
            return early(Reason::DUnavailable);
        }
        let (path, reason) = policy.choose(&Context {
            input,
            scored: &scored,
            weights: w,
            slo: self.slo(),
            forecast: forecast.as_ref(),
        });
        if let Some(veto) = input.veto(path) {
            return early(veto);
        }
        Ok(Route {
            path,
            reason,
            scored: Some(scored),
            forecast,
        })
    }
}

fn score_in(table: &Table, input: &DecisionInput, w: Weights) -> Scored {
    let (point, r) = table.lookup(input.n_ctx, input.n_in, input.n_out, input.qps);
    Scored {
        point,
        cell_at: r.at,
        distance: r.distance,
        d_ttft: r.d_ttft,
        d_tpot: r.d_tpot,
        score: score(r.d_ttft, r.d_tpot, w),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::{Residency, MIN_RESIDENT_CHECK_TOKENS};
    use crate::table::tests::{cell, doc_with, m};
    use proptest::prelude::*;

    /// Local helps TTFT and hurts TPOT everywhere (the paper's premise), by
    /// amounts that vary per cell.
    fn tradeoff_table() -> Table {
        let wl = crate::catalog::paper_workloads();
        let mut cells = Vec::new();
        for (ci, c) in ["small", "large"].iter().enumerate() {
            for (wi, w) in wl.iter().enumerate() {
                for (qi, &q) in crate::catalog::PAPER_QPS.iter().enumerate() {
                    let gain = 0.1 + 0.05 * ((ci + wi + qi) % 10) as f64; // 10%..55% TTFT
                    let cost = 0.02 + 0.03 * ((wi * 7 + qi * 3) % 12) as f64; // 2%..35% TPOT
                    cells.push(cell(
                        c,
                        &w.name,
                        q,
                        m(100.0, 10.0),
                        m(100.0 * (1.0 - gain), 10.0 * (1.0 + cost)),
                    ));
                }
            }
        }
        Table::from_doc(doc_with(cells), "tradeoff").unwrap()
    }

    fn engine(policy: PolicyKind, w: Weights) -> DecisionEngine {
        DecisionEngine::new(tradeoff_table(), policy, w)
    }

    #[test]
    fn turn_one_always_takes_pd() {
        for p in [
            PolicyKind::Ppd,
            PolicyKind::Local,
            PolicyKind::Fraction(1.0),
        ] {
            let r = engine(p, Weights::default())
                .decide(&DecisionInput::turn(1, 100, 100, 0, 1.0))
                .unwrap();
            assert_eq!((r.path, r.reason), (Path::Pd, Reason::Turn1));
        }
    }

    #[test]
    fn replica_policy_sends_every_turn_to_replicas() {
        let e = engine(PolicyKind::Replica, Weights::default());
        for t in [1, 2, 7] {
            let r = e.decide(&DecisionInput::turn(t, 10, 10, 10, 1.0)).unwrap();
            assert_eq!((r.path, r.reason), (Path::Replica, Reason::ReplicaPolicy));
        }
    }

    #[test]
    fn session_and_node_state_override_the_policy() {
        let e = engine(PolicyKind::Local, Weights::default());
        let base = DecisionInput::turn(2, 64, 64, 300, 4.0);
        let r = e
            .decide(&DecisionInput {
                has_session: false,
                ..base
            })
            .unwrap();
        assert_eq!((r.path, r.reason), (Path::Pd, Reason::NoSession));
        let r = e
            .decide(&DecisionInput {
                d_available: false,
                ..base
            })
            .unwrap();
        assert_eq!((r.path, r.reason), (Path::Pd, Reason::DUnavailable));
        let r = e
            .decide(&DecisionInput {
                d_overloaded: true,
                ..base
            })
            .unwrap();
        assert_eq!((r.path, r.reason), (Path::Pd, Reason::DOverloaded));
        let r = e.decide(&base).unwrap();
        assert_eq!((r.path, r.reason), (Path::Local, Reason::Forced));
        let r = engine(PolicyKind::Pd, Weights::default())
            .decide(&base)
            .unwrap();
        assert_eq!((r.path, r.reason), (Path::Pd, Reason::Forced));
    }

    #[test]
    fn a_d_that_lost_or_never_held_the_kv_vetoes_local() {
        let e = engine(PolicyKind::Local, Weights::default());
        let base = DecisionInput::turn(2, 64, 64, 300, 4.0);
        let with = |residency| e.decide(&DecisionInput { residency, ..base }).unwrap();
        let r = with(Residency::Lost);
        assert_eq!((r.path, r.reason), (Path::Pd, Reason::KvLost));
        let r = with(Residency::Cached(149));
        assert_eq!((r.path, r.reason), (Path::Pd, Reason::NotResident));
        assert_eq!(with(Residency::Cached(150)).path, Path::Local);
        assert_eq!(with(Residency::Unknown).path, Path::Local);
        // A pd decision stays pd for its own reason.
        let r = engine(PolicyKind::Pd, Weights::default())
            .decide(&DecisionInput {
                residency: Residency::Lost,
                ..base
            })
            .unwrap();
        assert_eq!(r.reason, Reason::Forced);
    }

    #[test]
    fn pull_needs_a_handle_and_ds_copy_but_not_ds_compute() {
        let e = engine(PolicyKind::Pull, Weights::default());
        let ready = DecisionInput {
            pull_ready: true,
            ..DecisionInput::turn(2, 64, 64, 300, 4.0)
        };
        let r = e.decide(&ready).unwrap();
        assert_eq!((r.path, r.reason), (Path::Pull, Reason::Forced));
        let r = e
            .decide(&DecisionInput {
                pull_ready: false,
                ..ready
            })
            .unwrap();
        assert_eq!((r.path, r.reason), (Path::Pd, Reason::NoPullHandle));
        for (residency, why) in [
            (Residency::Lost, Reason::KvLost),
            (Residency::Cached(10), Reason::NotResident),
        ] {
            let r = e.decide(&DecisionInput { residency, ..ready }).unwrap();
            assert_eq!((r.path, r.reason), (Path::Pd, why));
        }
        // P computes, so a decode-only or busy D still serves a pull.
        let r = e
            .decide(&DecisionInput {
                d_local_capable: false,
                d_overloaded: true,
                ..ready
            })
            .unwrap();
        assert_eq!(r.path, Path::Pull);
        // Turn 1 and unknown conversations go pd as under every policy.
        let r = e.decide(&DecisionInput::turn(1, 64, 64, 0, 4.0)).unwrap();
        assert_eq!(r.reason, Reason::Turn1);
    }

    #[test]
    fn an_edited_history_vetoes_local() {
        let base = DecisionInput {
            prefix_ok: false,
            ..DecisionInput::turn(2, 64, 64, 300, 4.0)
        };
        let r = engine(PolicyKind::Local, Weights::default())
            .decide(&base)
            .unwrap();
        assert_eq!((r.path, r.reason), (Path::Pd, Reason::PrefixMismatch));
        let r = engine(PolicyKind::Pd, Weights::default())
            .decide(&base)
            .unwrap();
        assert_eq!((r.path, r.reason), (Path::Pd, Reason::Forced));
    }

    #[test]
    fn a_context_of_a_block_or_two_is_never_judged_not_resident() {
        let e = engine(PolicyKind::Local, Weights::default());
        let r = e
            .decide(&DecisionInput {
                residency: Residency::Cached(0),
                ..DecisionInput::turn(2, 8, 8, MIN_RESIDENT_CHECK_TOKENS - 1, 4.0)
            })
            .unwrap();
        assert_eq!(r.path, Path::Local);
    }

    #[test]
    fn decode_only_nodes_never_serve_local() {
        let e = engine(PolicyKind::Local, Weights::default());
        let r = e
            .decide(&DecisionInput {
                d_local_capable: false,
                ..DecisionInput::turn(2, 64, 64, 300, 4.0)
            })
            .unwrap();
        assert_eq!((r.path, r.reason), (Path::Pd, Reason::DecodeOnly));
        let r = engine(PolicyKind::Pd, Weights::default())
            .decide(&DecisionInput {
                d_local_capable: false,
                ..DecisionInput::turn(2, 64, 64, 300, 4.0)
            })
            .unwrap();
        assert_eq!(r.reason, Reason::Forced);
    }

    #[test]
    fn hybrid_share_sends_new_conversations_to_replicas_and_keeps_them_there() {
        let e = engine(PolicyKind::Ppd, Weights::default());
        let n = 10_000;
        let mut on_r = 0;
        for i in 0..n {
            let h = crate::identity::hash_id(&format!("c{i}"));
            let t1 = DecisionInput {
                conv_hash: h,
                replica_share: 0.25,
                ..DecisionInput::turn(1, 64, 64, 0, 1.0)
            };
            let r = e.decide(&t1).unwrap();
            if r.path == Path::Replica {
                assert_eq!(r.reason, Reason::HybridReplica);
                on_r += 1;
                let t2 = DecisionInput {
                    turn: 2,
                    session_on_replica: true,
                    ..t1
                };
                assert_eq!(e.decide(&t2).unwrap().reason, Reason::ReplicaSession);
            } else {
                assert_eq!(r.reason, Reason::Turn1);
            }
        }
        assert!((on_r as f64 / n as f64 - 0.25).abs() < 0.02, "{on_r}");
        assert!(e
            .decide(&DecisionInput {
                replica_share: 1.5,
                ..DecisionInput::turn(1, 1, 1, 1, 1.0)
            })
            .is_err());
    }

    #[test]
    fn ppd_goes_local_exactly_when_the_score_is_positive() {
        let e = engine(PolicyKind::Ppd, Weights::new(1.0, 1.0).unwrap());
        let t = e.table();
        for p in t.grid().points() {
            let w = &t.grid().workloads()[usize::from(p.workload)];
            let input = DecisionInput::turn(
                2,
                w.n_in,
                w.n_out,
                t.grid().representative_context(usize::from(p.context)),
                t.grid().qps_levels()[usize::from(p.qps)],
            );
            let r = e.decide(&input).unwrap();
            let s = r.scored.unwrap();
            let c = t.cell(t.resolve(p).cell).unwrap();
            let expect = (c.x0.ttft_ms - c.x1.ttft_ms) / c.x0.ttft_ms
                - (c.x1.tpot_ms - c.x0.tpot_ms) / c.x0.tpot_ms;
            assert!((s.score - expect).abs() < 1e-12);
            assert_eq!(r.path == Path::Local, expect > 0.0);
            assert_eq!(
                r.reason,
                if expect > 0.0 {
                    Reason::ScorePositive
                } else {
                    Reason::ScoreNegative
                }
            );
        }
    }

    #[test]
    fn extreme_weights_recover_x0_and_x1() {
        // Where local always wins TTFT and always loses TPOT, w_tpot = 0 is
        // x ≡ 1 and w_ttft = 0 is x ≡ 0 (paper §6.3, §6.5).
        let x1 = engine(PolicyKind::Ppd, Weights::new(1.0, 0.0).unwrap());
        let x0 = engine(PolicyKind::Ppd, Weights::new(0.0, 1.0).unwrap());
        let t = x1.table();
        for p in t.grid().points() {
            let w = &t.grid().workloads()[usize::from(p.workload)];
            let input = DecisionInput::turn(
                3,
                w.n_in,
                w.n_out,
                t.grid().representative_context(usize::from(p.context)),
                t.grid().qps_levels()[usize::from(p.qps)],
            );
            assert_eq!(x1.decide(&input).unwrap().path, Path::Local);
            assert_eq!(x0.decide(&input).unwrap().path, Path::Pd);
        }
    }

    #[test]
    fn weights_change_live() {
        let e = engine(PolicyKind::Ppd, Weights::new(1.0, 0.0).unwrap());
        let input = DecisionInput::turn(2, 512, 64, 2000, 8.0);
        assert_eq!(e.decide(&input).unwrap().path, Path::Local);
        e.set_weights(Weights::new(0.0, 1.0).unwrap());
        assert_eq!(e.decide(&input).unwrap().path, Path::Pd);
        e.set_policy(PolicyKind::Local);
        assert_eq!(e.decide(&input).unwrap().path, Path::Local);
        assert_eq!(e.policy(), PolicyKind::Local);
    }

    #[test]
    fn bad_inputs_are_errors_not_panics() {
        let e = engine(PolicyKind::Ppd, Weights::default());
        for q in [f64::NAN, f64::INFINITY, -1.0] {
            assert!(e.decide(&DecisionInput::turn(2, 1, 1, 1, q)).is_err());
        }
        assert!(e.decide(&DecisionInput::turn(0, 1, 1, 1, 1.0)).is_err());
        assert!(Weights::new(f64::NAN, 1.0).is_err());
        assert!(Weights::new(1.0, -0.5).is_err());
    }

    #[test]
    fn fraction_share_holds_and_is_stable_per_conversation() {
        for x in [0.0, 0.25, 0.5, 0.9, 1.0] {
            let e = engine(PolicyKind::Fraction(x), Weights::default());
            let n = 20_000;
            let mut local = 0;
            for i in 0..n {
                let h = crate::identity::hash_id(&format!("conversation-{i}"));
                let input = DecisionInput {
                    conv_hash: h,
                    ..DecisionInput::turn(2, 32, 256, 300, 2.0)
                };
                let a = e.decide(&input).unwrap();
                let b = e.decide(&DecisionInput { turn: 5, ..input }).unwrap();
                assert_eq!(a.path, b.path, "a conversation stays on one side");
                local += usize::from(a.path == Path::Local);
            }
            let share = local as f64 / n as f64;
            assert!((share - x).abs() < 0.015, "x={x} share={share}");
        }
    }

    proptest! {
        #[test]
        fn decide_is_total_over_valid_inputs(turn in 1u32..100, n_in in any::<u32>(), n_out in any::<u32>(), n_ctx in any::<u32>(), qps in 0.0f64..1e5, h in any::<u64>(), wt in 0.0f64..1e6, wp in 0.0f64..1e6) {
            let e = engine(PolicyKind::Ppd, Weights::new(wt, wp).unwrap());
            let r = e.decide(&DecisionInput { conv_hash: h, ..DecisionInput::turn(turn, n_in, n_out, n_ctx, qps) }).unwrap();
            if turn == 1 { prop_assert_eq!(r.reason, Reason::Turn1); } else { prop_assert!(r.scored.is_some()); }
        }

        #[test]
        fn unit_interval_is_in_range(h in any::<u64>()) {
            let u = unit_interval(h);
            prop_assert!((0.0..1.0).contains(&u));
        }
    }
}
