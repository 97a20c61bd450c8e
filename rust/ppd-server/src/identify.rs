//! Identity and features of a request: which conversation, which turn, how many tokens in and out, at what arrival rate.

use axum::http::HeaderMap;

use ppd_core::identity::{conversation_id, features, Features};
use ppd_core::request::RequestView;
use ppd_core::session::Session;

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
    Ok(Identified {
        conv: conv.id,
        features,
        session,
        qps,
    })
}
