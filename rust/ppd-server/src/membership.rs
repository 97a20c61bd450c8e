//! Nodes joining and leaving while the router runs (admin API, ZMQ discovery): the registry entry and the node's KV-event subscriber, together.

use std::sync::Arc;

use ppd_core::Role;

use crate::config::NodeSpec;
use crate::kv_subscriber;
use crate::metrics::{
    NodeFigureLabels, NodeLabel, NodeModeLabels, NodeOutcomeLabels, NodeRoleStateLabels,
};
use crate::registry::{Node, NodeState, Source};
use crate::state::AppState;

/// Subscribes to a node's KV events, if it publishes them; the task ends
/// when the node leaves the registry ([`crate::kv_subscriber::NodeKv::close`]).
pub(crate) fn subscribe(st: &Arc<AppState>, n: &Node) -> Option<tokio::task::JoinHandle<()>> {
    n.kv.endpoint.as_ref()?;
    let rt = st.background.get()?;
    let clock = Arc::clone(st);
    Some(rt.spawn(kv_subscriber::run(
        Arc::clone(&n.kv),
        Arc::clone(&n.load),
        move || clock.now_ms(),
    )))
}

/// Registers (or refreshes) a node at run time — the admin API, ZMQ
/// discovery — and subscribes to its KV events when it is new.
pub fn register_node(
    st: &Arc<AppState>,
    spec: &NodeSpec,
    role: Role,
    source: Source,
) -> (Arc<Node>, bool) {
    let (node, new) = st.registry.upsert_with_events(
        &spec.url,
        role,
        spec.zmq.clone(),
        spec.kv_events.clone(),
        source,
        st.now_ms(),
    );
    if new {
        tracing::info!(node = %node.url, role = role.as_str(), source = ?source, "node joined");
        subscribe(st, &node);
    }
    (node, new)
}

/// Removes a node by URL and forgets it ([`departed`]); returns what went.
pub fn deregister_node(st: &AppState, url: &str) -> Vec<Arc<Node>> {
    let gone = st.registry.remove(url.trim_end_matches('/'));
    for n in &gone {
        tracing::info!(node = %n.url, role = n.role.as_str(), "node removed");
        departed(st, n);
    }
    gone
}

/// What goes with a node that left the registry (removed, or silent past
/// its heartbeat): its KV-event subscriber, what the cost model learnt of
/// it, and its metric series.
pub fn departed(st: &AppState, n: &Node) {
    n.kv.close();
    if let Some(m) = st.engine.cost_model() {
        m.corrections.forget(n.id.get());
    }
    forget_series(st, n);
}

/// Drops a departed node's per-node metric series, which would otherwise be
/// exported (frozen) for as long as the router runs.
fn forget_series(st: &AppState, n: &Node) {
    let m = &st.metrics;
    let node = || n.url.clone();
    for state in NodeState::ALL {
        m.node_state.remove(&NodeRoleStateLabels {
            node: node(),
            role: n.role.as_str(),
            state: state.as_str(),
        });
    }
    for figure in crate::metrics::NODE_FIGURES {
        m.node_load.remove(&NodeFigureLabels {
            node: node(),
            figure,
        });
    }
    for mode in kv_subscriber::Mode::ALL {
        m.residency_mode.remove(&NodeModeLabels {
            node: node(),
            mode: mode.as_str(),
        });
    }
    let _copy = m.kv_events_copy.lock();
    for outcome in crate::metrics::KV_EVENT_OUTCOMES {
        m.kv_events.remove(&NodeOutcomeLabels {
            node: node(),
            outcome,
        });
    }
    m.residency_blocks.remove(&NodeLabel { node: node() });
    m.node_restarts.remove(&NodeLabel { node: node() });
    m.node_scrape_failures.remove(&NodeLabel { node: node() });
}
