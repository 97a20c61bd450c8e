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
use ppd_core::request::{parse_request, ContentText};
use ppd_model::engine::mix64;
use ppd_model::text::{render_chat_ending, render_prompt, ChatEnd, Generator};
use ppd_model::{Content, Finish, Kind, Profile, Submit, Usage};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Notify};

use crate::driver::{EngineHandle, Out};
use crate::logprobs::{score, Logprobs, Scored};
use crate::metrics::{self, Metrics};
use crate::openai::{self, Asked, Refusal};
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
    /// One per prompt of a completions batch; chat has one.
    prompts: Vec<Vec<u64>>,
    sampling: Sampling,
    asked: Asked,
    max_tokens: Option<u32>,
    stream: bool,
    include_usage: bool,
    kv: Value,
}

fn parse_u32(v: &Value, field: &str) -> Result<Option<u32>, Response> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(None),
        // vLLM's request model takes a whole float (2.0) as the integer it is.
        Some(x) => match x.as_f64() {
            Some(n) if n >= 1.0 && n <= u32::MAX as f64 && n.fract() == 0.0 => Ok(Some(n as u32)),
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
    let seed = v.get("seed").and_then(|s| {
        s.as_u64()
            .or_else(|| s.as_i64().map(|i| i as u64))
            .or_else(|| s.as_f64().map(|f| f as i64 as u64))
    });
    if let Some(seed) = seed {
        return Sampling::Seeded(seed);
    }
    match v.get("temperature").and_then(Value::as_f64) {
        Some(t) if t <= 0.0 => Sampling::Greedy,
        _ => Sampling::Random,
    }
}

impl AppState {
    /// The generator's key for choice `j` of a prompt under a request's sampling:
    /// the choices of one prompt differ as vLLM's samples of one prompt do.
    fn answer_key(&self, prompt: &[u64], sampling: Sampling, j: u32) -> u64 {
        let key = self.gen.key(prompt);
        match sampling {
            Sampling::Greedy => key,
            Sampling::Seeded(seed) if j == 0 => mix64(key ^ mix64(seed ^ 0x5EED)),
            Sampling::Seeded(seed) => mix64(key ^ mix64(seed ^ 0x5EED) ^ mix64(u64::from(j))),
            Sampling::Random => mix64(key ^ mix64(self.sampling.fetch_add(1, Ordering::Relaxed))),
        }
    }
}

/// A refusal of vLLM's request checks as vLLM's 400 answer.
fn refused(r: Refusal) -> Response {
    let body =
        json!({"error": {"message": r.message, "type": r.kind, "param": r.param, "code": 400}});
    (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
}

/// vLLM's error for a body that is not JSON (pydantic's `json_invalid`, at the error's offset).
fn not_json(text: &str, e: &serde_json::Error) -> Response {
    let offset: usize = text
        .split_inclusive('\n')
        .take(e.line().saturating_sub(1))
        .map(str::len)
        .sum::<usize>()
        + e.column().saturating_sub(1);
    refused(Refusal {
        kind: "Bad Request",
        message: format!("1 validation error:\n  {{'type': 'json_invalid', 'loc': 'body.{offset}', 'msg': 'JSON decode error', 'ctx': {{'error': '{e}'}}}}"),
        param: Some(format!("body.{offset}")),
    })
}

/// A completions `prompt`: a string, a list of strings, token ids, or a list of token-id lists;
/// each prompt of a list is answered on its own (vLLM's batch).
fn completion_prompts(v: &Value) -> Result<Vec<Vec<u64>>, Response> {
    let token_ids = |x: &Value| -> Option<Vec<u64>> {
        x.as_array()?
            .iter()
            .map(|t| t.as_u64().filter(|&t| t <= u32::MAX as u64))
            .map(|t| t.map(|t| given_token_id(t as u32)))
            .collect()
    };
    let shape_error = || {
        bad("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")
    };
    let prompts = match v.get("prompt") {
        None | Some(Value::Null) => {
            return Err(refused(Refusal {
                kind: "BadRequestError",
                message: "Either prompt or prompt_embeds must be provided and non-empty.".into(),
                param: Some("prompt".into()),
            }))
        }
        Some(Value::String(s)) => vec![render_prompt(s)],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(refused(Refusal {
                kind: "BadRequestError",
                message: "You must pass at least one prompt".into(),
                param: None,
            }))
        }
        Some(all @ Value::Array(items)) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|x| x.as_str().map(render_prompt))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(shape_error)?,
            Value::Array(_) => items
                .iter()
                .map(token_ids)
                .collect::<Option<Vec<_>>>()
                .ok_or_else(shape_error)?,
            _ => vec![token_ids(all).ok_or_else(shape_error)?],
        },
        Some(_) => return Err(shape_error()),
    };
    if prompts.iter().any(Vec::is_empty) {
        return Err(bad("prompt must not be empty"));
    }
    Ok(prompts)
}

/// How the chat's rendering ends, from vLLM's two request fields (checked
/// against each other by `openai::check_validators`).
fn chat_end(v: &Value) -> ChatEnd {
    let flag = |name: &str| v.get(name).and_then(Value::as_bool);
    if flag("continue_final_message") == Some(true) {
        ChatEnd::OpenFinal
    } else if flag("add_generation_prompt") == Some(false) {
        ChatEnd::Closed
    } else {
        ChatEnd::GenerationPrompt
    }
}

fn chat_prompt(text: &str, end: ChatEnd) -> Result<Vec<u64>, Response> {
    let view = parse_request(text).map_err(|e| bad(e.to_string()))?;
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
    Ok(render_chat_ending(
        parts.iter().map(|(r, c)| (r.as_str(), c.as_str())),
        end,
    ))
}

/// Checks a body as vLLM does, in vLLM's order: its request model (types), its
/// validators, the model name, then the sampler's ranges.
fn parse_body(s: &AppState, ep: Endpoint, text: &str) -> Result<Parsed, Response> {
    let chat = ep == Endpoint::Chat;
    let v: Value = serde_json::from_str(text).map_err(|e| not_json(text, &e))?;
    let o = openai::check_schema(&v, chat).map_err(refused)?;
    openai::check_validators(o, chat).map_err(refused)?;
    if let Some(m) = v.get("model").and_then(Value::as_str) {
        if m != s.model {
            return Err(error(
                StatusCode::NOT_FOUND,
                format!("The model `{m}` does not exist."),
                Some("model"),
            ));
        }
    }
    let asked = openai::check_sampling(o, chat).map_err(refused)?;
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = match v.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(o) if o.is_object() => o
            .get("include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false),
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
    let prompts = match ep {
        Endpoint::Chat => vec![chat_prompt(text, chat_end(&v))?],
        Endpoint::Completion => completion_prompts(&v)?,
    };
    if prompts.iter().any(Vec::is_empty) {
        return Err(bad("prompt must not be empty"));
    }
    if (prompts.len() as u64) * u64::from(asked.n) > openai::MAX_N as u64 {
        return Err(bad(format!(
            "{} prompts × n={} asks for more than {} choices",
            prompts.len(),
            asked.n,
            openai::MAX_N
        )));
    }
    Ok(Parsed {
        prompts,
        sampling: sampling_of(&v),
        asked,
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

/// Aborts a request's unfinished engine requests when the response is dropped before it finished.
struct AbortGuard {
    engine: EngineHandle,
    /// Engine ids of the choices not finished yet.
    open: Vec<u64>,
}

impl AbortGuard {
    fn finished(&mut self, id: u64) {
        self.open.retain(|&x| x != id);
    }

    fn disarm(&mut self) {
        self.open.clear();
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        for &id in &self.open {
            self.engine.abort(id);
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
    let first_len = p.prompts[0].len() as u32;
    let remote_prefix = match (&s.bidirectional, decode_source(&p.kv)) {
        (Some(b), Some(src)) if kind == Kind::RemoteDecode => {
            // vLLM's pull scheduler: min(remote_num_tokens, prompt), and no
            // pull at all below kv_recompute_threshold.
            let want = src.num_tokens.min(first_len.saturating_sub(1));
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
    let n = p.asked.n;
    let total = p.prompts.len() as u64 * u64::from(n);
    let base = s.next_id.fetch_add(total, Ordering::Relaxed);
    let name = s.request_name(
        if ep == Endpoint::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        base,
    );
    // Choice c answers prompt c / n (vLLM's prompt-major order); only the
    // first carries the request's KV transfer, as the router's P/D split has
    // one choice.
    let mut plans = Vec::with_capacity(total as usize);
    let mut submits = Vec::with_capacity(total as usize);
    for prompt in &p.prompts {
        let prompt_len = prompt.len() as u32;
        for j in 0..n {
            let c = plans.len() as u64;
            let key = s.answer_key(prompt, p.sampling, j);
            let (n_out, finish_reason) = match p.max_tokens {
                Some(m) => (m, "length"),
                None => {
                    let room = s.max_model_len.saturating_sub(prompt_len);
                    (s.gen.natural_len(key).min(room.max(1)), "stop")
                }
            };
            let mut ids = prompt.clone();
            if (n_out as u64 + prompt_len as u64) <= s.max_model_len as u64 {
                s.gen.push_ids(key, n_out, &mut ids);
            }
            let first = c == 0;
            submits.push(Submit {
                id: base + c,
                content: Content::Explicit(ids.into()),
                prompt_len,
                max_tokens: n_out,
                kind: if first { kind } else { Kind::Local },
                remote_prefix: if first { remote_prefix } else { 0 },
                pin_ms: if first { pin_ms } else { None },
            });
            plans.push(Plan {
                key,
                finish_reason,
                counts_prompt: j == 0,
            });
        }
    }
    tokio::time::sleep(s.request_overhead).await;
    let rx = s.engine.submit_all(submits);
    let guard = AbortGuard {
        engine: s.engine.clone(),
        open: (base..base + total).collect(),
    };
    let ctx = Ctx {
        created: unix_now(),
        model_json: serde_json::to_string(&s.model).unwrap_or_else(|_| "\"\"".into()),
        s: Arc::clone(&s),
        ep,
        name,
        base,
        plans,
        logprobs: p.asked.logprobs,
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

/// How one choice is generated.
struct Plan {
    key: u64,
    finish_reason: &'static str,
    /// The first choice of its prompt: its prompt (and cached) tokens count
    /// in usage once, as vLLM counts a prompt once for its n samples.
    counts_prompt: bool,
}

struct Ctx {
    s: Arc<AppState>,
    /// `created` of every chunk of this response (vLLM keeps one per request).
    created: u64,
    model_json: String,
    ep: Endpoint,
    name: String,
    /// Engine id of choice 0; choice c is `base + c`.
    base: u64,
    plans: Vec<Plan>,
    /// Alternatives per token to report, when the client asked for logprobs.
    logprobs: Option<u32>,
    include_usage: bool,
    kind: Kind,
    /// A bidirectional D keeps this request's blocks for a later pull.
    pinned: bool,
    arrived: Instant,
}

/// Usage summed over a request's choices.
#[derive(Default)]
struct UsageSum {
    prompt: u32,
    completion: u32,
    cached: u32,
}

impl UsageSum {
    fn add(&mut self, plan: &Plan, u: &Usage) {
        if plan.counts_prompt {
            self.prompt += u.prompt_tokens;
            self.cached += u.cached_tokens;
        }
        self.completion += u.completion_tokens;
    }
}

impl Ctx {
    /// The choice an engine id answers, when it is one of this request's.
    fn choice(&self, id: u64) -> Option<usize> {
        let c = id.checked_sub(self.base)? as usize;
        (c < self.plans.len()).then_some(c)
    }

    fn usage(&self, u: &UsageSum) -> Value {
        json!({
            "prompt_tokens": u.prompt,
            "total_tokens": u.prompt + u.completion,
            "completion_tokens": u.completion,
            "prompt_tokens_details": {"cached_tokens": u.cached}
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

    fn finish_str(&self, c: usize, f: Finish) -> &'static str {
        match f {
            Finish::Length => self.plans[c].finish_reason,
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

    /// Token `i` of choice `c`, with its logprobs when asked for.
    fn scored(&self, c: usize, i: u32) -> (String, Option<Scored>) {
        let key = self.plans[c].key;
        match self.logprobs {
            Some(k) => {
                let s = score(&self.s.gen, key, i, k);
                (s.token.clone(), Some(s))
            }
            None => (self.s.gen.piece(key, i), None),
        }
    }

    fn chunk(&self, choice: impl std::fmt::Display, usage: Option<Value>) -> String {
        let object = if self.ep == Endpoint::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        // In vLLM's order (its pydantic models' fields), not serde_json's
        // sorted one: clients and the router read vLLM's bytes.
        let usage = usage.map_or(String::new(), |u| format!(",\"usage\":{u}"));
        format!(
            "data: {{\"id\":{},\"object\":\"{object}\",\"created\":{},\"model\":{},\"choices\":{choice}{usage}}}\n\n",
            Value::from(self.name.as_str()),
            self.created,
            self.model_json
        )
    }

    /// One token's SSE event, written directly (the hot path: one per token per stream).
    /// Pieces are generator words (ASCII letters and a space), so they need no escaping.
    fn push_token_chunk(&self, buf: &mut String, c: usize, piece: &str) {
        use std::fmt::Write;
        let (object, open, close) = match self.ep {
            Endpoint::Chat => (
                "chat.completion.chunk",
                r#","delta":{"content":""#,
                r#""},"logprobs":null,"finish_reason":null}"#,
            ),
            Endpoint::Completion => (
                "text_completion",
                r#","text":""#,
                r#"","logprobs":null,"finish_reason":null,"stop_reason":null}"#,
            ),
        };
        let _ = write!(
            buf,
            "data: {{\"id\":\"{}\",\"object\":\"{object}\",\"created\":{},\"model\":{},\"choices\":[{{\"index\":{c}{open}{piece}{close}]}}\n\n",
            self.name, self.created, self.model_json
        );
    }

    /// A token's event with its logprobs (`offset`: where it starts in the choice's text).
    fn push_scored_chunk(&self, buf: &mut String, c: usize, s: Scored, offset: usize) {
        let piece = s.token.clone();
        let mut lp = Logprobs::new(
            self.ep == Endpoint::Chat,
            self.logprobs.unwrap_or(0),
            offset,
        );
        lp.push(s);
        let choice = match self.ep {
            Endpoint::Chat => {
                json!([{"index": c, "delta": {"content": piece}, "logprobs": lp.to_json(), "finish_reason": null}])
            }
            Endpoint::Completion => {
                json!([{"index": c, "text": piece, "logprobs": lp.to_json(), "finish_reason": null, "stop_reason": null}])
            }
        };
        buf.push_str(&self.chunk(choice, None));
    }
}

/// One choice of a whole answer, as it grows.
struct Answer {
    text: String,
    logprobs: Option<Logprobs>,
    finish: Option<&'static str>,
}

impl Answer {
    fn json(&self, ep: Endpoint, c: usize) -> Value {
        let lp = self
            .logprobs
            .as_ref()
            .map_or(Value::Null, Logprobs::to_json);
        let fr = self.finish;
        match ep {
            Endpoint::Chat => json!({
                "index": c,
                "message": {"role": "assistant", "content": self.text, "refusal": null, "annotations": null,
                            "audio": null, "function_call": null, "reasoning": null},
                "logprobs": lp, "finish_reason": fr, "stop_reason": null, "token_ids": null
            }),
            Endpoint::Completion => json!({
                "index": c, "text": self.text, "logprobs": lp, "finish_reason": fr,
                "stop_reason": null, "token_ids": null, "prompt_logprobs": null, "prompt_token_ids": null
            }),
        }
    }
}

async fn json_response(
    ctx: Ctx,
    mut rx: mpsc::UnboundedReceiver<(u64, Out)>,
    mut guard: AbortGuard,
) -> Response {
    let chat = ctx.ep == Endpoint::Chat;
    let mut answers: Vec<Answer> = (0..ctx.plans.len())
        .map(|_| Answer {
            text: String::new(),
            logprobs: ctx.logprobs.map(|k| Logprobs::new(chat, k, 0)),
            finish: None,
        })
        .collect();
    let mut usage = UsageSum::default();
    let mut open = ctx.plans.len();
    let mut ttft = None;
    let mut last = Instant::now();
    let mut itl = Vec::new();
    let mut model_first = None;
    let mut kv = Value::Null;
    loop {
        let Some((id, out)) = rx.recv().await else {
            guard.disarm();
            return error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped", None);
        };
        let Some(c) = ctx.choice(id) else { continue };
        match out {
            Out::Token { index, t } => {
                let now = Instant::now();
                if ttft.is_none() {
                    model_first = Some(t);
                    ttft = Some(ctx.arrived.elapsed().as_secs_f64());
                } else if c == 0 {
                    itl.push(now.duration_since(last).as_secs_f64());
                }
                if c == 0 {
                    last = now;
                }
                let (piece, scored) = ctx.scored(c, index);
                let a = &mut answers[c];
                a.text.push_str(&piece);
                if let (Some(lp), Some(s)) = (a.logprobs.as_mut(), scored) {
                    lp.push(s);
                }
            }
            // The guard aborts the other choices: one refused prompt refuses the request, as in vLLM.
            Out::Rejected(e) => return bad(e.to_string()),
            Out::Finished {
                usage: u,
                finish,
                held_blocks,
                held_tokens,
                t,
            } => {
                guard.finished(id);
                let fr = ctx.finish_str(c, finish);
                // TTFT and ITL are choice 0's, as one stream's timing.
                let (first, gaps): (Option<f64>, &[f64]) =
                    if c == 0 { (ttft, &itl) } else { (None, &[]) };
                ctx.record(first, gaps, fr);
                usage.add(&ctx.plans[c], &u);
                answers[c].finish = Some(fr);
                if c == 0 {
                    kv = ctx.kv_params(Some((&held_blocks, held_tokens)));
                }
                open -= 1;
                if open == 0 {
                    ctx.s.record_timing(&ctx.name, model_first, t);
                    break;
                }
            }
        }
    }
    let choices: Vec<Value> = answers
        .iter()
        .enumerate()
        .map(|(c, a)| a.json(ctx.ep, c))
        .collect();
    let object = if chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    let mut body = json!({
        "id": ctx.name, "object": object, "created": ctx.created, "model": ctx.s.model,
        "choices": choices, "usage": ctx.usage(&usage), "service_tier": null,
        "system_fingerprint": null, "kv_transfer_params": kv
    });
    if chat {
        body["prompt_logprobs"] = Value::Null;
    }
    axum::Json(body).into_response()
}

/// One choice of a stream: whether its first token went out, where its text ends.
#[derive(Default, Clone, Copy)]
struct Streamed {
    started: bool,
    offset: usize,
}

struct StreamState {
    ctx: Ctx,
    rx: mpsc::UnboundedReceiver<(u64, Out)>,
    guard: AbortGuard,
    choices: Vec<Streamed>,
    usage: UsageSum,
    open: usize,
    last: Instant,
    ttft: Option<f64>,
    model_first: Option<f64>,
    itl: Vec<f64>,
    done: bool,
}

impl StreamState {
    /// Writes one engine event of choice `c`; true when the stream is complete.
    fn write(&mut self, buf: &mut String, id: u64, c: usize, out: Out) -> bool {
        match out {
            Out::Token { index, t } => {
                let now = Instant::now();
                if self.ttft.is_none() {
                    self.model_first = Some(t);
                    self.ttft = Some(self.ctx.arrived.elapsed().as_secs_f64());
                } else if c == 0 {
                    self.itl.push(now.duration_since(self.last).as_secs_f64());
                }
                if c == 0 {
                    self.last = now;
                }
                if !self.choices[c].started && self.ctx.ep == Endpoint::Chat {
                    // vLLM's first chunk of a choice: its role, in vLLM's field order.
                    let role = format!(
                        r#"[{{"index":{c},"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]"#
                    );
                    buf.push_str(&self.ctx.chunk(role, None));
                }
                self.choices[c].started = true;
                match self.ctx.scored(c, index) {
                    (piece, None) => self.ctx.push_token_chunk(buf, c, &piece),
                    (piece, Some(s)) => {
                        let offset = self.choices[c].offset;
                        self.choices[c].offset += piece.len();
                        self.ctx.push_scored_chunk(buf, c, s, offset);
                    }
                }
                false
            }
            Out::Rejected(e) => {
                let err = json!({"error": {"message": e.to_string(), "type": "BadRequestError", "param": null, "code": 400}});
                buf.push_str(&format!("data: {err}\n\ndata: [DONE]\n\n"));
                true
            }
            Out::Finished {
                usage, finish, t, ..
            } => {
                self.guard.finished(id);
                let fr = self.ctx.finish_str(c, finish);
                if c == 0 {
                    self.ctx.record(self.ttft, &self.itl, fr);
                } else {
                    self.ctx.record(None, &[], fr);
                }
                self.usage.add(&self.ctx.plans[c], &usage);
                let tail = match self.ctx.ep {
                    Endpoint::Chat => {
                        json!([{"index": c, "delta": {}, "logprobs": null, "finish_reason": fr, "stop_reason": null}])
                    }
                    Endpoint::Completion => {
                        json!([{"index": c, "text": "", "logprobs": null, "finish_reason": fr, "stop_reason": null}])
                    }
                };
                buf.push_str(&self.ctx.chunk(tail, None));
                self.open -= 1;
                if self.open > 0 {
                    return false;
                }
                self.ctx
                    .s
                    .record_timing(&self.ctx.name, self.model_first, t);
                if self.ctx.include_usage {
                    buf.push_str(&self.ctx.chunk(json!([]), Some(self.ctx.usage(&self.usage))));
                }
                buf.push_str("data: [DONE]\n\n");
                true
            }
        }
    }
}

async fn stream_response(
    ctx: Ctx,
    mut rx: mpsc::UnboundedReceiver<(u64, Out)>,
    mut guard: AbortGuard,
) -> Response {
    // Refusals arrive before any token: answer them as JSON errors, like vLLM.
    let first = match rx.recv().await {
        Some((_, Out::Rejected(e))) => return bad(e.to_string()),
        None => {
            guard.disarm();
            return error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped", None);
        }
        Some(o) => o,
    };
    let st = StreamState {
        choices: vec![Streamed::default(); ctx.plans.len()],
        open: ctx.plans.len(),
        ctx,
        rx,
        guard,
        usage: UsageSum::default(),
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
                    st.guard.disarm();
                    if buf.is_empty() {
                        return Some((
                            Err(std::io::Error::other("engine stopped mid-stream")),
                            (st, None),
                        ));
                    }
                    break;
                }
                Some((id, out)) => {
                    if let Some(c) = st.ctx.choice(id) {
                        if st.write(&mut buf, id, c, out) {
                            st.done = true;
                            break;
                        }
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn prompts(v: Value) -> Result<Vec<Vec<u64>>, StatusCode> {
        completion_prompts(&v).map_err(|r| r.status())
    }

    #[test]
    fn a_prompt_list_is_a_batch_of_prompts_in_order() {
        let one = prompts(json!({"prompt": "a b"})).unwrap();
        let two = prompts(json!({"prompt": ["a b", "c"]})).unwrap();
        assert_eq!(two.len(), 2);
        assert_eq!(two[0], one[0]);
        assert_eq!(two[1], render_prompt("c"));
        let ids = prompts(json!({"prompt": [[1, 2], [3]]})).unwrap();
        assert_eq!(
            ids,
            vec![
                vec![given_token_id(1), given_token_id(2)],
                vec![given_token_id(3)]
            ]
        );
        // A flat list of ids is one prompt.
        assert_eq!(prompts(json!({"prompt": [1, 2, 3]})).unwrap().len(), 1);
    }

    #[test]
    fn missing_empty_and_mixed_prompts_are_refused() {
        for v in [
            json!({}),
            json!({"prompt": []}),
            json!({"prompt": ["a", 1]}),
            json!({"prompt": [[1], "a"]}),
            json!({"prompt": [[]]}),
            json!({"prompt": [-1]}),
            json!({"prompt": 5}),
        ] {
            assert_eq!(prompts(v.clone()), Err(StatusCode::BAD_REQUEST), "{v}");
        }
    }

    #[tokio::test]
    async fn invalid_json_is_pydantics_error_at_the_offending_offset() {
        let text = "{\"a\": 1,\n x}";
        let e = serde_json::from_str::<Value>(text).unwrap_err();
        let r = not_json(text, &e);
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        let body = axum::body::to_bytes(r.into_body(), usize::MAX)
            .await
            .unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "Bad Request");
        // Line 2, column 2: the 11th character.
        assert_eq!(v["error"]["param"], "body.10");
    }
}
