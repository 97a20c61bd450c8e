//! The router's shared state, built once from a validated configuration.

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use thread_local::ThreadLocal;

use ppd_core::builtin::load_table;
use ppd_core::prompt::{HfRenderer, PromptRenderer, WordRuleRenderer};
use ppd_core::qps::QpsEstimator;
use ppd_core::session::{SessionConfig, SessionTable};
use ppd_core::tokens::{TokenCounter, WordRule};
use ppd_core::{DecisionEngine, Path, Reason, Role};

use crate::admission::Admission;
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
    clients: ThreadLocal<reqwest::Client>,
    /// Built at start, so a client that cannot be built is a start-up error.
    first_client: reqwest::Client,
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
            http_client(&cfg).map_err(|e| ServerError::Config(format!("HTTP client: {e}")))?;
        let started_wall_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let shared = match &cfg.state_url {
            Some(url) => Some(
                crate::shared::Shared::new(url, &cfg.state_prefix, started_wall_ms)
                    .map_err(|e| ServerError::Config(format!("invalid setting `state`: {e}")))?,
            ),
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

/// The client of every node call. With `upstream_api_key` it sends
/// `Authorization: Bearer <key>` on each call (completions, health checks,
/// `/metrics` scrapes, `/v1/models`); `https://` nodes are reached over rustls
/// with the public web roots and, with `upstream_ca_file`, its CAs.
pub(crate) fn http_client(cfg: &RouterConfig) -> Result<reqwest::Client, String> {
    let mut b = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs_f64(cfg.connect_timeout))
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024)
        .tcp_nodelay(true);
    if let Some(key) = cfg.upstream_secret.get() {
        let mut v = axum::http::HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| "invalid setting `upstream_api_key`: not a header value".to_owned())?;
        v.set_sensitive(true);
        let mut h = reqwest::header::HeaderMap::new();
        h.insert(reqwest::header::AUTHORIZATION, v);
        b = b.default_headers(h);
    }
    if let Some(path) = &cfg.upstream_ca_file {
        for cert in config::read_ca_file(path)
            .map_err(|e| format!("invalid setting `upstream_ca_file`: {e}"))?
        {
            b = b.add_root_certificate(cert);
        }
    }
    b.build().map_err(|e| e.to_string())
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
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A one-answer-per-connection HTTPS node on 127.0.0.1 with a self-signed
    /// certificate for `localhost`: answers 200 and sends back the
    /// `Authorization` line it got (or `none`). Returns its port and the
    /// certificate's PEM.
    // ring, the provider reqwest's rustls uses here (rustls deprecates it
    // for lacking post-quantum key exchange, irrelevant to a test node).
    #[allow(deprecated)]
    async fn tls_node() -> (u16, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let pem = cert.pem();
        let server = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&head).to_lowercase();
                    let auth = head
                        .lines()
                        .find_map(|l| l.strip_prefix("authorization: "))
                        .unwrap_or("none")
                        .to_owned();
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{auth}",
                        auth.len()
                    );
                    let _ = tls.write_all(answer.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        (port, pem)
    }

    fn settings_with(mutate: impl FnOnce(&mut RouterConfig)) -> RouterConfig {
        let mut c = RouterConfig::default();
        mutate(&mut c);
        c.validate().unwrap().config().clone()
    }

    #[tokio::test]
    async fn https_nodes_are_reached_with_the_ca_file_and_the_upstream_key() {
        let (port, pem) = tls_node().await;
        let dir = std::env::temp_dir().join(format!("ppd-tls-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, &pem).unwrap();
        let url = format!("https://localhost:{port}/health");
        let node = format!("https://localhost:{port}");

        // The node's certificate is trusted through upstream_ca_file; the
        // upstream key goes on every call the client makes.
        let cfg = settings_with(|c| {
            c.replica = vec![node.clone()];
            c.upstream_ca_file = Some(ca.display().to_string());
            c.upstream_api_key = Some("node-key".into());
        });
        let client = http_client(&cfg).unwrap();
        let r = client.get(&url).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "bearer node-key");

        // Without the key, nothing; without the CA, the handshake fails.
        let cfg = settings_with(|c| c.upstream_ca_file = Some(ca.display().to_string()));
        let r = http_client(&cfg).unwrap().get(&url).send().await.unwrap();
        assert_eq!(r.text().await.unwrap(), "none");
        let untrusting = http_client(&RouterConfig::default()).unwrap();
        let e = untrusting.get(&url).send().await.unwrap_err();
        assert!(e.is_connect(), "{e:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
