//! The router's shared state, built once from a validated configuration.

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use thread_local::ThreadLocal;

use ppd_core::qps::QpsEstimator;
use ppd_core::session::{SessionConfig, SessionTable};
use ppd_core::tokens::{TokenCounter, WordRule};
use ppd_core::{DecisionEngine, Path, Reason, Table};

use crate::config::{KvProtocol, RouterConfig, Validated};
use crate::metrics::Metrics;
use crate::registry::{BreakerConfig, Registry, Role, Source};
use crate::ServerError;

/// The shipped tables, compiled in so a bare install can route with them.
pub const BUILTIN_TABLES: [(&str, &str); 3] = [
    (
        "h100-1P3pD",
        include_str!("../../../tables/h100-llama3.1-8b-1P3pD.json"),
    ),
    (
        "h100-2P2pD",
        include_str!("../../../tables/h100-llama3.1-8b-2P2pD.json"),
    ),
    (
        "h100-3P1pD",
        include_str!("../../../tables/h100-llama3.1-8b-3P1pD.json"),
    ),
];

/// Loads `builtin:NAME` or a file path.
pub fn load_table(spec: &str) -> Result<Table, ServerError> {
    if let Some(name) = spec.strip_prefix("builtin:") {
        let (_, text) = BUILTIN_TABLES
            .iter()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| ServerError::Config(format!("invalid setting `table`: no builtin table {name:?} (have h100-1P3pD, h100-2P2pD, h100-3P1pD)")))?;
        return Table::from_json(text, spec).map_err(|e| ServerError::Config(e.to_string()));
    }
    let text = std::fs::read_to_string(spec).map_err(|e| {
        ServerError::Config(format!("invalid setting `table`: cannot read {spec}: {e}"))
    })?;
    Table::from_json(&text, spec).map_err(|e| ServerError::Config(e.to_string()))
}

/// The builtin table whose P:D ratio is closest to the deployment's.
pub fn default_table_for(p: usize, d: usize) -> String {
    let ratio = if d == 0 {
        1.0
    } else {
        p as f64 / (p + d) as f64
    };
    let options = [
        (0.25, "h100-1P3pD"),
        (0.5, "h100-2P2pD"),
        (0.75, "h100-3P1pD"),
    ];
    let best = options
        .iter()
        .min_by(|a, b| (a.0 - ratio).abs().total_cmp(&(b.0 - ratio).abs()))
        .map_or("h100-2P2pD", |o| o.1);
    format!("builtin:{best}")
}

/// Counts of decisions by path, reason and cell, for the admin API.
#[derive(Default)]
pub struct DecisionStats {
    pub by_path_reason: HashMap<(Path, Reason), u64>,
    pub by_cell: HashMap<(String, String, u64), [u64; 3]>,
}

#[derive(Serialize)]
pub struct CellCount {
    pub context: String,
    pub workload: String,
    pub qps: f64,
    pub pd: u64,
    pub local: u64,
    pub replica: u64,
}

pub struct AppState {
    pub cfg: RouterConfig,
    pub kv: KvProtocol,
    pub engine: DecisionEngine,
    pub table_spec: Mutex<String>,
    pub sessions: SessionTable,
    pub registry: Registry,
    pub qps: Mutex<QpsEstimator>,
    pub metrics: Metrics,
    /// One HTTP client (and so one upstream connection pool) per thread: see
    /// [`AppState::client`].
    clients: ThreadLocal<reqwest::Client>,
    /// Built at start, so a client that cannot be built is a start-up error.
    first_client: reqwest::Client,
    pub counter: Arc<dyn TokenCounter>,
    pub stats: Mutex<DecisionStats>,
    /// Model entries of `/v1/models`, gathered from the nodes.
    pub models: ArcSwap<Vec<serde_json::Value>>,
    started: Instant,
    started_wall_ms: u64,
}

impl AppState {
    pub fn build(
        cfg: RouterConfig,
        v: &Validated,
        table_spec: String,
    ) -> Result<Arc<AppState>, ServerError> {
        let table = load_table(&table_spec)?;
        let engine = DecisionEngine::new(table, v.policy, v.weights);
        let sessions = SessionTable::new(SessionConfig {
            ttl_ms: (cfg.session_ttl * 1000.0) as u64,
            capacity: cfg.session_capacity,
            shards: 64,
        })
        .map_err(|e| ServerError::Config(e.to_string()))?;
        let registry = Registry::new(BreakerConfig {
            failures: cfg.breaker_failures,
            open_ms: (cfg.breaker_open * 1000.0) as u64,
        });
        let qps = QpsEstimator::new((cfg.qps_window * 1000.0) as u64, 100)
            .map_err(|e| ServerError::Config(e.to_string()))?;
        let counter: Arc<dyn TokenCounter> = match &cfg.tokenizer {
            Some(path) => {
                Arc::new(ppd_core::tokens::HfTokenizer::from_file(path).map_err(|e| {
                    ServerError::Config(format!("invalid setting `tokenizer`: {e}"))
                })?)
            }
            None => Arc::new(WordRule),
        };
        let first_client =
            http_client(&cfg).map_err(|e| ServerError::Config(format!("HTTP client: {e}")))?;
        let started_wall_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let state = Arc::new(AppState {
            kv: v.kv,
            engine,
            table_spec: Mutex::new(table_spec),
            sessions,
            registry,
            qps: Mutex::new(qps),
            metrics: Metrics::new(),
            clients: ThreadLocal::new(),
            first_client,
            counter,
            stats: Mutex::new(DecisionStats::default()),
            models: ArcSwap::from_pointee(Vec::new()),
            started: Instant::now(),
            started_wall_ms,
            cfg,
        });
        let now = state.now_ms();
        for (specs, role) in [
            (&v.prefill, Role::P),
            (&v.decode, Role::D),
            (&v.pd_capable, Role::PD),
            (&v.replica, Role::R),
        ] {
            for s in specs {
                state
                    .registry
                    .upsert(&s.url, role, s.zmq.clone(), Source::Static, now);
            }
        }
        Ok(state)
    }

    /// The calling thread's HTTP client. A pooled connection is driven by a
    /// task on the runtime that opened it; with a pool per thread, a request on
    /// a thread-per-core I/O thread only uses connections driven on that same
    /// thread, so no wake-up crosses threads.
    pub fn client(&self) -> &reqwest::Client {
        self.clients
            .get_or(|| http_client(&self.cfg).unwrap_or_else(|_| self.first_client.clone()))
    }

    /// Wall-clock milliseconds that never step back (monotonic since start).
    pub fn now_ms(&self) -> u64 {
        self.started_wall_ms + self.started.elapsed().as_millis() as u64
    }

    /// Share of new conversations for replicas in a hybrid deployment.
    pub fn replica_share(&self) -> f64 {
        if let Some(s) = self.cfg.replica_share {
            return s;
        }
        let r = self.registry.count(|n| n.role == Role::R);
        let d = self.registry.count(|n| n.role.decodes());
        if r + d == 0 {
            0.0
        } else {
            r as f64 / (r + d) as f64
        }
    }

    pub fn record_decision(&self, path: Path, reason: Reason, cell: Option<(String, String, f64)>) {
        let mut s = self.stats.lock();
        *s.by_path_reason.entry((path, reason)).or_insert(0) += 1;
        if let Some((c, w, q)) = cell {
            let e = s.by_cell.entry((c, w, q.to_bits())).or_insert([0; 3]);
            e[match path {
                Path::Pd => 0,
                Path::Local => 1,
                Path::Replica => 2,
            }] += 1;
        }
    }

    pub fn cell_counts(&self) -> Vec<CellCount> {
        let s = self.stats.lock();
        let mut out: Vec<CellCount> = s
            .by_cell
            .iter()
            .map(|((c, w, q), n)| CellCount {
                context: c.clone(),
                workload: w.clone(),
                qps: f64::from_bits(*q),
                pd: n[0],
                local: n[1],
                replica: n[2],
            })
            .collect();
        out.sort_by(|a, b| {
            (&a.context, &a.workload)
                .cmp(&(&b.context, &b.workload))
                .then(a.qps.total_cmp(&b.qps))
        });
        out
    }
}

fn http_client(cfg: &RouterConfig) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs_f64(cfg.connect_timeout))
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024)
        .tcp_nodelay(true)
        .build()
}
