//! The anchors' rules for skipping the prefill node, as policies of this engine, so every comparison runs them side by side with ours.
//!
//! Each skips P (our `local` path: the decode node append-prefills) when its
//! rule says so and re-prefills on P (`pd`) otherwise. None of them weighs
//! what a local prefill costs the sequences decoding beside it; that is the
//! difference `ppd-live` is measured against.

use super::{Context, Policy, PolicyKind};
use crate::cost::LiveView;
use crate::route::{Path, Reason};

/// NVIDIA Dynamo's `isl_bounding` conditional disaggregation
/// (`lib/kv-router/src/conditional_disagg.rs`, `ConditionalDisaggPolicyKind::
/// IslBounding`, its default): the decode worker prefills locally when the
/// prompt's uncached part (`net_new_tokens`) is under `eff_isl_threshold`
/// (2048) and under `eff_isl_ratio_threshold` (0.7) of the prompt, both
/// strictly. Its decode-busy gate is off unless configured, as here.
pub struct DynamoIslPolicy {
    /// Skip P only below this many uncached prompt tokens.
    pub max_uncached_tokens: u32,
    /// ... and only when the uncached part is below this share of the prompt.
    pub max_uncached_ratio: f64,
}

impl Default for DynamoIslPolicy {
    fn default() -> Self {
        DynamoIslPolicy {
            max_uncached_tokens: 2048,
            max_uncached_ratio: 0.7,
        }
    }
}

/// Whether Dynamo's bound holds for `uncached` of `prompt` tokens.
fn within_isl_bound(p: &DynamoIslPolicy, uncached: u32, prompt: u32) -> bool {
    uncached < p.max_uncached_tokens
        && f64::from(uncached) < p.max_uncached_ratio * f64::from(prompt.max(1))
}

impl Policy for DynamoIslPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::DynamoIsl
    }
    fn choose(&self, c: &Context) -> (Path, Reason) {
        let prompt = c.input.n_ctx.saturating_add(c.input.n_in);
        if within_isl_bound(self, c.input.uncached_on_d(), prompt) {
            (Path::Local, Reason::ShortUncached)
        } else {
            (Path::Pd, Reason::LongUncached)
        }
    }
}

/// NVIDIA Dynamo's `prefill_load` conditional disaggregation with its
/// decode-busy gate (`conditional_disagg.rs`, `ConditionalDisaggPolicyKind::
/// PrefillLoad`): skip P when the prefill worker the router would pick is
/// busy — its active prefill tokens over `prefill_busy_threshold` × its
/// `max_num_batched_tokens` — unless the decode worker is busy — its KV
/// blocks over `decode_busy_threshold` of its pool. Dynamo ships no default
/// for either threshold (the prefill one falls back to
/// `--router-queue-threshold`; the gate is off when unset); the values here
/// are ours, stated in bench/results/decision.md.
pub struct DynamoLoadPolicy {
    /// P is busy above this many of its token budgets in flight.
    pub prefill_busy_threshold: f64,
    /// D is busy above this share of its KV cache in use.
    pub decode_busy_threshold: f64,
}

impl Default for DynamoLoadPolicy {
    fn default() -> Self {
        DynamoLoadPolicy {
            prefill_busy_threshold: 1.0,
            decode_busy_threshold: 0.9,
        }
    }
}

impl DynamoLoadPolicy {
    /// Dynamo treats a missing busy signal as calm: P prefills.
    fn prefill_busy(&self, live: &LiveView) -> bool {
        live.p.is_some_and(|p| {
            p.queued_prefill_tokens as f64
                > self.prefill_busy_threshold * f64::from(p.token_budget.max(1))
        })
    }
    fn decode_busy(&self, live: &LiveView) -> bool {
        live.d.kv_usage > self.decode_busy_threshold
    }
}

impl Policy for DynamoLoadPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::DynamoLoad
    }
    fn choose(&self, c: &Context) -> (Path, Reason) {
        // Without a load snapshot nothing is known to be busy: P prefills.
        let Some(live) = c.input.live else {
            return (Path::Pd, Reason::PrefillIdle);
        };
        if !self.prefill_busy(&live) {
            (Path::Pd, Reason::PrefillIdle)
        } else if self.decode_busy(&live) {
            (Path::Pd, Reason::DecodeBusy)
        } else {
            (Path::Local, Reason::PrefillBusy)
        }
    }
}

/// llm-d's prefix-based PD decider (llm-d-router, `pkg/epp/framework/
/// plugins/scheduling/profilehandler/disagg/prefix_based_pd_decider.go`):
/// the decode pod prefills when the prompt's tokens it does not cache are
/// under `nonCachedTokens`, strictly. Its code default 0 disables the
/// decider (never prefill on P); the value is that of its shipped P/D
/// configuration (`deploy/config/pd-epp-config.yaml`: 16).
pub struct LlmdThresholdPolicy {
    /// Skip P below this many uncached prompt tokens (0: always skip).
    pub non_cached_tokens: u32,
}

impl Default for LlmdThresholdPolicy {
    fn default() -> Self {
        LlmdThresholdPolicy {
            non_cached_tokens: 16,
        }
    }
}

impl Policy for LlmdThresholdPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LlmdThreshold
    }
    fn choose(&self, c: &Context) -> (Path, Reason) {
        if self.non_cached_tokens == 0 || c.input.uncached_on_d() < self.non_cached_tokens {
            (Path::Local, Reason::ShortUncached)
        } else {
            (Path::Pd, Reason::LongUncached)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::NodeView;
    use crate::grid::GridPoint;
    use crate::route::{DecisionInput, Residency, Scored, Weights};

    fn run(p: &dyn Policy, input: &DecisionInput) -> (Path, Reason) {
        let g = GridPoint {
            context: 0,
            workload: 0,
            qps: 0,
        };
        let scored = Scored {
            point: g,
            cell_at: g,
            distance: 0.0,
            d_ttft: 0.0,
            d_tpot: 0.0,
            score: 0.0,
        };
        p.choose(&Context {
            input,
            scored: &scored,
            weights: Weights::default(),
            slo: None,
            forecast: None,
        })
    }

    fn with_cached(n_ctx: u32, n_in: u32, cached: u32) -> DecisionInput {
        DecisionInput {
            residency: Residency::Cached(cached),
            ..DecisionInput::turn(2, n_in, 64, n_ctx, 1.0)
        }
    }

    #[test]
    fn dynamo_isl_skips_p_only_for_a_short_and_minor_uncached_part() {
        let p = DynamoIslPolicy::default();
        assert_eq!(
            run(&p, &with_cached(4000, 500, 4000)),
            (Path::Local, Reason::ShortUncached)
        );
        // 2,100 uncached tokens: over the absolute bound.
        assert_eq!(run(&p, &with_cached(4000, 2100, 4000)).0, Path::Pd);
        // 900 of 1,200 uncached: under 2,048 but 75 % of the prompt.
        assert_eq!(
            run(&p, &with_cached(1000, 200, 300)),
            (Path::Pd, Reason::LongUncached)
        );
    }

    #[test]
    fn dynamo_load_skips_p_when_p_is_busy_unless_d_is_busy_too() {
        let p = DynamoLoadPolicy::default();
        let at = |queued: u64, d_kv: f64| DecisionInput {
            live: Some(LiveView {
                d: NodeView {
                    kv_usage: d_kv,
                    ..NodeView::default()
                },
                p: Some(NodeView {
                    queued_prefill_tokens: queued,
                    token_budget: 8192,
                    ..NodeView::default()
                }),
                ..LiveView::default()
            }),
            ..DecisionInput::turn(2, 64, 64, 1000, 1.0)
        };
        assert_eq!(run(&p, &at(0, 0.1)), (Path::Pd, Reason::PrefillIdle));
        assert_eq!(
            run(&p, &at(8192, 0.1)),
            (Path::Pd, Reason::PrefillIdle),
            "strictly over"
        );
        assert_eq!(
            run(&p, &at(20_000, 0.1)),
            (Path::Local, Reason::PrefillBusy)
        );
        assert_eq!(run(&p, &at(20_000, 0.95)), (Path::Pd, Reason::DecodeBusy));
        assert_eq!(
            run(&p, &DecisionInput::turn(2, 64, 64, 1000, 1.0)).0,
            Path::Pd
        );
    }

    #[test]
    fn llmd_skips_p_under_its_uncached_threshold() {
        let p = LlmdThresholdPolicy::default();
        assert_eq!(run(&p, &with_cached(3000, 15, 3000)).0, Path::Local);
        assert_eq!(
            run(&p, &with_cached(3000, 16, 3000)),
            (Path::Pd, Reason::LongUncached)
        );
        assert_eq!(run(&p, &with_cached(3000, 10, 1000)).0, Path::Pd);
        let off = LlmdThresholdPolicy {
            non_cached_tokens: 0,
        };
        assert_eq!(
            run(&off, &with_cached(3000, 900, 0)).0,
            Path::Local,
            "0 disables the decider"
        );
    }
}
