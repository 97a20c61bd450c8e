//! ppd-emulator: vLLM-compatible P, D (pD) and R nodes for machines without GPUs.
//!
//! Each node runs the engine model of [`ppd_model`] against the wall
//! clock and serves vLLM's OpenAI API, `/metrics`, and the NIXL
//! `kv_transfer_params` exchange. Nodes can run one per process
//! ([`run_blocking`]) or many in one process ([`start_cluster`]).

mod api;
mod driver;
mod kv_publisher;
pub use kv_publisher::KvEventsConfig;
mod logprobs;
mod metrics;
mod openai;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

pub use ppd_core::layout::{parse_layout, Role};
pub use ppd_model::{load_profile, Profile};

/// Fault injection for tests; also settable at run time by `POST /admin/faults`.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Added before every generation request is admitted, ms.
    pub latency_ms: f64,
    /// Share of generation requests answered with HTTP 500, in [0, 1].
    pub error_rate: f64,
    /// Accept generation requests and never answer them.
    pub hang: bool,
    /// Stop serving at once: the listener closes and open streams are cut.
    pub crash: bool,
}

impl Faults {
    pub fn validate(&self) -> Result<(), Error> {
        if !self.latency_ms.is_finite() || self.latency_ms < 0.0 {
            return Err(Error::Config(format!(
                "latency_ms must be ≥ 0, got {}",
                self.latency_ms
            )));
        }
        if !(0.0..=1.0).contains(&self.error_rate) {
            return Err(Error::Config(format!(
                "error_rate must be in [0, 1], got {}",
                self.error_rate
            )));
        }
        Ok(())
    }
}

/// One node's settings. `None` overrides keep the profile's value.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub role: Role,
    /// Address to bind for [`run_blocking`] (ignored by [`serve`], which gets a listener).
    pub host: String,
    pub port: u16,
    pub profile: Profile,
    pub kv_link_gbps: Option<f64>,
    pub max_num_seqs: Option<u32>,
    pub max_num_batched_tokens: Option<u32>,
    pub kv_blocks: Option<u32>,
    pub seed: u64,
    pub served_model_name: String,
    /// NIXL engine id reported in `kv_transfer_params` (default: a name from role and port).
    pub engine_id: Option<String>,
    /// Host that D nodes use to reach this node's KV (`remote_host`).
    pub advertise_host: String,
    pub faults: Faults,
    /// Publish KV events like vLLM's `--kv-events-config` (None: off).
    pub kv_events: Option<KvEventsConfig>,
    /// vLLM's NIXL bidirectional transfer (None: off).
    pub bidirectional: Option<Bidirectional>,
    /// vLLM's `--api-key`: requests on paths under `/v1` must carry
    /// `Authorization: Bearer <key>` (else 401 `{"error": "Unauthorized"}`);
    /// `/health`, `/metrics` and the rest stay open, as in vLLM.
    pub api_key: Option<String>,
}

/// vLLM's NIXL `kv_connector_extra_config` for bidirectional transfer: a D
/// keeps a finished request's blocks for `decoder_kv_blocks_ttl` seconds and
/// names them in its answer's `kv_transfer_params`, so that a P can read the
/// conversation's KV back (`do_remote_decode` with D's `remote_block_ids`) and
/// prefill only the new tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bidirectional {
    /// Seconds a D pins a finished request's blocks (vLLM's default 480).
    pub decoder_kv_blocks_ttl_s: f64,
    /// A P recomputes instead of pulling fewer tokens than this (vLLM's default 64).
    pub kv_recompute_threshold: u32,
}

impl Default for Bidirectional {
    fn default() -> Self {
        Bidirectional {
            decoder_kv_blocks_ttl_s: 480.0,
            kv_recompute_threshold: 64,
        }
    }
}

impl Bidirectional {
    /// From vLLM's `kv_connector_extra_config` JSON (`bidirectional_kv_xfer`,
    /// `decoder_kv_blocks_ttl`, `kv_recompute_threshold`); `None` when
    /// bidirectional transfer is off. Other keys are vLLM's and ignored here.
    pub fn from_extra_config(json: &str) -> Result<Option<Bidirectional>, Error> {
        #[derive(serde::Deserialize)]
        struct Extra {
            #[serde(default)]
            bidirectional_kv_xfer: bool,
            decoder_kv_blocks_ttl: Option<f64>,
            kv_recompute_threshold: Option<u32>,
        }
        let e: Extra = serde_json::from_str(json)
            .map_err(|e| Error::Config(format!("kv_connector_extra_config: {e}")))?;
        if !e.bidirectional_kv_xfer {
            return Ok(None);
        }
        let d = Bidirectional::default();
        let b = Bidirectional {
            decoder_kv_blocks_ttl_s: e.decoder_kv_blocks_ttl.unwrap_or(d.decoder_kv_blocks_ttl_s),
            kv_recompute_threshold: e.kv_recompute_threshold.unwrap_or(d.kv_recompute_threshold),
        };
        if !(b.decoder_kv_blocks_ttl_s.is_finite() && b.decoder_kv_blocks_ttl_s > 0.0) {
            return Err(Error::Config(format!(
                "decoder_kv_blocks_ttl must be a positive number of seconds, got {}",
                b.decoder_kv_blocks_ttl_s
            )));
        }
        Ok(Some(b))
    }
}

impl NodeConfig {
    /// A node of `role` with the built-in calibrated profile on port 0.
    pub fn new(role: Role) -> NodeConfig {
        NodeConfig {
            role,
            host: "127.0.0.1".into(),
            port: 0,
            profile: ppd_core::profiles::default_profile(),
            kv_link_gbps: None,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            kv_blocks: None,
            seed: 0,
            served_model_name: "meta-llama/Llama-3.1-8B-Instruct".into(),
            engine_id: None,
            advertise_host: "127.0.0.1".into(),
            faults: Faults::default(),
            kv_events: None,
            bidirectional: None,
            api_key: None,
        }
    }

    /// The profile with this node's overrides applied and validated.
    pub fn effective_profile(&self) -> Result<Profile, Error> {
        let mut p = self.profile.clone();
        if let Some(g) = self.kv_link_gbps {
            p.link.gbps = g;
        }
        if let Some(n) = self.max_num_seqs {
            p.max_num_seqs = n;
        }
        if let Some(n) = self.max_num_batched_tokens {
            p.max_num_batched_tokens = n;
        }
        if let Some(n) = self.kv_blocks {
            p.kv_blocks = n;
        }
        p.validate().map_err(model_error)?;
        self.faults.validate()?;
        if self.served_model_name.trim().is_empty() {
            return Err(Error::Config("served model name must not be empty".into()));
        }
        Ok(p)
    }
}

/// The model's configuration errors, in the emulator's words.
pub fn model_error(e: ppd_core::Error) -> Error {
    match e {
        ppd_core::Error::Config(m) => Error::Config(m),
        other => Error::Config(other.to_string()),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("node crashed by fault injection")]
    Crashed,
}

/// Serves one node on `listener` until `shutdown` resolves (graceful: open
/// streams finish) or a crash fault fires (abrupt, returns [`Error::Crashed`]).
pub async fn serve(
    cfg: NodeConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let profile = cfg.effective_profile()?;
    let port = listener.local_addr()?.port();
    let state = api::AppState::new(&cfg, profile, port);
    let crash = state.crash_signal();
    let app = api::router(Arc::clone(&state));
    let st = Arc::clone(&state);
    let shutdown = async move {
        shutdown.await;
        st.release_hangs();
    };
    let server = axum::serve(listener, app).with_graceful_shutdown(shutdown);
    let result = tokio::select! {
        r = server => r.map_err(Error::Io),
        _ = crash.notified() => Err(Error::Crashed),
    };
    state.release_hangs();
    result
}

/// Binds `cfg.host:cfg.port`, serves on a runtime of its own, and returns when
/// `shutdown` resolves (Ok), on a crash fault, or on an error.
pub fn run_blocking(
    cfg: NodeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", cfg.host, cfg.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| Error::Config(format!("cannot bind {addr}: {e}")))?;
        serve(cfg, listener, shutdown).await
    })
}

/// A node of a running cluster.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub role: Role,
    pub addr: SocketAddr,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    /// Where it publishes KV events (decoding nodes), for the router to bind.
    pub kv_events: Option<String>,
}

impl NodeInfo {
    /// The node as the router's settings name it (`URL;kv_events=...`).
    pub fn spec(&self) -> String {
        match &self.kv_events {
            Some(e) => format!("{};kv_events={e}", self.url),
            None => self.url.clone(),
        }
    }
}

/// A free loopback port for a KV-event endpoint (the subscriber binds it later).
fn free_port() -> Result<u16, Error> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Nodes started in this process; [`Cluster::shutdown`] stops them all.
pub struct Cluster {
    pub nodes: Vec<NodeInfo>,
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<Result<(), Error>>>,
}

impl Cluster {
    /// Stops every node gracefully and waits for them.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url.clone()).collect()
    }
}

/// Starts one node per role on free 127.0.0.1 ports, on the current tokio
/// runtime. `base` gives everything but role and port; node `i` gets seed
/// `base.seed + i`.
pub async fn start_cluster(roles: &[Role], base: &NodeConfig) -> Result<Cluster, Error> {
    base.effective_profile()?;
    let (stop, rx) = tokio::sync::watch::channel(false);
    let mut nodes = Vec::with_capacity(roles.len());
    let mut tasks = Vec::with_capacity(roles.len());
    for (i, &role) in roles.iter().enumerate() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let mut cfg = base.clone();
        cfg.role = role;
        cfg.port = addr.port();
        cfg.seed = base.seed.wrapping_add(i as u64);
        cfg.engine_id = Some(format!("emu-{}{}-{}", role.as_str(), i, addr.port()));
        // Decoding nodes publish their cache as vLLM's would; P's KV only passes through.
        if role != Role::P {
            cfg.kv_events = Some(KvEventsConfig::new(
                &format!("tcp://127.0.0.1:{}", free_port()?),
                &format!("kv.{}{i}", role.as_str()),
                false,
            ));
        }
        let kv_events = cfg.kv_events.as_ref().map(|k| k.endpoint.clone());
        let mut rx = rx.clone();
        let stop_fut = async move {
            while !*rx.borrow() {
                if rx.changed().await.is_err() {
                    break;
                }
            }
        };
        tasks.push(tokio::spawn(serve(cfg, listener, stop_fut)));
        nodes.push(NodeInfo {
            role,
            addr,
            url: format!("http://{addr}"),
            kv_events,
        });
    }
    Ok(Cluster { nodes, stop, tasks })
}

/// A cluster on a runtime thread of its own, for callers without tokio (bindings, CLIs).
pub struct ClusterThread {
    pub nodes: Vec<NodeInfo>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ClusterThread {
    pub fn start(roles: &[Role], base: &NodeConfig) -> Result<ClusterThread, Error> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let cluster = rt.block_on(start_cluster(roles, base))?;
        let nodes = cluster.nodes.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("ppd-emulator".into())
            .spawn(move || {
                rt.block_on(async move {
                    let _ = rx.await;
                    cluster.shutdown().await;
                });
            })?;
        Ok(ClusterThread {
            nodes,
            stop: Some(tx),
            thread: Some(thread),
        })
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url.clone()).collect()
    }

    /// The nodes as router settings name them (with their KV-event endpoints).
    pub fn specs(&self) -> Vec<String> {
        self.nodes.iter().map(NodeInfo::spec).collect()
    }

    /// Stops the nodes and joins the runtime thread.
    pub fn shutdown(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ClusterThread {
    fn drop(&mut self) {
        self.stop_inner();
    }
}
