//! Nodes joining and leaving while the router runs (admin API, ZMQ discovery): the registry entry and the node's KV-event subscriber, together.

use std::sync::Arc;

use ppd_core::Role;

use crate::config::NodeSpec;
use crate::kv_subscriber;
use crate::registry::{Node, Source};
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

/// Removes a node by URL, stops its KV-event subscriber and drops what the
/// cost model learnt of it; returns what went.
pub fn deregister_node(st: &AppState, url: &str) -> Vec<Arc<Node>> {
    let gone = st.registry.remove(url.trim_end_matches('/'));
    let model = st.engine.cost_model();
    for n in &gone {
        tracing::info!(node = %n.url, role = n.role.as_str(), "node removed");
        n.kv.close();
        if let Some(m) = &model {
            m.corrections.forget(n.id.get());
        }
    }
    gone
}
