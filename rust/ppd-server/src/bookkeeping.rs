//! The end of a request: the session update, latencies, KV accounting and node health, recorded once per answer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use ppd_core::identity::{History, IdSource};
use ppd_core::session::{Expected, NodeId, TurnRecord};
use ppd_core::{DecisionInput, Path, Role, Route};

use crate::metrics::{ErrorLabels, RequestLabels};
use crate::registry::Node;
use crate::sse::Usage;
use crate::state::AppState;
use crate::trail::{ConvHash, Line, Trail};

/// Marks a response already counted in `ppd_requests_total` (a routed request).
#[derive(Clone, Copy)]
pub struct Counted;

/// Marks an answer whose [`Ticket`] writes the request's log line when the
/// answer ends (a stream ends after the handler returned).
#[derive(Clone, Copy)]
pub struct Ticketed;

/// Counts one routed request's outcome.
pub(crate) fn count(st: &AppState, route: &Route, status: u16) {
    st.metrics
        .requests
        .get_or_create(&RequestLabels {
            path: route.path.as_str(),
            reason: route.reason.as_str(),
            status,
        })
        .inc();
}

/// A routed request's final answer, counted under its route once.
pub(crate) fn counted(
    st: &AppState,
    route: &Route,
    mut resp: axum::response::Response,
) -> axum::response::Response {
    resp.extensions_mut().insert(Counted);
    // For the request's log line.
    resp.extensions_mut().insert(*route);
    count(st, route, resp.status().as_u16());
    resp
}

/// Counts a failure of a node call by the node's role and the failure's kind.
pub(crate) fn upstream_error(st: &AppState, role: Role, kind: &'static str) {
    st.metrics
        .upstream_errors
        .get_or_create(&ErrorLabels {
            role: role.as_str(),
            kind,
        })
        .inc();
}

/// What bookkeeping needs once the answer is complete.
pub(crate) struct Ticket {
    pub state: Arc<AppState>,
    pub conv: String,
    /// Where `conv` came from: a client's id, or the router's key.
    pub source: IdSource,
    /// The request's history hashes (a chat), to which the answer adds the
    /// next turn's.
    pub history: Option<History>,
    pub turn: u32,
    pub n_in: u32,
    pub route: Route,
    /// What the route was decided on (its live view scores the prediction).
    pub decided: DecisionInput,
    pub p: Option<Arc<Node>>,
    pub d: Arc<Node>,
    pub trail: Arc<Trail>,
    /// The `model_name` the latencies are labelled with ([`model_name`]).
    pub model: String,
}

/// The model a request's latencies are labelled with: the one it names when
/// a node serves it, the nodes' only model when it names none, else
/// `unknown` (a client's free text never becomes a label value).
pub(crate) fn model_name(st: &AppState, asked: Option<&str>) -> String {
    let models = st.models.load();
    let id = |m: &serde_json::Value| m.get("id").and_then(|v| v.as_str()).map(str::to_owned);
    match asked {
        Some(a) => models
            .iter()
            .filter_map(id)
            .find(|m| m == a)
            .unwrap_or_else(|| "unknown".into()),
        None if models.len() == 1 => id(&models[0]).unwrap_or_else(|| "unknown".into()),
        None => "unknown".into(),
    }
}

impl Ticket {
    /// The request's end: counted under its route and logged in its one line.
    pub fn settle(&self, status: u16, first_token: Option<Instant>) {
        count(&self.state, &self.route, status);
        Line {
            trail: &self.trail,
            conv: Some(ConvHash::of(&self.conv)),
            turn: Some(self.turn),
            route: Some(&self.route),
            p: self.p.as_deref(),
            d: Some(&self.d),
            status,
            ttft: first_token.map(|t| t - self.trail.started),
        }
        .emit();
    }

    /// A node call failed after the answer began (a broken or silent stream).
    pub fn fail(&self, kind: &'static str, first_token: Option<Instant>) {
        let st = &self.state;
        upstream_error(st, self.d.role, kind);
        st.registry.record_failure(&self.d, st.now_ms());
        self.settle(502, first_token);
    }

    /// A bidirectional D named the blocks it pins for this turn: the next
    /// turn may pull them (until vLLM's safety margin before the pin's TTL),
    /// under the key that turn will present. `answer` is the digest of this
    /// turn's answer (a history-keyed conversation's next key needs it).
    pub fn record_pin(&self, params: &serde_json::Value, answer: Option<u128>) {
        let st = &self.state;
        let next = if self.source.is_explicit() {
            Some(self.conv.clone())
        } else {
            self.history
                .zip(answer)
                .map(|(h, a)| h.whole.answered(a).key())
        };
        let Some(key) = next else { return };
        let expires = crate::pull::pin_expiry(st.now_ms(), st.cfg.decoder_kv_blocks_ttl);
        let d = (self.d.id, self.d.load.epoch());
        if let Some(h) = crate::pull::handle_of(params, d, expires) {
            st.pulls.record(&key, h);
        }
    }

    /// Scores the cost model's prediction for the path taken against what
    /// happened (TTFT, and TPOT when more than one token came), so later
    /// predictions on its nodes are corrected.
    fn correct_prediction(&self, ttft_ms: f64, tpot_ms: Option<f64>) {
        let (Some(live), Some(m)) = (self.decided.live, self.state.engine.cost_model()) else {
            return;
        };
        let i = &self.decided;
        m.observe(self.route.path, i.n_ctx, i.n_in, &live, ttft_ms, tpot_ms);
    }

    /// A complete answer: session, latencies, KV accounting, node health.
    /// `answer` is the digest of the answer's text (a chat's).
    pub fn finish(
        &self,
        usage: Option<Usage>,
        answer: Option<u128>,
        first_token: Option<Instant>,
        end: Instant,
    ) {
        let st = &self.state;
        self.record_session(usage, answer, Outcome::Answered);
        st.registry.record_success(&self.d);
        let path = self.route.path.as_str();
        let m = &st.metrics;
        m.e2e
            .observe(path, &self.model, (end - self.trail.started).as_secs_f64());
        if let Some(ft) = first_token {
            let ttft = (ft - self.trail.started).as_secs_f64();
            m.ttft.observe(path, &self.model, ttft);
            let tpot = usage
                .filter(|u| u.completion_tokens > 1)
                .map(|u| (end - ft).as_secs_f64() / f64::from(u.completion_tokens - 1));
            if let Some(tpot) = tpot {
                m.tpot.observe(path, &self.model, tpot);
            }
            self.correct_prediction(ttft * 1000.0, tpot.map(|t| t * 1000.0));
        }
        if let Some(u) = usage {
            let per_token = st.cfg.kv_bytes_per_token;
            match self.route.path {
                Path::Pd if st.connector.moves_kv() => {
                    st.metrics
                        .kv_bytes_moved
                        .inc_by(u64::from(u.prompt_tokens) * per_token);
                }
                Path::Local => {
                    let cached = u.prompt_tokens.saturating_sub(self.n_in);
                    st.metrics
                        .kv_bytes_avoided
                        .inc_by(u64::from(cached) * per_token);
                }
                // P hands D only the new tokens' KV (the read from D is
                // counted in kv_bytes_pulled).
                Path::Pull => {
                    st.metrics
                        .kv_bytes_moved
                        .inc_by(u64::from(self.n_in) * per_token);
                }
                _ => {}
            }
        }
        self.settle(200, first_token);
    }

    /// The client left mid-stream, after D's first token: D computed the
    /// prompt, so its prefix cache holds the conversation and the session
    /// keeps it (what the client kept of the answer is unknown: `answer` is
    /// the digest of the text relayed so far).
    pub fn abort(&self, answer: Option<u128>, first_token: Option<Instant>) {
        self.record_session(None, answer, Outcome::Aborted);
        self.settle(499, first_token);
    }

    /// Records the turn where the next one will look: under the client's id
    /// (with the history it should present next), or, for a conversation
    /// keyed by its history, under the key it presented (a retry finds it)
    /// and under the key of its history plus this answer.
    fn record_session(&self, usage: Option<Usage>, answer: Option<u128>, outcome: Outcome) {
        let st = &self.state;
        let now = st.now_ms();
        let next = self.history.zip(answer).map(|(h, a)| h.whole.answered(a));
        let mut record = TurnRecord {
            turn: self.turn,
            p: self.p.as_ref().map(|p| p.id),
            d: self.d.id,
            d_epoch: self.d.load.epoch(),
            usage: usage.map(|u| (u.prompt_tokens, u.completion_tokens)),
            expected: Expected::default(),
        };
        let before = if self.source.is_explicit() {
            if outcome == Outcome::Answered {
                record.expected = Expected {
                    next: next.map_or(0, |h| h.short()),
                    previous: self.history.and_then(|h| h.prefix).map_or(0, |h| h.short()),
                };
            }
            st.sessions.record_turn(&self.conv, now, &record).1
        } else {
            // An opening was never looked up and never will be: only the key
            // after its answer is worth an entry.
            let presented = (self.source != IdSource::Opening)
                .then(|| st.sessions.record_turn(&self.conv, now, &record));
            if let Some(next) = next {
                match presented {
                    Some((s, _)) => {
                        st.sessions.put(&next.key(), now, s);
                    }
                    None => {
                        st.sessions.record_turn(&next.key(), now, &record);
                    }
                }
            }
            presented.and_then(|(_, before)| before)
        };
        self.count_session_on_d(before);
    }

    /// A conversation whose KV moved to this D counts as one more of its sessions.
    fn count_session_on_d(&self, before: Option<NodeId>) {
        if before != Some(self.d.id) {
            self.d.sessions.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Answered,
    Aborted,
}
