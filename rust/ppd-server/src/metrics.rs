//! Prometheus metrics of the router (text exposition at `/metrics`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub path: &'static str,
    pub reason: &'static str,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PathLabel {
    pub path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeStateLabels {
    pub role: &'static str,
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabels {
    /// `node_failed` (a D, pD or R failed before the first byte) or `no_prefill`.
    pub cause: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabels {
    /// `admitted`, `queued` (admitted after waiting), `shed_rate`, `shed_queue_full`, `shed_queue_timeout`.
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

/// A node by its URL (an operator's own address, never a client's input).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabel {
    pub node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeFigureLabels {
    pub node: String,
    /// `inflight`, `prompt_tokens`, `decode_tokens`, `kv_bytes` (the router's
    /// own work on the node), `running`, `waiting`, `kv_usage` (the node's
    /// `/metrics`, absent while stale).
    pub figure: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeModeLabels {
    pub node: String,
    /// `exact` (KV events) or `approx` (the session alone).
    pub mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeOutcomeLabels {
    pub node: String,
    /// `received` (events), `missed` (messages lost in a sequence gap),
    /// `malformed`, `orphaned`, `skipped`, `reset`.
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FigureLabel {
    pub figure: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub role: &'static str,
    pub kind: &'static str,
}

pub struct Metrics {
    pub registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub ttft: Family<PathLabel, Histogram>,
    pub tpot: Family<PathLabel, Histogram>,
    pub decision: Histogram,
    pub kv_bytes_moved: Counter,
    pub kv_bytes_avoided: Counter,
    pub kv_bytes_pulled: Counter,
    /// What bidirectional D nodes pin for the pull path, as far as the
    /// router holds handles on it: `handles`, `blocks`, `tokens`.
    pub pinned: Family<FigureLabel, Gauge>,
    pub upstream_errors: Family<ErrorLabels, Counter>,
    pub retries: Counter,
    pub request_retries: Family<RetryLabels, Counter>,
    pub admission: Family<AdmissionLabels, Counter>,
    pub kv_releases: Family<ResultLabel, Counter>,
    pub queue_waiting: Gauge,
    pub sessions: Gauge,
    pub nodes: Family<NodeStateLabels, Gauge>,
    pub node_load: Family<NodeFigureLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub node_restarts: Family<NodeLabel, Counter>,
    pub node_scrape_failures: Family<NodeLabel, Counter>,
    pub residency_mode: Family<NodeModeLabels, Gauge>,
    pub residency_blocks: Family<NodeLabel, Gauge>,
    pub kv_events: Family<NodeOutcomeLabels, Counter>,
    /// Serialises the copy of each node's event counts into `kv_events`
    /// (counters only go up by the difference since the last copy).
    pub kv_events_copy: parking_lot::Mutex<()>,
}

fn latency_histogram() -> Histogram {
    // 0.5 ms … ~65 s
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("ppd");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests by path, reason code and HTTP status",
            requests.clone(),
        );
        let ttft = Family::<PathLabel, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        registry.register(
            "ttft_seconds",
            "Time to first token seen by the router, per path",
            ttft.clone(),
        );
        let tpot = Family::<PathLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0005, 2.0, 14))
        });
        registry.register(
            "tpot_seconds",
            "Time per output token after the first, per path",
            tpot.clone(),
        );
        let decision = Histogram::new(exponential_buckets(1e-7, 2.0, 20));
        registry.register(
            "decision_seconds",
            "Time from request bytes to route (identity, features, policy)",
            decision.clone(),
        );
        let kv_bytes_moved = Counter::default();
        registry.register(
            "kv_bytes_moved",
            "KV bytes sent P to D on the pd path (estimated from prompt tokens)",
            kv_bytes_moved.clone(),
        );
        let kv_bytes_avoided = Counter::default();
        registry.register(
            "kv_bytes_avoided",
            "KV bytes not moved because Turn 2+ ran local (estimated from context tokens)",
            kv_bytes_avoided.clone(),
        );
        let upstream_errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "upstream_errors",
            "Upstream failures by node role and kind",
            upstream_errors.clone(),
        );
        let retries = Counter::default();
        registry.register(
            "prefill_retries",
            "Prefills retried on another P after a failure before any byte",
            retries.clone(),
        );
        let request_retries = Family::<RetryLabels, Counter>::default();
        registry.register(
            "request_retries",
            "Requests routed again because a node failed before their first byte reached the client",
            request_retries.clone(),
        );
        let admission = Family::<AdmissionLabels, Counter>::default();
        registry.register(
            "admission",
            "Requests by admission outcome: admitted at once, after queueing, or shed (rate, queue full, queue timeout)",
            admission.clone(),
        );
        let kv_releases = Family::<ResultLabel, Counter>::default();
        registry.register(
            "kv_releases",
            "Requests that asked a D to free KV staged on P for a hand-off that did not happen, by result",
            kv_releases.clone(),
        );
        let queue_waiting = Gauge::default();
        registry.register(
            "queue_waiting",
            "Requests waiting for room on their node now",
            queue_waiting.clone(),
        );
        let sessions = Gauge::default();
        registry.register("sessions", "Live sessions", sessions.clone());
        let nodes = Family::<NodeStateLabels, Gauge>::default();
        registry.register("nodes", "Nodes by role and state", nodes.clone());
        let node_load =
            Family::<NodeFigureLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register(
            "node_load",
            "Each node's live load: the router's work on it and the node's own /metrics figures",
            node_load.clone(),
        );
        let node_restarts = Family::<NodeLabel, Counter>::default();
        registry.register(
            "node_restarts",
            "Node restarts seen in its /metrics (a new start time or counters reset); its cached KV is gone",
            node_restarts.clone(),
        );
        let node_scrape_failures = Family::<NodeLabel, Counter>::default();
        registry.register(
            "node_scrape_failures",
            "Scrapes of a node's /metrics that failed or had no vLLM load figures",
            node_scrape_failures.clone(),
        );
        let residency_mode = Family::<NodeModeLabels, Gauge>::default();
        registry.register(
            "residency_mode",
            "How the router knows what each node caches: 1 for its mode (exact: KV events; approx: sessions)",
            residency_mode.clone(),
        );
        let residency_blocks = Family::<NodeLabel, Gauge>::default();
        registry.register(
            "residency_blocks",
            "Prefix-cache blocks the router's index holds for each node (from its KV events)",
            residency_blocks.clone(),
        );
        let kv_events = Family::<NodeOutcomeLabels, Counter>::default();
        registry.register(
            "kv_events",
            "KV events per node: received, missed (sequence gaps), malformed, orphaned, skipped, reset",
            kv_events.clone(),
        );
        let kv_bytes_pulled = Counter::default();
        registry.register(
            "kv_bytes_pulled",
            "KV bytes P read back from D's pin on the pull path (the context it did not recompute)",
            kv_bytes_pulled.clone(),
        );
        let pinned = Family::<FigureLabel, Gauge>::default();
        registry.register(
            "pinned_kv",
            "What bidirectional D nodes pin for the pull path, by the router's live handles: handles, blocks, tokens",
            pinned.clone(),
        );
        Metrics {
            kv_bytes_pulled,
            pinned,
            residency_mode,
            residency_blocks,
            kv_events,
            kv_events_copy: parking_lot::Mutex::new(()),
            registry,
            requests,
            ttft,
            tpot,
            decision,
            kv_bytes_moved,
            kv_bytes_avoided,
            upstream_errors,
            retries,
            request_retries,
            admission,
            kv_releases,
            queue_waiting,
            sessions,
            nodes,
            node_load,
            node_restarts,
            node_scrape_failures,
        }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
