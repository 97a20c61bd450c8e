//! `ppd-live`: each Turn 2+ request takes the feasible path — local, pull or pd — that the cost model predicts best for the operator's objective.
//!
//! The objective is Equation 1 generalised to three paths, each scored
//! against pd: S = w_ttft·(TTFT_pd − TTFT)/TTFT_pd − w_tpot·(TPOT burden −
//! burden of pd), where the TPOT burden is what the path's prefill adds to
//! every sequence decoding on D, relative to their TPOT and summed over them
//! (the mean TPOT of all requests pays each of them). Or, with SLOs set, the
//! path under which the most requests meet both: this one by its predicted
//! TTFT, those decoding beside it by their TPOT after the stall it adds, less
//! the decodes on D its stall is expected to push past their deadline (the
//! router's request timeout); the score breaks ties. With weights, first of
//! all the path that stalls least the decodes it would push past their
//! deadline. Without live data the table's prior decides, as `ppd`.

use super::{ppd::PpdPolicy, Context, Policy, PolicyKind};
use crate::cost::{AtRisk, Forecast, PathCost, TpotLevel};
use crate::route::{Path, Reason, Weights};

/// Latency objectives per request, ms.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

pub struct LivePolicy;

/// The paths a live decision weighs, pd first: it wins ties, since it moves
/// nothing onto the decode node.
const CANDIDATES: [Path; 3] = [Path::Pd, Path::Local, Path::Pull];

/// Equation 1 for `path` against pd.
pub fn score(f: &Forecast, path: Path, w: Weights) -> f64 {
    let (pd, c) = (f.pd, f.get(path));
    let d_ttft = if pd.ttft_ms > 0.0 {
        (pd.ttft_ms - c.ttft_ms) / pd.ttft_ms
    } else {
        0.0
    };
    w.w_ttft * d_ttft - w.w_tpot * (c.tpot_burden() - pd.tpot_burden())
}

/// P(X ≤ limit) for X scattered around `predicted` by a relative σ
/// `spread` (learnt per node by the corrections): the logistic
/// approximation of the normal CDF (within 0.01 of it everywhere).
fn within(limit: f64, predicted: f64, spread: f64) -> f64 {
    let sigma = (spread * predicted).max(1e-6);
    1.0 / (1.0 + (-1.702 * (limit - predicted) / sigma).exp())
}

/// What a decode pushed past its deadline costs under SLOs, in requests
/// that miss them. More than the one request it is: a timeout is an error
/// the client sees and a whole answer's decoding thrown away, where a late
/// one is still an answer — and the Goal C puts success ahead of
/// goodput. The chances below are sharp (D's TPOT spread is a few %) and
/// its pace only a forecast, so one lost request each under-weighed them:
/// the Table-3 sweeps lost 0.4–0.8 % of requests to timeouts at 3P_1pD QPS 8
/// where `pd` lost none; 3 is the smallest whole weight that lost none there
/// (`bench/results/decision.md`, round 7).
const TIMEOUT_COST: f64 = 3.0;

/// The decodes on D expected to miss their deadline because of a path's
/// stall: for each, the chance it ends in time at D's observed pace
/// (scattered by its relative spread) without the stall, less that chance
/// after it. One already lost, or with time to spare, costs nothing.
fn deadlines_missed(at_risk: &AtRisk, c: &PathCost) -> f64 {
    at_risk
        .iter()
        .map(|d| {
            let needed = f64::from(d.remaining_tokens) * c.base_tpot_ms;
            let in_time = |stall: f64| within(d.time_left_ms, needed + stall, c.tpot_spread);
            in_time(0.0) - in_time(c.stall_ms)
        })
        .sum()
}

/// Requests expected to meet both SLOs under a path: this one, by its
/// predicted TTFT and its TPOT on D; less the co-running sequences whose
/// TPOT the path's stall pushes over the objective (those whose TPOT lay
/// within the stall below it). A co-runner's TPOT is its whole answer's,
/// so it is judged by the TPOTs D's requests have been getting
/// (`corunners`), not by D's step of this moment, which at a busy moment
/// sits near the objective while the answers around it, most of them
/// decoded in calmer steps, do not; without that record, by the step.
pub fn goodput(c: &PathCost, corunners: Option<TpotLevel>, slo: Slo) -> f64 {
    let tpot = |limit: f64| within(limit, c.base_tpot_ms, c.tpot_spread);
    let meets = within(slo.ttft_ms, c.ttft_ms, c.ttft_spread) * tpot(slo.tpot_ms);
    let level = corunners.unwrap_or(TpotLevel {
        ms: c.base_tpot_ms,
        spread: c.tpot_spread,
    });
    let co = |limit: f64| within(limit, level.ms, level.spread);
    let pushed_over = co(slo.tpot_ms) - co(slo.tpot_ms - c.tpot_added_ms);
    meets - f64::from(c.corunners) * pushed_over
}

impl Policy for LivePolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Live
    }

    fn choose(&self, c: &Context) -> (Path, Reason) {
        let Some(f) = c.forecast else {
            return PpdPolicy.choose(c);
        };
        // A decode on D pushed past its deadline is a request the client
        // gives up on, lost whole. Under SLOs that loss is counted in
        // goodput's own unit, requests: the expected decodes a path's stall
        // makes miss (at TIMEOUT_COST each), while D's decodes meet the TPOT
        // objective (past it they are lost to goodput whether they time out
        // or not). With weights, whose units are latencies, no latency gain
        // buys it: the path that stalls the pressed decodes least goes
        // first (priced like SLOs' instead, at (w_ttft + w_tpot) per
        // expected timeout, it lost Goal C at 3P_1pD QPS 8: round 7).
        let goodput_guard = c.slo.is_some_and(|slo| f.pd.base_tpot_ms <= slo.tpot_ms);
        let lost = |pc: PathCost| {
            if goodput_guard {
                TIMEOUT_COST * deadlines_missed(&f.at_risk, &pc)
            } else {
                0.0
            }
        };
        let pressed = |pc: PathCost| {
            if c.slo.is_none() {
                f.at_risk.pressed_stall_ms(
                    pc.free_tpot_ms,
                    pc.base_tpot_ms,
                    pc.tpot_spread,
                    pc.stall_ms,
                )
            } else {
                0.0
            }
        };
        // Each feasible path keyed once: the deadline term with weights,
        // then goodput (differences under a thousandth of a request are
        // ties) and the score — with the deadlines and without, which says
        // whether they decided.
        let key = |p: Path| {
            let pc = f.get(p);
            let s = score(f, p, c.weights);
            let (with, without) = match c.slo {
                Some(slo) => {
                    let g = goodput(&pc, f.corunner_tpot, slo);
                    (((g - lost(pc)) * 1000.0).round(), (g * 1000.0).round())
                }
                None => (0.0, 0.0),
            };
            (p, -pressed(pc), (with, s), (without, s))
        };
        // Pd first: it is always feasible, and wins ties.
        let pd = key(Path::Pd);
        let (mut chosen, mut unguarded) = (pd, pd);
        let feasible = CANDIDATES[1..]
            .iter()
            .copied()
            .filter(|&p| c.input.veto(p).is_none());
        for k in feasible.map(key) {
            if k.3 > unguarded.3 {
                unguarded = k;
            }
            if (k.1, k.2) > (chosen.1, chosen.2) {
                chosen = k;
            }
        }
        let (chosen, unguarded) = (chosen.0, unguarded.0);
        let reason = if chosen != unguarded {
            Reason::Deadline
        } else if c.slo.is_some() {
            Reason::SloGoodput
        } else {
            Reason::CostModel
        };
        (chosen, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{AtRisk, Deadline, TpotLevel, AT_RISK};
    use crate::grid::GridPoint;
    use crate::route::{DecisionInput, Residency, Scored};

    fn cost(ttft_ms: f64, tpot_added_ms: f64, corunners: u32) -> PathCost {
        PathCost {
            ttft_ms,
            tpot_added_ms,
            corunners,
            stall_ms: tpot_added_ms * 100.0,
            base_tpot_ms: 10.0,
            free_tpot_ms: 10.0,
            ttft_spread: crate::cost::DEFAULT_SPREAD,
            tpot_spread: crate::cost::DEFAULT_SPREAD,
        }
    }

    fn scored() -> Scored {
        let p = GridPoint {
            context: 0,
            workload: 0,
            qps: 0,
        };
        Scored {
            point: p,
            cell_at: p,
            distance: 0.0,
            d_ttft: 0.0,
            d_tpot: 0.0,
            score: -1.0,
        }
    }

    fn choose(
        input: &DecisionInput,
        f: Option<&Forecast>,
        w: Weights,
        slo: Option<Slo>,
    ) -> (Path, Reason) {
        LivePolicy.choose(&Context {
            input,
            scored: &scored(),
            weights: w,
            slo,
            forecast: f,
        })
    }

    /// [`input`] where D holds no pin to pull from.
    fn no_pull() -> DecisionInput {
        DecisionInput {
            pull_ready: false,
            ..input()
        }
    }

    fn input() -> DecisionInput {
        DecisionInput {
            pull_ready: true,
            ..DecisionInput::turn(2, 64, 128, 2000, 4.0)
        }
    }

    #[test]
    fn a_cheap_local_append_wins_and_says_why() {
        let f = Forecast {
            pd: cost(200.0, 0.0, 4),
            local: cost(40.0, 0.01, 4),
            pull: cost(90.0, 0.0, 4),
            ..Forecast::default()
        };
        let r = choose(&input(), Some(&f), Weights::default(), None);
        assert_eq!(r, (Path::Local, Reason::CostModel));
    }

    #[test]
    fn a_crowded_d_sends_the_turn_to_pull_where_p_computes_it() {
        // 200 sequences decoding, each slowed by 0.05 ms per token (0.5 % of
        // their TPOT): a burden of 1.0, more than local's TTFT gain over pull.
        let f = Forecast {
            pd: cost(200.0, 0.0, 200),
            local: cost(40.0, 0.05, 200),
            pull: cost(90.0, 0.0, 200),
            ..Forecast::default()
        };
        assert_eq!(
            choose(&input(), Some(&f), Weights::default(), None).0,
            Path::Pull
        );
        // A TTFT-only objective keeps it local.
        assert_eq!(
            choose(&input(), Some(&f), Weights::new(1.0, 0.0).unwrap(), None).0,
            Path::Local
        );
    }

    #[test]
    fn a_vetoed_path_is_never_chosen_however_cheap() {
        let f = Forecast {
            pd: cost(200.0, 0.0, 0),
            local: cost(1.0, 0.0, 0),
            pull: cost(2.0, 0.0, 0),
            ..Forecast::default()
        };
        let lost = DecisionInput {
            residency: Residency::Lost,
            ..input()
        };
        assert_eq!(
            choose(&lost, Some(&f), Weights::default(), None).0,
            Path::Pd
        );
        let no_handle = DecisionInput {
            pull_ready: false,
            d_local_capable: false,
            ..input()
        };
        assert_eq!(
            choose(&no_handle, Some(&f), Weights::default(), None).0,
            Path::Pd
        );
    }

    #[test]
    fn slo_mode_prefers_the_path_that_meets_the_ttft_objective() {
        let f = Forecast {
            pd: cost(900.0, 0.0, 10),
            local: cost(300.0, 0.2, 10),
            pull: cost(450.0, 0.0, 10),
            ..Forecast::default()
        };
        let slo = Slo {
            ttft_ms: 500.0,
            tpot_ms: 10.1,
        };
        // Local meets TTFT but pushes 10 decodes over 10.1 ms per token; pull meets all.
        assert_eq!(
            choose(&input(), Some(&f), Weights::default(), Some(slo)),
            (Path::Pull, Reason::SloGoodput)
        );
        // Equation 1 prefers pull here (0.50 against local's 0.47), but only
        // local meets a 350 ms TTFT objective, and a loose TPOT one holds.
        assert_eq!(
            choose(&input(), Some(&f), Weights::default(), None).0,
            Path::Pull
        );
        let fast_first_token = Slo {
            ttft_ms: 350.0,
            tpot_ms: 50.0,
        };
        assert_eq!(
            choose(
                &input(),
                Some(&f),
                Weights::default(),
                Some(fast_first_token)
            )
            .0,
            Path::Local
        );
    }

    /// A decode on D with `time_left_ms` before its deadline and
    /// `remaining` tokens to go.
    fn pressed(time_left_ms: f64, remaining: u32) -> AtRisk {
        let mut a = AtRisk::default();
        a.offer(Deadline {
            time_left_ms,
            remaining_tokens: remaining,
        });
        a
    }

    #[test]
    fn a_local_stall_that_would_push_a_decode_past_its_deadline_loses_to_pd() {
        // Local's prefill stalls D's decodes 20 ms (cost(): 100 x its added
        // TPOT); pd's first step 1 ms. A decode with 1,000 tokens to go at
        // 10 ms each (1.1 with the spread) has 11,010 ms left: it ends in
        // time after pd's stall and not after local's.
        let f = Forecast {
            pd: cost(200.0, 0.01, 8),
            local: cost(40.0, 0.2, 8),
            pull: cost(90.0, 0.0, 8),
            at_risk: pressed(11_010.0, 1_000),
            corunner_tpot: None,
        };
        let no_pull = no_pull();
        let w = Weights::new(1.0, 0.0).unwrap();
        assert_eq!(
            choose(&no_pull, Some(&f), w, None),
            (Path::Pd, Reason::Deadline)
        );
        // With time to spare, or past saving even at D's stall-free pace,
        // the objective alone decides.
        for at_risk in [pressed(20_000.0, 1_000), pressed(9_000.0, 1_000)] {
            let f = Forecast { at_risk, ..f };
            assert_eq!(
                choose(&no_pull, Some(&f), w, None),
                (Path::Local, Reason::CostModel)
            );
        }
        // Under SLOs the deadline counts only while D's decodes meet the
        // TPOT objective: past it they are lost to goodput anyway.
        let missed_tpot = Slo {
            ttft_ms: 500.0,
            tpot_ms: 5.0,
        };
        assert_eq!(
            choose(&no_pull, Some(&f), w, Some(missed_tpot)),
            (Path::Local, Reason::SloGoodput)
        );
        let met_tpot = Slo {
            tpot_ms: 50.0,
            ..missed_tpot
        };
        assert_eq!(
            choose(&no_pull, Some(&f), w, Some(met_tpot)),
            (Path::Pd, Reason::Deadline)
        );
        // Pull stalls D less than local does, and saves the decode too.
        assert_eq!(
            choose(&input(), Some(&f), w, None),
            (Path::Pull, Reason::Deadline)
        );
    }

    #[test]
    fn under_slos_decodes_pushed_past_their_deadline_are_weighed_in_requests() {
        // Local meets the TTFT objective and pd does not: about one request
        // won. Local's prefill stalls D 2 s (pd's: 1 ms); a decode needs
        // 10 s at D's 10 ms a token (σ 10 %).
        let slo = Slo {
            ttft_ms: 100.0,
            tpot_ms: 50.0,
        };
        let f = |time_left_ms: f64| {
            let mut at_risk = AtRisk::default();
            at_risk.offer(Deadline {
                time_left_ms,
                remaining_tokens: 1_000,
            });
            Forecast {
                pd: cost(200.0, 0.01, 8),
                local: cost(40.0, 20.0, 8),
                pull: cost(90.0, 0.0, 8),
                at_risk,
                corunner_tpot: None,
            }
        };
        let no_pull = no_pull();
        let w = Weights::default();
        // With 11,010 ms left it ends in time with a chance of 0.85
        // unstalled and 0.20 after local's stall: 0.65 of a timeout, at
        // TIMEOUT_COST each, outweighs the turn's own objective...
        let close = f(11_010.0);
        let lost = deadlines_missed(&close.at_risk, &close.local);
        assert!((0.6..0.7).contains(&lost), "{lost}");
        assert_eq!(
            choose(&no_pull, Some(&close), w, Some(slo)),
            (Path::Pd, Reason::Deadline)
        );
        // ...with 13,000 ms left, 0.99 against 0.81 does not.
        let roomy = f(13_000.0);
        let lost = deadlines_missed(&roomy.at_risk, &roomy.local);
        assert!((0.15..0.25).contains(&lost), "{lost}");
        assert_eq!(
            choose(&no_pull, Some(&roomy), w, Some(slo)),
            (Path::Local, Reason::SloGoodput)
        );
    }

    #[test]
    fn co_runners_are_judged_by_the_tpots_d_has_been_giving_not_its_busiest_step() {
        // D's step of the moment is 14.5 ms against a 15 ms objective, and
        // 45 sequences decode beside a local prefill that adds 0.03 ms to
        // each one's TPOT. Judged by that step (σ 3 %) a good share of them
        // sit just under the objective; D's answers have been getting
        // 12.5 ms (σ 10 %), and few of those are within 0.03 ms of it.
        let slo = Slo {
            ttft_ms: 150.0,
            tpot_ms: 15.0,
        };
        let local = PathCost {
            tpot_spread: 0.03,
            base_tpot_ms: 14.5,
            corunners: 45,
            tpot_added_ms: 0.03,
            ..cost(60.0, 0.03, 45)
        };
        let by_step = goodput(&local, None, slo);
        let history = TpotLevel {
            ms: 12.5,
            spread: 0.1,
        };
        let by_history = goodput(&local, Some(history), slo);
        assert!(by_history - by_step > 0.3, "{by_step} -> {by_history}");
        // So the turn stays local, where by the step it went to pd (whose
        // TTFT misses 150 ms half the time).
        let f = |corunner_tpot| Forecast {
            pd: PathCost {
                tpot_added_ms: 0.0,
                stall_ms: 0.0,
                ..PathCost {
                    ttft_ms: 150.0,
                    ..local
                }
            },
            local,
            pull: local,
            at_risk: AtRisk::default(),
            corunner_tpot,
        };
        let no_pull = no_pull();
        let w = Weights::default();
        assert_eq!(choose(&no_pull, Some(&f(None)), w, Some(slo)).0, Path::Pd);
        assert_eq!(
            choose(&no_pull, Some(&f(Some(history))), w, Some(slo)),
            (Path::Local, Reason::SloGoodput)
        );
    }

    #[test]
    fn the_most_pressed_decodes_are_kept_and_the_lost_ones_dropped() {
        let mut a = AtRisk::default();
        // Time left per remaining token 1..=12 ms, in a scrambled order,
        // with one already past its deadline and one with nothing left.
        let mut offered = vec![(-5.0, 100), (5_000.0, 0)];
        offered.extend((0..12u32).map(|i| (f64::from((i * 7) % 12 + 1) * 100.0, 100)));
        for (t, n) in offered {
            a.offer(Deadline {
                time_left_ms: t,
                remaining_tokens: n,
            });
        }
        let kept: Vec<f64> = a.0.iter().flatten().map(|d| d.time_left_ms).collect();
        let most_pressed: Vec<f64> = (1..=AT_RISK as u32).map(|k| f64::from(k) * 100.0).collect();
        assert_eq!(kept, most_pressed);
    }

    #[test]
    fn without_live_data_the_table_decides() {
        let r = choose(&input(), None, Weights::default(), None);
        assert_eq!(r, (Path::Pd, Reason::ScoreNegative));
    }
}
