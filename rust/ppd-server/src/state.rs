//! The router's shared state, built once from a validated configuration.

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use thread_local::ThreadLocal;

use ppd_core::builtin::load_table;
use ppd_core::prompt::{HfRenderer, PromptRenderer, WordRuleRenderer};
use ppd_core::qps::QpsEstimator;
use ppd_core::session::{SessionConfig, SessionTable};
use ppd_core::tokens::{TokenCounter, WordRule};
use ppd_core::{DecisionEngine, Path, Reason, Role};

use crate::admission::Admission;
use crate::client::NodeClient;
use crate::config::{self, RouterConfig, Settings};
use crate::connector::{self, KvConnector};
use crate::metrics::Metrics;
use crate::pull::PullHandles;
use crate::registry::{BreakerConfig, NodeLimits, Registry, Source};
use crate::ServerError;

/// Counts of decisions by path, reason and cell, for the admin API.
#[derive(Default)]
pub struct DecisionStats {
    pub by_path_reason: HashMap<(Path, Reason), u64>,
    /// Decisions per cell, by path in [`Path::ALL`] order.
    pub by_cell: HashMap<(String, String, u64), [u64; 4]>,
}

#[derive(Serialize)]
pub struct CellCount {
    pub context: String,
    pub workload: String,
    pub qps: f64,
    pub pd: u64,
    pub local: u64,
    pub replica: u64,
    pub pull: u64,
}

/// Memory the pull path's handles may take in the router (a handle names a
/// D's pin: ~100 bytes plus 4 per block id).
const PULL_HANDLES_MAX_BYTES: usize = 64 << 20;

pub struct AppState {
    pub cfg: RouterConfig,
    /// How the pd path hands KV from P to D, chosen once from `kv_protocol`.
    pub(crate) connector: Box<dyn KvConnector>,
    pub(crate) admission: Admission,
    pub engine: DecisionEngine,
    pub table_spec: Mutex<String>,
    pub sessions: SessionTable,
    pub registry: Registry,
    pub qps: Mutex<QpsEstimator>,
    pub metrics: Metrics,
    /// One HTTP client (and so one upstream connection pool) per thread: see
    /// [`AppState::client`].
    clients: ThreadLocal<NodeClient>,
    /// Built at start, so a client that cannot be built is a start-up error.
    first_client: NodeClient,
    pub counter: Arc<dyn TokenCounter>,
    /// Renders requests into node token ids for exact residency (`None`: approximate only).
    pub renderer: Option<Arc<dyn PromptRenderer>>,
    pub stats: Mutex<DecisionStats>,
    /// What bidirectional D nodes pin for the pull path, per conversation.
    pub(crate) pulls: PullHandles,
    /// The runtime that runs KV-event subscribers of nodes registered later
    /// (set when the router starts).
    pub(crate) background: std::sync::OnceLock<tokio::runtime::Handle>,
    /// Model entries of `/v1/models`, gathered from the nodes.
    pub models: ArcSwap<Vec<serde_json::Value>>,
    /// Admin changes shared with the other replicas (with `state` only).
    pub(crate) shared: Option<crate::shared::Shared>,
    started: Instant,
    started_wall_ms: u64,
}

impl AppState {
    pub fn build(settings: &Settings) -> Result<Arc<AppState>, ServerError> {
        let cfg = settings.config().clone();
        let table_spec = settings.table_spec();
        let table = load_table(&table_spec)
            .map_err(|e| ServerError::Config(format!("invalid setting `table`: {e}")))?;
        let engine = DecisionEngine::new(table, cfg.policy, settings.weights());
        engine.set_cost_model(Arc::new(ppd_core::CostModel::new(
            settings.profile().clone(),
        )));
        engine.set_slo(settings.slo());
        let sessions = SessionTable::new(SessionConfig {
            ttl_ms: (cfg.session_ttl * 1000.0) as u64,
            capacity: cfg.session_capacity,
            shards: 64,
            max_bytes: cfg.session_max_bytes,
        })
        .map_err(|e| ServerError::Config(e.to_string()))?;
        let registry = Registry::new(
            BreakerConfig {
                failures: cfg.breaker_failures,
                open_ms: (cfg.breaker_open * 1000.0) as u64,
            },
            NodeLimits {
                requests: cfg.max_inflight_per_node,
                prompt_tokens: cfg.max_inflight_tokens_per_node,
            },
        );
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
        let renderer = prompt_renderer(&cfg)?;
        let first_client =
            NodeClient::new(&cfg).map_err(|e| ServerError::Config(format!("HTTP client: {e}")))?;
        let started_wall_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let shared = match &cfg.state_url {
            Some(url) => {
                let ca = match &cfg.state_ca_file {
                    Some(path) => Some(std::fs::read(path).map_err(|e| {
                        ServerError::Config(format!("invalid setting `state_ca_file`: {e}"))
                    })?),
                    None => None,
                };
                Some(
                    crate::shared::Shared::new(url, ca, &cfg.state_prefix, started_wall_ms)
                        .map_err(|e| {
                            ServerError::Config(format!("invalid setting `state`: {e}"))
                        })?,
                )
            }
            None => None,
        };
        let metrics = if shared.is_some() {
            Metrics::new().with_state_metrics()
        } else {
            Metrics::new()
        };
        let state = Arc::new(AppState {
            connector: connector::build(cfg.kv_protocol),
            admission: Admission::new(&cfg),
            engine,
            table_spec: Mutex::new(table_spec),
            sessions,
            registry,
            qps: Mutex::new(qps),
            metrics,
            clients: ThreadLocal::new(),
            first_client,
            counter,
            renderer,
            stats: Mutex::new(DecisionStats::default()),
            pulls: PullHandles::new(PULL_HANDLES_MAX_BYTES),
            background: std::sync::OnceLock::new(),
            models: ArcSwap::from_pointee(Vec::new()),
            shared,
            started: Instant::now(),
            started_wall_ms,
            cfg,
        });
        let now = state.now_ms();
        for (role, node) in settings.nodes() {
            state.registry.upsert_with_events(
                &node.url,
                *role,
                node.zmq.clone(),
                node.kv_events.clone(),
                Source::Static,
                now,
            );
        }
        Ok(state)
    }

    /// The calling thread's HTTP client. A pooled connection is driven by a
    /// task on the runtime that opened it; with a pool per thread, a request on
    /// a thread-per-core I/O thread only uses connections driven on that same
    /// thread, so no wake-up crosses threads.
    pub(crate) fn client(&self) -> &NodeClient {
        self.clients
            .get_or(|| NodeClient::new(&self.cfg).unwrap_or_else(|_| self.first_client.clone()))
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
            let e = s.by_cell.entry((c, w, q.to_bits())).or_insert([0; 4]);
            if let Some(i) = Path::ALL.iter().position(|p| *p == path) {
                e[i] += 1;
            }
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
                pull: n[3],
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

/// The renderer of exact residency, from `prompt_renderer` and `tokenizer`.
fn prompt_renderer(cfg: &RouterConfig) -> Result<Option<Arc<dyn PromptRenderer>>, ServerError> {
    Ok(match (cfg.prompt_renderer, &cfg.tokenizer) {
        (config::PromptRenderer::None, _) | (config::PromptRenderer::Auto, None) => None,
        (config::PromptRenderer::WordRule, _) => Some(Arc::new(WordRuleRenderer)),
        (config::PromptRenderer::Auto, Some(path)) => Some(Arc::new(
            HfRenderer::from_tokenizer_file(path).map_err(|e| {
                ServerError::Config(format!(
                    "invalid setting `tokenizer` (its chat template): {e}"
                ))
            })?,
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_file_that_is_not_pem_certificates_is_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("ppd-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("ca.pem");
        std::fs::write(&f, "not a certificate\n").unwrap();
        for path in [f.display().to_string(), "/nonexistent/ca.pem".into()] {
            let c = RouterConfig {
                upstream_ca_file: Some(path),
                ..RouterConfig::default()
            };
            assert_eq!(c.validate().unwrap_err().field, "upstream_ca_file");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
