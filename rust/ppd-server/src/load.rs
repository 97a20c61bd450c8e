//! Live load of each node — the router's own in-flight accounting plus what the node's `/metrics` says — read by the route step as a snapshot, without a lock.
//!
//! The router knows exactly what it sent (requests, prompt tokens to compute,
//! decode tokens expected, KV bytes handed over); only the node knows what it
//! runs and queues for other clients and other routers, and how full its KV
//! cache is. A background task scrapes every node's `/metrics` once per
//! `load_interval` and swaps the parsed figures in; the route step reads them
//! with one atomic load. The same scrape tells a restarted node: its
//! `process_start_time_seconds` changes, or a counter goes backwards (the
//! Prometheus rule for a reset), and its cache epoch is bumped so sessions on
//! it stop counting on KV it no longer holds.

use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use ppd_core::cost::{AtRisk, Deadline};
use serde::Serialize;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// What a node's `/metrics` said at one scrape (vLLM V1 names; several
/// engines of one server are summed, the KV usage is their maximum).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Scraped {
    /// `vllm:num_requests_running`.
    pub running: f64,
    /// `vllm:num_requests_waiting` (includes requests waiting for remote KV).
    pub waiting: f64,
    /// `vllm:kv_cache_usage_perc`, 0..1.
    pub kv_usage: f64,
    /// `process_start_time_seconds`, when the node exposes it.
    #[serde(skip)]
    pub start_time: Option<f64>,
    /// The sum of the node's monotonic counters that a restart resets
    /// (prompt tokens, prefix-cache queries, finished requests).
    #[serde(skip)]
    pub counters: f64,
    /// Router clock (ms) of the scrape.
    pub at_ms: u64,
}

/// A scrape older than three scrape intervals is not a live figure any more.
pub fn stale_after_ms(load_interval_s: f64) -> u64 {
    (load_interval_s * 3000.0) as u64
}

/// Counters whose sum never goes down while the node process lives.
const RESET_COUNTERS: [&str; 3] = [
    "vllm:prompt_tokens",
    "vllm:prefix_cache_queries",
    "vllm:request_success",
];

/// The families [`parse_metrics`] reads (besides [`RESET_COUNTERS`]).
const LOAD_FAMILIES: [&str; 4] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "process_start_time_seconds",
];

fn is_help(line: &str) -> bool {
    line.strip_prefix('#')
        .is_some_and(|c| c.trim_start().starts_with("HELP "))
}

/// The family a line of a Prometheus text page belongs to: the metric name
/// of a sample, `# HELP` or `# TYPE` line, less a counter's `_total`
/// (`_created` is a gauge family of its own in this format); `None` for
/// blank lines and other comments.
fn family_of(line: &str) -> Option<&str> {
    let rest = match line.strip_prefix('#') {
        Some(c) => c
            .trim_start()
            .strip_prefix("HELP ")
            .or_else(|| c.trim_start().strip_prefix("TYPE "))?
            .trim_start(),
        None => line,
    };
    let end = rest.find(['{', ' ', '\t']).unwrap_or(rest.len());
    let name = &rest[..end];
    Some(name.strip_suffix("_total").unwrap_or(name)).filter(|n| !n.is_empty())
}

/// Only the sample and `# TYPE` lines of the families the router reads. A
/// vLLM page is mostly histograms it never reads, and parsing the whole page
/// was 60 % of the router's instructions at 50 req/s (callgrind, 2 nodes, 1 s
/// scrapes); of what was left, the help texts were half the parse (the
/// format makes `# HELP` optional, and no figure depends on it).
fn load_lines(text: &str) -> String {
    let mut kept = String::with_capacity(1024);
    for line in text.lines() {
        if !is_help(line)
            && family_of(line)
                .is_some_and(|f| LOAD_FAMILIES.contains(&f) || RESET_COUNTERS.contains(&f))
        {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    kept
}

/// Parses a Prometheus text exposition into the figures the router uses;
/// `None` when it holds none of vLLM's load gauges (not a vLLM node).
pub fn parse_metrics(text: &str, at_ms: u64) -> Option<Scraped> {
    use openmetrics_parser::PrometheusValue;
    let page = openmetrics_parser::prometheus::parse_prometheus(&load_lines(text)).ok()?;
    let mut running = None;
    let mut waiting = None;
    let mut kv_usage: Option<f64> = None;
    let mut start_time = None;
    let mut counters = 0.0;
    for (family, metric) in &page.families {
        let name = family.strip_suffix("_total").unwrap_or(family);
        for sample in metric.iter_samples() {
            let v = match &sample.value {
                PrometheusValue::Gauge(n) | PrometheusValue::Unknown(n) => n.as_f64(),
                PrometheusValue::Counter(c) => c.value.as_f64(),
                PrometheusValue::Histogram(_) | PrometheusValue::Summary(_) => continue,
            };
            if !v.is_finite() {
                continue;
            }
            match name {
                "vllm:num_requests_running" => *running.get_or_insert(0.0) += v,
                "vllm:num_requests_waiting" => *waiting.get_or_insert(0.0) += v,
                "vllm:kv_cache_usage_perc" => kv_usage = Some(kv_usage.map_or(v, |k| k.max(v))),
                "process_start_time_seconds" => start_time = Some(v),
                n if RESET_COUNTERS.contains(&n) => counters += v,
                _ => {}
            }
        }
    }
    if running.is_none() && waiting.is_none() && kv_usage.is_none() {
        return None;
    }
    Some(Scraped {
        running: running.unwrap_or(0.0),
        waiting: waiting.unwrap_or(0.0),
        kv_usage: kv_usage.unwrap_or(0.0),
        start_time,
        counters,
        at_ms,
    })
}

/// Whether `now` comes from a different process than `before`: a new start
/// time, or counters that went backwards.
pub fn restarted(before: &Scraped, now: &Scraped) -> bool {
    match (before.start_time, now.start_time) {
        (Some(a), Some(b)) if (a - b).abs() > 0.5 => true,
        _ => now.counters + 0.5 < before.counters,
    }
}

/// A node's load and cache epoch, written by requests and the scraper, read
/// by the route step.
#[derive(Debug, Default)]
pub struct NodeLoad {
    prompt_tokens: AtomicU64,
    decode_tokens: AtomicU64,
    context_tokens: AtomicU64,
    /// Σ 1e6 / decode tokens over the requests decoding (their harmonic mean).
    inv_decode_micros: AtomicU64,
    kv_bytes: AtomicU64,
    scraped: ArcSwapOption<Scraped>,
    scrape_failures: AtomicU64,
    /// Bumped each time the node's cache is known to have been emptied.
    epoch: AtomicU32,
    restarts: AtomicU64,
    /// The router's requests decoding on the node, for the deadline term.
    decodes: Mutex<Vec<Arc<Progress>>>,
}

/// A request the node decodes for the router: when the router gives up on
/// it, and how many tokens of those asked for it has relayed so far.
#[derive(Debug)]
pub(crate) struct Progress {
    deadline_ms: u64,
    asked: u32,
    produced: AtomicU32,
}

impl Progress {
    /// One more token event relayed to the client.
    pub fn token(&self) {
        self.produced.fetch_add(1, Ordering::Relaxed);
    }
}

/// Work the router has put on a node and not yet seen finish.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Work {
    /// Prompt tokens the node computes (the whole prompt on P or on a direct
    /// D, only the new tokens on a local pD, none on a pd D).
    pub prompt_tokens: u32,
    /// Tokens the node is expected to decode.
    pub decode_tokens: u32,
    /// The whole prompt of a request the node decodes: the context its
    /// decode steps attend over (0 on P).
    pub context_tokens: u32,
    /// KV bytes handed to the node by a P.
    pub kv_bytes: u64,
}

impl Work {
    /// 1e6 / the tokens it decodes (0 for none): summed over a node's
    /// requests, their harmonic mean output length.
    fn inv_decode_micros(&self) -> u64 {
        1_000_000u64
            .checked_div(u64::from(self.decode_tokens))
            .unwrap_or(0)
    }
}

impl LoadSnapshot {
    /// Requests on the node as far as anyone says: the router's own, or
    /// what a fresh scrape counts running and waiting (every client's).
    pub fn requests(&self) -> u64 {
        let scraped = self
            .scraped
            .map_or(0.0, |s| s.running.max(0.0) + s.waiting.max(0.0));
        u64::from(self.inflight).max(scraped as u64)
    }

    /// The harmonic mean of the output lengths the node decodes for the
    /// router: a stall of t ms adds t/n to the TPOT of an answer of n tokens.
    pub fn mean_out_harmonic(&self) -> Option<f64> {
        (self.inv_decode_micros > 0 && self.inflight > 0)
            .then(|| f64::from(self.inflight) * 1e6 / self.inv_decode_micros as f64)
    }
}

/// What the route step sees of a node's load.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LoadSnapshot {
    /// The router's requests in flight on the node.
    pub inflight: u32,
    pub prompt_tokens: u64,
    pub decode_tokens: u64,
    pub context_tokens: u64,
    /// Σ 1e6 / decode tokens of the requests it decodes.
    pub inv_decode_micros: u64,
    pub kv_bytes: u64,
    /// The node's own figures, when a scrape within `stale_after_ms` had them.
    pub scraped: Option<Scraped>,
}

impl NodeLoad {
    /// Adds `w` to the node's load; the returned value takes it off on drop.
    pub(crate) fn add(self: &Arc<Self>, w: Work) -> WorkGuard {
        self.prompt_tokens
            .fetch_add(u64::from(w.prompt_tokens), Ordering::Relaxed);
        self.decode_tokens
            .fetch_add(u64::from(w.decode_tokens), Ordering::Relaxed);
        self.context_tokens
            .fetch_add(u64::from(w.context_tokens), Ordering::Relaxed);
        self.inv_decode_micros
            .fetch_add(w.inv_decode_micros(), Ordering::Relaxed);
        self.kv_bytes.fetch_add(w.kv_bytes, Ordering::Relaxed);
        WorkGuard {
            load: Arc::clone(self),
            work: w,
            progress: None,
        }
    }

    /// Like [`Self::add`] for a request the node decodes, whose progress
    /// the router follows against `deadline_ms` (router clock).
    pub(crate) fn add_decode(self: &Arc<Self>, w: Work, deadline_ms: u64) -> WorkGuard {
        let mut g = self.add(w);
        let p = Arc::new(Progress {
            deadline_ms,
            asked: w.decode_tokens,
            produced: AtomicU32::new(0),
        });
        self.decodes.lock().push(Arc::clone(&p));
        g.progress = Some(p);
        g
    }

    /// The router's decodes here closest to their deadline at `now_ms`.
    pub fn at_risk(&self, now_ms: u64) -> AtRisk {
        let mut a = AtRisk::default();
        for p in self.decodes.lock().iter() {
            a.offer(Deadline {
                time_left_ms: p.deadline_ms as f64 - now_ms as f64,
                remaining_tokens: p.asked.saturating_sub(p.produced.load(Ordering::Relaxed)),
            });
        }
        a
    }

    pub fn snapshot(&self, inflight: u32, now_ms: u64, stale_after_ms: u64) -> LoadSnapshot {
        let scraped = self
            .scraped
            .load()
            .as_deref()
            .copied()
            .filter(|s| now_ms.saturating_sub(s.at_ms) <= stale_after_ms);
        LoadSnapshot {
            inflight,
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
            decode_tokens: self.decode_tokens.load(Ordering::Relaxed),
            context_tokens: self.context_tokens.load(Ordering::Relaxed),
            inv_decode_micros: self.inv_decode_micros.load(Ordering::Relaxed),
            kv_bytes: self.kv_bytes.load(Ordering::Relaxed),
            scraped,
        }
    }

    /// Takes a scrape in; returns whether it shows the node restarted since
    /// the previous one. The cache epoch is then bumped, unless
    /// `already_known` (the node's KV events showed the empty cache first).
    pub fn record_scrape(&self, s: Scraped, already_known: bool) -> bool {
        let before = self.scraped.swap(Some(Arc::new(s)));
        let restarted = before.is_some_and(|b| restarted(&b, &s));
        if restarted {
            if !already_known {
                self.cache_cleared();
            }
            self.restarts.fetch_add(1, Ordering::Relaxed);
        }
        restarted
    }

    pub fn record_scrape_failure(&self) {
        self.scrape_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// The node's cache is empty (a restart, or its KV events said so).
    pub fn cache_cleared(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// Changes each time the node's cache is known to have been emptied.
    pub fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::Acquire)
    }

    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }

    pub fn scrape_failures(&self) -> u64 {
        self.scrape_failures.load(Ordering::Relaxed)
    }
}

/// A request's share of a node's load, returned when the request ends.
#[derive(Debug)]
pub(crate) struct WorkGuard {
    load: Arc<NodeLoad>,
    work: Work,
    progress: Option<Arc<Progress>>,
}

impl WorkGuard {
    pub(crate) fn progress(&self) -> Option<&Progress> {
        self.progress.as_deref()
    }
}

impl Drop for WorkGuard {
    fn drop(&mut self) {
        let l = &self.load;
        if let Some(p) = self.progress.take() {
            let mut d = l.decodes.lock();
            if let Some(i) = d.iter().position(|x| Arc::ptr_eq(x, &p)) {
                d.swap_remove(i);
            }
        }
        l.prompt_tokens
            .fetch_sub(u64::from(self.work.prompt_tokens), Ordering::Relaxed);
        l.decode_tokens
            .fetch_sub(u64::from(self.work.decode_tokens), Ordering::Relaxed);
        l.context_tokens
            .fetch_sub(u64::from(self.work.context_tokens), Ordering::Relaxed);
        l.inv_decode_micros
            .fetch_sub(self.work.inv_decode_micros(), Ordering::Relaxed);
        l.kv_bytes.fetch_sub(self.work.kv_bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1200.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.76e9
"#;

    #[test]
    fn engines_are_summed_and_the_fullest_cache_counts() {
        let s = parse_metrics(VLLM, 7).unwrap();
        assert_eq!((s.running, s.waiting, s.kv_usage), (5.0, 4.0, 0.5));
        assert_eq!(s.start_time, Some(1.76e9));
        assert_eq!(s.counters, 1200.0);
        assert_eq!(s.at_ms, 7);
    }

    /// VLLM with what a real page (Python's prometheus_client) has around
    /// it: histograms, other families, a counter's `_created` family, comments.
    fn full_page() -> String {
        let mut page = String::from("# some comment\n\n");
        page.push_str("# HELP vllm:time_to_first_token_seconds Histogram.\n");
        page.push_str("# TYPE vllm:time_to_first_token_seconds histogram\n");
        for i in 0..40 {
            page.push_str(&format!(
                "vllm:time_to_first_token_seconds_bucket{{le=\"{i}.0\",model_name=\"m\"}} {i}.0\n"
            ));
        }
        page.push_str(
            "vllm:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"m\"} 40.0\n",
        );
        page.push_str("vllm:time_to_first_token_seconds_count{model_name=\"m\"} 40.0\n");
        page.push_str("vllm:time_to_first_token_seconds_sum{model_name=\"m\"} 12.5\n");
        page.push_str(&VLLM.replace(
            "1200.0\n",
            "1200.0\n# HELP vllm:prompt_tokens_created Created.\n# TYPE vllm:prompt_tokens_created gauge\n\
             vllm:prompt_tokens_created{engine=\"0\",model_name=\"m\"} 1.7e9\n",
        ));
        page.push_str(
            "# TYPE vllm:num_requests_running_other gauge\nvllm:num_requests_running_other 99\n",
        );
        page
    }

    #[test]
    fn a_whole_page_parses_to_what_its_load_lines_say() {
        let page = full_page();
        let whole = openmetrics_parser::prometheus::parse_prometheus(&page);
        assert!(whole.is_ok(), "the fixture is a valid page: {whole:?}");
        let kept = load_lines(&page);
        assert!(!kept.contains("time_to_first_token"), "{kept}");
        assert!(!kept.contains("running_other"), "{kept}");
        assert!(
            !kept.contains("# HELP"),
            "help texts are not parsed: {kept}"
        );
        assert!(
            kept.contains("# TYPE vllm:prompt_tokens_total counter"),
            "{kept}"
        );
        assert_eq!(parse_metrics(&page, 7), parse_metrics(VLLM, 7));
    }

    #[test]
    fn a_malformed_family_the_router_does_not_read_hides_nothing() {
        // A histogram without its +Inf bucket fails the whole page's parse.
        let page = full_page().replace(
            "vllm:time_to_first_token_seconds_bucket{le=\"+Inf\"",
            "x{le=\"1\"",
        );
        assert!(openmetrics_parser::prometheus::parse_prometheus(&page).is_err());
        assert_eq!(parse_metrics(&page, 7), parse_metrics(VLLM, 7));
    }

    #[test]
    fn a_line_names_its_family_without_a_counter_suffix() {
        assert_eq!(
            family_of("vllm:prompt_tokens_total{a=\"b\"} 1"),
            Some("vllm:prompt_tokens")
        );
        assert_eq!(
            family_of("# TYPE vllm:prompt_tokens_total counter"),
            Some("vllm:prompt_tokens")
        );
        assert_eq!(family_of("#  HELP up Up."), Some("up"));
        assert_eq!(family_of("up 1"), Some("up"));
        assert_eq!(family_of("# a comment"), None);
        assert_eq!(family_of(""), None);
    }

    #[test]
    fn a_page_without_vllm_gauges_is_not_a_load_figure() {
        assert!(parse_metrics("# TYPE up gauge\nup 1\n", 0).is_none());
        assert!(parse_metrics("", 0).is_none());
        assert!(parse_metrics("\u{0}garbage {{{", 0).is_none());
    }

    #[test]
    fn a_new_start_time_or_a_counter_going_back_is_a_restart() {
        let a = parse_metrics(VLLM, 0).unwrap();
        assert!(!restarted(&a, &a));
        let later = Scraped {
            counters: a.counters + 10.0,
            ..a
        };
        assert!(!restarted(&a, &later));
        let new_process = Scraped {
            start_time: Some(1.77e9),
            ..later
        };
        assert!(restarted(&a, &new_process));
        let reset = Scraped {
            start_time: None,
            counters: 3.0,
            ..a
        };
        assert!(restarted(&a, &reset));
    }

    #[test]
    fn a_restart_bumps_the_cache_epoch_once() {
        let load = NodeLoad::default();
        let a = parse_metrics(VLLM, 0).unwrap();
        assert!(!load.record_scrape(a, false));
        assert!(!load.record_scrape(a, false));
        assert_eq!(load.epoch(), 0);
        assert!(load.record_scrape(
            Scraped {
                start_time: Some(2e9),
                ..a
            },
            false
        ));
        assert_eq!((load.epoch(), load.restarts()), (1, 1));
        // A restart the KV events already reported is counted, not bumped again.
        assert!(load.record_scrape(a, true));
        assert_eq!((load.epoch(), load.restarts()), (1, 2));
    }

    #[test]
    fn work_is_counted_while_its_guard_lives() {
        let load = Arc::new(NodeLoad::default());
        let w = Work {
            prompt_tokens: 100,
            decode_tokens: 20,
            context_tokens: 300,
            kv_bytes: 4096,
        };
        let g1 = load.add(w);
        let g2 = load.add(w);
        let s = load.snapshot(2, 0, 1000);
        assert_eq!(
            (
                s.prompt_tokens,
                s.decode_tokens,
                s.context_tokens,
                s.kv_bytes
            ),
            (200, 40, 600, 8192)
        );
        drop(g1);
        drop(g2);
        let s = load.snapshot(0, 0, 1000);
        assert_eq!((s.prompt_tokens, s.decode_tokens, s.kv_bytes), (0, 0, 0));
    }

    #[test]
    fn a_stale_scrape_is_not_shown() {
        let load = NodeLoad::default();
        load.record_scrape(parse_metrics(VLLM, 1000).unwrap(), false);
        assert!(load.snapshot(0, 2000, 1500).scraped.is_some());
        assert!(load.snapshot(0, 2600, 1500).scraped.is_none());
    }

    #[test]
    fn a_decode_is_followed_against_its_deadline_until_it_ends() {
        let load = Arc::new(NodeLoad::default());
        let w = |tokens| Work {
            decode_tokens: tokens,
            ..Work::default()
        };
        let near = load.add_decode(w(100), 10_000);
        let far = load.add_decode(w(100), 60_000);
        for _ in 0..40 {
            near.progress().unwrap().token();
        }
        let left: Vec<(f64, u32)> = load
            .at_risk(4_000)
            .0
            .iter()
            .flatten()
            .map(|d| (d.time_left_ms, d.remaining_tokens))
            .collect();
        assert_eq!(left, [(6_000.0, 60), (56_000.0, 100)]);
        drop(near);
        let left = load.at_risk(4_000);
        assert_eq!(left.0.iter().flatten().count(), 1);
        drop(far);
        assert_eq!(load.at_risk(4_000), AtRisk::default());
    }
}
