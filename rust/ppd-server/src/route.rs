//! The route step: the one place where a request's path, its P and D, and every veto are chosen.
//!
//! [`plan`] asks the decision engine for the path (Turn 1, no session, D
//! unavailable or overloaded, the policy), places it on nodes — taking the
//! pull path's handle on D's pin — and vetoes the pd path's prefill when no P
//! is available (`p_unavailable`);
//! [`prefill_node`] picks the P of each prefill attempt; [`after_failure`]
//! and [`without_prefill`] make the one retry a request gets when a node
//! failed before anything reached the client.

use std::sync::Arc;

use ppd_core::identity::hash_id;
use ppd_core::session::NodeId;
use ppd_core::{DecisionInput, LiveView, NodeView, Path, Reason, Residency, Role, Route};

use crate::config::Placement;
use crate::identify::Identified;
use crate::load::Work;
use crate::pull::Handle;
use crate::registry::Node;
use crate::state::AppState;

/// A decided route and the nodes it runs on.
pub(crate) struct Plan {
    pub route: Route,
    /// What the engine decided on, kept for a second decision.
    input: DecisionInput,
    /// The conversation's placement key, kept to place a retry alike.
    placement_key: u64,
    pub target: Target,
}

pub(crate) enum Target {
    /// Append-prefill on the session's pD.
    Local(Arc<Node>),
    Replica(Arc<Node>),
    /// A P (chosen per attempt by [`prefill_node`]) prefills, this node decodes.
    Pd(Arc<Node>),
    /// A P reads the conversation's KV back from this node's pin, prefills
    /// the new tokens, and this node decodes.
    Pull(Arc<Node>, Pin),
    /// This node computes the whole prompt itself: no P can prefill (or the
    /// KV protocol has none).
    Direct(Arc<Node>),
    /// No node can serve the path: why.
    Unavailable(&'static str),
}

/// The pin a pull reads.
pub(crate) enum Pin {
    /// Named by D's last whole answer (the handle, used once).
    Held(Box<Handle>),
    /// None named (the last answer streamed): asked of D first (pin.rs).
    Ask,
}

impl Plan {
    /// What the decision was made on.
    pub fn input(&self) -> &DecisionInput {
        &self.input
    }

    /// What the plan puts on its decoding node, for the load figures: the
    /// prompt tokens it computes there, the tokens it decodes, the KV a P
    /// hands it.
    pub fn decoder_work(&self, kv_bytes_per_token: u64, moves_kv: bool) -> Work {
        let i = &self.input;
        let whole = i.n_in.saturating_add(i.n_ctx);
        let (prompt_tokens, kv_bytes) = match self.target {
            Target::Local(_) => (i.n_in, 0),
            Target::Replica(_) if i.session_on_replica => (i.n_in, 0),
            Target::Pd(_) if moves_kv => (0, u64::from(whole) * kv_bytes_per_token),
            Target::Pd(_) => (0, 0),
            // D already holds the context; only the new tokens' KV comes back.
            Target::Pull(..) => (0, u64::from(i.n_in) * kv_bytes_per_token),
            Target::Replica(_) | Target::Direct(_) | Target::Unavailable(_) => (whole, 0),
        };
        Work {
            prompt_tokens,
            decode_tokens: i.n_out,
            context_tokens: whole,
            kv_bytes,
        }
    }

    /// What the plan's prefill puts on its P: the whole prompt, or on the
    /// pull path the new tokens (and the context's KV read from D).
    pub fn prefill_work(&self, kv_bytes_per_token: u64) -> Work {
        let i = &self.input;
        match &self.target {
            Target::Pull(_, pin) => Work {
                prompt_tokens: i.n_in,
                kv_bytes: u64::from(match pin {
                    Pin::Held(h) => h.tokens,
                    Pin::Ask => i.n_ctx,
                }) * kv_bytes_per_token,
                ..Work::default()
            },
            _ => Work {
                prompt_tokens: i.n_in.saturating_add(i.n_ctx),
                ..Work::default()
            },
        }
    }
}

impl Target {
    /// The node that decodes (and so holds the request's room), if any.
    pub fn decoder(&self) -> Option<&Arc<Node>> {
        match self {
            Target::Local(n)
            | Target::Replica(n)
            | Target::Pd(n)
            | Target::Pull(n, _)
            | Target::Direct(n) => Some(n),
            Target::Unavailable(_) => None,
        }
    }
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
        d_overloaded: holder.as_ref().is_some_and(|n| overloaded(st, n, now)),
        residency: residency(id, holder.as_deref()),
        prefix_ok: id.prefix_ok,
        d_local_capable: holder.as_ref().is_some_and(|n| n.role.local_capable()),
        replica_share: st.replica_share(),
        session_on_replica: holder.as_ref().is_some_and(|n| n.role == Role::R),
        pull_ready: st.cfg.bidirectional_kv_xfer
            && holder.as_ref().is_some_and(|n| {
                asks_pin(id, n) || st.pulls.ready(&id.conv, (n.id, n.load.epoch()), now)
            }),
        live: None,
    };
    let input = DecisionInput {
        live: holder
            .as_deref()
            .filter(|_| f.turn > 1 && st.engine.policy().sees_load())
            .map(|d| live_view(st, &input, id, d, now)),
        ..input
    };
    let route = st.engine.decide(&input)?;
    st.metrics.decision.observe(started.elapsed().as_secs_f64());
    let cell = route.scored.map(|s| {
        let table = st.engine.table();
        let (c, w, q) = table.describe(s.cell_at);
        (c.to_owned(), w.to_owned(), q)
    });
    let pin = PinLookup {
        conv: &id.conv,
        ask: holder.as_ref().is_some_and(|n| asks_pin(id, n)),
    };
    let mut plan = placed(st, route, input, holder, pin, id.placement_key, &[]);
    if let (1, Target::Pd(d)) = (f.turn, &plan.target) {
        if st.engine.policy().predicts() {
            // A Turn 1 is a pd prefill on P: its TTFT teaches P's
            // corrections before any Turn 2 asks for them.
            plan.input.live = Some(live_view(st, &plan.input, id, d, now));
        }
    }
    let route = plan.route;
    st.record_decision(route.path, route.reason, cell);
    // The conversation as a hash, as in the request's line: a client's id stays out of the log.
    tracing::debug!(conversation = %crate::trail::ConvHash::of(&id.conv), turn = f.turn, path = route.path.as_str(), reason = route.reason.as_str(), "route");
    Ok(plan)
}

/// What the decision sees of the session's D and of the P the pd and pull
/// paths would use: the router's own work on them, their last scrape, and
/// the prompt tokens each holds.
fn live_view(
    st: &AppState,
    input: &DecisionInput,
    id: &Identified,
    d: &Node,
    now: u64,
) -> LiveView {
    let stale = crate::load::stale_after_ms(st.cfg.load_interval);
    let budget = st
        .engine
        .cost_model()
        .map_or(0, |m| m.profile().max_num_batched_tokens);
    let p = prefill_node(st, &[]);
    let d_cached = match input.residency {
        Residency::Cached(t) => t,
        Residency::Lost => 0,
        // The session vouches for the context.
        Residency::Unknown => input.n_ctx,
    };
    let p_cached = match (&p, &id.prompt_ids) {
        (Some(p), Some(ids)) => p.kv.cached_prefix_tokens(ids),
        _ => 0,
    };
    let dl = d.load_snapshot(now, stale);
    LiveView {
        d: node_view(d, &dl, budget),
        p: p.as_deref()
            .map(|p| node_view(p, &p.load_snapshot(now, stale), budget)),
        d_cached,
        p_cached,
        mean_out_tokens: dl.mean_out_harmonic().unwrap_or(f64::from(input.n_out)),
        pull_asks_pin: asks_pin(id, d) && !st.pulls.ready(&id.conv, (d.id, d.load.epoch()), now),
        at_risk: d.load.at_risk(now),
    }
}

/// One node's load as the cost model reads it. The router knows its own
/// requests exactly; a fresh scrape adds what other clients run there. The
/// prompt work still queued is the router's in-flight prompt tokens on a P
/// (its requests end with their prefill), and on a decoding node their
/// share of the requests the node reports waiting.
fn node_view(n: &Node, l: &crate::load::LoadSnapshot, token_budget: u32) -> NodeView {
    let ours = l.inflight.max(1);
    let (running, waiting) = match l.scraped {
        Some(s) => (s.running.max(0.0) as u32, s.waiting.max(0.0) as u32),
        None => (l.inflight, 0),
    };
    let queued = if n.role == Role::P {
        l.prompt_tokens
    } else {
        l.prompt_tokens * u64::from(waiting.min(ours)) / u64::from(ours)
    };
    NodeView {
        node: n.id.get(),
        running: if n.role == Role::P { 0 } else { running },
        decode_ctx_tokens: l.context_tokens / u64::from(ours) * u64::from(running),
        queued_prefill_tokens: queued,
        waiting,
        link_bytes: 0,
        kv_usage: l.scraped.map_or(0.0, |s| s.kv_usage),
        token_budget,
    }
}

/// Whether a pD is too busy for an append-prefill: the router's own requests
/// on it, or what the node itself reports waiting or holding in KV.
fn overloaded(st: &AppState, n: &Node, now_ms: u64) -> bool {
    let cfg = &st.cfg;
    let load = n.load_snapshot(now_ms, crate::load::stale_after_ms(cfg.load_interval));
    let by_router = cfg.overload_inflight > 0 && load.inflight >= cfg.overload_inflight;
    let by_node = load.scraped.is_some_and(|s| {
        (cfg.overload_waiting > 0 && s.waiting >= f64::from(cfg.overload_waiting))
            || (cfg.overload_kv_usage > 0.0 && s.kv_usage >= cfg.overload_kv_usage)
    });
    by_router || by_node
}

/// What the session's D still holds: lost when its cache epoch moved on
/// since the conversation's last turn there (it restarted or was cleared);
/// else, where its KV events are live, exactly the prompt's cached leading
/// tokens; else unknown (the session alone vouches for it).
fn residency(id: &Identified, holder: Option<&Node>) -> Residency {
    match (id.session, holder) {
        (Some(s), Some(d)) if s.d == Some(d.id) && s.d_epoch != d.load.epoch() => Residency::Lost,
        (Some(s), Some(d)) if s.d == Some(d.id) => match &id.prompt_ids {
            Some(ids) => Residency::Cached(d.kv.cached_prefix_tokens(ids)),
            None => Residency::Unknown,
        },
        _ => Residency::Unknown,
    }
}

/// Routes again after `failed` failed before the first byte reached the
/// client. A local turn goes through pd: the engine decides knowing its D is
/// gone (`d_unavailable`). Any other path runs again on another node
/// (`node_failed`). `None` when no other node can take it.
pub(crate) fn after_failure(
    st: &AppState,
    before: &Plan,
    failed: &Node,
) -> Result<Option<Plan>, ppd_core::Error> {
    let input = DecisionInput {
        d_available: false,
        ..before.input
    };
    let route = match before.route.path {
        Path::Local => st.engine.decide(&input)?,
        // The first P may have read D's pin already: the retry prefills it all.
        Path::Pull => Route {
            path: Path::Pd,
            reason: Reason::NodeFailed,
            ..before.route
        },
        _ => Route {
            reason: Reason::NodeFailed,
            ..before.route
        },
    };
    let plan = placed(
        st,
        route,
        input,
        None,
        PinLookup {
            conv: "",
            ask: false,
        },
        before.placement_key,
        &[failed.id],
    );
    if matches!(plan.target, Target::Unavailable(_)) {
        return Ok(None);
    }
    st.record_decision(route.path, route.reason, None);
    Ok(Some(plan))
}

/// Routes again after every P failed or went away: the pd path's D computes
/// the whole prompt itself (`p_unavailable`).
pub(crate) fn without_prefill(st: &AppState, before: &Plan) -> Plan {
    // D computes it all: a pull without its P is a pd turn run direct.
    let route = Route {
        path: if before.route.path == Path::Pull {
            Path::Pd
        } else {
            before.route.path
        },
        reason: Reason::PUnavailable,
        ..before.route
    };
    st.record_decision(route.path, route.reason, None);
    let target = match &before.target {
        Target::Pd(d) | Target::Pull(d, _) => Target::Direct(Arc::clone(d)),
        _ => Target::Unavailable("no healthy prefill node"),
    };
    Plan {
        route,
        input: before.input,
        placement_key: before.placement_key,
        target,
    }
}

/// Whether a pull of this turn can ask `d` for a pin when no whole answer
/// named one: a chat (the pin request renders its history), after an
/// answer, whose session's D decodes.
fn asks_pin(id: &Identified, d: &Node) -> bool {
    id.history.is_some() && id.features.turn > 1 && d.role.decodes()
}

/// Where a pull finds its pin: the conversation's handle, filed under
/// `conv`, else (where `ask`) a pin asked of D.
struct PinLookup<'a> {
    conv: &'a str,
    ask: bool,
}

/// A route on its nodes: the session's node where it can serve, else a
/// node of the path's roles ([`new_decoder`] for a decoding node), never
/// one in `exclude`. A pd path
/// without an available P runs direct on its D (`p_unavailable`); a pull
/// takes the conversation's handle, else asks D for a pin where `pin`
/// allows, else is a pd turn (its handle raced away).
fn placed(
    st: &AppState,
    mut route: Route,
    input: DecisionInput,
    holder: Option<Arc<Node>>,
    pin: PinLookup<'_>,
    placement_key: u64,
    exclude: &[NodeId],
) -> Plan {
    let now = st.now_ms();
    let least_loaded = |roles: &[Role]| st.registry.least_loaded(roles, exclude, now);
    let usable = |n: &Arc<Node>| n.available(now) && !exclude.contains(&n.id);
    if route.path == Path::Pull {
        let found = holder
            .as_ref()
            .filter(|n| usable(n) && prefill_node(st, &[]).is_some())
            .and_then(|n| {
                let held = st.pulls.take(pin.conv, (n.id, n.load.epoch()), now);
                match held {
                    Some(h) => Some((n, Pin::Held(Box::new(h)))),
                    None => pin.ask.then_some((n, Pin::Ask)),
                }
            });
        match found {
            Some((d, pin)) => {
                return Plan {
                    route,
                    input,
                    placement_key,
                    target: Target::Pull(Arc::clone(d), pin),
                }
            }
            None => {
                route.path = Path::Pd;
                route.reason = Reason::NoPullHandle;
            }
        }
    }
    let target = match route.path {
        Path::Local => holder.filter(|n| !exclude.contains(&n.id)).map_or(
            Target::Unavailable("the session's decode node is gone"),
            Target::Local,
        ),
        Path::Replica => holder
            .filter(|n| n.role == Role::R && usable(n))
            .or_else(|| least_loaded(&[Role::R]))
            .map_or(
                Target::Unavailable("no healthy replica node"),
                Target::Replica,
            ),
        Path::Pd | Path::Pull => match holder
            .filter(|n| n.role.decodes() && usable(n))
            .or_else(|| new_decoder(st, placement_key, exclude, now))
        {
            None => Target::Unavailable("no healthy decode node"),
            Some(d) if !st.connector.prefills() => Target::Direct(d),
            Some(d) if prefill_node(st, &[]).is_none() => {
                route.reason = Reason::PUnavailable;
                Target::Direct(d)
            }
            Some(d) => Target::Pd(d),
        },
    };
    Plan {
        route,
        input,
        placement_key,
        target,
    }
}

/// The decoding node of a conversation without one: the least loaded, or
/// under rendezvous placement the node its key places on with bounded
/// loads, as every router replica computes it.
fn new_decoder(st: &AppState, key: u64, exclude: &[NodeId], now: u64) -> Option<Arc<Node>> {
    let roles = [Role::D, Role::PD];
    match st.cfg.placement {
        Placement::LeastLoaded => st.registry.least_loaded(&roles, exclude, now),
        Placement::Rendezvous => {
            let stale = crate::load::stale_after_ms(st.cfg.load_interval);
            st.registry.placed(&roles, key, exclude, now, stale, true)
        }
    }
}

/// The P of the next prefill attempt: the least loaded available P not yet tried.
pub(crate) fn prefill_node(st: &AppState, tried: &[NodeId]) -> Option<Arc<Node>> {
    st.registry.least_loaded(&[Role::P], tried, st.now_ms())
}
