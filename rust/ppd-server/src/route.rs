//! The route step: the one place where a request's path, its P and D, and every veto are chosen.
//!
//! [`plan`] asks the decision engine for the path (Turn 1, no session, D
//! unavailable or overloaded, the policy) and places it on nodes;
//! [`prefill_node`] picks the P of each prefill attempt; [`without_holder`]
//! routes again when the session's pD turned out unreachable.

use std::sync::Arc;

use ppd_core::identity::hash_id;
use ppd_core::session::NodeId;
use ppd_core::{DecisionInput, Path, Role, Route};

use crate::identify::Identified;
use crate::registry::Node;
use crate::state::AppState;

/// A decided route and the nodes it runs on.
pub(crate) struct Plan {
    pub route: Route,
    /// What the engine decided on, kept for a second decision.
    input: DecisionInput,
    pub target: Target,
}

pub(crate) enum Target {
    /// Append-prefill on the session's pD.
    Local(Arc<Node>),
    Replica(Arc<Node>),
    /// A P (chosen per attempt by [`prefill_node`]) prefills, this node decodes.
    Pd(Arc<Node>),
    /// No node can serve the path: why.
    Unavailable(&'static str),
}

/// Decides the path of an identified request and places it.
pub(crate) fn plan(
    st: &AppState,
    id: &Identified,
    started: std::time::Instant,
) -> Result<Plan, ppd_core::Error> {
    let now = st.now_ms();
    let f = &id.features;
    let holder = id
        .session
        .and_then(|s| s.d)
        .and_then(|n| st.registry.get(n));
    let input = DecisionInput {
        turn: f.turn,
        n_in: f.n_in,
        n_out: f.n_out,
        n_ctx: f.n_ctx,
        qps: id.qps,
        conv_hash: hash_id(&id.conv),
        has_session: id.session.is_some_and(|s| s.d.is_some()),
        d_available: holder.as_ref().is_some_and(|n| n.available(now)),
        d_overloaded: holder.as_ref().is_some_and(|n| {
            st.cfg.overload_inflight > 0 && n.inflight() >= st.cfg.overload_inflight
        }),
        d_local_capable: holder.as_ref().is_some_and(|n| n.role.local_capable()),
        replica_share: st.replica_share(),
        session_on_replica: holder.as_ref().is_some_and(|n| n.role == Role::R),
    };
    let route = st.engine.decide(&input)?;
    st.metrics.decision.observe(started.elapsed().as_secs_f64());
    let cell = route.scored.map(|s| {
        let table = st.engine.table();
        let (c, w, q) = table.describe(s.cell_at);
        (c.to_owned(), w.to_owned(), q)
    });
    st.record_decision(route.path, route.reason, cell);
    tracing::debug!(conv = %id.conv, turn = f.turn, path = route.path.as_str(), reason = route.reason.as_str(), "route");
    Ok(Plan {
        route,
        input,
        target: place(st, route.path, holder, now),
    })
}

/// Routes again after the session's pD refused the connection: the engine
/// decides knowing that D is gone (`d_unavailable`), so never `local`.
pub(crate) fn without_holder(st: &AppState, before: &Plan) -> Result<Plan, ppd_core::Error> {
    let input = DecisionInput {
        d_available: false,
        ..before.input
    };
    let route = st.engine.decide(&input)?;
    st.record_decision(route.path, route.reason, None);
    Ok(Plan {
        route,
        input,
        target: place(st, route.path, None, st.now_ms()),
    })
}

/// The nodes of a path: the session's node where it can serve, else the
/// least loaded node of the path's roles.
fn place(st: &AppState, path: Path, holder: Option<Arc<Node>>, now: u64) -> Target {
    let least_loaded = |roles: &[Role]| st.registry.least_loaded(roles, &[], now);
    match path {
        Path::Local => holder.map_or(
            Target::Unavailable("the session's decode node is gone"),
            Target::Local,
        ),
        Path::Replica => holder
            .filter(|n| n.role == Role::R && n.available(now))
            .or_else(|| least_loaded(&[Role::R]))
            .map_or(
                Target::Unavailable("no healthy replica node"),
                Target::Replica,
            ),
        Path::Pd => holder
            .filter(|n| n.role.decodes() && n.available(now))
            .or_else(|| least_loaded(&[Role::D, Role::PD]))
            .map_or(Target::Unavailable("no healthy decode node"), Target::Pd),
    }
}

/// The P of the next prefill attempt: the least loaded available P not yet tried.
pub(crate) fn prefill_node(st: &AppState, tried: &[NodeId]) -> Option<Arc<Node>> {
    st.registry.least_loaded(&[Role::P], tried, st.now_ms())
}
