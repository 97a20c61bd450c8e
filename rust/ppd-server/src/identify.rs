//! Identity and features of a request: which conversation, which turn, how many tokens in and out, at what arrival rate.

use axum::http::HeaderMap;

use ppd_core::identity::{conversation_id, features, Features, History, IdHints, IdSource};
use ppd_core::prompt::request_ids;
use ppd_core::request::RequestView;
use ppd_core::session::Session;

use ppd_core::Role;

use crate::config::Placement;
use crate::kv_subscriber::Mode;
use crate::metrics::AdoptionLabel;
use crate::state::AppState;

pub const SESSION_HEADER: &str = "x-session-id";

/// What the route step knows of a request before deciding.
pub(crate) struct Identified {
    pub conv: String,
    /// Where `conv` came from: a client's id, or the router's key.
    pub source: IdSource,
    /// The hashes of a chat's messages (`None` for a plain prompt).
    pub history: Option<History>,
    /// The request continues the history its session's last turn ended with
    /// (or nothing says otherwise). A conversation keyed by its history
    /// always does: its key is that history.
    pub prefix_ok: bool,
    pub features: Features,
    /// The router's live session of the conversation, if any.
    pub session: Option<Session>,
    /// Conversations arriving per second (the table's QPS axis).
    pub qps: f64,
    /// The prompt's token ids as the session's D computes them, when that D's
    /// KV events let the route step match them exactly (Turn 2+ only).
    pub prompt_ids: Option<Vec<u64>>,
    /// Where the conversation places among decoding nodes: the same key at
    /// every turn and in every router replica.
    pub placement_key: u64,
}

/// How a later turn without a session here found its D (rendezvous placement only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Adoption {
    /// The node whose KV events show the longest part of its prompt.
    Residency,
    /// No node's events say: the node its key places it on.
    Placement,
}

impl Adoption {
    pub fn as_str(self) -> &'static str {
        match self {
            Adoption::Residency => "residency",
            Adoption::Placement => "placement",
        }
    }
}

/// Names the conversation and derives its features; a Turn 1 counts as an
/// arrival for the QPS estimate.
pub(crate) fn identify(
    st: &AppState,
    headers: &HeaderMap,
    view: &RequestView<'_>,
) -> Result<Identified, ppd_core::Error> {
    let hints = IdHints {
        headers: IdSource::HEADERS.map(|src| {
            src.header_name()
                .and_then(|name| headers.get(name))
                .and_then(|v| v.to_str().ok())
        }),
        from_user: st.cfg.session_from_user,
    };
    let conv = conversation_id(hints, view)?;
    let now = st.now_ms();
    let mut session = st.sessions.get(&conv.id, now);
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
    } + st.shared.as_ref().map_or(0.0, |s| s.fleet.others_rate());
    let placement_key = conv.placement_key();
    let mut prompt_ids = exact_prompt_ids(st, view, session.as_ref())?;
    // Under rendezvous placement other replicas serve turns too: a session
    // that missed the turns before this one knows neither where they ran
    // nor the history they ended with.
    let stale = session.is_some_and(|s| features.turn > s.turns + 1);
    if (session.is_none() || stale)
        && features.turn > 1
        && st.cfg.placement == Placement::Rendezvous
    {
        let a = adopt(
            st,
            view,
            prompt_ids.take(),
            placement_key,
            features.turn,
            now,
        )?;
        if a.session.is_some() {
            st.metrics
                .sessions_adopted
                .get_or_create(&AdoptionLabel { by: a.by.as_str() })
                .inc();
        }
        session = a.session;
        prompt_ids = a.prompt_ids;
    }
    let prefix_ok = continues(conv.source, conv.history, session.as_ref());
    Ok(Identified {
        conv: conv.id,
        source: conv.source,
        history: conv.history,
        prefix_ok,
        features,
        session,
        qps,
        prompt_ids,
        placement_key,
    })
}

/// A later turn that another router replica (or this one, before its
/// session aged out) placed: the session its D implies. The nodes' KV
/// events say exactly where its prompt is cached; without them the node
/// its key places on is where every replica put its first turn (unless
/// that node was full then). The adopted session knows the D only: the
/// features stay estimated, as for a session with no usage yet. `rendered`:
/// the prompt's ids if they were rendered already (for a stale session).
fn adopt(
    st: &AppState,
    view: &RequestView<'_>,
    rendered: Option<Vec<u64>>,
    key: u64,
    turn: u32,
    now: u64,
) -> Result<Adopted, ppd_core::Error> {
    let decoding = [Role::D, Role::PD];
    let ids = match (rendered, st.renderer.as_deref()) {
        (Some(ids), _) => Some(ids),
        (None, Some(r)) if st.registry.any_exact(&decoding, now) => Some(request_ids(view, r)?),
        (None, _) => None,
    };
    let held = ids
        .as_deref()
        .and_then(|ids| st.registry.holding(&decoding, ids, now));
    let (d, how) = match held {
        Some((d, _)) => (Some(d), Adoption::Residency),
        None => (
            st.registry.placed(&decoding, key, &[], now, 0, false),
            Adoption::Placement,
        ),
    };
    let session = d.as_ref().map(|d| {
        let mut s = Session::new(now);
        s.turns = turn - 1;
        s.d = Some(d.id);
        s.d_epoch = d.load.epoch();
        s
    });
    // The ids match only an exact D's cache; a D placed blind reads them as
    // nothing cached, which is what its silence says.
    let ids = ids.filter(|_| d.as_ref().is_some_and(|d| d.kv.mode() == Mode::Exact));
    Ok(Adopted {
        session,
        prompt_ids: ids,
        by: how,
    })
}

/// What [`adopt`] found: the session, the prompt's ids where they match
/// its D's cache, and how.
struct Adopted {
    session: Option<Session>,
    prompt_ids: Option<Vec<u64>>,
    by: Adoption,
}

/// Whether a named conversation's request presents the history its last
/// answer ended (or the one that turn continued, for a regeneration).
fn continues(source: IdSource, history: Option<History>, session: Option<&Session>) -> bool {
    match (history.and_then(|h| h.prefix), session) {
        (Some(prefix), Some(s)) if source.is_explicit() => s.expected.admits(prefix.short()),
        _ => true,
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use ppd_core::identity::ContentHasher;
    use ppd_core::request::{parse_request, ContentText};
    use ppd_core::session::Expected;

    fn history(body: &str) -> History {
        History::of(parse_request(body).unwrap().messages.as_deref().unwrap()).unwrap()
    }

    #[test]
    fn an_edited_history_does_not_continue_a_named_session() {
        let t1 = history(r#"{"messages":[{"role":"user","content":"q"}]}"#);
        let answer = ContentHasher::of(&ContentText::One("a".into()));
        let mut s = Session::new(0);
        s.expected = Expected {
            next: t1.whole.answered(answer).short(),
            previous: 0,
        };
        let same = history(
            r#"{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"r"}]}"#,
        );
        let edited = history(
            r#"{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a, edited"},{"role":"user","content":"r"}]}"#,
        );
        let named = IdSource::SessionHeader;
        assert!(continues(named, Some(same), Some(&s)));
        assert!(!continues(named, Some(edited), Some(&s)));
        // Keyed by its history, a request is its own check; nothing recorded, nothing to check.
        assert!(continues(IdSource::History, Some(edited), Some(&s)));
        assert!(continues(named, Some(edited), Some(&Session::new(0))));
    }
}
