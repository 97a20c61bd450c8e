//! Assembles the HTTP service, starts the background planes (health checks, load scrapes, heartbeat expiry, session sweep) and runs until shutdown.

use axum::extract::State;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

use ppd_core::Role;

use crate::config::{RouterConfig, Runtime, Settings};
use crate::error::{method_not_allowed, openai_error};
use crate::ingress;
use crate::kv_subscriber;
use crate::listener::{self, Budget, Shared, ADMIN_MAX_CONNECTIONS};
use crate::load;
use crate::membership;
use crate::metrics::{
    NodeFigureLabels, NodeLabel, NodeModeLabels, NodeOutcomeLabels, NodeRoleStateLabels,
    NodeStateLabels,
};
use crate::registry::NodeState;
use crate::state::AppState;
use crate::ServerError;

/// The main port's app: the OpenAI endpoints, `/health`, and — unless
/// `admin_port` moves them to a listener of their own ([`admin_app`]) —
/// `/metrics` and the admin API.
pub fn app(state: Arc<AppState>) -> Router {
    let main = Router::new()
        .route("/v1/chat/completions", post(ingress::chat))
        .route("/v1/completions", post(ingress::complete))
        .route("/v1/models", get(models))
        .route("/health", get(health));
    let main = if state.cfg.admin_port.is_none() {
        main.route("/metrics", get(metrics))
            .merge(crate::admin::routes())
    } else {
        main
    };
    finish(main, state)
}

/// The admin listener's app (with `admin_port`): `/metrics` and the admin API.
pub fn admin_app(state: Arc<AppState>) -> Router {
    finish(
        Router::new()
            .route("/metrics", get(metrics))
            .merge(crate::admin::routes()),
        state,
    )
}

/// Unknown paths and methods answered as OpenAI errors.
fn finish(router: Router<Arc<AppState>>, state: Arc<AppState>) -> Router {
    router
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .with_state(state)
}

async fn wrong_method(method: Method, uri: Uri) -> Response {
    method_not_allowed(method.as_str(), uri.path())
}

async fn not_found() -> Response {
    openai_error(
        StatusCode::NOT_FOUND,
        "no such endpoint",
        "invalid_request_error",
        "not_found",
    )
}

async fn models(State(st): State<Arc<AppState>>, headers: axum::http::HeaderMap) -> Response {
    if let Some(refused) = crate::auth::client_refusal(&st.cfg, &headers) {
        return refused;
    }
    let data = st.models.load_full();
    Json(serde_json::json!({"object": "list", "data": *data})).into_response()
}

/// Healthy when some node can decode (a D, pD or R is available).
/// `{"status", "nodes": {role: {"available", "total"}}}`: `ok` (200) when
/// every node is available, `degraded` (200) when some node is out but some
/// D, pD or R can still serve (with every P out, pD nodes prefill:
/// `p_unavailable`), `unavailable` (503) when none can. With `state`, also
/// `"state": {"backend", "connected", "since_s", "pending"}`: whether the
/// store that shares admin changes is reachable, since when, and how many
/// changes made here it still lacks (never a reason for a 503).
async fn health(State(st): State<Arc<AppState>>) -> Response {
    let now = st.now_ms();
    let nodes = st.registry.nodes();
    let mut by_role = serde_json::Map::new();
    for role in Role::ALL {
        let of_role: Vec<_> = nodes.iter().filter(|n| n.role == role).collect();
        if !of_role.is_empty() {
            let available = of_role.iter().filter(|n| n.available(now)).count();
            by_role.insert(
                role.as_str().into(),
                serde_json::json!({"available": available, "total": of_role.len()}),
            );
        }
    }
    let serves = nodes.iter().any(|n| n.role != Role::P && n.available(now));
    let (status, code) = match (serves, nodes.iter().all(|n| n.available(now))) {
        (false, _) => ("unavailable", StatusCode::SERVICE_UNAVAILABLE),
        (true, true) => ("ok", StatusCode::OK),
        (true, false) => ("degraded", StatusCode::OK),
    };
    let mut body = serde_json::json!({"status": status, "nodes": by_role});
    if let Some(shared) = &st.shared {
        // Losing the store is no reason to stop serving: it shows here only.
        body["state"] = shared.health(now);
    }
    if !serves {
        // An OpenAI-style error beside the counts, like every other refusal.
        body["error"] = serde_json::json!({"message": "no healthy decode or replica node",
            "type": "service_unavailable", "param": null, "code": "no_eligible_node"});
    }
    (code, Json(body)).into_response()
}

async fn metrics(State(st): State<Arc<AppState>>, headers: axum::http::HeaderMap) -> Response {
    st.metrics.sessions.set(st.sessions.len() as i64);
    st.metrics.queue_waiting.set(st.admission.waiting() as i64);
    let now = st.now_ms();
    for role in [Role::P, Role::D, Role::PD, Role::R] {
        for state in [
            NodeState::Healthy,
            NodeState::Unhealthy,
            NodeState::BreakerOpen,
        ] {
            let n = st
                .registry
                .count(|x| x.role == role && x.state(now) == state);
            st.metrics
                .nodes
                .get_or_create(&NodeStateLabels {
                    role: role.as_str(),
                    state: state.as_str(),
                })
                .set(n as i64);
        }
    }
    let mut in_flight = 0_i64;
    // Rebuilt each scrape, so a node that left has no state.
    st.metrics.node_state.clear();
    for n in st.registry.nodes().iter() {
        in_flight += i64::from(n.inflight());
        let now_in = n.state(now);
        for state in NodeState::ALL {
            st.metrics
                .node_state
                .get_or_create(&NodeRoleStateLabels {
                    node: n.url.clone(),
                    role: n.role.as_str(),
                    state: state.as_str(),
                })
                .set(i64::from(state == now_in));
        }
    }
    st.metrics.in_flight.set(in_flight);
    let stale = load::stale_after_ms(st.cfg.load_interval);
    for n in st.registry.nodes().iter() {
        let s = n.load_snapshot(now, stale);
        let scraped = s.scraped.map(|x| [x.running, x.waiting, x.kv_usage]);
        let figures = [
            ("inflight", Some(f64::from(s.inflight))),
            ("prompt_tokens", Some(s.prompt_tokens as f64)),
            ("decode_tokens", Some(s.decode_tokens as f64)),
            ("kv_bytes", Some(s.kv_bytes as f64)),
            ("running", scraped.map(|x| x[0])),
            ("waiting", scraped.map(|x| x[1])),
            ("kv_usage", scraped.map(|x| x[2])),
        ];
        for (figure, v) in figures {
            let labels = NodeFigureLabels {
                node: n.url.clone(),
                figure,
            };
            match v {
                Some(v) => {
                    st.metrics.node_load.get_or_create(&labels).set(v);
                }
                None => {
                    st.metrics.node_load.remove(&labels);
                }
            }
        }
    }
    export_residency(&st);
    export_model(&st);
    let pinned = st.pulls.pinned(st.now_ms());
    for (figure, v) in [
        ("handles", pinned.handles),
        ("blocks", pinned.blocks),
        ("tokens", pinned.tokens),
    ] {
        st.metrics
            .pinned
            .get_or_create(&crate::metrics::FigureLabel { figure })
            .set(i64::try_from(v).unwrap_or(i64::MAX));
    }
    let accept = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok());
    let (content_type, body) = st.metrics.exposition(crate::metrics::negotiate(accept));
    ([("content-type", content_type)], body).into_response()
}

/// `ppd-live`'s corrections per node (those of departed nodes are gone from
/// the cost model, so each scrape rewrites the series from it).
fn export_model(st: &AppState) {
    let Some(model) = st.engine.cost_model() else {
        return;
    };
    let m = &st.metrics;
    let _copy = m.model_copy.lock();
    m.model_ttft_correction.clear();
    m.model_tpot_correction.clear();
    m.model_tpot_level.clear();
    for c in model.corrections.view() {
        let Some(node) = ppd_core::session::NodeId::new(c.node).and_then(|id| st.registry.get(id))
        else {
            continue;
        };
        for (p, path) in ppd_core::cost::CORRECTED_PATHS.into_iter().enumerate() {
            for (k, size_class) in ppd_core::cost::SIZE_CLASS_NAMES.into_iter().enumerate() {
                if c.ttft_samples[p][k] > 0 {
                    m.model_ttft_correction
                        .get_or_create(&crate::metrics::CorrectionLabels {
                            node: node.url.clone(),
                            path: path.as_str(),
                            size_class,
                        })
                        .set(c.ttft[p][k]);
                }
            }
        }
        let label = NodeLabel {
            node: node.url.clone(),
        };
        if c.tpot_samples > 0 {
            m.model_tpot_correction.get_or_create(&label).set(c.tpot);
        }
        if let Some(ms) = c.tpot_level_ms {
            m.model_tpot_level.get_or_create(&label).set(ms / 1000.0);
        }
    }
}

/// Each node's residency mode, index size and KV-event counts, into the metrics.
fn export_residency(st: &AppState) {
    let m = &st.metrics;
    let _copy = m.kv_events_copy.lock();
    for n in st.registry.nodes().iter() {
        let mode = n.kv.mode();
        for each in kv_subscriber::Mode::ALL {
            m.residency_mode
                .get_or_create(&NodeModeLabels {
                    node: n.url.clone(),
                    mode: each.as_str(),
                })
                .set(i64::from(each == mode));
        }
        m.residency_blocks
            .get_or_create(&NodeLabel {
                node: n.url.clone(),
            })
            .set(n.kv.blocks() as i64);
        let c = n.kv.counts();
        for (outcome, v) in [
            ("received", c.events),
            ("missed", c.missed),
            ("malformed", c.malformed),
            ("orphaned", c.orphaned),
            ("skipped", c.skipped),
            ("reset", c.resets),
        ] {
            let counter = m.kv_events.get_or_create(&NodeOutcomeLabels {
                node: n.url.clone(),
                outcome,
            });
            counter.inc_by(v.saturating_sub(counter.get()));
        }
    }
}

/// One round of active health checks; the first healthy answer of
/// `/v1/models` per node feeds the router's model list.
pub async fn check_health(st: &AppState) {
    let nodes = st.registry.nodes();
    let checks = nodes.iter().map(|n| async move {
        let within = Duration::from_secs(2);
        let health = st.client().status(&format!("{}/health", n.url));
        let ok = matches!(tokio::time::timeout(within, health).await, Ok(Ok(s)) if s.is_success());
        n.set_healthy(ok);
        if ok && n.role != Role::P {
            let models = st.client().get(&format!("{}/v1/models", n.url));
            if let Ok(Ok((status, body))) = tokio::time::timeout(within, models).await {
                if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) {
                    if status.is_success() {
                        return v
                            .get("data")
                            .and_then(|d| d.as_array())
                            .cloned()
                            .unwrap_or_default();
                    }
                }
            }
        }
        Vec::new()
    });
    let mut seen = std::collections::BTreeMap::new();
    for list in futures_util::future::join_all(checks).await {
        for m in list {
            if let Some(id) = m.get("id").and_then(|i| i.as_str()) {
                seen.entry(id.to_owned()).or_insert(m);
            }
        }
    }
    if !seen.is_empty() {
        st.models.store(Arc::new(seen.into_values().collect()));
    }
}

/// One round of load scrapes: every node's `/metrics`, in parallel, each
/// within the interval. A node seen restarting has its cache epoch bumped
/// (its sessions' next turns do not count on the KV it lost).
pub async fn scrape_load(st: &AppState) {
    let timeout = Duration::from_secs_f64(st.cfg.load_interval.clamp(0.2, 2.0));
    let nodes = st.registry.nodes();
    let scrapes = nodes.iter().map(|n| async move {
        let got = tokio::time::timeout(timeout, async {
            let (status, body) = st.client().get(&format!("{}/metrics", n.url)).await.ok()?;
            if !status.is_success() {
                return None;
            }
            load::parse_metrics(&String::from_utf8_lossy(&body), st.now_ms())
        })
        .await;
        let label = || NodeLabel {
            node: n.url.clone(),
        };
        match got {
            Ok(Some(s)) => {
                // The event stream sees a restart first (its sequence starts over).
                let known = n.kv.reset_within(st.now_ms(), KV_RESET_WINDOW_MS);
                if n.load.record_scrape(s, known) {
                    tracing::warn!(node = %n.url, "node restarted: its cached KV is gone");
                    st.metrics.node_restarts.get_or_create(&label()).inc();
                    if !known {
                        n.kv.clear();
                    }
                }
            }
            _ => {
                n.load.record_scrape_failure();
                st.metrics
                    .node_scrape_failures
                    .get_or_create(&label())
                    .inc();
            }
        }
    });
    futures_util::future::join_all(scrapes).await;
}

/// A restart the KV events reported this recently is the one a scrape sees.
const KV_RESET_WINDOW_MS: u64 = 10_000;

/// One subscriber task per node that publishes KV events (static nodes).
fn start_kv_subscribers(st: &Arc<AppState>) -> Vec<tokio::task::JoinHandle<()>> {
    let _ = st.background.set(tokio::runtime::Handle::current());
    st.registry
        .nodes()
        .iter()
        .filter_map(|n| membership::subscribe(st, n))
        .collect()
}

async fn scrape_loop(st: Arc<AppState>) {
    if st.cfg.load_interval <= 0.0 {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_secs_f64(st.cfg.load_interval));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        scrape_load(&st).await;
    }
}

async fn background(st: Arc<AppState>) {
    let interval = Duration::from_secs_f64(st.cfg.health_interval);
    let heartbeat_ms = (st.cfg.heartbeat_timeout * 1000.0) as u64;
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        check_health(&st).await;
        let now = st.now_ms();
        for gone in st.registry.expire(now, heartbeat_ms) {
            tracing::warn!(node = %gone.url, "no heartbeat: node removed");
            crate::membership::departed(&st, &gone);
        }
        st.sessions.evict_expired(now);
    }
}

/// Runs the router on `listener` until `shutdown` resolves.
/// An emulated layout must have been started (and turned into nodes with
/// [`Settings::with_emulated_nodes`]) by the caller: the router runs on nodes only.
/// With `admin_port`, the admin listener is bound here, before `ready`.
pub async fn run(
    settings: Settings,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    ready: Option<tokio::sync::oneshot::Sender<Arc<AppState>>>,
) -> Result<(), ServerError> {
    if settings.emulated().is_some() {
        return Err(ServerError::Config(
            "invalid setting `emulated`: the emulated nodes must be started before the router (ppd-router serve does)".into(),
        ));
    }
    crate::logging::install(settings.config()).map_err(ServerError::Config)?;
    tracing::info!(
        settings = %crate::logging::settings_for_log(settings.config()),
        "ppd-router starting"
    );
    let state = AppState::build(&settings)?;
    let cfg = &state.cfg;
    let admin_listener = match cfg.admin_port {
        Some(port) => Some(
            bind(cfg.admin_host.as_deref().unwrap_or(&cfg.host), port)
                .await
                .map_err(|e| ServerError::Config(format!("admin listener (admin_port): {e}")))?,
        ),
        None => None,
    };
    check_health(&state).await;
    let bg = tokio::spawn(background(Arc::clone(&state)));
    let scraper = tokio::spawn(scrape_loop(Arc::clone(&state)));
    let subscribers = start_kv_subscribers(&state);
    let sharing = tokio::spawn(crate::replicas::run(Arc::clone(&state)));
    if let Some(tx) = ready {
        let _ = tx.send(Arc::clone(&state));
    }
    warn_if_few_descriptors(cfg.max_connections);
    let (stop_tx, stop_rx) = watch::channel(false);
    let main = Shared::new(
        app(Arc::clone(&state)),
        cfg,
        Budget::new(cfg.max_connections),
    );
    let serving_main = async {
        let served = if cfg.runtime == Runtime::WorkStealing {
            let keeper = tokio::spawn(keep_timer_wake_near());
            listener::serve(listener, main, stop_rx.clone()).await;
            keeper.abort();
            Ok(())
        } else {
            serve_thread_per_core(listener, main, io_threads(cfg), &stop_tx).await
        };
        // Whatever ended it, the admin listener stops too.
        let _ = stop_tx.send(true);
        served
    };
    let serving_admin = async {
        if let Some(l) = admin_listener {
            let admin = Shared::new(
                admin_app(Arc::clone(&state)),
                cfg,
                Budget::new(ADMIN_MAX_CONNECTIONS.min(cfg.max_connections)),
            );
            listener::serve(l, admin, stop_rx.clone()).await;
        }
    };
    let serving = async { tokio::join!(serving_main, serving_admin).0 };
    tokio::pin!(serving);
    let served = tokio::select! {
        // Only a failed I/O thread ends it before shutdown.
        served = &mut serving => served,
        () = shutdown => {
            let _ = stop_tx.send(true);
            serving.await
        }
    };
    bg.abort();
    scraper.abort();
    sharing.abort();
    for s in &subscribers {
        s.abort();
    }
    crate::logging::flush_traces();
    served
}

/// Warns when the process may run out of file descriptors before it reaches
/// `max_connections` (accept then fails and connections wait in the backlog).
fn warn_if_few_descriptors(max_connections: usize) {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes only into the struct it is given.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0;
        // Refusals in progress, the admin listener, upstream connections, files.
        let need = (max_connections + 1024) as libc::rlim_t;
        if ok && lim.rlim_cur != libc::RLIM_INFINITY && lim.rlim_cur < need {
            tracing::warn!(
                "the open-file limit ({}) is below max_connections ({max_connections}) + 1024: \
                 raise it (ulimit -n) or lower max_connections",
                lim.rlim_cur
            );
        }
    }
    #[cfg(not(unix))]
    let _ = max_connections;
}

/// Tokio wakes its driver (an eventfd write, and an extra `epoll_wait` return)
/// whenever a timer is set to fire before the driver's next planned wake-up; on
/// an otherwise timer-less runtime that is every per-request timeout and every
/// reset of the stream-idle timer, several per request. A tick every 100 ms
/// keeps the next wake-up near, so timeouts of a second or more never force one.
async fn keep_timer_wake_near() {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
    }
}

fn io_threads(cfg: &RouterConfig) -> usize {
    if cfg.worker_threads > 0 {
        cfg.worker_threads
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

/// Serves with `threads` OS threads, each a single-threaded runtime accepting
/// from the shared listening socket: a connection, its requests, their
/// upstream calls (per-thread pools, [`AppState::client`]) and the relayed
/// stream all stay on the thread that accepted it; the connection cap is
/// shared by all. Returns when `stop` turns true and every thread has let
/// its open streams finish, or, with its error, when a thread fails (the
/// others are stopped first).
async fn serve_thread_per_core(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    threads: usize,
    stop: &watch::Sender<bool>,
) -> Result<(), ServerError> {
    let socket = listener.into_std().map_err(ServerError::Io)?;
    let mut running = tokio::task::JoinSet::new();
    for i in 0..threads {
        let socket = socket.try_clone().map_err(ServerError::Io)?;
        let shared = Arc::clone(&shared);
        let stop = stop.subscribe();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<std::io::Result<()>>();
        std::thread::Builder::new()
            .name(format!("ppd-router-io-{i}"))
            .spawn(move || {
                let served = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .and_then(|rt| {
                        rt.block_on(async move {
                            tokio::spawn(keep_timer_wake_near());
                            let listener = tokio::net::TcpListener::from_std(socket)?;
                            listener::serve(listener, shared, stop).await;
                            Ok(())
                        })
                    });
                let _ = done_tx.send(served);
            })
            .map_err(ServerError::Io)?;
        running.spawn(done_rx);
    }
    drop(socket);
    let mut first_error = None;
    let mut stopped = stop.subscribe();
    tokio::select! {
        biased;
        _ = stopped.wait_for(|s| *s) => {}
        Some(ended) = running.join_next() => {
            // A thread that stops before shutdown has failed: stop the others too.
            first_error = Some(match io_thread_error(ended) {
                Ok(()) if *stop.borrow() => Ok(()),
                Ok(()) => Err(ServerError::Config("a router I/O thread stopped on its own".into())),
                failed => failed,
            });
        }
    }
    let _ = stop.send(true);
    while let Some(ended) = running.join_next().await {
        let e = io_thread_error(ended);
        if first_error.is_none() {
            first_error = Some(e);
        }
    }
    match first_error {
        Some(Err(e)) => Err(e),
        _ => Ok(()),
    }
}

fn io_thread_error(
    ended: Result<
        Result<std::io::Result<()>, tokio::sync::oneshot::error::RecvError>,
        tokio::task::JoinError,
    >,
) -> Result<(), ServerError> {
    match ended {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(e))) => Err(ServerError::Io(e)),
        // The thread ended without reporting: it panicked.
        Ok(Err(_)) | Err(_) => Err(ServerError::Config("a router I/O thread panicked".into())),
    }
}

/// Listens on `host:port` with an accept backlog of [`ACCEPT_BACKLOG`].
pub async fn bind(host: &str, port: u16) -> Result<tokio::net::TcpListener, ServerError> {
    let addr = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}") // an IPv6 address
    } else {
        format!("{host}:{port}")
    };
    let cannot = |e: std::io::Error| ServerError::Config(format!("cannot listen on {addr}: {e}"));
    let mut last = None;
    for a in tokio::net::lookup_host(&addr).await.map_err(cannot)? {
        let socket = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        };
        let listened = socket.and_then(|s| {
            s.set_reuseaddr(true)?;
            s.bind(a)?;
            s.listen(ACCEPT_BACKLOG)
        });
        match listened {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(cannot(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, "no address")
    })))
}

/// Connections the kernel completes before the router accepts them (the
/// system's `somaxconn` may lower it); a burst beyond it waits for SYN retries.
const ACCEPT_BACKLOG: u32 = 1024;

/// The router's main runtime (`worker_threads` workers, or one per core): it
/// runs health checks, discovery and embedded nodes, and under `work-stealing`
/// also serves requests; under `thread-per-core` requests never touch it.
fn runtime(cfg: &RouterConfig) -> Result<tokio::runtime::Runtime, ServerError> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if cfg.worker_threads > 0 {
        b.worker_threads(cfg.worker_threads);
    }
    b.enable_all().build().map_err(ServerError::Io)
}

/// A router on a runtime thread of its own (for embedding and the Python API).
pub struct RouterHandle {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), ServerError>>>,
}

impl RouterHandle {
    /// Starts and returns once the router accepts connections.
    pub fn start(settings: Settings) -> Result<RouterHandle, ServerError> {
        let cfg = settings.config();
        let rt = runtime(cfg)?;
        let listener = rt.block_on(bind(&cfg.host, cfg.port))?;
        let addr = listener.local_addr().map_err(ServerError::Io)?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("ppd-router".into())
            .spawn(move || {
                rt.block_on(run(
                    settings,
                    listener,
                    async move {
                        let _ = stop_rx.await;
                    },
                    Some(ready_tx),
                ))
            })
            .map_err(ServerError::Io)?;
        match ready_rx.blocking_recv() {
            Ok(state) => Ok(RouterHandle {
                addr,
                state,
                stop: Some(stop_tx),
                thread: Some(thread),
            }),
            Err(_) => {
                // The runtime ended before it was ready: report its error.
                let err = thread
                    .join()
                    .map_err(|_| ServerError::Config("router thread panicked".into()))?;
                Err(err.err().unwrap_or_else(|| {
                    ServerError::Config("router stopped during start-up".into())
                }))
            }
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, lets open streams finish, and joins the thread.
    pub fn stop(&mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| ServerError::Config("router thread panicked".into()))?,
            None => Ok(()),
        }
    }
}

impl Drop for RouterHandle {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// Runs in the foreground until SIGINT or SIGTERM.
pub fn serve_blocking(settings: Settings) -> Result<(), ServerError> {
    let rt = runtime(settings.config())?;
    rt.block_on(async move {
        let cfg = settings.config();
        let listener = bind(&cfg.host, cfg.port).await?;
        let addr = listener.local_addr().map_err(ServerError::Io)?;
        eprintln!("ppd-router listening on http://{addr}");
        if let Some(port) = cfg.admin_port {
            let host = cfg.admin_host.as_deref().unwrap_or(&cfg.host);
            eprintln!("ppd-router admin API and metrics on http://{host}:{port}");
        }
        run(settings, listener, shutdown_signal(), None).await
    })
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
