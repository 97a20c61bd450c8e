//! The vocabulary of a decision — its input, weights, path, reason and outcome — shared by the engine and every policy.
//!
//! These types live apart from [`crate::decision`] so that policies depend on
//! them without depending on the engine that runs the policies.

use crate::cost::{Forecast, LiveView};
use crate::error::Error;
use crate::grid::GridPoint;
pub use crate::path::Path;

/// Operator weights of Equation 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    pub w_ttft: f64,
    pub w_tpot: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            w_ttft: 1.0,
            w_tpot: 1.0,
        }
    }
}

impl Weights {
    pub fn new(w_ttft: f64, w_tpot: f64) -> Result<Weights, Error> {
        for (name, w) in [("w_ttft", w_ttft), ("w_tpot", w_tpot)] {
            if !w.is_finite() || w < 0.0 {
                return Err(Error::InvalidInput(format!(
                    "{name} must be a finite number ≥ 0, got {w}"
                )));
            }
        }
        Ok(Weights { w_ttft, w_tpot })
    }
}

/// Why the engine chose a path; logged and counted with every outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Turn 1: nothing is cached yet.
    Turn1,
    /// Turn 2+ but the router has no session for the conversation (new or expired).
    NoSession,
    /// The session's D is gone or unhealthy.
    DUnavailable,
    /// The policy chose local but the session's D is overloaded.
    DOverloaded,
    /// S > 0 in the request's cell.
    ScorePositive,
    /// S ≤ 0 in the request's cell.
    ScoreNegative,
    /// A static policy (`pd` or `local`) fixed the path.
    Forced,
    /// The conversation falls in the fraction policy's local share.
    FractionLocal,
    /// The conversation falls outside the fraction policy's local share.
    FractionPd,
    /// The replica policy sends everything to replicas.
    ReplicaPolicy,
    /// The policy chose local but the session's D is decode-only (x ≡ 0 node).
    DecodeOnly,
    /// A hybrid deployment put this new conversation on a replica.
    HybridReplica,
    /// The conversation lives on a replica, which holds its KV.
    ReplicaSession,
    /// No prefill node can take the pd path: its D computes the whole prompt itself.
    PUnavailable,
    /// A node failed before the answer's first byte reached the client; this is
    /// the one retry, on another node of the same path.
    NodeFailed,
    /// The session's D restarted or cleared its cache since the conversation's
    /// last turn: the KV that local would reuse is gone.
    KvLost,
    /// The session's D holds less than half of the conversation's context
    /// (evicted, or never cached): local would recompute most of it anyway.
    NotResident,
    /// The policy chose pull but the router cannot name blocks on D for P to
    /// read: D's last answer streamed (vLLM 0.32 returns its transfer params
    /// only in whole answers), its pin expired, or was already read.
    NoPullHandle,
    /// The request's history differs from the one the conversation's last
    /// turn ended with (the client edited it, or stripped reasoning traces):
    /// the session's D holds another prefix than the one the prompt needs.
    PrefixMismatch,
    /// `ppd-live`, weights: the path with the best Equation 1 score over the
    /// cost model's predictions (TTFT gained, TPOT added to D's decodes).
    CostModel,
    /// `ppd-live`, SLO mode: the path under which most requests — this one
    /// and those decoding beside it — are predicted to meet both SLOs.
    SloGoodput,
    /// An anchor's rule (Dynamo, llm-d) found the prompt's uncached part
    /// small enough to prefill on the decode node.
    ShortUncached,
    /// An anchor's rule found the prompt's uncached part too large for the decode node.
    LongUncached,
    /// Dynamo's load rule: the prefill pool is busy, so the decode node prefills.
    PrefillBusy,
    /// Dynamo's load rule: the prefill pool has room, so it prefills.
    PrefillIdle,
    /// Dynamo's decode-busy gate: the decode node is too busy to prefill locally.
    DecodeBusy,
    /// `ppd-live`: the path its objective preferred would have pushed a
    /// request decoding on D past its deadline (the router's request
    /// timeout); this one does not, or fewer.
    Deadline,
}

impl Reason {
    pub const ALL: [Reason; 27] = [
        Reason::Turn1,
        Reason::NoSession,
        Reason::DUnavailable,
        Reason::DOverloaded,
        Reason::ScorePositive,
        Reason::ScoreNegative,
        Reason::Forced,
        Reason::FractionLocal,
        Reason::FractionPd,
        Reason::ReplicaPolicy,
        Reason::DecodeOnly,
        Reason::HybridReplica,
        Reason::ReplicaSession,
        Reason::PUnavailable,
        Reason::NodeFailed,
        Reason::KvLost,
        Reason::NotResident,
        Reason::NoPullHandle,
        Reason::PrefixMismatch,
        Reason::CostModel,
        Reason::SloGoodput,
        Reason::ShortUncached,
        Reason::LongUncached,
        Reason::PrefillBusy,
        Reason::PrefillIdle,
        Reason::DecodeBusy,
        Reason::Deadline,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Turn1 => "turn1",
            Reason::NoSession => "no_session",
            Reason::DUnavailable => "d_unavailable",
            Reason::DOverloaded => "d_overloaded",
            Reason::ScorePositive => "score_positive",
            Reason::ScoreNegative => "score_negative",
            Reason::Forced => "forced",
            Reason::FractionLocal => "fraction_local",
            Reason::FractionPd => "fraction_pd",
            Reason::ReplicaPolicy => "replica_policy",
            Reason::DecodeOnly => "d_decode_only",
            Reason::HybridReplica => "hybrid_replica",
            Reason::ReplicaSession => "replica_session",
            Reason::PUnavailable => "p_unavailable",
            Reason::NodeFailed => "node_failed",
            Reason::KvLost => "kv_lost",
            Reason::NotResident => "not_resident",
            Reason::NoPullHandle => "no_pull_handle",
            Reason::PrefixMismatch => "prefix_mismatch",
            Reason::CostModel => "cost_model",
            Reason::SloGoodput => "slo_goodput",
            Reason::ShortUncached => "short_uncached",
            Reason::LongUncached => "long_uncached",
            Reason::PrefillBusy => "prefill_busy",
            Reason::PrefillIdle => "prefill_idle",
            Reason::DecodeBusy => "decode_busy",
            Reason::Deadline => "deadline",
        }
    }
}

/// What the session's D holds of the conversation, as far as the router can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Residency {
    /// Nothing live is known: the session alone says D holds it.
    #[default]
    Unknown,
    /// D restarted or cleared its cache after the conversation's last turn.
    Lost,
    /// D holds this many leading tokens of the request's prompt (exactly, from
    /// its KV events, or estimated).
    Cached(u32),
}

/// Contexts shorter than this are never judged not resident: they span a
/// block or two, which prefix caching may legitimately not hold (only full
/// blocks are cached), and local or pd differ little for them.
pub const MIN_RESIDENT_CHECK_TOKENS: u32 = 64;

impl Residency {
    /// Whether D holds too little of a context of `n_ctx` tokens for local
    /// to be an append-prefill: less than half of it.
    pub fn too_little_of(self, n_ctx: u32) -> bool {
        match self {
            Residency::Cached(t) => {
                n_ctx >= MIN_RESIDENT_CHECK_TOKENS && u64::from(t) * 2 < u64::from(n_ctx)
            }
            Residency::Unknown | Residency::Lost => false,
        }
    }
}

/// What the engine knows of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecisionInput {
    pub turn: u32,
    pub n_in: u32,
    pub n_out: u32,
    pub n_ctx: u32,
    /// Current conversation arrival rate (the table's QPS axis).
    pub qps: f64,
    /// [`crate::identity::hash_id`] of the conversation id.
    pub conv_hash: u64,
    /// The router holds a live session (and so a D with this conversation's KV).
    pub has_session: bool,
    /// That D is registered and healthy.
    pub d_available: bool,
    /// That D is over its load limit (a veto on local).
    pub d_overloaded: bool,
    /// What that D still holds of the conversation (a veto on local).
    pub residency: Residency,
    /// The request continues the history the session's last turn ended with
    /// (false: a veto on local).
    pub prefix_ok: bool,
    /// That D may append-prefill locally (a pD, not a decode-only D).
    pub d_local_capable: bool,
    /// Hybrid R + P/D: the share of new conversations that replicas take.
    pub replica_share: f64,
    /// The session lives on a replica.
    pub session_on_replica: bool,
    /// That D pins the conversation's blocks and the router can name them
    /// for a P to read (the pull path is feasible).
    pub pull_ready: bool,
    /// The nodes' live state, for policies that predict (`None`: the router
    /// has no snapshot, and those policies fall back to the table).
    pub live: Option<LiveView>,
}

impl DecisionInput {
    /// A Turn 2+ request on a live, available, unloaded session.
    pub fn turn(turn: u32, n_in: u32, n_out: u32, n_ctx: u32, qps: f64) -> Self {
        DecisionInput {
            turn,
            n_in,
            n_out,
            n_ctx,
            qps,
            conv_hash: 0,
            has_session: true,
            d_available: true,
            d_overloaded: false,
            residency: Residency::Unknown,
            prefix_ok: true,
            d_local_capable: true,
            replica_share: 0.0,
            session_on_replica: false,
            pull_ready: false,
            live: None,
        }
    }

    /// Prompt tokens the session's D does not hold: what a local turn computes.
    pub fn uncached_on_d(&self) -> u32 {
        let prompt = self.n_ctx.saturating_add(self.n_in);
        let cached = match (self.live, self.residency) {
            (Some(l), _) => l.d_cached,
            (None, Residency::Cached(t)) => t,
            (None, Residency::Lost) => 0,
            (None, Residency::Unknown) => self.n_ctx,
        };
        prompt.saturating_sub(cached.min(prompt))
    }

    /// Why `path` cannot serve this Turn 2+ request on its session's D, if
    /// it cannot: the vetoes every policy's choice goes through.
    pub fn veto(&self, path: Path) -> Option<Reason> {
        // Both reuse D's copy of the context: local computes on D, pull reads
        // it from D. Only local computes there (decode-only, overload).
        let reuses = matches!(path, Path::Local | Path::Pull);
        if path == Path::Local && !self.d_local_capable {
            return Some(Reason::DecodeOnly);
        }
        if reuses && !self.prefix_ok {
            return Some(Reason::PrefixMismatch);
        }
        if reuses && self.residency == Residency::Lost {
            return Some(Reason::KvLost);
        }
        if reuses && self.residency.too_little_of(self.n_ctx) {
            return Some(Reason::NotResident);
        }
        if path == Path::Local && self.d_overloaded {
            return Some(Reason::DOverloaded);
        }
        if path == Path::Pull && !self.pull_ready {
            return Some(Reason::NoPullHandle);
        }
        None
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if !self.qps.is_finite() || self.qps < 0.0 {
            return Err(Error::InvalidInput(format!(
                "qps must be a finite number ≥ 0, got {}",
                self.qps
            )));
        }
        if self.turn == 0 {
            return Err(Error::InvalidInput("turn must be at least 1".into()));
        }
        if !(0.0..=1.0).contains(&self.replica_share) {
            return Err(Error::InvalidInput(format!(
                "replica_share must be in [0, 1], got {}",
                self.replica_share
            )));
        }
        Ok(())
    }
}

/// The request's cell and its score under the current weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    /// The grid point the features discretize to.
    pub point: GridPoint,
    /// The populated cell that answered for it (== point unless it fell back).
    pub cell_at: GridPoint,
    /// Distance of the fallback (0 when the cell is populated).
    pub distance: f64,
    pub d_ttft: f64,
    pub d_tpot: f64,
    pub score: f64,
}

/// The decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Route {
    pub path: Path,
    pub reason: Reason,
    /// Present for Turn 2+ requests that reached the table.
    pub scored: Option<Scored>,
    /// The cost model's predictions the decision saw (policies that predict).
    pub forecast: Option<Forecast>,
}
