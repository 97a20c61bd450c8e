//! Identity and features of a request: which conversation, which turn, how many tokens in and out, at what arrival rate.

use axum::http::HeaderMap;

use ppd_core::identity::{conversation_id, features, Features};
use ppd_core::prompt::request_ids;
use ppd_core::request::RequestView;
use ppd_core::session::Session;

use crate::kv_subscriber::Mode;
use crate::state::AppState;

pub const SESSION_HEADER: &str = "x-session-id";

/// What the route step knows of a request before deciding.
pub(crate) struct Identified {
    pub conv: String,
    pub features: Features,
    /// The router's live session of the conversation, if any.
    pub session: Option<Session>,
    /// Conversations arriving per second (the table's QPS axis).
    pub qps: f64,
    /// The prompt's token ids as the session's D computes them, when that D's
    /// KV events let the route step match them exactly (Turn 2+ only).
    pub prompt_ids: Option<Vec<u64>>,
}

/// Names the conversation and derives its features; a Turn 1 counts as an
/// arrival for the QPS estimate.
pub(crate) fn identify(
    st: &AppState,
    headers: &HeaderMap,
    view: &RequestView<'_>,
) -> Result<Identified, ppd_core::Error> {
    let header_id = headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok());
    let conv = conversation_id(header_id, view)?;
    let now = st.now_ms();
    let session = st.sessions.get(&conv.id, now);
    let table = st.engine.table();
    let features = features(
        view,
        st.counter.as_ref(),
        session.as_ref(),
        table.default_n_out(),
    )?;
    let qps = {
        let mut q = st.qps.lock();
        if features.turn == 1 {
            q.record(now);
        }
        q.rate(now)
    };
    let prompt_ids = exact_prompt_ids(st, view, session.as_ref())?;
    Ok(Identified {
        conv: conv.id,
        features,
        session,
        qps,
        prompt_ids,
    })
}

/// Renders the prompt only where it pays: a session whose D reports its
/// cache through KV events, and a renderer that computes what D computes.
fn exact_prompt_ids(
    st: &AppState,
    view: &RequestView<'_>,
    session: Option<&Session>,
) -> Result<Option<Vec<u64>>, ppd_core::Error> {
    let Some(renderer) = st.renderer.as_deref() else {
        return Ok(None);
    };
    let exact_d = session
        .and_then(|s| s.d)
        .and_then(|d| st.registry.get(d))
        .is_some_and(|n| n.kv.mode() == Mode::Exact);
    if !exact_d {
        return Ok(None);
    }
    request_ids(view, renderer).map(Some)
}
