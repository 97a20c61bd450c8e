//! The HTTP surface of a node, shaped like vLLM's OpenAI server: chat and text
//! completions (JSON and SSE), models, health, metrics, the NIXL side channel
//! (`/internal/kv/pull`) and the fault-injection admin endpoint.

// Parsing helpers return the ready error Response; it is built once per bad request.
#![allow(clippy::result_large_err)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use ppd_core::prompt::given_token_id;
use ppd_core::request::{parse_request, ContentText, PromptText};
use ppd_model::engine::mix64;
use ppd_model::text::{render_chat, render_prompt, Generator};
use ppd_model::{Content, Finish, Kind, Profile, Submit, Usage};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Notify};

use crate::driver::{EngineHandle, Out};
use crate::metrics::{self, Metrics};
use crate::{Bidirectional, Faults, NodeConfig, Role};

/// Largest request body accepted (vLLM has none; this keeps a bad client from exhausting memory).
const MAX_BODY: usize = 64 * 1024 * 1024;

pub struct AppState {
    role: Role,
    model: String,
    engine_id: String,
    advertise_host: String,
    port: u16,
    max_model_len: u32,
    request_overhead: Duration,
    gen: Generator,
    engine: EngineHandle,
    metrics: Mutex<Metrics>,
    faults: Mutex<Faults>,
    crash: Arc<Notify>,
    api_key: Option<String>,
    stopping: Notify,
    shutting_down: AtomicBool,
    crashed: AtomicBool,
    next_id: AtomicU64,
    node_tag: u32,
    rng: AtomicU64,
    /// Draws of sampled requests' nonces; seeded per process, like vLLM's
    /// sampler, so sampled answers differ across requests and runs.
    sampling: AtomicU64,
    client: reqwest::Client,
    created: u64,
    bidirectional: Option<Bidirectional>,
    /// Model times of recent requests (name, first token ms, finish ms) for `/admin/timings`.
    timings: Mutex<std::collections::VecDeque<(String, f64, f64)>>,
}

const TIMINGS_KEPT: usize = 65_536;

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl AppState {
    pub fn new(cfg: &NodeConfig, profile: Profile, port: u16) -> Arc<AppState> {
        let engine = EngineHandle::start(
            &profile,
            cfg.kv_events.clone().map(crate::kv_publisher::start),
        );
        let tag = (mix64(cfg.seed ^ ((port as u64) << 32) ^ unix_now()) >> 32) as u32;
        Arc::new(AppState {
            role: cfg.role,
            model: cfg.served_model_name.clone(),
            engine_id: cfg
                .engine_id
                .clone()
                .unwrap_or_else(|| format!("emu-{}-{port}", cfg.role.as_str())),
            advertise_host: cfg.advertise_host.clone(),
            port,
            max_model_len: profile.max_model_len,
            request_overhead: Duration::from_secs_f64(profile.api.request_overhead_ms / 1000.0),
            gen: Generator::new(cfg.seed),
            engine,
            metrics: Mutex::new(Metrics::default()),
            faults: Mutex::new(cfg.faults),
            crash: Arc::new(Notify::new()),
            stopping: Notify::new(),
            shutting_down: AtomicBool::new(false),
            crashed: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            node_tag: tag,
            rng: AtomicU64::new(mix64(cfg.seed ^ 0xFA17)),
            sampling: AtomicU64::new(mix64(u64::from(tag) ^ 0x5A3F_11E5)),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap_or_default(),
            created: unix_now(),
            bidirectional: cfg.bidirectional,
            api_key: cfg.api_key.clone(),
            timings: Mutex::new(std::collections::VecDeque::new()),
        })
    }

    pub fn crash_signal(&self) -> Arc<Notify> {
        Arc::clone(&self.crash)
    }

    /// Releases handlers that hang by fault injection, so shutdown can finish.
    pub fn release_hangs(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.stopping.notify_waiters();
    }

    /// The crash fault: health fails, open streams are cut.
    fn crash_now(&self) {
        self.crashed.store(true, Ordering::SeqCst);
        self.release_hangs();
        self.crash.notify_one();
    }

    async fn wait_shutdown(&self) {
        let n = self.stopping.notified();
        if self.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        n.await;
    }

    fn record_timing(&self, name: &str, first: Option<f64>, finish: f64) {
        if let Ok(mut t) = self.timings.lock() {
            if t.len() >= TIMINGS_KEPT {
                t.pop_front();
            }
            t.push_back((name.to_owned(), first.unwrap_or(finish), finish));
        }
    }

    fn faults(&self) -> Faults {
        self.faults.lock().map(|f| *f).unwrap_or_default()
    }

    fn with_metrics(&self, f: impl FnOnce(&mut Metrics)) {
        if let Ok(mut m) = self.metrics.lock() {
            f(&mut m);
        }
    }

    fn uniform(&self) -> f64 {
        let x = mix64(self.rng.fetch_add(1, Ordering::Relaxed));
        (x >> 11) as f64 / (1u64 << 53) as f64
    }

    fn request_name(&self, prefix: &str, id: u64) -> String {
        format!("{prefix}-{:08x}{:016x}", self.node_tag, id)
    }

    /// The engine id inside a request name made by [`request_name`] of this node.
    fn parse_request_name(&self, name: &str) -> Option<u64> {
        let hex = name.rsplit('-').next()?;
        if hex.len() != 24 {
            return None;
        }
        let tag = u32::from_str_radix(&hex[..8], 16).ok()?;
        (tag == self.node_tag)
            .then(|| u64::from_str_radix(&hex[8..], 16).ok())
            .flatten()
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/admin/faults", get(get_faults).post(set_faults))
        .route("/admin/timings", get(timings))
        .route("/internal/kv/pull", post(kv_pull))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            api_key_check,
        ))
        .with_state(state)
}

/// vLLM's `--api-key` check (its `authentication` middleware): only paths
/// under `/v1`, and not OPTIONS, need `Authorization: Bearer <key>` exactly.
async fn api_key_check(
    State(st): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(key) = &st.api_key {
        let guarded =
            req.method() != axum::http::Method::OPTIONS && req.uri().path().starts_with("/v1");
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .map(HeaderValue::as_bytes);
        if guarded && given != Some(format!("Bearer {key}").as_bytes()) {
            return (
                StatusCode::UNAUTHORIZED,
                axum::Json(json!({"error": "Unauthorized"})),
            )
                .into_response();
        }
    }
    next.run(req).await
}

/// vLLM's error body: `{"error": {"message", "type", "param", "code"}}`.
pub fn error(status: StatusCode, message: impl Into<String>, param: Option<&str>) -> Response {
    let kind = match status {
        StatusCode::BAD_REQUEST => "BadRequestError",
        StatusCode::NOT_FOUND => "NotFoundError",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    let body = json!({"error": {"message": message.into(), "type": kind, "param": param, "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

fn bad(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, message, None)
}

async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "Not Found", None)
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    if s.crashed.load(Ordering::SeqCst) {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    StatusCode::OK.into_response()
}

async fn models(State(s): State<Arc<AppState>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": s.model, "object": "model", "created": s.created, "owned_by": "vllm",
            "root": s.model, "parent": null, "max_model_len": s.max_model_len,
            "permission": [{
                "id": format!("modelperm-{:08x}", s.node_tag), "object": "model_permission",
                "created": s.created, "allow_create_engine": false, "allow_sampling": true,
                "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                "allow_fine_tuning": false, "organization": "*", "group": null, "is_blocking": false
            }]
        }]
    }))
    .into_response()
}

async fn metrics_text(State(s): State<Arc<AppState>>) -> Response {
    let snap = s.engine.snapshot();
    let lag = s.engine.lag();
    let text = match s.metrics.lock() {
        Ok(m) => metrics::render(&s.model, s.role.as_str(), &m, &snap, &lag),
        Err(_) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "metrics lock poisoned",
                None,
            )
        }
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// Emulator-only: model times (ms since node start) of recent requests, to check real-time fidelity.
async fn timings(State(s): State<Arc<AppState>>) -> Response {
    let list: Vec<Value> = match s.timings.lock() {
        Ok(t) => t
            .iter()
            .map(|(n, a, b)| json!({"id": n, "model_first_token_ms": a, "model_finish_ms": b}))
            .collect(),
        Err(_) => vec![],
    };
    axum::Json(json!({"requests": list})).into_response()
}

async fn get_faults(State(s): State<Arc<AppState>>) -> Response {
    axum::Json(s.faults()).into_response()
}

async fn set_faults(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let f: Faults = match serde_json::from_slice(&body) {
        Ok(f) => f,
        Err(e) => return bad(format!("faults: {e}")),
    };
    if let Err(e) = f.validate() {
        return bad(e.to_string());
    }
    if let Ok(mut cur) = s.faults.lock() {
        *cur = f;
    }
    if f.crash {
        s.crash_now();
    }
    axum::Json(f).into_response()
}

/// The NIXL side channel, reduced to HTTP: a D takes P's held KV of a request.
/// The transfer time itself is modelled on the D's link.
async fn kv_pull(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return bad(format!("invalid JSON body: {e}")),
    };
    let Some(name) = v.get("remote_request_id").and_then(Value::as_str) else {
        return bad("remote_request_id (string) is required");
    };
    let Some(id) = s.parse_request_name(name) else {
        return error(
            StatusCode::NOT_FOUND,
            format!("no KV held for request {name:?} on this engine"),
            Some("remote_request_id"),
        );
    };
    match s.engine.take_hold(id).await {
        Some(h) => axum::Json(json!({"remote_request_id": name, "num_tokens": h.tokens, "num_blocks": h.blocks.len(), "engine_id": s.engine_id})).into_response(),
        None => error(StatusCode::NOT_FOUND, format!("no KV held for request {name:?} (never prefilled here, already pulled, or its lease expired)"), Some("remote_request_id")),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completion,
}

async fn chat(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    generate(s, Endpoint::Chat, body).await
}

async fn completions(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    generate(s, Endpoint::Completion, body).await
}

/// A parsed generation request, ready for the engine.
struct Parsed {
    prompt: Vec<u64>,
    sampling: Sampling,
    max_tokens: Option<u32>,
    stream: bool,
    include_usage: bool,
    kv: Value,
}

fn parse_u32(v: &Value, field: &str) -> Result<Option<u32>, Response> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => match x.as_u64() {
            Some(n) if n >= 1 && n <= u32::MAX as u64 => Ok(Some(n as u32)),
            _ => Err(bad(format!("{field} must be an integer ≥ 1, got {x}"))),
        },
    }
}

/// How the answer's text is chosen, as vLLM samples it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sampling {
    /// `temperature: 0`: greedy, the same text for the same prompt.
    Greedy,
    /// An explicit `seed`: the same text for the same prompt and seed.
    Seeded(u64),
    /// `temperature > 0` (vLLM's default is 1.0) without a seed: each
    /// request its own text.
    Random,
}

fn sampling_of(v: &Value) -> Sampling {
    let seed = v
        .get("seed")
        .and_then(|s| s.as_u64().or_else(|| s.as_i64().map(|i| i as u64)));
    if let Some(seed) = seed {
        return Sampling::Seeded(seed);
    }
    match v.get("temperature").and_then(Value::as_f64) {
        Some(t) if t <= 0.0 => Sampling::Greedy,
        _ => Sampling::Random,
    }
}

impl AppState {
    /// The generator's key for a prompt under a request's sampling.
    fn answer_key(&self, prompt: &[u64], sampling: Sampling) -> u64 {
        let key = self.gen.key(prompt);
        match sampling {
            Sampling::Greedy => key,
            Sampling::Seeded(seed) => mix64(key ^ mix64(seed ^ 0x5EED)),
            Sampling::Random => mix64(key ^ mix64(self.sampling.fetch_add(1, Ordering::Relaxed))),
        }
    }
}

fn parse_body(s: &AppState, ep: Endpoint, text: &str) -> Result<Parsed, Response> {
    let view = parse_request(text).map_err(|e| bad(e.to_string()))?;
    let v: Value =
        serde_json::from_str(text).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    if !v.is_object() {
        return Err(bad("request body must be a JSON object"));
    }
    if let Some(m) = view.model.as_deref() {
        if m != s.model {
            return Err(error(
                StatusCode::NOT_FOUND,
                format!("The model `{m}` does not exist."),
                Some("model"),
            ));
        }
    }
    match v.get("n") {
        None | Some(Value::Null) => {}
        Some(n) if n.as_u64() == Some(1) => {}
        Some(n) => return Err(bad(format!("n must be 1 on the emulator, got {n}"))),
    }
    let stream = match v.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(x) => return Err(bad(format!("stream must be a boolean, got {x}"))),
    };
    let include_usage = match v.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(o) if o.is_object() => {
            if !stream {
                return Err(bad(
                    "Stream options can only be defined when `stream=True`.",
                ));
            }
            o.get("include_usage")
                .and_then(Value::as_bool)
                .unwrap_or(false)
        }
        Some(x) => return Err(bad(format!("stream_options must be an object, got {x}"))),
    };
    let max_tokens = match ep {
        Endpoint::Chat => match parse_u32(&v, "max_completion_tokens")? {
            Some(n) => Some(n),
            None => parse_u32(&v, "max_tokens")?,
        },
        Endpoint::Completion => parse_u32(&v, "max_tokens")?,
    };
    let kv = match v.get("kv_transfer_params") {
        None | Some(Value::Null) => Value::Null,
        Some(o) if o.is_object() => o.clone(),
        Some(x) => {
            return Err(bad(format!(
                "kv_transfer_params must be an object, got {x}"
            )))
        }
    };
    let prompt = match ep {
        Endpoint::Chat => {
            let Some(msgs) = view.messages.as_ref() else {
                return Err(bad("messages is required for /v1/chat/completions"));
            };
            if msgs.is_empty() {
                return Err(bad("messages must not be empty"));
            }
            let mut parts = Vec::with_capacity(msgs.len());
            for m in msgs {
                if m.role.trim().is_empty() {
                    return Err(bad("every message needs a non-empty role"));
                }
                let c = ContentText::parse(m.content).map_err(|e| bad(e.to_string()))?;
                parts.push((m.role.to_string(), c.joined().into_owned()));
            }
            render_chat(parts.iter().map(|(r, c)| (r.as_str(), c.as_str())))
        }
        Endpoint::Completion => {
            let Some(raw) = view.prompt else {
                return Err(bad("prompt is required for /v1/completions"));
            };
            match PromptText::parse(raw).map_err(|e| bad(e.to_string()))? {
                PromptText::Text(t) => render_prompt(&t),
                PromptText::TokenIds(ids) => ids.into_iter().map(given_token_id).collect(),
            }
        }
    };
    if prompt.is_empty() {
        return Err(bad("prompt must not be empty"));
    }
    Ok(Parsed {
        prompt,
        sampling: sampling_of(&v),
        max_tokens,
        stream,
        include_usage,
        kv,
    })
}

/// Where the KV of a `do_remote_prefill` request lives.
struct Remote {
    host: String,
    port: u16,
    request_id: String,
}

fn remote_of(kv: &Value) -> Result<Option<Remote>, Response> {
    if kv.get("do_remote_prefill").and_then(Value::as_bool) != Some(true) {
        return Ok(None);
    }
    let host = kv.get("remote_host").and_then(Value::as_str);
    let port = kv.get("remote_port").and_then(|p| {
        p.as_u64()
            .or_else(|| p.as_str().and_then(|s| s.parse().ok()))
    });
    let rid = kv.get("remote_request_id").and_then(Value::as_str);
    match (host, port, rid) {
        (Some(h), Some(p), Some(r)) if p > 0 && p <= u16::MAX as u64 => {
            Ok(Some(Remote { host: h.to_owned(), port: p as u16, request_id: r.to_owned() }))
        }
        _ => Err(bad("kv_transfer_params with do_remote_prefill needs remote_host, remote_port and remote_request_id")),
    }
}

/// Where a bidirectional P reads a conversation's KV back from: a D's
/// answered `kv_transfer_params` (`do_remote_decode` with D's
/// `remote_block_ids`), as vLLM's pull scheduler requires them.
struct DecodeSource {
    remote: Remote,
    num_tokens: u32,
}

fn decode_source(kv: &Value) -> Option<DecodeSource> {
    if kv.get("do_remote_decode").and_then(Value::as_bool) != Some(true) {
        return None;
    }
    let blocks = kv.get("remote_block_ids").and_then(Value::as_array)?;
    if blocks.is_empty() || kv.get("remote_engine_id").is_none_or(Value::is_null) {
        return None;
    }
    let host = kv.get("remote_host").and_then(Value::as_str)?;
    let port = kv.get("remote_port").and_then(Value::as_u64)?;
    let rid = kv.get("remote_request_id").and_then(Value::as_str)?;
    let num_tokens = kv
        .get("remote_num_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    Some(DecodeSource {
        remote: Remote {
            host: host.to_owned(),
            port: u16::try_from(port).ok()?,
            request_id: rid.to_owned(),
        },
        num_tokens: u32::try_from(num_tokens).unwrap_or(u32::MAX),
    })
}

/// Takes the KV a remote node holds for `r` (P's prefill, or D's pin):
/// the tokens it covers, or `None` when it holds none (never, already
/// pulled, expired, unreachable).
async fn pull(s: &AppState, r: &Remote) -> Option<u32> {
    let url = format!("http://{}:{}/internal/kv/pull", r.host, r.port);
    let resp = s
        .client
        .post(&url)
        .json(&json!({"remote_request_id": r.request_id}))
        .send()
        .await
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let v: Value = resp.json().await.ok()?;
    v.get("num_tokens")
        .and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
}

/// vLLM's cleanup of a refused `do_remote_prefill` request
/// (`notify_kv_transfer_request_rejected`): a D that answers such a request
/// with an error tells its P at once that the KV it holds will not be pulled.
async fn release_rejected(s: &AppState, text: &str) {
    let Some(kv) = serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| v.get("kv_transfer_params").cloned())
    else {
        return;
    };
    if let Ok(Some(r)) = remote_of(&kv) {
        let _ = pull(s, &r).await;
    }
}

/// Aborts the engine request when the response is dropped before it finished.
struct AbortGuard {
    engine: EngineHandle,
    id: u64,
    armed: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            self.engine.abort(self.id);
        }
    }
}

async fn generate(s: Arc<AppState>, ep: Endpoint, body: Bytes) -> Response {
    let arrived = Instant::now();
    let Ok(text) = std::str::from_utf8(&body) else {
        return bad("request body is not UTF-8");
    };
    let p = match parse_body(&s, ep, text) {
        Ok(p) => p,
        Err(r) => {
            release_rejected(&s, text).await;
            return r;
        }
    };
    let remote = match remote_of(&p.kv) {
        Ok(r) => r,
        Err(r) => return r,
    };
    let faults = s.faults();
    if faults.latency_ms > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(faults.latency_ms / 1000.0)).await;
    }
    if faults.hang {
        s.wait_shutdown().await;
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "node is shutting down",
            None,
        );
    }
    if faults.error_rate > 0.0 && s.uniform() < faults.error_rate {
        s.with_metrics(|m| m.injected_errors += 1);
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "injected fault: error_rate",
            None,
        );
    }
    let mut kind = if p.kv.get("do_remote_decode").and_then(Value::as_bool) == Some(true) {
        Kind::RemoteDecode
    } else {
        Kind::Local
    };
    if let Some(r) = &remote {
        if pull(&s, r).await.is_some() {
            kind = Kind::RemotePrefill;
        } else {
            // vLLM's kv_load_failure_policy=recompute: compute the prompt here.
            s.with_metrics(|m| m.kv_pull_failures += 1);
        }
    }
    let prompt_len = p.prompt.len() as u32;
    let remote_prefix = match (&s.bidirectional, decode_source(&p.kv)) {
        (Some(b), Some(src)) if kind == Kind::RemoteDecode => {
            // vLLM's pull scheduler: min(remote_num_tokens, prompt), and no
            // pull at all below kv_recompute_threshold.
            let want = src.num_tokens.min(prompt_len.saturating_sub(1));
            if want < b.kv_recompute_threshold.max(1) {
                0
            } else {
                match pull(&s, &src.remote).await {
                    Some(held) => want.min(held),
                    None => {
                        s.with_metrics(|m| m.kv_pull_failures += 1);
                        0
                    }
                }
            }
        }
        _ => 0,
    };
    // A bidirectional D pins what a request with transfer params computed,
    // for a later turn's P to read (vLLM pins only such requests).
    let pin_ms = match &s.bidirectional {
        Some(b)
            if kind != Kind::RemoteDecode && p.kv.as_object().is_some_and(|o| !o.is_empty()) =>
        {
            Some(b.decoder_kv_blocks_ttl_s * 1000.0)
        }
        _ => None,
    };
    let key = s.answer_key(&p.prompt, p.sampling);
    let (n_out, finish_reason) = match p.max_tokens {
        Some(n) => (n, "length"),
        None => {
            let room = s.max_model_len.saturating_sub(prompt_len);
            (s.gen.natural_len(key).min(room.max(1)), "stop")
        }
    };
    let mut ids = p.prompt;
    if (n_out as u64 + prompt_len as u64) <= s.max_model_len as u64 {
        s.gen.push_ids(key, n_out, &mut ids);
    }
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let name = s.request_name(
        if ep == Endpoint::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        id,
    );
    let submit = Submit {
        id,
        content: Content::Explicit(ids.into()),
        prompt_len,
        max_tokens: n_out,
        kind,
        remote_prefix,
        pin_ms,
    };
    tokio::time::sleep(s.request_overhead).await;
    let rx = s.engine.submit(submit);
    let guard = AbortGuard {
        engine: s.engine.clone(),
        id,
        armed: true,
    };
    let ctx = Ctx {
        created: unix_now(),
        model_json: serde_json::to_string(&s.model).unwrap_or_else(|_| "\"\"".into()),
        s: Arc::clone(&s),
        ep,
        name,
        key,
        finish_reason,
        include_usage: p.include_usage,
        kind,
        pinned: pin_ms.is_some(),
        arrived,
    };
    if p.stream {
        stream_response(ctx, rx, guard).await
    } else {
        json_response(ctx, rx, guard).await
    }
}

struct Ctx {
    s: Arc<AppState>,
    /// `created` of every chunk of this response (vLLM keeps one per request).
    created: u64,
    model_json: String,
    ep: Endpoint,
    name: String,
    key: u64,
    finish_reason: &'static str,
    include_usage: bool,
    kind: Kind,
    /// A bidirectional D keeps this request's blocks for a later pull.
    pinned: bool,
    arrived: Instant,
}

impl Ctx {
    fn usage(&self, u: &Usage) -> Value {
        json!({
            "prompt_tokens": u.prompt_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "completion_tokens": u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}
        })
    }

    /// What vLLM's NIXL scheduler answers at `request_finished`: a P names
    /// the prefill a D is to pull; a pinning D names the blocks a later P may
    /// read back. `held` is what the engine keeps (blocks, tokens).
    fn kv_params(&self, held: Option<(&[u32], u32)>) -> Value {
        let Some((blocks, tokens)) = held.filter(|(b, _)| !b.is_empty()) else {
            return Value::Null;
        };
        let is_p = self.kind == Kind::RemoteDecode;
        if !is_p && !self.pinned {
            return Value::Null;
        }
        let expiry = self.s.bidirectional.filter(|_| !is_p).map(|b| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0)
                + b.decoder_kv_blocks_ttl_s
        });
        json!({
            "do_remote_prefill": is_p,
            "do_remote_decode": !is_p,
            "remote_block_ids": blocks,
            "remote_engine_id": self.s.engine_id,
            "remote_request_id": self.name,
            "remote_host": self.s.advertise_host,
            "remote_port": self.s.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": tokens,
            "remote_blocks_expiry_time": expiry,
            "transfer_mode": "pull"
        })
    }

    fn finish_str(&self, f: Finish) -> &'static str {
        match f {
            Finish::Length => self.finish_reason,
            Finish::Aborted => "abort",
        }
    }

    fn record(&self, ttft: Option<f64>, itl: &[f64], finish: &str) {
        let e2e = self.arrived.elapsed().as_secs_f64();
        self.s.with_metrics(|m| {
            if let Some(t) = ttft {
                m.ttft.observe(t);
            }
            for &x in itl {
                m.itl.observe(x);
            }
            m.e2e.observe(e2e);
            match finish {
                "length" => m.success_length += 1,
                "stop" => m.success_stop += 1,
                _ => m.success_abort += 1,
            }
        });
    }

    fn chunk(&self, choice: Value, usage: Option<Value>) -> String {
        let object = if self.ep == Endpoint::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let mut v = json!({"id": self.name, "object": object, "created": self.created, "model": self.s.model, "choices": choice});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        format!("data: {v}\n\n")
    }

    /// One token's SSE event, written directly (the hot path: one per token per stream).
    /// Pieces are generator words (ASCII letters and a space), so they need no escaping.
    fn push_token_chunk(&self, buf: &mut String, piece: &str) {
        use std::fmt::Write;
        let (object, open, close) = match self.ep {
            Endpoint::Chat => (
                "chat.completion.chunk",
                r#"{"index":0,"delta":{"content":""#,
                r#""},"logprobs":null,"finish_reason":null}"#,
            ),
            Endpoint::Completion => (
                "text_completion",
                r#"{"index":0,"text":""#,
                r#"","logprobs":null,"finish_reason":null,"stop_reason":null}"#,
            ),
        };
        let _ = write!(
            buf,
            "data: {{\"id\":\"{}\",\"object\":\"{object}\",\"created\":{},\"model\":{},\"choices\":[{open}{piece}{close}]}}\n\n",
            self.name, self.created, self.model_json
        );
    }
}

async fn json_response(
    ctx: Ctx,
    mut rx: mpsc::UnboundedReceiver<Out>,
    mut guard: AbortGuard,
) -> Response {
    let mut text = String::new();
    let mut ttft = None;
    let mut last = Instant::now();
    let mut itl = Vec::new();
    let mut model_first = None;
    loop {
        match rx.recv().await {
            Some(Out::Token { index, t }) => {
                let now = Instant::now();
                if index == 0 {
                    model_first = Some(t);
                    ttft = Some(ctx.arrived.elapsed().as_secs_f64());
                } else {
                    itl.push(now.duration_since(last).as_secs_f64());
                }
                last = now;
                text.push_str(&ctx.s.gen.piece(ctx.key, index));
            }
            Some(Out::Rejected(e)) => {
                guard.armed = false;
                return bad(e.to_string());
            }
            Some(Out::Finished {
                usage,
                finish,
                held_blocks,
                held_tokens,
                t,
            }) => {
                guard.armed = false;
                ctx.s.record_timing(&ctx.name, model_first, t);
                let fr = ctx.finish_str(finish);
                ctx.record(ttft, &itl, fr);
                let choice = match ctx.ep {
                    Endpoint::Chat => json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": text, "refusal": null, "annotations": null,
                                    "audio": null, "function_call": null, "tool_calls": [], "reasoning_content": null},
                        "logprobs": null, "finish_reason": fr, "stop_reason": null
                    }),
                    Endpoint::Completion => json!({
                        "index": 0, "text": text, "logprobs": null, "finish_reason": fr,
                        "stop_reason": null, "prompt_logprobs": null
                    }),
                };
                let object = if ctx.ep == Endpoint::Chat {
                    "chat.completion"
                } else {
                    "text_completion"
                };
                let mut body = json!({
                    "id": ctx.name, "object": object, "created": ctx.created, "model": ctx.s.model,
                    "choices": [choice], "usage": ctx.usage(&usage),
                    "system_fingerprint": null, "kv_transfer_params": ctx.kv_params(Some((&held_blocks, held_tokens)))
                });
                if ctx.ep == Endpoint::Chat {
                    body["service_tier"] = Value::Null;
                    body["prompt_logprobs"] = Value::Null;
                }
                return axum::Json(body).into_response();
            }
            None => {
                guard.armed = false;
                return error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped", None);
            }
        }
    }
}

struct StreamState {
    ctx: Ctx,
    rx: mpsc::UnboundedReceiver<Out>,
    guard: AbortGuard,
    last: Instant,
    ttft: Option<f64>,
    model_first: Option<f64>,
    itl: Vec<f64>,
    done: bool,
}

async fn stream_response(
    ctx: Ctx,
    mut rx: mpsc::UnboundedReceiver<Out>,
    mut guard: AbortGuard,
) -> Response {
    // Refusals arrive before any token: answer them as JSON errors, like vLLM.
    let first = rx.recv().await;
    let first = match first {
        Some(Out::Rejected(e)) => {
            guard.armed = false;
            return bad(e.to_string());
        }
        None => {
            guard.armed = false;
            return error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped", None);
        }
        Some(o) => o,
    };
    let st = StreamState {
        ctx,
        rx,
        guard,
        last: Instant::now(),
        ttft: None,
        model_first: None,
        itl: Vec::new(),
        done: false,
    };
    let stream = futures_util::stream::unfold((st, Some(first)), |(mut st, pending)| async move {
        if st.done {
            return None;
        }
        let mut buf = String::new();
        let mut next = match pending {
            Some(o) => Some(o),
            None => st.rx.recv().await,
        };
        // Drain what is ready so one write carries a whole step's tokens.
        loop {
            match next {
                None => {
                    st.done = true;
                    st.guard.armed = false;
                    if buf.is_empty() {
                        return Some((
                            Err(std::io::Error::other("engine stopped mid-stream")),
                            (st, None),
                        ));
                    }
                    break;
                }
                Some(Out::Token { index, t }) => {
                    let now = Instant::now();
                    if index == 0 {
                        st.model_first = Some(t);
                        st.ttft = Some(st.ctx.arrived.elapsed().as_secs_f64());
                    } else {
                        st.itl.push(now.duration_since(st.last).as_secs_f64());
                    }
                    st.last = now;
                    let piece = st.ctx.s.gen.piece(st.ctx.key, index);
                    if index == 0 && st.ctx.ep == Endpoint::Chat {
                        let role = json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
                        buf.push_str(&st.ctx.chunk(role, None));
                    }
                    st.ctx.push_token_chunk(&mut buf, &piece);
                }
                Some(Out::Rejected(e)) => {
                    st.done = true;
                    st.guard.armed = false;
                    let err = json!({"error": {"message": e.to_string(), "type": "BadRequestError", "param": null, "code": 400}});
                    buf.push_str(&format!("data: {err}\n\ndata: [DONE]\n\n"));
                    break;
                }
                Some(Out::Finished {
                    usage, finish, t, ..
                }) => {
                    st.ctx.s.record_timing(&st.ctx.name, st.model_first, t);
                    st.done = true;
                    st.guard.armed = false;
                    let fr = st.ctx.finish_str(finish);
                    st.ctx.record(st.ttft, &st.itl, fr);
                    let tail = match st.ctx.ep {
                        Endpoint::Chat => {
                            json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": fr, "stop_reason": null}])
                        }
                        Endpoint::Completion => {
                            json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": fr, "stop_reason": null}])
                        }
                    };
                    buf.push_str(&st.ctx.chunk(tail, None));
                    if st.ctx.include_usage {
                        buf.push_str(&st.ctx.chunk(json!([]), Some(st.ctx.usage(&usage))));
                    }
                    buf.push_str("data: [DONE]\n\n");
                    break;
                }
            }
            next = match st.rx.try_recv() {
                Ok(o) => Some(o),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => None,
            };
        }
        if st.ctx.s.crashed.load(Ordering::SeqCst) && !st.done {
            // A crash cuts streams mid-way.
            st.done = true;
            return Some((Err(std::io::Error::other("node crashed")), (st, None)));
        }
        Some((Ok::<Bytes, std::io::Error>(Bytes::from(buf)), (st, None)))
    });
    let mut resp = Response::new(Body::from_stream(stream));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}
