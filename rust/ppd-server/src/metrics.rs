//! Prometheus metrics of the router, served at `/metrics` in the exposition format the scraper asks for (OpenMetrics or Prometheus text 0.0.4).

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

/// A latency's labels: the path, and the model as vLLM labels its own
/// (`model_name`), so router and node panels filter alike.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LatencyLabels {
    pub path: &'static str,
    pub model_name: String,
}

/// One node's state (1 for the state it is in, 0 for the others).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeRoleStateLabels {
    pub node: String,
    pub role: &'static str,
    pub state: &'static str,
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

/// A gauge of fractional values (factors, seconds, shares).
pub type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// A node by its URL (an operator's own address, never a client's input).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabel {
    pub node: String,
}

/// A cell of the cost model's TTFT corrections: the node that computes the
/// prompt, the path, and the class of prompt tokens it computes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CorrectionLabels {
    pub node: String,
    pub path: &'static str,
    /// `le_256`, `le_2048`, `over_2048` computed tokens.
    pub size_class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeFigureLabels {
    pub node: String,
    /// `inflight`, `prompt_tokens`, `decode_tokens`, `kv_bytes` (the router's
    /// own work on the node), `running`, `waiting`, `kv_usage` (the node's
    /// `/metrics`, absent while stale).
    pub figure: &'static str,
}

/// Every `figure` of [`NodeFigureLabels`].
pub const NODE_FIGURES: [&str; 7] = [
    "inflight",
    "prompt_tokens",
    "decode_tokens",
    "kv_bytes",
    "running",
    "waiting",
    "kv_usage",
];

/// Every `outcome` of [`NodeOutcomeLabels`].
pub const KV_EVENT_OUTCOMES: [&str; 6] = [
    "received",
    "missed",
    "malformed",
    "orphaned",
    "skipped",
    "reset",
];

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
pub struct AdoptionLabel {
    /// `residency` (KV events showed the prompt) or `placement` (its key).
    pub by: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FigureLabel {
    pub figure: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// Of a shared admin change: `sent` (stored in the state store),
    /// `applied` (another replica's, applied here), `failed` (not stored, or
    /// not applicable here).
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub role: &'static str,
    pub kind: &'static str,
}

/// A latency family with the histograms of its first label sets at hand:
/// `Family::get_or_create` hashes the labels (SipHash over the model's name)
/// under a lock, three times per answer (~1,500 instructions); a short list
/// compared by path and model costs a fraction of that.
pub struct Latency {
    pub family: Family<LatencyLabels, Histogram>,
    known: parking_lot::Mutex<Vec<(LatencyLabels, Histogram)>>,
}

/// The label sets a [`Latency`] keeps at hand (paths × models); past them,
/// each observation looks its histogram up in the family.
const KNOWN_LATENCY_LABELS: usize = 16;

impl Latency {
    fn new(histogram: fn() -> Histogram) -> Latency {
        Latency {
            family: Family::new_with_constructor(histogram),
            known: parking_lot::Mutex::new(Vec::with_capacity(KNOWN_LATENCY_LABELS)),
        }
    }

    /// Observes `v` under `path` and `model` (the family's histogram: the
    /// one `/metrics` shows).
    pub fn observe(&self, path: &'static str, model: &str, v: f64) {
        let mut known = self.known.lock();
        if let Some((_, h)) = known
            .iter()
            .find(|(l, _)| l.path == path && l.model_name == model)
        {
            h.observe(v);
            return;
        }
        let labels = LatencyLabels {
            path,
            model_name: model.to_owned(),
        };
        let h = self.family.get_or_create(&labels).clone();
        h.observe(v);
        if known.len() < KNOWN_LATENCY_LABELS {
            known.push((labels, h));
        }
    }
}

pub struct Metrics {
    pub registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub ttft: Latency,
    pub tpot: Latency,
    /// From the request's first byte to the answer's last, per path and model.
    pub e2e: Latency,
    /// Requests a node works on for the router now (prefill or decode).
    pub in_flight: Gauge,
    pub node_state: Family<NodeRoleStateLabels, Gauge>,
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
    /// Pins asked of a D after a streamed answer, for a pull (pin.rs).
    pub pin_requests: Family<ResultLabel, Counter>,
    pub queue_waiting: Gauge,
    pub sessions: Gauge,
    pub sessions_adopted: Family<AdoptionLabel, Counter>,
    pub nodes: Family<NodeStateLabels, Gauge>,
    pub node_load: Family<NodeFigureLabels, FloatGauge>,
    pub node_restarts: Family<NodeLabel, Counter>,
    pub node_scrape_failures: Family<NodeLabel, Counter>,
    pub residency_mode: Family<NodeModeLabels, Gauge>,
    pub residency_blocks: Family<NodeLabel, Gauge>,
    pub kv_events: Family<NodeOutcomeLabels, Counter>,
    /// Serialises the copy of each node's event counts into `kv_events`
    /// (counters only go up by the difference since the last copy).
    pub kv_events_copy: parking_lot::Mutex<()>,
    /// `ppd-live`'s corrections, rewritten from the cost model at each scrape.
    pub model_ttft_correction: Family<CorrectionLabels, FloatGauge>,
    pub model_tpot_correction: Family<NodeLabel, FloatGauge>,
    pub model_tpot_level: Family<NodeLabel, FloatGauge>,
    /// Serialises those rewrites (a scrape between another's clear and
    /// refill would see nothing).
    pub model_copy: parking_lot::Mutex<()>,
    /// 1 while the state store (`state`) is reachable; registered only with `state`.
    pub state_connected: Gauge,
    /// Shared admin changes by outcome; registered only with `state`.
    pub state_updates: Family<OutcomeLabel, Counter>,
}

/// vLLM's `vllm:time_to_first_token_seconds` buckets, so that the router's
/// and the nodes' TTFT land in the same buckets and compare per quantile.
pub const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's `vllm:time_per_output_token_seconds` (and inter-token latency) buckets.
pub const TPOT_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's `vllm:e2e_request_latency_seconds` buckets.
pub const E2E_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

fn ttft_histogram() -> Histogram {
    Histogram::new(TTFT_BUCKETS)
}

fn tpot_histogram() -> Histogram {
    Histogram::new(TPOT_BUCKETS)
}

fn e2e_histogram() -> Histogram {
    Histogram::new(E2E_BUCKETS)
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
        let ttft = Latency::new(ttft_histogram);
        registry.register(
            "ttft_seconds",
            "Time to first token seen by the router, per path and model",
            ttft.family.clone(),
        );
        let tpot = Latency::new(tpot_histogram);
        registry.register(
            "tpot_seconds",
            "Time per output token after the first, per path and model",
            tpot.family.clone(),
        );
        let e2e = Latency::new(e2e_histogram);
        registry.register(
            "e2e_request_latency_seconds",
            "Time from a request's arrival to its answer's end, per path and model",
            e2e.family.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "requests_in_flight",
            "Requests a node is prefilling or decoding for the router now",
            in_flight.clone(),
        );
        let node_state = Family::<NodeRoleStateLabels, Gauge>::default();
        registry.register(
            "node_state",
            "Each node's state: 1 for healthy, unhealthy or breaker_open, whichever it is in",
            node_state.clone(),
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
        let pin_requests = Family::<ResultLabel, Counter>::default();
        registry.register(
            "pin_requests",
            "Pins a pull asked of its D because no whole answer had named one (a streamed last answer), by result",
            pin_requests.clone(),
        );
        let queue_waiting = Gauge::default();
        registry.register(
            "queue_waiting",
            "Requests waiting for room on their node now",
            queue_waiting.clone(),
        );
        let sessions = Gauge::default();
        registry.register("sessions", "Live sessions", sessions.clone());
        let sessions_adopted = Family::<AdoptionLabel, Counter>::default();
        registry.register(
            "sessions_adopted",
            "Later turns with no session here (placement rendezvous: another replica served the earlier ones), by how their D was found",
            sessions_adopted.clone(),
        );
        let nodes = Family::<NodeStateLabels, Gauge>::default();
        registry.register("nodes", "Nodes by role and state", nodes.clone());
        let node_load = Family::<NodeFigureLabels, FloatGauge>::default();
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
        let model_ttft_correction = Family::default();
        registry.register(
            "model_ttft_correction",
            "ppd-live's cost model: observed / predicted TTFT per node, path and class of computed prompt tokens (1: the profile holds), cells with samples only",
            model_ttft_correction.clone(),
        );
        let model_tpot_correction = Family::default();
        registry.register(
            "model_tpot_correction",
            "ppd-live's cost model: observed / predicted TPOT (D's decode step) per node",
            model_tpot_correction.clone(),
        );
        let model_tpot_level = Family::default();
        registry.register(
            "model_tpot_level_seconds",
            "ppd-live's cost model: the TPOT a node's requests have been getting (geometric mean), what co-runners are judged by under SLOs",
            model_tpot_level.clone(),
        );
        let pinned = Family::<FigureLabel, Gauge>::default();
        registry.register(
            "pinned_kv",
            "What bidirectional D nodes pin for the pull path, by the router's live handles: handles, blocks, tokens",
            pinned.clone(),
        );
        Metrics {
            state_connected: Gauge::default(),
            state_updates: Family::default(),
            kv_bytes_pulled,
            pinned,
            residency_mode,
            residency_blocks,
            kv_events,
            kv_events_copy: parking_lot::Mutex::new(()),
            model_ttft_correction,
            model_tpot_correction,
            model_tpot_level,
            model_copy: parking_lot::Mutex::new(()),
            registry,
            requests,
            ttft,
            tpot,
            e2e,
            in_flight,
            node_state,
            decision,
            kv_bytes_moved,
            kv_bytes_avoided,
            upstream_errors,
            retries,
            request_retries,
            admission,
            kv_releases,
            pin_requests,
            queue_waiting,
            sessions,
            sessions_adopted,
            nodes,
            node_load,
            node_restarts,
            node_scrape_failures,
        }
    }

    /// Adds the state store's metrics (with `state` only, so that a router
    /// on its own exposes exactly what it did before).
    pub fn with_state_metrics(mut self) -> Metrics {
        self.registry.register(
            "state_connected",
            "1 while the state store that shares admin changes between replicas is reachable, else 0",
            self.state_connected.clone(),
        );
        self.registry.register(
            "state_updates",
            "Shared admin changes: sent to the state store, applied from another replica, or failed",
            self.state_updates.clone(),
        );
        for outcome in ["sent", "applied", "failed"] {
            let _ = self.state_updates.get_or_create(&OutcomeLabel { outcome });
        }
        self
    }

    /// The metrics in OpenMetrics text (what the encoder writes).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The metrics in `format`, with the content type that says so.
    pub fn exposition(&self, format: Exposition) -> (&'static str, String) {
        let open = self.encode();
        match format {
            Exposition::OpenMetrics => (OPENMETRICS_CONTENT_TYPE, open),
            Exposition::Text => (TEXT_CONTENT_TYPE, openmetrics_to_text(&open)),
        }
    }
}

pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The two exposition formats `/metrics` serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exposition {
    /// `application/openmetrics-text` 1.0.0 (Prometheus asks for it first).
    OpenMetrics,
    /// Prometheus text 0.0.4, what a scraper gets unless it asks for OpenMetrics.
    Text,
}

/// The format an `Accept` header prefers: OpenMetrics when it is listed with
/// a quality above the plain text's (or plain text is not listed), else
/// text 0.0.4, which every scraper reads.
pub fn negotiate(accept: Option<&str>) -> Exposition {
    let mut open = 0.0_f64;
    let mut text = 0.0_f64;
    for range in accept.unwrap_or_default().split(',') {
        let mut params = range.split(';').map(str::trim);
        let mime = params.next().unwrap_or_default().to_ascii_lowercase();
        let q = params
            .filter_map(|p| p.strip_prefix("q="))
            .find_map(|q| q.parse::<f64>().ok())
            .unwrap_or(1.0);
        match mime.as_str() {
            "application/openmetrics-text" => open = open.max(q),
            "text/plain" | "text/*" | "*/*" => text = text.max(q),
            _ => {}
        }
    }
    if open > 0.0 && open >= text {
        Exposition::OpenMetrics
    } else {
        Exposition::Text
    }
}

/// Rewrites the encoder's OpenMetrics into Prometheus text 0.0.4: a
/// counter's family is named with its `_total` suffix (as its samples are, so
/// 0.0.4 parsers type them instead of dropping them as untyped), `# UNIT` and
/// `# EOF` go, and OpenMetrics-only types become their 0.0.4 kin.
pub fn openmetrics_to_text(open: &str) -> String {
    let mut out = String::with_capacity(open.len() + 512);
    // A family's `# HELP` comes before its `# TYPE`, which decides its name.
    let mut help: Option<(&str, &str)> = None;
    let flush = |out: &mut String, help: &mut Option<(&str, &str)>| {
        if let Some((name, text)) = help.take() {
            out.push_str(&format!("# HELP {name} {text}\n"));
        }
    };
    for line in open.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            flush(&mut out, &mut help);
            help = Some(rest.split_once(' ').unwrap_or((rest, "")));
            continue;
        }
        if let Some((name, kind)) = line.strip_prefix("# TYPE ").and_then(|r| r.split_once(' ')) {
            let (name, kind) = match kind {
                "counter" if !name.ends_with("_total") => (format!("{name}_total"), "counter"),
                "counter" | "gauge" | "histogram" | "summary" => (name.to_owned(), kind),
                "info" | "stateset" => (name.to_owned(), "gauge"),
                _ => (name.to_owned(), "untyped"),
            };
            if let Some((_, text)) = help.take() {
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
            continue;
        }
        flush(&mut out, &mut help);
        out.push_str(line);
        out.push('\n');
    }
    flush(&mut out, &mut help);
    out
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_gets_openmetrics_and_everyone_else_text() {
        let prometheus = "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2";
        assert_eq!(negotiate(Some(prometheus)), Exposition::OpenMetrics);
        assert_eq!(
            negotiate(Some("application/openmetrics-text")),
            Exposition::OpenMetrics
        );
        assert_eq!(negotiate(None), Exposition::Text);
        assert_eq!(negotiate(Some("*/*")), Exposition::Text);
        assert_eq!(
            negotiate(Some("text/plain;version=0.0.4")),
            Exposition::Text
        );
        let prefers_text = "text/plain;q=0.9,application/openmetrics-text;q=0.5";
        assert_eq!(negotiate(Some(prefers_text)), Exposition::Text);
        assert_eq!(
            negotiate(Some("application/openmetrics-text;q=0")),
            Exposition::Text
        );
    }

    #[test]
    fn text_names_counter_families_with_their_total_suffix() {
        let m = Metrics::new();
        m.requests
            .get_or_create(&RequestLabels {
                path: "pd",
                reason: "turn1",
                status: 200,
            })
            .inc();
        let (kind, text) = m.exposition(Exposition::Text);
        assert_eq!(kind, TEXT_CONTENT_TYPE);
        assert!(
            text.contains("# TYPE ppd_requests_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("# HELP ppd_requests_total Requests by path"),
            "{text}"
        );
        assert!(text.contains(r#"ppd_requests_total{path="pd",reason="turn1",status="200"} 1"#));
        assert!(text.contains("# TYPE ppd_sessions gauge\n"));
        assert!(!text.contains("# EOF"));
        let (kind, open) = m.exposition(Exposition::OpenMetrics);
        assert_eq!(kind, OPENMETRICS_CONTENT_TYPE);
        assert!(open.contains("# TYPE ppd_requests counter\n") && open.ends_with("# EOF\n"));
    }

    #[test]
    fn latencies_kept_at_hand_are_the_ones_metrics_shows() {
        let m = Metrics::new();
        for _ in 0..3 {
            m.e2e.observe("local", "m", 0.5);
        }
        m.e2e.observe("pd", "m", 0.5);
        // Past the label sets kept at hand, straight to the family.
        for i in 0..KNOWN_LATENCY_LABELS + 2 {
            m.e2e.observe("local", &format!("model-{i}"), 0.5);
        }
        m.e2e.observe("local", "model-17", 0.5);
        let text = openmetrics_to_text(&m.encode());
        let count = |labels: &str| {
            text.lines()
                .find_map(|l| {
                    l.strip_prefix(&format!(
                        "ppd_e2e_request_latency_seconds_count{{{labels}}} "
                    ))
                })
                .unwrap_or_else(|| panic!("{labels}: {text}"))
                .to_owned()
        };
        assert_eq!(count(r#"path="local",model_name="m""#), "3");
        assert_eq!(count(r#"path="pd",model_name="m""#), "1");
        assert_eq!(count(r#"path="local",model_name="model-17""#), "2");
        // A family observed under no labels yet shows none.
        assert!(!text.contains("ppd_ttft_seconds_count{"), "{text}");
    }

    #[test]
    fn latency_buckets_are_vllms() {
        let m = Metrics::new();
        let labels = LatencyLabels {
            path: "local",
            model_name: "m".into(),
        };
        m.ttft.family.get_or_create(&labels).observe(0.03);
        let text = openmetrics_to_text(&m.encode());
        for le in ["0.001", "0.04", "2560.0", "+Inf"] {
            assert!(
                text.contains(&format!(
                    r#"ppd_ttft_seconds_bucket{{le="{le}",path="local",model_name="m"}}"#
                )),
                "{le}: {text}"
            );
        }
    }
}
