//! The virtual-time cluster simulator: the emulator's engine model on every node,
//! the router's own [`DecisionEngine`] (ppd-core) as the router, and the paper's two-turn
//! Poisson workloads, reporting the metrics of the measured result files.
//!
//! One point (deployment × policy × workload × QPS) is one deterministic run;
//! [`run_grid`] spreads many points over threads. Several router replicas,
//! each with its own delayed view of load, share a cluster of up to
//! [`ppd_core::layout::MAX_SIM_NODES`] nodes (`replicas`).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use ahash::AHashMap;
use serde::{Deserialize, Serialize};

use ppd_core::catalog::Workload;
use ppd_core::cost::{AtRisk, Deadline};
use ppd_core::layout::{parse_sim_layout, Role};
use ppd_core::placement::{capacity_of, DEFAULT_LOAD_BOUND};
use ppd_core::qps::QpsEstimator;
use ppd_core::{
    DecisionEngine, DecisionInput, Error, LiveView, Path, PolicyKind, Slo, Table, Weights,
};

use crate::engine::{mix64, Content, Engine, Event, Finish, Kind, Submit};
use crate::profile::Profile;

mod events;
mod replicas;
use events::{time_key, Events};
use replicas::{node_names, place, replica_for, Replica};

/// One simulated point. Times in seconds, as on the command line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfig {
    pub deployment: String,
    pub policy: String,
    pub workload: String,
    pub qps: f64,
    #[serde(default = "default_duration")]
    pub duration_s: f64,
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "default_timeout")]
    pub timeout_s: f64,
    #[serde(default = "default_turns")]
    pub turns: u32,
    #[serde(default = "one")]
    pub w_ttft: f64,
    #[serde(default = "one")]
    pub w_tpot: f64,
    /// Explicit conversations, each a list of per-turn `[n_in, n_out]` tokens
    /// (Turn 1 first; later turns' `n_in` is the new input only). When given,
    /// `workload` is only a label and `turns` is ignored: arrival `i` replays
    /// conversation `i % len`. This is how generated and recorded workloads
    /// (ShareGPT, WildChat-like) reach the simulator without I/O in this crate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversations: Option<Vec<Vec<[u32; 2]>>>,
    /// Latency objectives: `ppd-live` decides for SLO goodput, and the result
    /// reports the share of requests that meet both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<Slo>,
    /// The nodes run this many times slower than the profile the router
    /// predicts with (hardware that drifted since calibration): its
    /// corrections have to find it out.
    #[serde(default = "one")]
    pub node_slowdown: f64,
    /// Router replicas, each routing its own share of the requests (each
    /// turn reaches one uniformly at random). One is the single router of
    /// the committed results: new conversations' D by round-robin, every
    /// node's load exact. Several place a new conversation as the live
    /// router does, by `ppd_core::placement::bounded` over their own delayed
    /// view of load (`replicas`); each keeps its own QPS estimate and
    /// cost-model corrections.
    #[serde(default = "one_router")]
    pub routers: u32,
    /// With several routers, how old the other replicas' load may be in a
    /// replica's view: each refreshes it every this many seconds (the live
    /// router scrapes its nodes every 1 s); 0 = every decision sees the true load.
    #[serde(default = "default_view_delay")]
    pub view_delay_s: f64,
    /// The client asks for whole answers (`"stream": false`). vLLM (0.32)
    /// names a bidirectional D's pinned KV only in a whole answer's
    /// `kv_transfer_params`; after a streamed answer the router first asks D
    /// for a pin (one more request on D: the context, one token), as
    /// ppd-server's pin.rs does. Pull needs a profile whose link can pull
    /// (NIXL) either way. The clients measured and benchmarked here stream;
    /// TTFT is still when the engine produced the first token.
    #[serde(default)]
    pub whole_answers: bool,
}

fn default_duration() -> f64 {
    10.0
}
fn default_timeout() -> f64 {
    30.0
}
fn default_turns() -> u32 {
    2
}
fn one() -> f64 {
    1.0
}
fn one_router() -> u32 {
    1
}
fn default_view_delay() -> f64 {
    1.0
}

impl SimConfig {
    pub fn new(deployment: &str, policy: &str, workload: &str, qps: f64) -> SimConfig {
        SimConfig {
            deployment: deployment.into(),
            policy: policy.into(),
            workload: workload.into(),
            qps,
            duration_s: default_duration(),
            seed: 0,
            timeout_s: default_timeout(),
            turns: default_turns(),
            w_ttft: 1.0,
            w_tpot: 1.0,
            conversations: None,
            slo: None,
            node_slowdown: 1.0,
            routers: one_router(),
            view_delay_s: default_view_delay(),
            whole_answers: false,
        }
    }
}

/// Per-turn metrics, named as in the measured result files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TurnStats {
    pub count: u64,
    pub avg_ttft_ms: f64,
    pub p50_ttft_ms: f64,
    pub p99_ttft_ms: f64,
    pub avg_tpot_ms: f64,
    pub p50_tpot_ms: f64,
    pub p99_tpot_ms: f64,
    pub avg_e2e_ms: f64,
    pub p99_e2e_ms: f64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    pub requests_per_sec: f64,
    pub tokens_per_sec: f64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SimResult {
    pub turn1: TurnStats,
    pub turn2plus: TurnStats,
    pub throughput: Throughput,
    /// Completed requests over requests sent, in [0, 1].
    pub success_rate: f64,
    /// Share of Turn 2+ requests routed `local`.
    pub local_share: f64,
    pub total_requests: u64,
    pub failed_requests: u64,
    /// Conversations that arrived.
    #[serde(default)]
    pub conversations: u64,
    /// Virtual seconds from the first arrival to the last completion.
    pub duration_s: f64,
    /// Share of all requests sent that met both SLOs (TTFT, and TPOT where
    /// more than one token came); 0 without SLOs.
    #[serde(default)]
    pub slo_attainment: f64,
    /// The same over Turn 2+ requests.
    #[serde(default)]
    pub slo_attainment_t2: f64,
    /// Share of Turn 2+ requests routed `pull`.
    #[serde(default)]
    pub pull_share: f64,
    /// Pins the router asked of a D before a pull (after streamed answers).
    #[serde(default)]
    pub pins_asked: u64,
    /// Median |ln(observed / predicted)| of Turn 2+ TTFT where the router
    /// predicted (the cost model's error after its corrections); 0 otherwise.
    #[serde(default)]
    pub ttft_prediction_error: f64,
    /// Predicted Turn 2+ requests until every later prediction was within
    /// 25 % of what happened (how long the corrections took to settle).
    #[serde(default)]
    pub predictions_until_settled: u64,
    /// Recompute-preemptions over all nodes (a KV pool that ran full).
    #[serde(default)]
    pub preemptions: u64,
    /// New conversations placed on the decoding node that got the most,
    /// over the mean per decoding node (1 = perfectly even).
    #[serde(default)]
    pub placement_max_over_mean: f64,
    /// Share of placements that, by the true loads of that moment, put a
    /// conversation on a node at or above the bounded-load capacity (what
    /// stale views cost; 0 when every replica sees the true load).
    #[serde(default)]
    pub placements_over_bound: f64,
    /// Share of Turn 2+ requests of conversations held on a D that went to
    /// that D (below 1 only where the conversation lost its key and was
    /// placed afresh).
    #[serde(default)]
    pub turn2_on_own_d: f64,
    /// Share of the same requests whose D held at least half their context
    /// in its prefix cache when routed (the router's `not_resident` line).
    #[serde(default)]
    pub turn2_kv_found: f64,
}

/// A placeholder table for policies that never consult one.
fn placeholder_table() -> Result<Table, Error> {
    let doc = r#"{"schema":"ppd-table/1","source":"placeholder","axes":{"context_bins":[512,4096],
      "workloads":[{"name":"tiny","n_in":16,"n_out":32}],"qps":[1]},
      "cells":[{"context":"small","workload":"tiny","qps":1,
        "x0":{"ttft_ms":1,"tpot_ms":1,"n":1},"x1":{"ttft_ms":1,"tpot_ms":1,"n":1}}]}"#;
    Ok(Table::from_json(doc, "<placeholder>")?)
}

/// Keep the measured proxy's P, D and R draws of one key apart.
const SALT_P: u64 = 0x5041_5254;
const SALT_D: u64 = 0x4445_434F;
const SALT_R: u64 = 0x5245_504C;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// On D, the router's pin request before a pull after a streamed
    /// answer (ppd-server's pin.rs): the context, one token; then P (node).
    Pin { p: usize },
    /// On P, prefilling for the D that will pull (node, of the final stage).
    Prefill { d: usize },
    /// Producing the answer.
    Final,
}

#[derive(Debug, Clone, Copy)]
struct ReqInfo {
    conv: u32,
    stage: Stage,
    node: usize,
}

#[derive(Debug, Clone, Default)]
struct Conv {
    key: u64,
    /// Index into `Sim::specs`.
    spec: u32,
    arrival: f64,
    turn: u32,
    /// When the current turn's latency clock started (arrival for Turn 1, send for later).
    start: f64,
    sent: f64,
    first_token: Option<f64>,
    d: Option<usize>,
    on_replica: bool,
    /// The current engine request (node, id).
    cur: Option<(usize, u64)>,
    /// P's held KV for the D pull in flight (node, id).
    hold: Option<(usize, u64)>,
    done: bool,
    context: u32,
    /// The cost model's uncorrected and corrected TTFT for the path taken,
    /// with what the correction is keyed by (node, path, computed tokens).
    predicted: Option<Predicted>,
    /// The replica that routed the current turn.
    replica: u32,
    /// The node whose in-flight count holds the current turn, until answered.
    counted: Option<usize>,
}

#[derive(Debug, Clone, Copy)]
struct Predicted {
    /// The corrected prediction the decision saw (none for a Turn 1, which
    /// only teaches the corrections).
    corrected_ms: Option<f64>,
    path: Path,
    n_ctx: u32,
    n_in: u32,
    live: LiveView,
}

/// Whether a conversation's last turn left its KV on a D (not a replica).
fn c_d_holds(c: &Conv) -> bool {
    c.d.is_some() && !c.on_replica
}

#[derive(Debug, Clone)]
enum Ext {
    Arrive(u32),
    Send(u32),
    Submit {
        node: usize,
        conv: u32,
        stage: Stage,
        req: Submit,
    },
    Release {
        node: usize,
        id: u64,
    },
    Timeout {
        conv: u32,
        turn: u32,
    },
    /// A router replica refreshes its view of the other replicas' load.
    Refresh(u32),
}

#[derive(Default)]
struct Samples {
    ttft: Vec<f64>,
    tpot: Vec<f64>,
    e2e: Vec<f64>,
}

/// numpy's default (linear) percentile.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

impl Samples {
    fn stats(mut self) -> TurnStats {
        for v in [&mut self.ttft, &mut self.tpot, &mut self.e2e] {
            v.sort_by(f64::total_cmp);
        }
        TurnStats {
            count: self.e2e.len() as u64,
            avg_ttft_ms: mean(&self.ttft),
            p50_ttft_ms: percentile(&self.ttft, 50.0),
            p99_ttft_ms: percentile(&self.ttft, 99.0),
            avg_tpot_ms: mean(&self.tpot),
            p50_tpot_ms: percentile(&self.tpot, 50.0),
            p99_tpot_ms: percentile(&self.tpot, 99.0),
            avg_e2e_ms: mean(&self.e2e),
            p99_e2e_ms: percentile(&self.e2e, 99.0),
        }
    }
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    p: &'a Profile,
    /// Per-turn (n_in, n_out) of each distinct conversation shape.
    specs: Vec<Vec<(u32, u32)>>,
    replicas: Vec<Replica>,
    roles: Vec<Role>,
    nodes: Vec<Engine>,
    /// Nodes by the time of their next internal event (stale entries, whose
    /// time is no longer the node's, are skipped): the next node to advance
    /// without scanning them all.
    agenda: BinaryHeap<Reverse<(u64, usize)>>,
    /// Each node's time on the agenda (`u64::MAX`: none), so that a node
    /// touched without its time moving is not queued again.
    on_agenda: Vec<u64>,
    names: Vec<String>,
    /// Requests routed to each node and not yet answered, over all replicas.
    inflight: Vec<u32>,
    /// The same summed over the decoding nodes (the placement candidates).
    d_inflight: u64,
    /// New conversations placed on each node.
    placed: Vec<u32>,
    placements: u64,
    over_bound: u64,
    /// Turn 2+ requests of conversations held on a D; of those, sent to it; whose D held their KV.
    t2_held: u64,
    t2_own_d: u64,
    t2_kv_found: u64,
    ps: Vec<usize>,
    ds: Vec<usize>,
    rs: Vec<usize>,
    replica_share: f64,
    /// Later turns can be pulled: the profile's link pulls.
    pulls: bool,
    /// A pull first asks D for a pin (the last answer streamed).
    asks_pin: bool,
    events: Events<Ext>,
    next_id: u64,
    reqs: AHashMap<u64, ReqInfo>,
    convs: Vec<Conv>,
    queue: VecDeque<u32>,
    in_flight: u32,
    open: usize,
    samples: [Samples; 2],
    sent: u64,
    failed: u64,
    out_tokens: u64,
    local: u64,
    pull: u64,
    pins_asked: u64,
    decided2: u64,
    last_done: f64,
    ev: Vec<Event>,
    /// Requests that met both SLOs: [Turn 1, Turn 2+].
    slo_met: [u64; 2],
    sent2: u64,
    /// Running mean of output tokens, the router's estimate for its co-runners.
    mean_out: f64,
    /// |ln(observed / predicted)| TTFT of each predicted Turn 2+ request.
    prediction_errors: Vec<f64>,
}

impl<'a> Sim<'a> {
    fn push(&mut self, t: f64, e: Ext) {
        self.events.push(t, e);
    }

    fn pick(list: &[usize], rr: &mut usize) -> usize {
        let n = list[*rr % list.len()];
        *rr += 1;
        n
    }

    /// The node of `list` that the measured proxy's hash of `key` picks
    /// (`Harness::hashed_placement`; `salt` keeps the P, D and R draws apart).
    fn hashed(list: &[usize], key: u64, salt: u64) -> usize {
        list[(mix64(key ^ salt) % list.len() as u64) as usize]
    }

    fn hop(&self) -> f64 {
        self.p.api.router_hop_ms
    }

    #[allow(clippy::too_many_arguments)]
    fn submit_at(
        &mut self,
        t: f64,
        node: usize,
        conv: u32,
        stage: Stage,
        prompt: u32,
        out: u32,
        kind: Kind,
        remote_prefix: u32,
    ) {
        self.next_id += 1;
        let content = self.content(conv, prompt);
        let req = Submit {
            id: self.next_id,
            content,
            prompt_len: prompt,
            max_tokens: out,
            kind,
            remote_prefix,
            pin_ms: None,
        };
        let at = t + self.p.api.request_overhead_ms;
        self.push(
            at,
            Ext::Submit {
                node,
                conv,
                stage,
                req,
            },
        );
    }

    /// The tokens of a conversation's request of `prompt` tokens, as its nodes hash them.
    fn content(&self, conv: u32, prompt: u32) -> Content {
        let c = &self.convs[conv as usize];
        if self.p.harness.answer_prefix_hit {
            Content::Synthetic(c.key)
        } else {
            // The prompt as the client renders it is canonical; the answer generated
            // after it is salted per turn, so the next turn's re-rendered copy of it
            // misses the cache (from the block holding the prompt's end) while
            // everything the client sent before still hits.
            Content::SyntheticSalted {
                key: c.key,
                stable_blocks: prompt / self.p.block_size,
                salt: c.turn as u64,
            }
        }
    }

    /// What the router sees for a Turn 2+ request on D `d`: every node's
    /// state now (one router, whose own accounting is exact), or, among
    /// several replicas, as the deciding one's last refresh read it; the
    /// prompt tokens D and the next P hold (KV events: the same truth at
    /// every replica).
    fn live_view(&self, t: f64, conv: u32, d: usize, prompt: u32) -> LiveView {
        let content = self.content(conv, prompt);
        let replica = &self.replicas[self.convs[conv as usize].replica as usize];
        let view = |n: usize| ppd_core::NodeView {
            node: n as u32,
            ..replica.view(n).unwrap_or_else(|| self.nodes[n].load_view())
        };
        let rr_p = replica.rr_p;
        let p = (!self.ps.is_empty()).then(|| self.ps[rr_p % self.ps.len()]);
        LiveView {
            d: view(d),
            p: p.map(view),
            d_cached: self.nodes[d].cached_prefix(&content, prompt),
            p_cached: p.map_or(0, |p| self.nodes[p].cached_prefix(&content, prompt)),
            mean_out_tokens: self.nodes[d].mean_out_harmonic().unwrap_or(self.mean_out),
            pull_asks_pin: self.asks_pin,
            at_risk: self.at_risk(t, d, self.convs[conv as usize].replica),
        }
    }

    /// D's decodes closest to the client's timeout, which the router knows
    /// as its own request timeout: each from when its turn was sent. A
    /// replica knows only the requests it routed itself.
    fn at_risk(&self, t: f64, d: usize, replica: u32) -> AtRisk {
        let mut a = AtRisk::default();
        let limit = self.cfg.timeout_s * 1000.0;
        for (id, out, max_out) in self.nodes[d].decoding() {
            let Some(r) = self.reqs.get(&id) else {
                continue;
            };
            let c = &self.convs[r.conv as usize];
            if c.replica == replica {
                a.offer(Deadline {
                    time_left_ms: c.sent + limit - t,
                    remaining_tokens: max_out.saturating_sub(out),
                });
            }
        }
        a
    }

    /// The client sends the conversation's next turn at `t`; the router decides.
    fn send(&mut self, t: f64, conv: u32) -> Result<(), Error> {
        let c = &mut self.convs[conv as usize];
        c.turn += 1;
        c.sent = t;
        c.start = if c.turn == 1 { c.arrival } else { t };
        c.first_token = None;
        let turn = c.turn;
        let r = replica_for(c.key, turn, self.cfg.routers);
        c.replica = r as u32;
        let held_by = c.d.filter(|_| turn > 1 && c_d_holds(c));
        let n_ctx = c.context;
        let (n_in, n_out) = self.specs[c.spec as usize][turn as usize - 1];
        let prompt = n_ctx + n_in;
        // The measured proxy lost some conversations' key at Turn 2 (see
        // `Harness::new_conversation_share`): it routed them as a new conversation's
        // Turn 1, to nodes chosen afresh, with the whole prompt prefilled on P.
        let rekeyed = turn > 1 && {
            let draw = mix64(c.key ^ mix64(u64::from(turn) ^ 0xC0_4E55));
            ((draw >> 11) as f64 / (1u64 << 53) as f64) < self.p.harness.new_conversation_share
        };
        if rekeyed {
            c.d = None;
            c.on_replica = false;
        }
        let seen_turn = if rekeyed { 1 } else { turn };
        let qps = self.replicas[r].fleet_rate(t as u64);
        let mut input = DecisionInput::turn(seen_turn, n_in, n_out, n_ctx, qps);
        input.conv_hash = if rekeyed {
            mix64(c.key ^ u64::from(turn))
        } else {
            c.key
        };
        input.has_session = seen_turn > 1;
        input.session_on_replica = c.on_replica;
        input.d_local_capable = c.d.is_some_and(|d| self.roles[d].local_capable());
        input.replica_share = self.replica_share;
        // As the live router: a pull needs a link that can pull and D's
        // pin, named by a whole answer or asked for (the pin's memory on D
        // is not modelled).
        input.pull_ready = self.pulls && turn > 1 && c_d_holds(&self.convs[conv as usize]);
        let holder = self.convs[conv as usize].d.filter(|_| turn > 1);
        if let Some(d) = holder.filter(|_| c_d_holds(&self.convs[conv as usize])) {
            input.live = Some(self.live_view(t, conv, d, prompt));
        }
        let route = self.replicas[r].router.decide(&input)?;
        self.convs[conv as usize].predicted = Self::predicted(&route, &input);
        if turn > 1 {
            self.decided2 += 1;
            self.sent2 += 1;
            if route.path == Path::Pull {
                self.pull += 1;
            }
        }
        self.sent += 1;
        let timeout = self.cfg.timeout_s * 1000.0;
        self.events
            .push_timeout(t + timeout, Ext::Timeout { conv, turn });
        let t = t + self.hop();
        match route.path {
            Path::Replica => {
                if self.rs.is_empty() {
                    return Err(Error::Config(format!(
                        "deployment {} has no R node for the replica path",
                        self.cfg.deployment
                    )));
                }
                let c = &mut self.convs[conv as usize];
                let node = match (c.on_replica, c.d) {
                    (true, Some(r)) => r,
                    _ if self.p.harness.hashed_placement => {
                        Self::hashed(&self.rs, input.conv_hash, SALT_R)
                    }
                    _ => Self::pick(&self.rs, &mut self.replicas[r].rr_r),
                };
                let c = &mut self.convs[conv as usize];
                c.on_replica = true;
                c.d = Some(node);
                self.count_in(conv, node);
                self.submit_at(t, node, conv, Stage::Final, prompt, n_out, Kind::Local, 0);
            }
            Path::Local => {
                self.local += 1;
                let node = self.convs[conv as usize].d.unwrap_or(self.ds[0]);
                self.count_in(conv, node);
                self.note_turn2(conv, held_by, node, prompt);
                let t = t + self.p.api.local_path_extra_ms;
                self.submit_at(t, node, conv, Stage::Final, prompt, n_out, Kind::Local, 0);
            }
            Path::Pd | Path::Pull => {
                if self.ps.is_empty() || self.ds.is_empty() {
                    return Err(Error::Config(format!(
                        "deployment {} needs P and D nodes for the pd path",
                        self.cfg.deployment
                    )));
                }
                let p = if self.p.harness.hashed_placement {
                    Self::hashed(&self.ps, input.conv_hash, SALT_P)
                } else {
                    Self::pick(&self.ps, &mut self.replicas[r].rr_p)
                };
                let d = match self.convs[conv as usize].d {
                    Some(d) if !self.convs[conv as usize].on_replica => d,
                    _ => self.place_new(conv, r, input.conv_hash),
                };
                self.convs[conv as usize].d = Some(d);
                self.count_in(conv, d);
                self.note_turn2(conv, held_by, d, prompt);
                if turn == 1 && self.replicas[r].router.policy().sees_load() {
                    // A Turn 1 is a pd prefill on P: its TTFT teaches P's
                    // corrections before any Turn 2 asks for them.
                    self.convs[conv as usize].predicted = Some(Predicted {
                        corrected_ms: None,
                        path: Path::Pd,
                        n_ctx,
                        n_in,
                        live: self.live_view(t, conv, d, prompt),
                    });
                }
                // Pull: P reads the context D holds over its link, then
                // computes only the new tokens; after a streamed answer D is
                // asked for the pin first.
                if route.path == Path::Pull && self.asks_pin {
                    self.pins_asked += 1;
                    self.submit_at(t, d, conv, Stage::Pin { p }, n_ctx, 1, Kind::Local, 0);
                } else {
                    let remote = if route.path == Path::Pull { n_ctx } else { 0 };
                    self.submit_at(
                        t,
                        p,
                        conv,
                        Stage::Prefill { d },
                        prompt,
                        1,
                        Kind::RemoteDecode,
                        remote,
                    );
                }
            }
        }
        Ok(())
    }

    /// The prediction for the path taken, to score against what happens.
    fn predicted(route: &ppd_core::Route, input: &DecisionInput) -> Option<Predicted> {
        Some(Predicted {
            corrected_ms: Some(route.forecast?.get(route.path).ttft_ms),
            path: route.path,
            n_ctx: input.n_ctx,
            n_in: input.n_in,
            live: input.live?,
        })
    }

    /// A new conversation's D (or one that lost its key): round-robin with
    /// one router, as the committed results were simulated; with several,
    /// the live router's bounded-load rendezvous on the conversation's
    /// stable key (`ConversationId::placement_key`), over the deciding
    /// replica's view of load; as the measured proxy drew it (by the key it
    /// saw, `proxy_key`) with `Harness::hashed_placement`.
    fn place_new(&mut self, conv: u32, r: usize, proxy_key: u64) -> usize {
        let d = if self.p.harness.hashed_placement {
            Self::hashed(&self.ds, proxy_key, SALT_D)
        } else if self.cfg.routers <= 1 {
            Self::pick(&self.ds, &mut self.replicas[r].rr_d)
        } else {
            let key = self.convs[conv as usize].key;
            let (replica, truth) = (&self.replicas[r], &self.inflight);
            if self.cfg.view_delay_s <= 0.0 {
                place(key, &self.ds, &self.names, |n| truth[n], self.d_inflight)
            } else {
                let total = replica.seen_d_total();
                place(key, &self.ds, &self.names, |n| replica.seen(n), total)
            }
        };
        // Checked against the true loads, whatever the replica saw.
        let cap = capacity_of(self.d_inflight, self.ds.len(), DEFAULT_LOAD_BOUND);
        self.over_bound += u64::from(u64::from(self.inflight[d]) >= cap);
        self.placements += 1;
        self.placed[d] += 1;
        d
    }

    /// The turn's request now counts on `node`'s load, for every replica's
    /// next refresh and exactly for the replica that routed it.
    fn count_in(&mut self, conv: u32, node: usize) {
        let c = &mut self.convs[conv as usize];
        c.counted = Some(node);
        self.inflight[node] += 1;
        let decodes = self.roles[node].decodes();
        self.d_inflight += u64::from(decodes);
        self.replicas[c.replica as usize].sent(node, decodes);
    }

    /// The turn is answered (or given up): its node's load drops.
    fn count_out(&mut self, conv: u32) {
        let c = &mut self.convs[conv as usize];
        let Some(node) = c.counted.take() else {
            return;
        };
        self.inflight[node] -= 1;
        let decodes = self.roles[node].decodes();
        self.d_inflight -= u64::from(decodes);
        self.replicas[c.replica as usize].answered(node, decodes);
    }

    /// Where a Turn 2+ of a conversation held on D `held_by` went: to that
    /// D or not, and whether the D it went to held its context.
    fn note_turn2(&mut self, conv: u32, held_by: Option<usize>, d: usize, prompt: u32) {
        let Some(held_by) = held_by else {
            return;
        };
        self.t2_held += 1;
        self.t2_own_d += u64::from(d == held_by);
        let n_ctx = self.convs[conv as usize].context;
        let content = self.content(conv, prompt);
        let cached = self.nodes[d].cached_prefix(&content, prompt);
        self.t2_kv_found += u64::from(2 * u64::from(cached) >= u64::from(n_ctx));
    }

    /// Puts `node`'s next internal event on the agenda (after anything that
    /// may have moved it).
    fn touch(&mut self, node: usize) {
        let key = self.nodes[node]
            .next_event_time()
            .map_or(u64::MAX, time_key);
        if key != self.on_agenda[node] {
            let old = std::mem::replace(&mut self.on_agenda[node], key);
            // Most often the node stepped from the agenda's top: its entry moves
            // down in place (one sift) rather than a new entry going in and the
            // stale one coming out later (two). The valid entries are the same.
            if key != u64::MAX {
                if let Some(mut top) = self.agenda.peek_mut() {
                    if top.0 == (old, node) {
                        *top = Reverse((key, node));
                        return;
                    }
                }
                self.agenda.push(Reverse((key, node)));
            }
            // Entries a node left behind far ahead (an idle P's lease expiry
            // minutes away) would pile up: drop them once they outnumber the nodes.
            if self.agenda.len() > 4 * self.nodes.len() + 1024 {
                let on = &self.on_agenda;
                self.agenda.retain(|&Reverse((k, n))| on[n] == k);
            }
        }
    }

    /// The node whose internal event comes next, and its time (the lowest
    /// index among equal times, as a scan in node order finds it).
    fn next_node(&mut self) -> Option<(f64, usize)> {
        while let Some(&Reverse((k, n))) = self.agenda.peek() {
            if self.on_agenda[n] == k {
                return Some((f64::from_bits(k), n));
            }
            self.agenda.pop();
        }
        None
    }

    /// Starts fetching the state of the node likely to step after the one at
    /// the agenda's top (a child of the top: the second-earliest entry, if not
    /// stale), so that its cache misses overlap this step's work.
    fn prefetch_runner_up(&self) {
        let heap = self.agenda.as_slice();
        let next = match (heap.get(1), heap.get(2)) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        if let Some(&Reverse((_, n))) = next {
            self.nodes[n].prefetch();
        }
    }

    fn start_conversation(&mut self, t: f64, conv: u32) -> Result<(), Error> {
        self.in_flight += 1;
        self.send(t, conv)
    }

    fn end_conversation(&mut self, t: f64, conv: u32) -> Result<(), Error> {
        let c = &mut self.convs[conv as usize];
        if c.done {
            return Ok(());
        }
        c.done = true;
        self.open -= 1;
        self.in_flight -= 1;
        self.last_done = self.last_done.max(t);
        if let Some(next) = self.queue.pop_front() {
            self.start_conversation(t, next)?;
        }
        Ok(())
    }

    fn handle_ext(&mut self, t: f64, e: Ext) -> Result<(), Error> {
        match e {
            Ext::Arrive(conv) => {
                let r = replica_for(self.convs[conv as usize].key, 1, self.cfg.routers);
                self.replicas[r].qps.record(t as u64);
                let cap = self.p.harness.max_conversations;
                if cap > 0 && self.in_flight >= cap {
                    self.queue.push_back(conv);
                } else {
                    self.start_conversation(t, conv)?;
                }
            }
            Ext::Send(conv) => self.send(t, conv)?,
            Ext::Submit {
                node,
                conv,
                stage,
                req,
            } => {
                let c = &self.convs[conv as usize];
                if c.done {
                    return Ok(());
                }
                let id = req.id;
                self.reqs.insert(id, ReqInfo { conv, stage, node });
                self.convs[conv as usize].cur = Some((node, id));
                let mut ev = std::mem::take(&mut self.ev);
                let r = self.nodes[node].submit(t, req, &mut ev);
                self.touch(node);
                if let Err(e) = r {
                    self.ev = ev;
                    return Err(Error::Config(format!(
                        "workload {}: {e}",
                        self.cfg.workload
                    )));
                }
                self.handle_events(node, &mut ev)?;
                self.ev = ev;
            }
            Ext::Release { node, id } => {
                let mut ev = std::mem::take(&mut self.ev);
                self.nodes[node].take_hold(t, id, &mut ev);
                self.touch(node);
                self.handle_events(node, &mut ev)?;
                self.ev = ev;
            }
            Ext::Timeout { conv, turn } => {
                let c = &self.convs[conv as usize];
                if c.done || c.turn != turn {
                    return Ok(());
                }
                self.failed += 1;
                let cur = c.cur;
                let hold = c.hold;
                self.count_out(conv);
                let mut ev = std::mem::take(&mut self.ev);
                if let Some((node, id)) = cur {
                    self.reqs.remove(&id);
                    self.nodes[node].abort(t, id, &mut ev);
                    self.touch(node);
                    self.handle_events(node, &mut ev)?;
                }
                if let Some((node, id)) = hold {
                    self.nodes[node].take_hold(t, id, &mut ev);
                    self.touch(node);
                    self.handle_events(node, &mut ev)?;
                }
                self.ev = ev;
                self.end_conversation(t, conv)?;
            }
            Ext::Refresh(r) => {
                let r = r as usize;
                let now = t as u64;
                let others_rate = (0..self.replicas.len())
                    .filter(|&o| o != r)
                    .map(|o| self.replicas[o].qps.rate(now))
                    .sum();
                // The nodes' state only where the policy reads it (a copy of
                // every node per refresh is not free at 1,000 nodes).
                let views: Vec<_> = if self.replicas[r].router.policy().sees_load() {
                    self.nodes.iter().map(|n| n.load_view()).collect()
                } else {
                    Vec::new()
                };
                self.replicas[r].refresh(&self.inflight, self.d_inflight);
                self.replicas[r].refresh_state(others_rate, &views);
                let r = r as u32;
                self.push(t + self.cfg.view_delay_s * 1000.0, Ext::Refresh(r));
            }
        }
        Ok(())
    }

    fn handle_events(&mut self, node: usize, ev: &mut Vec<Event>) -> Result<(), Error> {
        for e in ev.drain(..) {
            match e {
                Event::Token { id, index: 0, t } => {
                    if let Some(r) = self.reqs.get(&id) {
                        if r.stage == Stage::Final {
                            self.convs[r.conv as usize].first_token = Some(t);
                        }
                    }
                }
                Event::Token { .. } | Event::LeaseExpired { .. } => {}
                Event::TransferDone { id, t } => {
                    if let Some(r) = self.reqs.get(&id) {
                        if let Some((pn, pid)) = self.convs[r.conv as usize].hold.take() {
                            self.push(t, Ext::Release { node: pn, id: pid });
                        }
                    }
                }
                Event::Finished {
                    id,
                    t,
                    usage,
                    finish,
                } => {
                    let Some(r) = self.reqs.remove(&id) else {
                        continue;
                    };
                    if finish == Finish::Aborted {
                        continue;
                    }
                    let conv = r.conv;
                    match r.stage {
                        Stage::Pin { p } => {
                            // D named its pin: the router sends the pull to P.
                            let c = &self.convs[conv as usize];
                            let (n_in, _) = self.specs[c.spec as usize][c.turn as usize - 1];
                            let (ctx, d) = (c.context, node);
                            let at = t + self.hop();
                            self.submit_at(
                                at,
                                p,
                                conv,
                                Stage::Prefill { d },
                                ctx + n_in,
                                1,
                                Kind::RemoteDecode,
                                ctx,
                            );
                        }
                        Stage::Prefill { d } => {
                            let c = &mut self.convs[conv as usize];
                            c.hold = Some((node, id));
                            let (n_in, n_out) = self.specs[c.spec as usize][c.turn as usize - 1];
                            let prompt = c.context + n_in;
                            let at = t + self.hop();
                            self.submit_at(
                                at,
                                d,
                                conv,
                                Stage::Final,
                                prompt,
                                n_out,
                                Kind::RemotePrefill,
                                0,
                            );
                        }
                        Stage::Final => {
                            let c = &mut self.convs[conv as usize];
                            let first = c.first_token.unwrap_or(t);
                            let turn = c.turn;
                            let idx = usize::from(turn > 1);
                            let n = usage.completion_tokens;
                            let ttft = first - c.start;
                            let tpot = (n > 1).then(|| (t - first) / (n - 1) as f64);
                            self.samples[idx].ttft.push(ttft);
                            self.samples[idx].e2e.push(t - c.start);
                            if let Some(tpot) = tpot {
                                self.samples[idx].tpot.push(tpot);
                            }
                            if let Some(slo) = self.cfg.slo {
                                if ttft <= slo.ttft_ms && tpot.is_none_or(|x| x <= slo.tpot_ms) {
                                    self.slo_met[idx] += 1;
                                }
                            }
                            if let Some(pr) = c.predicted.take() {
                                let router = &self.replicas[c.replica as usize].router;
                                if let Some(m) = router.cost_model() {
                                    // From the router's send: a Turn 1's TTFT includes the client's queue.
                                    m.observe(
                                        pr.path,
                                        pr.n_ctx,
                                        pr.n_in,
                                        &pr.live,
                                        first - c.sent,
                                        tpot,
                                    );
                                }
                                if let Some(predicted) =
                                    pr.corrected_ms.filter(|&p| p > 0.0 && ttft > 0.0)
                                {
                                    self.prediction_errors.push((ttft / predicted).ln().abs());
                                }
                            }
                            self.mean_out += 0.05 * (f64::from(n) - self.mean_out);
                            self.out_tokens += n as u64;
                            let (n_in, _) = self.specs[c.spec as usize][turn as usize - 1];
                            c.context += n_in + n;
                            c.cur = None;
                            self.last_done = self.last_done.max(t);
                            let _ = r.node;
                            let more = (turn as usize) < self.specs[c.spec as usize].len();
                            self.count_out(conv);
                            if more {
                                self.push(t, Ext::Send(conv));
                            } else {
                                self.end_conversation(t, conv)?;
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn run(mut self) -> Result<SimResult, Error> {
        // Poisson arrivals over [0, duration).
        let mut rng = mix64(self.cfg.seed ^ 0x5EED);
        let mut t = 0.0;
        let horizon = self.cfg.duration_s * 1000.0;
        loop {
            rng = mix64(rng);
            let u = ((rng >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            t += -u.ln() / self.cfg.qps * 1000.0;
            if t >= horizon {
                break;
            }
            let idx = self.convs.len() as u32;
            let key = mix64(self.cfg.seed.wrapping_mul(0x9E37) ^ (idx as u64 + 1));
            self.convs.push(Conv {
                key,
                spec: (idx as usize % self.specs.len()) as u32,
                arrival: t,
                ..Conv::default()
            });
            self.events.push_arrival(t, Ext::Arrive(idx));
        }
        self.open = self.convs.len();
        if self.cfg.routers > 1 && self.cfg.view_delay_s > 0.0 {
            // Independent timers: the replicas' refreshes spread over one period.
            let period = self.cfg.view_delay_s * 1000.0;
            for r in 0..self.cfg.routers {
                let phase = period * f64::from(r) / f64::from(self.cfg.routers);
                self.push(phase, Ext::Refresh(r));
            }
        }
        let mut ev = Vec::with_capacity(256);
        while self.open > 0 {
            let te = self.events.next_time();
            let (tn, ni) = self.next_node().unwrap_or((f64::INFINITY, usize::MAX));
            match te {
                Some(te) if te <= tn => {
                    let Some((t, e)) = self.events.pop() else {
                        break;
                    };
                    self.handle_ext(t, e)?;
                }
                _ if ni != usize::MAX => {
                    self.prefetch_runner_up();
                    self.nodes[ni].advance(tn, &mut ev);
                    self.touch(ni);
                    self.handle_events(ni, &mut ev)?;
                }
                _ => break,
            }
        }
        let done = self.sent - self.failed;
        let dur_ms = self.last_done.max(1.0);
        let [s1, s2] = std::mem::take(&mut self.samples);
        Ok(SimResult {
            turn1: s1.stats(),
            turn2plus: s2.stats(),
            throughput: Throughput {
                requests_per_sec: done as f64 / (dur_ms / 1000.0),
                tokens_per_sec: self.out_tokens as f64 / (dur_ms / 1000.0),
            },
            success_rate: if self.sent == 0 {
                1.0
            } else {
                done as f64 / self.sent as f64
            },
            local_share: if self.decided2 == 0 {
                0.0
            } else {
                self.local as f64 / self.decided2 as f64
            },
            pins_asked: self.pins_asked,
            pull_share: if self.decided2 == 0 {
                0.0
            } else {
                self.pull as f64 / self.decided2 as f64
            },
            slo_attainment: if self.sent == 0 {
                0.0
            } else {
                (self.slo_met[0] + self.slo_met[1]) as f64 / self.sent as f64
            },
            slo_attainment_t2: if self.sent2 == 0 {
                0.0
            } else {
                self.slo_met[1] as f64 / self.sent2 as f64
            },
            preemptions: self
                .nodes
                .iter()
                .map(|n| n.snapshot().stats.preemptions)
                .sum(),
            predictions_until_settled: self
                .prediction_errors
                .iter()
                .rposition(|&e| e > 1.25f64.ln())
                .map_or(0, |i| i as u64 + 1),
            ttft_prediction_error: {
                let mut e = std::mem::take(&mut self.prediction_errors);
                e.sort_by(f64::total_cmp);
                percentile(&e, 50.0)
            },
            placement_max_over_mean: max_over_mean(self.ds.iter().map(|&d| self.placed[d])),
            placements_over_bound: share(self.over_bound, self.placements),
            turn2_on_own_d: share(self.t2_own_d, self.t2_held),
            turn2_kv_found: share(self.t2_kv_found, self.t2_held),
            total_requests: self.sent,
            failed_requests: self.failed,
            conversations: self.convs.len() as u64,
            duration_s: dur_ms / 1000.0,
        })
    }
}

/// `part / whole`, 0 for nothing counted.
fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// The largest count over the mean count (0 when nothing was counted).
fn max_over_mean(counts: impl Iterator<Item = u32>) -> f64 {
    let (mut n, mut sum, mut max) = (0u64, 0u64, 0u32);
    for c in counts {
        n += 1;
        sum += u64::from(c);
        max = max.max(c);
    }
    if sum == 0 {
        0.0
    } else {
        f64::from(max) * n as f64 / sum as f64
    }
}

/// The conversation shapes of a point: the explicit list, or the named synthetic
/// workload with `turns` turns. Checks sizes against the engine's limits so a bad
/// list is a clear error rather than a failed submit mid-run.
fn conversation_specs(cfg: &SimConfig, profile: &Profile) -> Result<Vec<Vec<(u32, u32)>>, Error> {
    let Some(list) = &cfg.conversations else {
        let wl = Workload::by_name(&cfg.workload)?;
        let mut turns = vec![wl.t1];
        turns.resize(cfg.turns as usize, wl.t2);
        return Ok(vec![turns]);
    };
    if list.is_empty() {
        return Err(Error::Config("conversations: empty list".into()));
    }
    if list.len() > 1_000_000 {
        return Err(Error::Config("conversations: more than 1,000,000".into()));
    }
    let mut specs = Vec::with_capacity(list.len());
    for (i, conv) in list.iter().enumerate() {
        if conv.is_empty() || conv.len() > 1024 {
            return Err(Error::Config(format!(
                "conversation {i}: needs 1–1024 turns, has {}",
                conv.len()
            )));
        }
        let mut context = 0u64;
        for (k, &[n_in, n_out]) in conv.iter().enumerate() {
            if n_in == 0 || n_out == 0 {
                return Err(Error::Config(format!(
                    "conversation {i} turn {}: n_in and n_out must be ≥ 1",
                    k + 1
                )));
            }
            context += n_in as u64 + n_out as u64;
            if context > profile.max_model_len as u64 {
                return Err(Error::Config(format!(
                    "conversation {i} turn {}: context {context} tokens exceeds the engine's \
                     max_model_len {} (cut long conversations, e.g. --max-context)",
                    k + 1,
                    profile.max_model_len
                )));
            }
        }
        specs.push(conv.iter().map(|&[a, b]| (a, b)).collect());
    }
    Ok(specs)
}

/// Runs one point. `table` is needed by the `ppd` policy only.
pub fn simulate(
    cfg: &SimConfig,
    profile: &Profile,
    table: Option<&Table>,
) -> Result<SimResult, Error> {
    profile.validate()?;
    if !cfg.qps.is_finite() || cfg.qps <= 0.0 || cfg.qps > 10_000.0 {
        return Err(Error::Config(format!(
            "qps must be in (0, 10000], got {}",
            cfg.qps
        )));
    }
    if !cfg.duration_s.is_finite() || cfg.duration_s <= 0.0 || cfg.duration_s > 86_400.0 {
        return Err(Error::Config(format!(
            "duration must be in (0, 86400] s, got {}",
            cfg.duration_s
        )));
    }
    if !cfg.timeout_s.is_finite() || cfg.timeout_s <= 0.0 {
        return Err(Error::Config(format!(
            "timeout must be > 0 s, got {}",
            cfg.timeout_s
        )));
    }
    if cfg.turns == 0 || cfg.turns > 64 {
        return Err(Error::Config(format!(
            "turns must be 1–64, got {}",
            cfg.turns
        )));
    }
    if cfg.qps * cfg.duration_s > 1_000_000.0 {
        return Err(Error::Config(
            "qps × duration above 1,000,000 conversations".into(),
        ));
    }
    let specs = conversation_specs(cfg, profile)?;
    let roles = parse_sim_layout(&cfg.deployment)?;
    let kind = PolicyKind::parse(&cfg.policy)?;
    let table = match (kind, table) {
        (_, Some(t)) => t.clone(),
        (PolicyKind::Ppd, None) => {
            return Err(Error::Config(
                "policy ppd needs a lookup table (--table)".into(),
            ))
        }
        _ => placeholder_table()?,
    };
    if cfg.routers == 0 || cfg.routers > 64 {
        return Err(Error::Config(format!(
            "routers must be 1–64, got {}",
            cfg.routers
        )));
    }
    if !cfg.view_delay_s.is_finite() || !(0.0..=3600.0).contains(&cfg.view_delay_s) {
        return Err(Error::Config(format!(
            "view_delay must be in [0, 3600] s, got {}",
            cfg.view_delay_s
        )));
    }
    let weights = Weights::new(cfg.w_ttft, cfg.w_tpot)?;
    let replicas = (0..cfg.routers)
        .map(|_| {
            let router = DecisionEngine::new(table.clone(), kind, weights);
            router.set_cost_model(std::sync::Arc::new(ppd_core::CostModel::new(
                profile.clone(),
            )));
            router.set_slo(cfg.slo);
            Ok(Replica::new(
                router,
                QpsEstimator::new(10_000, 100)?,
                roles.len(),
            ))
        })
        .collect::<Result<Vec<_>, Error>>()?;
    let idx = |f: fn(Role) -> bool| -> Vec<usize> {
        roles
            .iter()
            .enumerate()
            .filter(|(_, r)| f(**r))
            .map(|(i, _)| i)
            .collect()
    };
    let ps = idx(|r| r == Role::P);
    let ds = idx(|r| r.decodes());
    let rs = idx(|r| r == Role::R);
    // New conversations split between replicas and the P/D pipeline by their
    // serving nodes; a deployment lacking P or D sends everything to replicas.
    let replica_share = if ps.is_empty() || ds.is_empty() {
        if rs.is_empty() {
            return Err(Error::Config(format!(
                "deployment {}: needs P and D nodes, or R nodes",
                cfg.deployment
            )));
        }
        1.0
    } else {
        rs.len() as f64 / (rs.len() + ds.len()) as f64
    };
    if !cfg.node_slowdown.is_finite() || !(0.01..=100.0).contains(&cfg.node_slowdown) {
        return Err(Error::Config(format!(
            "node_slowdown must be in [0.01, 100], got {}",
            cfg.node_slowdown
        )));
    }
    let mut node_profile = profile.clone();
    let st = &mut node_profile.step;
    for cost in [
        &mut st.overhead_ms,
        &mut st.per_token_ms,
        &mut st.per_seq_ms,
        &mut st.prefill_token_ms,
        &mut st.attn_ms_per_mpair,
        &mut st.decode_ctx_ms_per_ktoken,
    ] {
        *cost *= cfg.node_slowdown;
    }
    let nodes = roles
        .iter()
        .map(|_| Engine::new(&node_profile, false))
        .collect();
    let n = roles.len();
    let sim = Sim {
        cfg,
        p: profile,
        specs,
        replicas,
        roles,
        nodes,
        agenda: BinaryHeap::new(),
        on_agenda: vec![u64::MAX; n],
        names: node_names(n),
        inflight: vec![0; n],
        d_inflight: 0,
        placed: vec![0; n],
        placements: 0,
        over_bound: 0,
        t2_held: 0,
        t2_own_d: 0,
        t2_kv_found: 0,
        ps,
        ds,
        rs,
        replica_share,
        pulls: profile.link.pull,
        asks_pin: !cfg.whole_answers,
        events: Events::new(),
        next_id: 0,
        reqs: AHashMap::new(),
        convs: Vec::new(),
        queue: VecDeque::new(),
        in_flight: 0,
        open: 0,
        samples: Default::default(),
        sent: 0,
        failed: 0,
        out_tokens: 0,
        local: 0,
        pull: 0,
        pins_asked: 0,
        decided2: 0,
        last_done: 0.0,
        ev: Vec::new(),
        slo_met: [0, 0],
        sent2: 0,
        mean_out: 128.0,
        prediction_errors: Vec::new(),
    };
    sim.run()
}

/// Runs points on `threads` threads; results keep the order of `points`.
pub fn run_grid(
    points: &[SimConfig],
    profile: &Profile,
    table: Option<&Table>,
    threads: usize,
) -> Vec<Result<SimResult, Error>> {
    let threads = threads.clamp(1, 64).min(points.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut out: Vec<Option<Result<SimResult, Error>>> = (0..points.len()).map(|_| None).collect();
    let slots = std::sync::Mutex::new(&mut out);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= points.len() {
                    break;
                }
                let r = simulate(&points[i], profile, table);
                if let Ok(mut o) = slots.lock() {
                    o[i] = Some(r);
                }
            });
        }
    });
    out.into_iter()
        .map(|r| r.unwrap_or_else(|| Err(Error::Config("grid worker failed".into()))))
        .collect()
}

#[cfg(test)]
mod golden;
#[cfg(test)]
mod tests;
