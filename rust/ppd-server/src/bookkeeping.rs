//! The end of a request: the session update, latencies, KV accounting and node health, recorded once per answer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use ppd_core::session::TurnRecord;
use ppd_core::{Path, Role, Route};

use crate::metrics::{ErrorLabels, PathLabel, RequestLabels};
use crate::registry::Node;
use crate::sse::Usage;
use crate::state::AppState;

/// How long before a pin's end the router stops naming it: vLLM's P declines
/// a read within 5 s of it (`_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`).
const PIN_SAFETY_MARGIN_MS: u64 = 5_000;

/// Marks a response already counted in `ppd_requests_total` (a routed request).
#[derive(Clone, Copy)]
pub struct Counted;

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
    pub turn: u32,
    pub n_in: u32,
    pub route: Route,
    pub p: Option<Arc<Node>>,
    pub d: Arc<Node>,
    pub started: Instant,
}

impl Ticket {
    pub fn count(&self, status: u16) {
        count(&self.state, &self.route, status);
    }

    /// A node call failed after the answer began (a broken or silent stream).
    pub fn fail(&self, kind: &'static str) {
        let st = &self.state;
        upstream_error(st, self.d.role, kind);
        st.registry.record_failure(&self.d, st.now_ms());
        self.count(502);
    }

    /// A bidirectional D named the blocks it pins for this turn: the next
    /// turn may pull them (until vLLM's safety margin before the pin's TTL).
    pub fn record_pin(&self, params: &serde_json::Value) {
        let st = &self.state;
        let now = st.now_ms();
        let ttl_ms = (st.cfg.decoder_kv_blocks_ttl * 1000.0) as u64;
        let expires = now + ttl_ms.saturating_sub(PIN_SAFETY_MARGIN_MS);
        let d = (self.d.id, self.d.load.epoch());
        if let Some(h) = crate::pull::handle_of(params, d, expires) {
            st.pulls.record(&self.conv, h);
        }
    }

    /// A complete answer: session, latencies, KV accounting, node health.
    pub fn finish(&self, usage: Option<Usage>, first_token: Option<Instant>, end: Instant) {
        let st = &self.state;
        let record = TurnRecord {
            turn: self.turn,
            p: self.p.as_ref().map(|p| p.id),
            d: self.d.id,
            d_epoch: self.d.load.epoch(),
            usage: usage.map(|u| (u.prompt_tokens, u.completion_tokens)),
        };
        let (_, before) = st.sessions.record_turn(&self.conv, st.now_ms(), &record);
        if before != Some(self.d.id) {
            self.d.sessions.fetch_add(1, Ordering::Relaxed);
        }
        st.registry.record_success(&self.d);
        let path = PathLabel {
            path: self.route.path.as_str(),
        };
        if let Some(ft) = first_token {
            st.metrics
                .ttft
                .get_or_create(&path)
                .observe((ft - self.started).as_secs_f64());
            if let Some(u) = usage.filter(|u| u.completion_tokens > 1) {
                let tpot = (end - ft).as_secs_f64() / f64::from(u.completion_tokens - 1);
                st.metrics.tpot.get_or_create(&path).observe(tpot);
            }
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
        self.count(200);
    }
}
