//! The cost model of the live decision: each path's predicted TTFT, and the TPOT its prefill adds to the sequences decoding where it lands, from the profile's step-time model and a snapshot of the nodes.
//!
//! It runs the same step-time model as the engine model (`ppd-model`, the
//! emulator and the simulator): a step costs a fixed overhead, a price per
//! scheduled token and sequence, prefill attention over (new token × attended
//! key) pairs, and decode attention over the batch's context. What it adds is
//! the arithmetic of a request's way through a busy node — the prefill work
//! queued ahead of it, chunked into steps beside the running decodes — and of
//! the KV link. Each figure is closed-form: a prediction is a few dozen
//! floating-point operations, no search and no allocation.
//!
//! Observed latencies correct the predictions online ([`Corrections`]): a
//! bounded table of exponentially weighted residuals per node, path and size
//! class, so a node that turns slower than its profile says is priced as it
//! is within a few requests.

use std::sync::atomic::{AtomicU64, Ordering};

use ahash::AHashMap;
use parking_lot::RwLock;

use crate::path::Path;
use crate::profile::{BatchShape, Profile};

/// One node as the decision sees it: the router's own accounting and the
/// node's last scrape, read as a snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeView {
    /// The router's id of the node (the key of its corrections).
    pub node: u32,
    /// Sequences decoding on it.
    pub running: u32,
    /// Σ context tokens of those sequences (their decode attention).
    pub decode_ctx_tokens: u64,
    /// Prompt tokens queued on it ahead of a new request (waiting, or
    /// mid-prefill), which it computes first.
    pub queued_prefill_tokens: u64,
    /// Requests waiting to be scheduled.
    pub waiting: u32,
    /// KV bytes in flight into it over its link.
    pub link_bytes: u64,
    /// Share of its KV cache in use, 0..1.
    pub kv_usage: f64,
    /// Tokens it schedules per step (vLLM's `max_num_batched_tokens`).
    pub token_budget: u32,
}

/// What the decision sees of the cluster for one Turn 2+ request.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LiveView {
    /// The session's D (or pD).
    pub d: NodeView,
    /// The P that the pd and pull paths would use; `None` when no P can.
    pub p: Option<NodeView>,
    /// Leading tokens of the prompt that D's prefix cache holds.
    pub d_cached: u32,
    /// Leading tokens of the prompt that P's prefix cache holds (a pd turn
    /// computes only the rest).
    pub p_cached: u32,
    /// Mean output tokens of D's sequences: how many steps a stall is spread
    /// over in their TPOT.
    pub mean_out_tokens: f64,
    /// A pull would first ask D for a pin (no whole answer named one): one
    /// more request on D, answered in its next step, before P starts.
    pub pull_asks_pin: bool,
    /// The sequences decoding on D that are closest to the router's request
    /// deadline (empty where the router knows none).
    pub at_risk: AtRisk,
}

/// How many of D's decodes the deadline term looks at: the most pressed
/// ones. A path's stall is the same for all of them, so the ones with the
/// least time per remaining token are the ones it can push over.
pub const AT_RISK: usize = 8;

/// One decode on D and its deadline: the time left before the client gives
/// up (the router's request timeout from when D took the request; the
/// simulator's client timeout from when the turn was sent) and the tokens
/// it still has to produce.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Deadline {
    pub time_left_ms: f64,
    pub remaining_tokens: u32,
}

impl Deadline {
    /// Time left per token still to come: the smaller, the closer to missing.
    fn ms_per_token(&self) -> f64 {
        self.time_left_ms / f64::from(self.remaining_tokens.max(1))
    }

    /// Whether it still ends in time at `tpot_ms` per token (inflated by
    /// the relative `spread` of D's observed TPOTs) after `stall_ms` more.
    pub fn meets(&self, tpot_ms: f64, spread: f64, stall_ms: f64) -> bool {
        f64::from(self.remaining_tokens) * tpot_ms * (1.0 + spread) + stall_ms <= self.time_left_ms
    }
}

/// The [`AT_RISK`] decodes on D with the least time left per remaining
/// token, most pressed first; filled by whoever builds the [`LiveView`].
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AtRisk(pub [Option<Deadline>; AT_RISK]);

impl AtRisk {
    /// Keeps `d` if it is among the most pressed so far. A decode past its
    /// deadline already, or with nothing left to produce, cannot be saved
    /// or harmed by a choice now.
    pub fn offer(&mut self, d: Deadline) {
        if d.time_left_ms <= 0.0 || d.remaining_tokens == 0 {
            return;
        }
        let key = d.ms_per_token();
        let at = self
            .0
            .iter()
            .position(|x| x.is_none_or(|x| key < x.ms_per_token()));
        if let Some(i) = at {
            self.0.copy_within(i..AT_RISK - 1, i + 1);
            self.0[i] = Some(d);
        }
    }

    /// The decodes kept, most pressed first.
    pub fn iter(&self) -> impl Iterator<Item = &Deadline> {
        self.0.iter().flatten()
    }

    /// The stall a path inflicts on the decodes it presses: those that
    /// would still end in time at D's stall-free pace (`free_tpot_ms`), but
    /// not at its observed pace (`tpot_ms`, which carries the stalls of the
    /// prefills around them on average) after this path's `stall_ms`. The
    /// observed pace is what they get if prefills keep landing on D as
    /// before; each stall spared them is time they need.
    pub fn pressed_stall_ms(
        &self,
        free_tpot_ms: f64,
        tpot_ms: f64,
        spread: f64,
        stall_ms: f64,
    ) -> f64 {
        let pressed = self
            .iter()
            .filter(|d| d.meets(free_tpot_ms, 0.0, 0.0) && !d.meets(tpot_ms, spread, stall_ms))
            .count();
        pressed as f64 * stall_ms
    }
}

/// The prediction for one path.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct PathCost {
    /// The request's time to first token, ms.
    pub ttft_ms: f64,
    /// The TPOT this request's prefill adds to each sequence decoding on its
    /// D, ms per token (0 where D computes nothing of it).
    pub tpot_added_ms: f64,
    /// How many sequences that is (D's running decodes).
    pub corunners: u32,
    /// The time the request's prefill adds to each of those sequences in
    /// all (`tpot_added_ms` before it is spread over their tokens), ms.
    pub stall_ms: f64,
    /// D's decode step without this request's prefill: the TPOT of its batch, ms.
    pub base_tpot_ms: f64,
    /// The same as the profile has it, with no correction: D's pace with no
    /// prefill beside its decodes at all.
    pub free_tpot_ms: f64,
    /// How far observed TTFTs spread around the prediction, relative (σ of
    /// ln(observed / predicted) on the node that computes it).
    pub ttft_spread: f64,
    /// The same for TPOTs on D.
    pub tpot_spread: f64,
}

impl PathCost {
    /// TPOT added over all co-running sequences, relative to their TPOT: the
    /// TPOT side of Equation 1 summed over the sequences that pay it, as the
    /// mean TPOT of all requests does.
    pub fn tpot_burden(&self) -> f64 {
        if self.base_tpot_ms <= 0.0 {
            return 0.0;
        }
        f64::from(self.corunners) * self.tpot_added_ms / self.base_tpot_ms
    }
}

/// The three paths' predictions (what each would cost, feasible or not).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Forecast {
    pub pd: PathCost,
    pub local: PathCost,
    pub pull: PathCost,
    /// D's decodes closest to their deadline (from the [`LiveView`]).
    pub at_risk: AtRisk,
    /// The TPOTs D's requests have been getting (none until D has enough
    /// of them): where the sequences decoding beside a new request end up.
    pub corunner_tpot: Option<TpotLevel>,
}

/// A node's recent per-request TPOTs: their geometric mean and the relative
/// σ around it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TpotLevel {
    pub ms: f64,
    pub spread: f64,
}

impl Forecast {
    pub fn get(&self, path: Path) -> PathCost {
        match path {
            Path::Local | Path::Replica => self.local,
            Path::Pull => self.pull,
            Path::Pd => self.pd,
        }
    }
}

/// Request sizes are corrected separately in these classes of computed
/// prompt tokens (a node can be slow on long prefills and not on short ones).
const SIZE_CLASSES: [u32; 3] = [256, 2048, u32::MAX];

/// The size classes by name, in [`NodeCorrection::ttft`]'s order.
pub const SIZE_CLASS_NAMES: [&str; 3] = ["le_256", "le_2048", "over_2048"];

/// The paths of [`NodeCorrection::ttft`], in its order.
pub const CORRECTED_PATHS: [Path; 3] = [Path::Local, Path::Pull, Path::Pd];

fn size_class(tokens: u32) -> usize {
    SIZE_CLASSES.iter().position(|&b| tokens <= b).unwrap_or(2)
}

/// Paths whose TTFT is corrected apart: local, pull, pd.
const PATHS: usize = 3;

fn path_slot(path: Path) -> usize {
    match path {
        Path::Local | Path::Replica => 0,
        Path::Pull => 1,
        Path::Pd => 2,
    }
}

/// One node's residuals: ln(observed / predicted) TTFT per path and size
/// class, and TPOT, as f64 bits (lock-free reads and writes; a lost update
/// under a race only delays convergence by one sample).
#[derive(Default)]
struct NodeResiduals {
    ttft: [[AtomicU64; SIZE_CLASSES.len()]; PATHS],
    ttft_n: [[AtomicU64; SIZE_CLASSES.len()]; PATHS],
    /// Over all of the node's TTFT samples: what a cell without samples of
    /// its own starts from (a node twice as slow is so for every path).
    any: AtomicU64,
    any_n: AtomicU64,
    /// Weighted means of the squared residuals: their spread.
    any_sq: AtomicU64,
    tpot_sq: AtomicU64,
    tpot_sq_n: AtomicU64,
    any_sq_n: AtomicU64,
    tpot: AtomicU64,
    tpot_n: AtomicU64,
    /// ln(observed TPOT) itself, and its square: the level D's requests get.
    level: AtomicU64,
    level_n: AtomicU64,
    level_sq: AtomicU64,
    level_sq_n: AtomicU64,
}

impl NodeResiduals {
    fn tpot_level(&self) -> Option<TpotLevel> {
        (self.level_sq_n.load(Ordering::Relaxed) >= MIN_SPREAD_SAMPLES).then(|| TpotLevel {
            ms: f64::from_bits(self.level.load(Ordering::Relaxed)).exp(),
            spread: spread(&self.level, &self.level_sq, &self.level_sq_n),
        })
    }
}

/// The online correction of predictions: per node, path and size class, an
/// exponentially weighted mean of ln(observed / predicted), a cell without
/// samples taking the node's mean over all of them. Memory is a fixed 240
/// bytes per node; nodes that leave are dropped with [`Corrections::forget`].
pub struct Corrections {
    /// Weight of a new sample; the first samples are averaged plainly so a
    /// fresh node converges as fast as its data allows.
    alpha: f64,
    nodes: RwLock<AHashMap<u32, Box<NodeResiduals>>>,
}

/// The spread assumed until a node has [`MIN_SPREAD_SAMPLES`] residuals.
pub const DEFAULT_SPREAD: f64 = 0.1;
const MIN_SPREAD_SAMPLES: u64 = 8;

/// σ of the residuals from their weighted mean and mean square, bounded to
/// what a prediction can usefully be trusted or distrusted by.
fn spread(mean: &AtomicU64, sq: &AtomicU64, n: &AtomicU64) -> f64 {
    if n.load(Ordering::Relaxed) < MIN_SPREAD_SAMPLES {
        return DEFAULT_SPREAD;
    }
    let m = f64::from_bits(mean.load(Ordering::Relaxed));
    let q = f64::from_bits(sq.load(Ordering::Relaxed));
    (q - m * m).max(0.0).sqrt().clamp(0.02, 1.0)
}

/// Residuals beyond ×/÷ e³ (20×) are a fault or a clock jump, not a trend.
const MAX_LN_RESIDUAL: f64 = 3.0;

fn ewma(value: &AtomicU64, count: &AtomicU64, sample: f64, alpha: f64) {
    let n = count.fetch_add(1, Ordering::Relaxed) + 1;
    let a = alpha.max(1.0 / n as f64);
    let old = f64::from_bits(value.load(Ordering::Relaxed));
    value.store((old + a * (sample - old)).to_bits(), Ordering::Relaxed);
}

impl Default for Corrections {
    fn default() -> Self {
        Corrections::new(0.2)
    }
}

impl Corrections {
    /// `alpha`: the weight of each new observation once a cell has 1/alpha of them.
    pub fn new(alpha: f64) -> Corrections {
        Corrections {
            alpha: alpha.clamp(0.001, 1.0),
            nodes: RwLock::new(AHashMap::new()),
        }
    }

    /// The factor by which a TTFT prediction for `path` on `node` is off.
    pub fn ttft_factor(&self, node: u32, path: Path, computed_tokens: u32) -> f64 {
        let nodes = self.nodes.read();
        nodes.get(&node).map_or(1.0, |r| {
            let (p, c) = (path_slot(path), size_class(computed_tokens));
            let cell = if r.ttft_n[p][c].load(Ordering::Relaxed) > 0 {
                &r.ttft[p][c]
            } else {
                &r.any
            };
            f64::from_bits(cell.load(Ordering::Relaxed)).exp()
        })
    }

    /// How widely TTFTs on `node` scatter around their corrected prediction (σ, relative).
    pub fn ttft_spread(&self, node: u32) -> f64 {
        let nodes = self.nodes.read();
        nodes
            .get(&node)
            .map_or(DEFAULT_SPREAD, |r| spread(&r.any, &r.any_sq, &r.any_sq_n))
    }

    /// How widely TPOTs on `node` scatter around their corrected prediction (σ, relative).
    pub fn tpot_spread(&self, node: u32) -> f64 {
        let nodes = self.nodes.read();
        nodes.get(&node).map_or(DEFAULT_SPREAD, |r| {
            spread(&r.tpot, &r.tpot_sq, &r.tpot_sq_n)
        })
    }

    /// The TPOTs `node`'s requests have been getting, once it has
    /// [`MIN_SPREAD_SAMPLES`] of them.
    pub fn tpot_level(&self, node: u32) -> Option<TpotLevel> {
        self.nodes.read().get(&node)?.tpot_level()
    }

    /// The factor by which D's predicted step time (TPOT) is off.
    pub fn tpot_factor(&self, node: u32) -> f64 {
        let nodes = self.nodes.read();
        nodes.get(&node).map_or(1.0, |r| {
            f64::from_bits(r.tpot.load(Ordering::Relaxed)).exp()
        })
    }

    fn with_node(&self, node: u32, f: impl FnOnce(&NodeResiduals)) {
        if let Some(r) = self.nodes.read().get(&node) {
            return f(r);
        }
        let mut nodes = self.nodes.write();
        f(nodes.entry(node).or_default());
    }

    /// Records an observed TTFT against the uncorrected prediction it was decided on.
    pub fn observe_ttft(
        &self,
        node: u32,
        path: Path,
        computed_tokens: u32,
        predicted_ms: f64,
        observed_ms: f64,
    ) {
        let Some(ln) = ln_ratio(observed_ms, predicted_ms) else {
            return;
        };
        let (p, c) = (path_slot(path), size_class(computed_tokens));
        self.with_node(node, |r| {
            ewma(&r.ttft[p][c], &r.ttft_n[p][c], ln, self.alpha);
            ewma(&r.any, &r.any_n, ln, self.alpha);
            ewma(&r.any_sq, &r.any_sq_n, ln * ln, self.alpha);
        });
    }

    /// Records an observed TPOT against the uncorrected predicted step time of its D.
    pub fn observe_tpot(&self, node: u32, predicted_ms: f64, observed_ms: f64) {
        let Some(ln) = ln_ratio(observed_ms, predicted_ms) else {
            return;
        };
        let level = observed_ms.ln();
        self.with_node(node, |r| {
            ewma(&r.tpot, &r.tpot_n, ln, self.alpha);
            ewma(&r.tpot_sq, &r.tpot_sq_n, ln * ln, self.alpha);
            ewma(&r.level, &r.level_n, level, self.alpha);
            ewma(&r.level_sq, &r.level_sq_n, level * level, self.alpha);
        });
    }

    /// Drops a node's corrections (it left; a node joining under the same id starts afresh).
    pub fn forget(&self, node: u32) {
        self.nodes.write().remove(&node);
    }

    /// Every node's factors, for `/admin/model` and metrics: (node, TTFT
    /// factor per path [local, pull, pd] × size class, samples, TPOT factor).
    pub fn view(&self) -> Vec<NodeCorrection> {
        let nodes = self.nodes.read();
        let mut out: Vec<NodeCorrection> = nodes
            .iter()
            .map(|(&node, r)| {
                let load = |a: &AtomicU64| f64::from_bits(a.load(Ordering::Relaxed)).exp();
                NodeCorrection {
                    node,
                    ttft: std::array::from_fn(|p| std::array::from_fn(|c| load(&r.ttft[p][c]))),
                    ttft_samples: std::array::from_fn(|p| {
                        std::array::from_fn(|c| r.ttft_n[p][c].load(Ordering::Relaxed))
                    }),
                    tpot: load(&r.tpot),
                    tpot_samples: r.tpot_n.load(Ordering::Relaxed),
                    tpot_level_ms: r.tpot_level().map(|l| l.ms),
                }
            })
            .collect();
        out.sort_by_key(|c| c.node);
        out
    }
}

/// One node's correction factors (observed ÷ predicted).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NodeCorrection {
    pub node: u32,
    /// Per path (local, pull, pd) and size class (≤ 256, ≤ 2,048, more computed tokens).
    pub ttft: [[f64; 3]; 3],
    pub ttft_samples: [[u64; 3]; 3],
    pub tpot: f64,
    pub tpot_samples: u64,
    /// The TPOT its requests have been getting (geometric mean), once known.
    pub tpot_level_ms: Option<f64>,
}

fn ln_ratio(observed: f64, predicted: f64) -> Option<f64> {
    (observed > 0.0 && predicted > 0.0 && observed.is_finite() && predicted.is_finite()).then(
        || {
            (observed / predicted)
                .ln()
                .clamp(-MAX_LN_RESIDUAL, MAX_LN_RESIDUAL)
        },
    )
}

/// The correction cell of a path's TTFT: the node that computes the prompt
/// (P for pd and pull when there is one, else D) and how many tokens it computes.
fn ttft_cell(path: Path, prompt: u32, live: &LiveView) -> (u32, u32) {
    let (node, cached) = match (path, live.p) {
        (Path::Pd, Some(p)) => (p.node, live.p_cached),
        (Path::Pull, Some(p)) => (p.node, live.d_cached),
        (Path::Pd, None) => (live.d.node, 0),
        _ => (live.d.node, live.d_cached),
    };
    (node, prompt.saturating_sub(cached))
}

/// The profile's numbers the predictions use, and the corrections learnt so far.
pub struct CostModel {
    profile: Profile,
    pub corrections: Corrections,
}

/// A prefill's way through one node: when its first token is out, and what
/// it adds to each step of the node's running decodes.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Prefill {
    engine_ms: f64,
    /// Decode time the request's own prefill adds to the node's steps, ms.
    added_ms: f64,
    /// The node's decode step without it, ms.
    base_ms: f64,
}

impl CostModel {
    pub fn new(profile: Profile) -> CostModel {
        CostModel {
            profile,
            corrections: Corrections::default(),
        }
    }

    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// The three paths' predictions, uncorrected: what the profile says.
    pub fn predict(&self, n_ctx: u32, n_in: u32, live: &LiveView) -> Forecast {
        let p = &self.profile;
        let api = &p.api;
        let prompt = n_ctx.saturating_add(n_in).max(1);
        // vLLM computes at least the prompt's last token, whatever it caches.
        let cap = |cached: u32| cached.min(prompt - 1);
        let d_cached = cap(live.d_cached);
        let mean_out = live.mean_out_tokens.max(1.0);
        let d_first = self.admit_step(&live.d);

        let on_d = self.prefill(&live.d, prompt - d_cached, d_cached);
        let local = PathCost {
            ttft_ms: api.router_hop_ms
                + api.local_path_extra_ms
                + api.request_overhead_ms
                + on_d.engine_ms,
            tpot_added_ms: on_d.added_ms / mean_out,
            corunners: live.d.running,
            stall_ms: on_d.added_ms,
            base_tpot_ms: on_d.base_ms,
            free_tpot_ms: on_d.base_ms,
            ttft_spread: DEFAULT_SPREAD,
            tpot_spread: DEFAULT_SPREAD,
        };
        // A pd or pull turn reaches D with all but the last prompt token
        // computed elsewhere: D computes one token in its next step.
        let handed = |prefill_ms: f64, p_link_ms: f64, to_d_tokens: u32| {
            let to_d = self.link_ms(&live.d, u64::from(to_d_tokens) * p.kv_bytes_per_token);
            PathCost {
                ttft_ms: 2.0 * (api.router_hop_ms + api.request_overhead_ms)
                    + p_link_ms
                    + prefill_ms
                    + p.link.push_ms
                    + to_d
                    + d_first.engine_ms,
                tpot_added_ms: d_first.added_ms / mean_out,
                corunners: live.d.running,
                stall_ms: d_first.added_ms,
                base_tpot_ms: d_first.base_ms,
                free_tpot_ms: d_first.base_ms,
                ttft_spread: DEFAULT_SPREAD,
                tpot_spread: DEFAULT_SPREAD,
            }
        };
        let Some(pv) = live.p else {
            // No P: the pd path is D computing the whole prompt (p_unavailable).
            let direct = self.prefill(&live.d, prompt, 0);
            let pd = PathCost {
                ttft_ms: api.router_hop_ms + api.request_overhead_ms + direct.engine_ms,
                tpot_added_ms: direct.added_ms / mean_out,
                corunners: live.d.running,
                stall_ms: direct.added_ms,
                base_tpot_ms: direct.base_ms,
                free_tpot_ms: direct.base_ms,
                ttft_spread: DEFAULT_SPREAD,
                tpot_spread: DEFAULT_SPREAD,
            };
            return Forecast {
                pd,
                local,
                pull: pd,
                at_risk: live.at_risk,
                corunner_tpot: None,
            };
        };
        let p_cached = cap(live.p_cached);
        let pd_transfer = if p.link.full_prompt_transfer {
            prompt - 1
        } else {
            (prompt - 1).saturating_sub(d_cached)
        };
        let pd = handed(
            self.prefill(&pv, prompt - p_cached, p_cached).engine_ms,
            0.0,
            pd_transfer,
        );
        // After a streamed answer D is first asked for its pin: the context
        // up to the last answer, for one token. D computes what of it its
        // cache lacks (the answer, where the client's rendering of it missed;
        // else the last partial block) before its first token, a prefill the
        // decodes there wait for too; then it holds the whole context.
        let ctx = n_ctx.min(prompt - 1);
        let (held, pin) = if live.pull_asks_pin && ctx > 0 {
            let cached = d_cached.min(ctx - 1);
            (
                ctx.max(d_cached),
                Some(self.prefill(&live.d, ctx - cached, cached)),
            )
        } else {
            (d_cached, None)
        };
        // Pull: P reads the context D holds, computes the rest, and D takes
        // back only what it lacks.
        let read = self.link_ms(&pv, u64::from(held) * p.kv_bytes_per_token);
        let mut pull = handed(
            self.prefill(&pv, prompt - held, held).engine_ms,
            read,
            (prompt - 1) - held,
        );
        if let Some(pin) = pin {
            pull.ttft_ms += api.router_hop_ms + api.request_overhead_ms + pin.engine_ms;
            pull.tpot_added_ms += pin.added_ms / mean_out;
            pull.stall_ms += pin.added_ms;
        }
        Forecast {
            pd,
            local,
            pull,
            at_risk: live.at_risk,
            corunner_tpot: None,
        }
    }

    /// [`Self::predict`] with the learnt corrections applied.
    pub fn forecast(&self, n_ctx: u32, n_in: u32, live: &LiveView) -> Forecast {
        let mut f = self.predict(n_ctx, n_in, live);
        self.correct(&mut f, n_ctx.saturating_add(n_in), live);
        f
    }

    /// Applies the corrections: TTFT by the node whose queue and compute
    /// dominate it (D for local, P for pd and pull), TPOT by D's.
    pub fn correct(&self, f: &mut Forecast, prompt: u32, live: &LiveView) {
        let c = &self.corrections;
        let d = live.d.node;
        for (path, pc) in [
            (Path::Local, &mut f.local),
            (Path::Pull, &mut f.pull),
            (Path::Pd, &mut f.pd),
        ] {
            let (node, tokens) = ttft_cell(path, prompt, live);
            pc.ttft_ms *= c.ttft_factor(node, path, tokens);
            pc.ttft_spread = c.ttft_spread(node);
        }
        let t = c.tpot_factor(d);
        let tpot_spread = c.tpot_spread(d);
        f.corunner_tpot = c.tpot_level(d);
        for pc in [&mut f.pd, &mut f.local, &mut f.pull] {
            pc.tpot_added_ms *= t;
            pc.stall_ms *= t;
            pc.base_tpot_ms *= t;
            pc.tpot_spread = tpot_spread;
        }
    }

    /// Scores what a request on `path` observed against what the profile
    /// predicted when it was decided, so later predictions are corrected:
    /// its TTFT on the node that computed the prompt (D for local, P for pd
    /// and pull) by the tokens computed there, its TPOT (when it decoded more
    /// than one token) on D — the correction then carries the stalls of the
    /// prefills that ran beside it, on average.
    pub fn observe(
        &self,
        path: Path,
        n_ctx: u32,
        n_in: u32,
        live: &LiveView,
        ttft_ms: f64,
        tpot_ms: Option<f64>,
    ) {
        let raw = self.predict(n_ctx, n_in, live).get(path);
        let (node, tokens) = ttft_cell(path, n_ctx.saturating_add(n_in), live);
        self.corrections
            .observe_ttft(node, path, tokens, raw.ttft_ms, ttft_ms);
        if let Some(tpot) = tpot_ms {
            self.corrections
                .observe_tpot(live.d.node, raw.base_tpot_ms, tpot);
        }
    }

    /// A decode step of `n`'s running sequences, ms.
    fn decode_step(&self, n: &NodeView) -> f64 {
        self.profile.step.step_ms(&BatchShape {
            seqs: n.running,
            decode_seqs: u64::from(n.running),
            decode_ctx_tokens: n.decode_ctx_tokens,
            ..BatchShape::default()
        })
    }

    /// `tokens` new prompt tokens over `cached` ones on node `n`, behind the
    /// prefill queued there, in chunks of what the token budget leaves beside
    /// the running decodes; the first token comes with the last chunk.
    fn prefill(&self, n: &NodeView, tokens: u32, cached: u32) -> Prefill {
        let s = &self.profile.step;
        let budget = match n.token_budget {
            0 => self.profile.max_num_batched_tokens,
            b => b,
        };
        let budget = f64::from(budget.max(1));
        let running = f64::from(n.running);
        let room = (budget - running).max(1.0);
        let base = self.decode_step(n);
        let queued = n.queued_prefill_tokens as f64;
        let waiting = f64::from(n.waiting.max(1));
        let t = f64::from(tokens);
        let steps = ((queued + t) / room).ceil().max(1.0);
        // Each queued prompt of mean length q/w attends over itself.
        let queued_pairs = queued * (queued / waiting) / 2.0;
        let own_pairs = t * (f64::from(cached) + t / 2.0);
        let per_step = s.overhead_ms
            + (s.per_token_ms + s.per_seq_ms) * running
            + s.decode_ctx_ms_per_ktoken * n.decode_ctx_tokens as f64 / 1e3;
        let token_ms = s.per_token_ms + s.prefill_token_ms;
        let seqs_ahead = if n.queued_prefill_tokens > 0 {
            f64::from(n.waiting)
        } else {
            0.0
        };
        // A step already running finishes first: half of one on average.
        let in_progress = if n.running > 0 || n.queued_prefill_tokens > 0 {
            base / 2.0
        } else {
            0.0
        };
        let engine_ms = in_progress
            + steps * per_step
            + token_ms * (queued + t)
            + s.per_seq_ms * (seqs_ahead + 1.0)
            + s.attn_ms_per_mpair * (queued_pairs + own_pairs) / 1e6;
        let added_ms = if n.running == 0 {
            0.0
        } else {
            token_ms * t + s.per_seq_ms + s.attn_ms_per_mpair * own_pairs / 1e6
        };
        Prefill {
            engine_ms,
            added_ms,
            base_ms: base,
        }
    }

    /// The step in which D admits a request whose KV arrived: one token to
    /// compute beside its decodes, after the step in progress.
    fn admit_step(&self, d: &NodeView) -> Prefill {
        let mut one = self.prefill(d, 1, 0);
        one.added_ms = if d.running == 0 { 0.0 } else { one.added_ms };
        one
    }

    /// `bytes` into node `n` over its link, sharing it with what is in flight.
    fn link_ms(&self, n: &NodeView, bytes: u64) -> f64 {
        if bytes == 0 {
            return 0.0;
        }
        let l = &self.profile.link;
        l.latency_ms + (bytes + n.link_bytes) as f64 / (l.gbps * 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> CostModel {
        let mut p = Profile::test_profile();
        p.link.push_ms = 0.0;
        p.link.full_prompt_transfer = false;
        CostModel::new(p)
    }

    fn idle(node: u32) -> NodeView {
        NodeView {
            node,
            ..NodeView::default()
        }
    }

    fn busy_d(running: u32) -> NodeView {
        NodeView {
            node: 1,
            running,
            decode_ctx_tokens: u64::from(running) * 2000,
            ..NodeView::default()
        }
    }

    fn view(d: NodeView, p: Option<NodeView>, d_cached: u32) -> LiveView {
        LiveView {
            d,
            p,
            d_cached,
            p_cached: 0,
            mean_out_tokens: 200.0,
            pull_asks_pin: false,
            at_risk: AtRisk::default(),
        }
    }

    #[test]
    fn a_pull_that_asks_d_for_its_pin_waits_a_step_of_d_first() {
        let m = model();
        let busy = view(busy_d(40), Some(idle(2)), 2000);
        let held = m.predict(2000, 64, &busy);
        let asked = m.predict(
            2000,
            64,
            &LiveView {
                pull_asks_pin: true,
                ..busy
            },
        );
        assert!(
            asked.pull.ttft_ms > held.pull.ttft_ms + 1.0,
            "{asked:?} {held:?}"
        );
        assert!(asked.pull.tpot_added_ms > held.pull.tpot_added_ms);
        assert_eq!((asked.pd, asked.local), (held.pd, held.local));
    }

    #[test]
    fn every_prompt_is_priced_down_to_a_single_token() {
        let m = model();
        for (n_ctx, n_in, d_cached) in sizes_cubed() {
            for pull_asks_pin in [false, true] {
                let live = LiveView {
                    pull_asks_pin,
                    ..view(busy_d(4), Some(idle(2)), d_cached)
                };
                let f = m.predict(n_ctx, n_in, &live);
                for c in [f.pd, f.local, f.pull] {
                    assert!(
                        c.ttft_ms.is_finite() && c.ttft_ms > 0.0,
                        "{n_ctx} {n_in} {d_cached}: {f:?}"
                    );
                    assert!(c.stall_ms.is_finite() && c.stall_ms >= 0.0);
                }
            }
        }
    }

    fn sizes_cubed() -> impl Iterator<Item = (u32, u32, u32)> {
        let sizes = [0u32, 1, 2, 15, 16, 17, 300];
        sizes.into_iter().flat_map(move |a| {
            sizes
                .into_iter()
                .flat_map(move |b| sizes.into_iter().map(move |c| (a, b, c)))
        })
    }

    #[test]
    fn a_pin_over_an_answer_d_did_not_cache_costs_d_its_recompute() {
        // A 2,000-token context whose last 400 tokens (the previous answer,
        // as the client rendered it) D's cache missed: the pin request
        // computes them on D, where the decodes wait; P then reads all 2,000.
        let m = model();
        let asks = |d_cached| LiveView {
            pull_asks_pin: true,
            ..view(busy_d(40), Some(idle(2)), d_cached)
        };
        let hit = m.predict(2000, 64, &asks(1990));
        let missed = m.predict(2000, 64, &asks(1600));
        assert!(
            missed.pull.stall_ms > 2.0 * hit.pull.stall_ms,
            "{missed:?} {hit:?}"
        );
        assert!(missed.pull.ttft_ms > hit.pull.ttft_ms);
        // Local computes the same missed tokens and the new ones; the pin
        // spares D only the new ones.
        assert!(missed.local.stall_ms > missed.pull.stall_ms);
    }

    #[test]
    fn an_idle_pd_with_the_context_makes_local_the_fastest_first_token() {
        let m = model();
        let f = m.predict(2000, 64, &view(idle(1), Some(idle(2)), 2000));
        assert!(f.local.ttft_ms < f.pull.ttft_ms, "{f:?}");
        assert!(
            f.pull.ttft_ms < f.pd.ttft_ms,
            "pull computes only the new tokens: {f:?}"
        );
        assert_eq!(f.local.tpot_burden(), 0.0, "nothing decodes beside it");
    }

    #[test]
    fn local_charges_the_sequences_decoding_on_d_and_pd_does_not() {
        let m = model();
        let f = m.predict(2000, 512, &view(busy_d(100), Some(idle(2)), 2000));
        assert_eq!(f.local.corunners, 100);
        assert!(f.local.tpot_added_ms > 10.0 * f.pd.tpot_added_ms, "{f:?}");
        assert!(f.local.tpot_burden() > f.pull.tpot_burden());
    }

    #[test]
    fn a_full_prefill_adds_far_more_decode_time_than_an_append_of_the_same_tokens() {
        // The paper's Figure 2, as the model prices it.
        let m = model();
        let d = busy_d(64);
        let append = m.prefill(&d, 1024, 8000);
        let full = m.prefill(&d, 9024, 0);
        assert!(
            full.added_ms > 5.0 * append.added_ms,
            "{full:?} vs {append:?}"
        );
    }

    #[test]
    fn a_queue_on_p_delays_pd_and_pull_but_not_local() {
        let m = model();
        let quiet = m.predict(1000, 100, &view(idle(1), Some(idle(2)), 1000));
        let queued_p = NodeView {
            queued_prefill_tokens: 20_000,
            waiting: 10,
            ..idle(2)
        };
        let busy = m.predict(1000, 100, &view(idle(1), Some(queued_p), 1000));
        assert_eq!(busy.local, quiet.local);
        assert!(busy.pd.ttft_ms > quiet.pd.ttft_ms + 50.0, "{busy:?}");
        assert!(busy.pull.ttft_ms > quiet.pull.ttft_ms + 50.0);
    }

    #[test]
    fn what_d_no_longer_holds_is_recomputed_by_local_and_pull() {
        let m = model();
        let held = m.predict(4000, 64, &view(idle(1), Some(idle(2)), 4000));
        let evicted = m.predict(4000, 64, &view(idle(1), Some(idle(2)), 0));
        assert!(evicted.local.ttft_ms > 2.0 * held.local.ttft_ms);
        assert!(evicted.pull.ttft_ms > held.pull.ttft_ms);
    }

    #[test]
    fn without_a_p_the_pd_path_is_d_computing_the_whole_prompt() {
        let m = model();
        let f = m.predict(3000, 64, &view(busy_d(8), None, 3000));
        assert!(f.pd.ttft_ms > f.local.ttft_ms);
        assert!(f.pd.tpot_added_ms > f.local.tpot_added_ms);
    }

    #[test]
    fn link_traffic_in_flight_slows_a_transfer() {
        let m = model();
        let clear = m.predict(4000, 64, &view(idle(1), Some(idle(2)), 0));
        let jammed = NodeView {
            link_bytes: 10_000_000_000,
            ..idle(1)
        };
        let slow = m.predict(4000, 64, &view(jammed, Some(idle(2)), 0));
        assert!(slow.pd.ttft_ms > clear.pd.ttft_ms + 100.0, "{slow:?}");
    }

    #[test]
    fn corrections_converge_to_a_node_twice_as_slow_as_its_profile() {
        let m = model();
        let live = view(idle(1), Some(idle(2)), 1000);
        let predicted = m.predict(1000, 64, &live).local.ttft_ms;
        let mut n = 0;
        loop {
            n += 1;
            m.corrections
                .observe_ttft(1, Path::Local, 64, predicted, 2.0 * predicted);
            let f = m.forecast(1000, 64, &live);
            if (f.local.ttft_ms / (2.0 * predicted) - 1.0).abs() < 0.01 {
                break;
            }
            assert!(n < 50, "not converged after {n} samples");
        }
        assert_eq!(n, 1, "a fresh cell takes its first sample whole");
        // Another node is untouched; the same node's unsampled cells start
        // from what its sampled ones learnt.
        let f = m.forecast(1000, 64, &live);
        assert_eq!(
            f.pd.ttft_ms,
            m.predict(1000, 64, &live).pd.ttft_ms,
            "pd is P's"
        );
        assert!((m.corrections.ttft_factor(1, Path::Local, 5000) - 2.0).abs() < 1e-9);
        m.corrections.observe_ttft(1, Path::Local, 5000, 10.0, 10.0);
        assert!((m.corrections.ttft_factor(1, Path::Local, 5000) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn corrections_follow_a_node_that_slows_down_later() {
        let m = model();
        for _ in 0..200 {
            m.corrections.observe_ttft(1, Path::Local, 64, 10.0, 10.0);
        }
        let mut n = 0;
        while m.corrections.ttft_factor(1, Path::Local, 64) < 1.9 {
            m.corrections.observe_ttft(1, Path::Local, 64, 10.0, 20.0);
            n += 1;
            assert!(n <= 20, "not within 20 samples");
        }
        // alpha 0.2: within 5 % of the new ratio after 14 samples.
        assert!(n <= 14, "{n}");
    }

    #[test]
    fn the_spread_is_learnt_from_how_much_observations_scatter() {
        let c = Corrections::default();
        assert_eq!(c.ttft_spread(1), DEFAULT_SPREAD, "unknown node");
        // Alternately 20 % over and under: σ of ln ≈ 0.18.
        for i in 0..60 {
            let obs = if i % 2 == 0 { 12.0 } else { 10.0 / 1.2 };
            c.observe_ttft(1, Path::Local, 64, 10.0, obs);
            c.observe_tpot(1, 10.0, 10.0);
        }
        assert!(
            (c.ttft_spread(1) - 1.2f64.ln()).abs() < 0.03,
            "{}",
            c.ttft_spread(1)
        );
        assert_eq!(c.tpot_spread(1), 0.02, "exact predictions: the floor");
    }

    #[test]
    fn the_named_paths_are_in_the_slots_order() {
        for (i, p) in CORRECTED_PATHS.into_iter().enumerate() {
            assert_eq!(path_slot(p), i);
        }
    }

    #[test]
    fn the_tpots_a_nodes_requests_get_are_learnt_whatever_was_predicted() {
        let c = Corrections::default();
        // Observed 12 and 13 ms alternately, against predictions all over
        // the place (the step of each request's own moment).
        for i in 0..60 {
            if i == MIN_SPREAD_SAMPLES - 1 {
                assert_eq!(c.tpot_level(1), None, "too few to say");
            }
            let observed = if i % 2 == 0 { 12.0 } else { 13.0 };
            c.observe_tpot(1, 5.0 + f64::from(i as u32 % 7) * 2.5, observed);
        }
        let level = c.tpot_level(1).expect("60 samples");
        assert!(
            (level.ms - (12.0f64 * 13.0).sqrt()).abs() < 0.1,
            "{level:?}"
        );
        assert!(
            (level.spread - (13.0f64 / 12.0).ln() / 2.0).abs() < 0.01,
            "{level:?}"
        );
        assert_eq!(c.view()[0].tpot_level_ms, Some(level.ms));
        assert_eq!(c.tpot_level(2), None, "unknown node");
        assert_eq!(std::mem::size_of::<NodeResiduals>(), 240, "as documented");
    }

    #[test]
    fn absurd_observations_are_bounded_and_garbage_ignored() {
        let c = Corrections::default();
        c.observe_ttft(3, Path::Pd, 10, 1.0, 1e12);
        assert!(c.ttft_factor(3, Path::Pd, 10) <= MAX_LN_RESIDUAL.exp() + 1e-9);
        c.observe_tpot(3, 0.0, 5.0);
        c.observe_tpot(3, 5.0, f64::NAN);
        assert_eq!(c.tpot_factor(3), 1.0);
        c.forget(3);
        assert!(c.view().is_empty());
    }
}
