//! `/metrics` in Prometheus text format with vLLM V1's metric names, labels and buckets.

use std::fmt::Write;

use ppd_model::Snapshot;

use crate::driver::Lag;

const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const E2E_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }
    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }
    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut acc = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            acc += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b:?}\"}} {acc}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// What handlers record per request.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub success_length: u64,
    pub success_stop: u64,
    pub success_abort: u64,
    pub kv_pull_failures: u64,
    pub injected_errors: u64,
    /// When this node started (Unix seconds): `process_start_time_seconds`,
    /// which a router reads to tell a restarted node (and its empty cache).
    pub started_unix_s: f64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            ttft: Histogram::new(&TTFT_BUCKETS),
            itl: Histogram::new(&ITL_BUCKETS),
            e2e: Histogram::new(&E2E_BUCKETS),
            success_length: 0,
            success_stop: 0,
            success_abort: 0,
            kv_pull_failures: 0,
            injected_errors: 0,
            started_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        }
    }
}

fn gauge(out: &mut String, name: &str, help: &str, labels: &str, v: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v}"
    );
}

fn counter(out: &mut String, name: &str, help: &str, labels: &str, v: f64) {
    let _ = writeln!(
        out,
        "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{{{labels}}} {v}"
    );
}

pub fn render(model: &str, role: &str, m: &Metrics, s: &Snapshot, lag: &Lag) -> String {
    let labels = format!("engine=\"0\",model_name=\"{}\"", model.replace('"', "'"));
    let l = labels.as_str();
    let mut o = String::with_capacity(8192);
    let _ = writeln!(
        o,
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {:.2}",
        m.started_unix_s
    );
    gauge(
        &mut o,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        l,
        s.running as f64,
    );
    gauge(
        &mut o,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        l,
        (s.waiting + s.waiting_remote) as f64,
    );
    gauge(
        &mut o,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        l,
        s.kv_usage,
    );
    counter(
        &mut o,
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        l,
        s.pool.queries as f64,
    );
    counter(
        &mut o,
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        l,
        s.pool.hits as f64,
    );
    counter(&mut o, "vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.", l, s.stats.external_queries as f64);
    counter(&mut o, "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.", l, s.stats.external_hits as f64);
    counter(
        &mut o,
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        l,
        s.stats.preemptions as f64,
    );
    counter(
        &mut o,
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        l,
        s.stats.prompt_tokens as f64,
    );
    counter(
        &mut o,
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        l,
        s.stats.generation_tokens as f64,
    );
    let _ = writeln!(
        o,
        "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.\n# TYPE vllm:prompt_tokens_by_source_total counter"
    );
    for (source, v) in [
        ("local_compute", s.stats.prompt_local_compute),
        ("local_cache_hit", s.stats.prompt_local_cache_hit),
        ("external_kv_transfer", s.stats.prompt_external),
    ] {
        let _ = writeln!(
            o,
            "vllm:prompt_tokens_by_source_total{{{l},source=\"{source}\"}} {v}"
        );
    }
    let _ = writeln!(o, "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter");
    for (reason, v) in [
        ("length", m.success_length),
        ("stop", m.success_stop),
        ("abort", m.success_abort),
    ] {
        let _ = writeln!(
            o,
            "vllm:request_success_total{{{l},finished_reason=\"{reason}\"}} {v}"
        );
    }
    m.ttft.render(
        &mut o,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        l,
    );
    m.itl.render(
        &mut o,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        l,
    );
    m.e2e.render(
        &mut o,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        l,
    );
    // Emulator-only series (not in vLLM), named apart so no dashboard confuses them.
    let el = format!("{l},role=\"{role}\"");
    gauge(
        &mut o,
        "emulator:kv_held_requests",
        "Finished prefills whose KV waits to be pulled.",
        &el,
        s.held as f64,
    );
    counter(
        &mut o,
        "emulator:kv_transfers",
        "KV pulls over the link model.",
        &el,
        s.stats.transfers as f64,
    );
    counter(
        &mut o,
        "emulator:kv_transfer_bytes",
        "Bytes moved over the link model.",
        &el,
        s.stats.transfer_bytes as f64,
    );
    counter(
        &mut o,
        "emulator:kv_pull_failures",
        "Pulls that found no KV at P (recomputed locally).",
        &el,
        m.kv_pull_failures as f64,
    );
    counter(
        &mut o,
        "emulator:kv_leases_expired",
        "Held KV freed unpulled after the lease.",
        &el,
        s.stats.leases_expired as f64,
    );
    counter(
        &mut o,
        "emulator:injected_errors",
        "Requests failed by fault injection.",
        &el,
        m.injected_errors as f64,
    );
    counter(
        &mut o,
        "emulator:engine_busy_seconds",
        "Modelled GPU busy time.",
        &el,
        s.stats.busy_ms / 1000.0,
    );
    counter(
        &mut o,
        "emulator:engine_steps",
        "Engine steps run.",
        &el,
        s.stats.steps as f64,
    );
    gauge(
        &mut o,
        "emulator:event_lag_max_seconds",
        "Largest delay of an event behind model time.",
        &el,
        lag.max_ms / 1000.0,
    );
    let mean = if lag.events == 0 {
        0.0
    } else {
        lag.sum_ms / lag.events as f64
    };
    gauge(
        &mut o,
        "emulator:event_lag_mean_seconds",
        "Mean delay of events behind model time.",
        &el,
        mean / 1000.0,
    );
    o
}
