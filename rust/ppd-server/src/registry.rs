//! The node registry: roles, health, load, circuit breakers, heartbeats, and the placement choices made on them.

use arc_swap::ArcSwap;
use axum::http::Uri;
use parking_lot::Mutex;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use ppd_core::session::NodeId;

use crate::admission::{Admitted, NodeSlots};
use crate::kv_subscriber::{Endpoint, Mode, NodeKv};
use crate::load::{LoadSnapshot, NodeLoad, Work, WorkGuard};
use ppd_core::placement::{self, Candidate};
use ppd_core::Role;

/// Where a node came from. Only ZMQ-registered nodes expire without
/// heartbeats; static ones and those added with `POST /admin/nodes` stay
/// until removed (`DELETE /admin/nodes`, or a ZMQ deregistration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Static,
    Zmq,
    Admin,
}

pub struct Node {
    pub id: NodeId,
    pub url: String,
    pub role: Role,
    pub zmq: Option<String>,
    pub source: Source,
    healthy: AtomicBool,
    pub inflight: AtomicU32,
    consecutive_failures: AtomicU32,
    breaker_open_until_ms: AtomicU64,
    last_heartbeat_ms: AtomicU64,
    pub sessions: AtomicU32,
    pub served: AtomicU64,
    pub failed: AtomicU64,
    /// Admission's room on this node (in-flight requests and prompt tokens).
    pub slots: NodeSlots,
    /// Live load (the router's work on it and the node's own figures) and
    /// the epoch of its cache.
    pub load: Arc<NodeLoad>,
    /// Its KV events and the block index they build (exact residency).
    pub kv: Arc<NodeKv>,
    /// `{url}/v1/chat/completions` and `{url}/v1/completions`, parsed once:
    /// parsing a URL per request cost more than building the rest of it.
    /// `None` when the URL does not parse (the request then reports why).
    pub endpoint_urls: Option<[Uri; 2]>,
    /// The `Host` header of its calls, built once ([`crate::client::host_header`]).
    pub host_header: Option<axum::http::HeaderValue>,
    /// The `x-ppd-node` response header, built once.
    pub url_header: Option<axum::http::HeaderValue>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    Healthy,
    Unhealthy,
    BreakerOpen,
}

impl NodeState {
    pub const ALL: [NodeState; 3] = [
        NodeState::Healthy,
        NodeState::Unhealthy,
        NodeState::BreakerOpen,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Healthy => "healthy",
            NodeState::Unhealthy => "unhealthy",
            NodeState::BreakerOpen => "breaker_open",
        }
    }
}

impl Node {
    pub fn state(&self, now_ms: u64) -> NodeState {
        if !self.healthy.load(Ordering::Acquire) {
            NodeState::Unhealthy
        } else if self.breaker_open_until_ms.load(Ordering::Acquire) > now_ms {
            NodeState::BreakerOpen
        } else {
            NodeState::Healthy
        }
    }
    pub fn available(&self, now_ms: u64) -> bool {
        self.state(now_ms) == NodeState::Healthy
    }
    /// Sets the health-check verdict; a change is logged (a node going
    /// out is a warning, coming back is news).
    pub fn set_healthy(&self, ok: bool) {
        let was = self.healthy.swap(ok, Ordering::AcqRel);
        if was && !ok {
            tracing::warn!(node = %self.url, role = self.role.as_str(), "node unhealthy");
        } else if !was && ok {
            tracing::info!(node = %self.url, role = self.role.as_str(), "node healthy again");
        }
    }
    pub fn heartbeat(&self, now_ms: u64) {
        self.last_heartbeat_ms.store(now_ms, Ordering::Release);
    }
    pub fn last_heartbeat_ms(&self) -> u64 {
        self.last_heartbeat_ms.load(Ordering::Acquire)
    }
    pub fn inflight(&self) -> u32 {
        self.inflight.load(Ordering::Acquire)
    }
    /// The node's load now; scraped figures older than `stale_after_ms` are left out.
    pub fn load_snapshot(&self, now_ms: u64, stale_after_ms: u64) -> LoadSnapshot {
        self.load.snapshot(self.inflight(), now_ms, stale_after_ms)
    }
}

fn endpoint_urls(base: &str) -> Option<[Uri; 2]> {
    let chat = format!("{base}/v1/chat/completions").parse().ok()?;
    let completions = format!("{base}/v1/completions").parse().ok()?;
    Some([chat, completions])
}

/// Holds a node's in-flight count up while a request uses it, and the room
/// admission gave the request on it.
pub struct InflightGuard {
    node: Arc<Node>,
    _admitted: Option<Admitted>,
    _work: Option<WorkGuard>,
}

impl InflightGuard {
    pub fn new(node: Arc<Node>) -> Self {
        node.inflight.fetch_add(1, Ordering::AcqRel);
        InflightGuard {
            node,
            _admitted: None,
            _work: None,
        }
    }
    /// Counts `work` in the node's load while the request lasts.
    pub(crate) fn with_work(mut self, work: Work) -> Self {
        self._work = Some(self.node.load.add(work));
        self
    }
    /// Counts a decode's `work` in the node's load while the request lasts,
    /// and follows its tokens against `deadline_ms` (router clock).
    pub(crate) fn with_decode(mut self, work: Work, deadline_ms: u64) -> Self {
        self._work = Some(self.node.load.add_decode(work, deadline_ms));
        self
    }
    /// The decode's progress, where [`Self::with_decode`] follows it.
    pub(crate) fn progress(&self) -> Option<&crate::load::Progress> {
        self._work.as_ref()?.progress()
    }
    pub(crate) fn admitted(node: Arc<Node>, admitted: Admitted) -> Self {
        let mut guard = InflightGuard::new(node);
        guard._admitted = Some(admitted);
        guard
    }
    pub fn node(&self) -> &Arc<Node> {
        &self.node
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.node.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug, Clone, Copy)]
pub struct BreakerConfig {
    pub failures: u32,
    pub open_ms: u64,
}

/// What each node may have in flight (0: unlimited).
#[derive(Debug, Clone, Copy, Default)]
pub struct NodeLimits {
    pub requests: u32,
    pub prompt_tokens: u32,
}

/// Nodes by id; the list is copy-on-write so placement never takes a lock.
pub struct Registry {
    nodes: ArcSwap<Vec<Arc<Node>>>,
    write: Mutex<()>,
    next_id: AtomicU32,
    breaker: BreakerConfig,
    limits: NodeLimits,
}

impl Registry {
    pub fn new(breaker: BreakerConfig, limits: NodeLimits) -> Self {
        Registry {
            nodes: ArcSwap::from_pointee(Vec::new()),
            write: Mutex::new(()),
            next_id: AtomicU32::new(1),
            breaker,
            limits,
        }
    }

    pub fn nodes(&self) -> Arc<Vec<Arc<Node>>> {
        self.nodes.load_full()
    }

    /// Adds a node, or refreshes the one with the same URL (a re-registration
    /// keeps its id, so sessions pointing at it stay valid). Returns it and
    /// whether it was new.
    pub fn upsert(
        &self,
        url: &str,
        role: Role,
        zmq: Option<String>,
        source: Source,
        now_ms: u64,
    ) -> (Arc<Node>, bool) {
        self.upsert_with_events(url, role, zmq, None, source, now_ms)
    }

    /// [`Registry::upsert`] for a node that publishes KV events at `kv_events`
    /// (kept from the node's first registration).
    pub fn upsert_with_events(
        &self,
        url: &str,
        role: Role,
        zmq: Option<String>,
        kv_events: Option<Endpoint>,
        source: Source,
        now_ms: u64,
    ) -> (Arc<Node>, bool) {
        let _w = self.write.lock();
        let cur = self.nodes.load_full();
        if let Some(n) = cur.iter().find(|n| n.url == url && n.role == role) {
            n.heartbeat(now_ms);
            return (Arc::clone(n), false);
        }
        let raw = self.next_id.fetch_add(1, Ordering::AcqRel);
        let id = NodeId::new(raw).unwrap_or(NodeId::new(u32::MAX).expect("u32::MAX is non-zero"));
        let endpoint_urls = endpoint_urls(url);
        let host_header = endpoint_urls
            .as_ref()
            .and_then(|u| crate::client::host_header(&u[0]));
        let node = Arc::new(Node {
            id,
            url: url.to_owned(),
            role,
            zmq,
            source,
            kv: Arc::new(NodeKv::new(kv_events)),
            healthy: AtomicBool::new(true),
            inflight: AtomicU32::new(0),
            consecutive_failures: AtomicU32::new(0),
            breaker_open_until_ms: AtomicU64::new(0),
            last_heartbeat_ms: AtomicU64::new(now_ms),
            sessions: AtomicU32::new(0),
            served: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            endpoint_urls,
            host_header,
            slots: NodeSlots::new(self.limits.requests, self.limits.prompt_tokens),
            load: Arc::default(),
            url_header: axum::http::HeaderValue::from_str(url).ok(),
        });
        let mut next = (*cur).clone();
        next.push(Arc::clone(&node));
        self.nodes.store(Arc::new(next));
        (node, true)
    }

    /// Removes the node(s) with this URL; returns what was removed.
    pub fn remove(&self, url: &str) -> Vec<Arc<Node>> {
        let _w = self.write.lock();
        let cur = self.nodes.load_full();
        let (gone, kept): (Vec<_>, Vec<_>) = cur.iter().cloned().partition(|n| n.url == url);
        if !gone.is_empty() {
            self.nodes.store(Arc::new(kept));
        }
        gone
    }

    /// Removes ZMQ-registered nodes silent for longer than `timeout_ms` (static
    /// and admin-added nodes send no heartbeats and stay until removed).
    pub fn expire(&self, now_ms: u64, timeout_ms: u64) -> Vec<Arc<Node>> {
        let _w = self.write.lock();
        let cur = self.nodes.load_full();
        let (gone, kept): (Vec<_>, Vec<_>) = cur.iter().cloned().partition(|n| {
            n.source == Source::Zmq && now_ms.saturating_sub(n.last_heartbeat_ms()) > timeout_ms
        });
        if !gone.is_empty() {
            self.nodes.store(Arc::new(kept));
        }
        gone
    }

    pub fn get(&self, id: NodeId) -> Option<Arc<Node>> {
        self.nodes.load().iter().find(|n| n.id == id).cloned()
    }

    pub fn count(&self, pred: impl Fn(&Node) -> bool) -> usize {
        self.nodes.load().iter().filter(|n| pred(n)).count()
    }

    /// The available node of the roles with the fewest requests in flight
    /// (then the fewest sessions, then the lowest id), skipping `exclude`.
    pub fn least_loaded(
        &self,
        roles: &[Role],
        exclude: &[NodeId],
        now_ms: u64,
    ) -> Option<Arc<Node>> {
        self.nodes
            .load()
            .iter()
            .filter(|n| roles.contains(&n.role) && !exclude.contains(&n.id) && n.available(now_ms))
            .min_by_key(|n| (n.inflight(), n.sessions.load(Ordering::Relaxed), n.id))
            .cloned()
    }

    /// Where a conversation placed by `key` goes among the available nodes
    /// of `roles`: rendezvous hashing with bounded loads over their URLs, so
    /// every router replica that sees the same nodes picks the same one.
    /// A node's load is the most requests in flight anyone reports: this
    /// router's own, or the node's fresh scrape (which counts every
    /// replica's). `bounded: false` takes the key's favourite whatever its
    /// load — where a later turn finds the node its first turn chose.
    pub fn placed(
        &self,
        roles: &[Role],
        key: u64,
        exclude: &[NodeId],
        now_ms: u64,
        stale_after_ms: u64,
        bounded: bool,
    ) -> Option<Arc<Node>> {
        let nodes = self.nodes.load();
        let pool: Vec<&Arc<Node>> = nodes
            .iter()
            .filter(|n| roles.contains(&n.role) && !exclude.contains(&n.id) && n.available(now_ms))
            .collect();
        let candidates: Vec<Candidate<'_>> = pool
            .iter()
            .map(|n| Candidate {
                name: &n.url,
                load: n.load_snapshot(now_ms, stale_after_ms).requests(),
            })
            .collect();
        let i = if bounded {
            placement::bounded(key, &candidates, placement::DEFAULT_LOAD_BOUND)
        } else {
            placement::rendezvous(key, &candidates)
        }?;
        Some(Arc::clone(pool[i]))
    }

    /// The available node of `roles` whose KV events show the longest
    /// leading part of `prompt` cached, with that many tokens (none when no
    /// such node reports events, or none holds a block of it).
    pub fn holding(&self, roles: &[Role], prompt: &[u64], now_ms: u64) -> Option<(Arc<Node>, u32)> {
        self.nodes
            .load()
            .iter()
            .filter(|n| {
                roles.contains(&n.role) && n.available(now_ms) && n.kv.mode() == Mode::Exact
            })
            .map(|n| (n, n.kv.cached_prefix_tokens(prompt)))
            .filter(|&(_, t)| t > 0)
            // The longest; on a tie (a prefix every node holds) the first registered.
            .max_by(|(a, ta), (b, tb)| ta.cmp(tb).then_with(|| b.id.cmp(&a.id)))
            .map(|(n, t)| (Arc::clone(n), t))
    }

    /// Whether any available node of `roles` reports its cache through KV events.
    pub fn any_exact(&self, roles: &[Role], now_ms: u64) -> bool {
        self.nodes
            .load()
            .iter()
            .any(|n| roles.contains(&n.role) && n.available(now_ms) && n.kv.mode() == Mode::Exact)
    }

    pub fn record_success(&self, node: &Node) {
        node.consecutive_failures.store(0, Ordering::Release);
        node.served.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a failure; enough in a row open the breaker for a while.
    pub fn record_failure(&self, node: &Node, now_ms: u64) {
        node.failed.fetch_add(1, Ordering::Relaxed);
        let n = node.consecutive_failures.fetch_add(1, Ordering::AcqRel) + 1;
        if n >= self.breaker.failures {
            let was_open = node.breaker_open_until_ms.load(Ordering::Acquire) > now_ms;
            node.breaker_open_until_ms
                .store(now_ms + self.breaker.open_ms, Ordering::Release);
            if !was_open {
                tracing::warn!(
                    node = %node.url,
                    role = node.role.as_str(),
                    failures = n,
                    open_s = self.breaker.open_ms as f64 / 1000.0,
                    "circuit breaker open"
                );
            }
            // Half-open after the pause: the next failure re-opens at once.
            node.consecutive_failures
                .store(self.breaker.failures.saturating_sub(1), Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg() -> Registry {
        Registry::new(
            BreakerConfig {
                failures: 2,
                open_ms: 1000,
            },
            NodeLimits::default(),
        )
    }

    #[test]
    fn least_loaded_prefers_fewest_inflight_then_sessions() {
        let r = reg();
        let (a, _) = r.upsert("http://a", Role::P, None, Source::Static, 0);
        let (b, _) = r.upsert("http://b", Role::P, None, Source::Static, 0);
        let _g = InflightGuard::new(Arc::clone(&a));
        assert_eq!(r.least_loaded(&[Role::P], &[], 0).unwrap().id, b.id);
        drop(_g);
        b.sessions.store(3, Ordering::Relaxed);
        assert_eq!(r.least_loaded(&[Role::P], &[], 0).unwrap().id, a.id);
        assert_eq!(r.least_loaded(&[Role::P], &[a.id], 0).unwrap().id, b.id);
        assert!(r.least_loaded(&[Role::R], &[], 0).is_none());
    }

    #[test]
    fn placement_is_the_same_in_registries_that_list_the_nodes_in_another_order() {
        let urls = ["http://d0", "http://d1", "http://d2", "http://d3"];
        let a = reg();
        let b = reg();
        for u in urls {
            a.upsert(u, Role::PD, None, Source::Static, 0);
        }
        for u in urls.iter().rev() {
            b.upsert(u, Role::PD, None, Source::Static, 0);
        }
        for key in 0..200u64 {
            let pa = a.placed(&[Role::PD], key, &[], 0, 0, true).unwrap();
            let pb = b.placed(&[Role::PD], key, &[], 0, 0, true).unwrap();
            assert_eq!(pa.url, pb.url, "key {key}");
        }
    }

    #[test]
    fn a_bounded_placement_passes_over_a_busy_favourite_and_an_unbounded_one_does_not() {
        let r = reg();
        for u in ["http://d0", "http://d1", "http://d2"] {
            r.upsert(u, Role::PD, None, Source::Static, 0);
        }
        let key = 7;
        let fav = r.placed(&[Role::PD], key, &[], 0, 0, true).unwrap();
        let _busy: Vec<_> = (0..4)
            .map(|_| InflightGuard::new(Arc::clone(&fav)))
            .collect();
        assert_ne!(
            r.placed(&[Role::PD], key, &[], 0, 0, true).unwrap().id,
            fav.id
        );
        assert_eq!(
            r.placed(&[Role::PD], key, &[], 0, 0, false).unwrap().id,
            fav.id
        );
        // Never an excluded node.
        assert_ne!(
            r.placed(&[Role::PD], key, &[fav.id], 0, 0, false)
                .unwrap()
                .id,
            fav.id
        );
    }

    #[test]
    fn breaker_opens_after_consecutive_failures_and_closes_after_its_pause() {
        let r = reg();
        let (a, _) = r.upsert("http://a", Role::PD, None, Source::Static, 0);
        r.record_failure(&a, 10);
        assert!(a.available(10));
        r.record_failure(&a, 20);
        assert_eq!(a.state(500), NodeState::BreakerOpen);
        assert!(a.available(1021));
        // Half-open: one more failure re-opens.
        r.record_failure(&a, 1100);
        assert_eq!(a.state(1200), NodeState::BreakerOpen);
        r.record_success(&a);
        assert_eq!(a.consecutive_failures.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn reregistration_keeps_the_id_and_heartbeats_expire_only_registered_nodes() {
        let r = reg();
        let (a, new) = r.upsert("http://a", Role::D, None, Source::Zmq, 0);
        assert!(new);
        let (a2, new2) = r.upsert("http://a", Role::D, None, Source::Zmq, 5_000);
        assert!(!new2);
        assert_eq!(a.id, a2.id);
        r.upsert("http://s", Role::P, None, Source::Static, 0);
        r.upsert("http://m", Role::PD, None, Source::Admin, 0);
        let gone = r.expire(40_000, 30_000);
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].url, "http://a");
        // The static and the admin-added node stay, however long they are silent.
        let left: Vec<_> = r.nodes().iter().map(|n| n.url.clone()).collect();
        assert_eq!(left, ["http://s", "http://m"]);
        assert!(r.expire(u64::MAX, 1).is_empty());
        assert!(r.get(a.id).is_none());
    }

    #[test]
    fn unhealthy_nodes_are_not_placed() {
        let r = reg();
        let (a, _) = r.upsert("http://a", Role::R, None, Source::Static, 0);
        a.set_healthy(false);
        assert!(r.least_loaded(&[Role::R], &[], 0).is_none());
        a.set_healthy(true);
        assert!(r.least_loaded(&[Role::R], &[], 0).is_some());
    }
}
