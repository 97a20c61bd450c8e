//! The per-request path: identity → features → policy → orchestration → streaming relay → bookkeeping, once, in that order.

use axum::body::{Body, Bytes};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt};
use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use ppd_core::identity::{conversation_id, features, hash_id};
use ppd_core::request::{parse_request, RequestView};
use ppd_core::session::Session;
use ppd_core::{DecisionInput, Path, Route};

use crate::body::{rewrite, Edit};
use crate::config::KvProtocol;
use crate::metrics::{ErrorLabels, PathLabel, RequestLabels};
use crate::registry::{InflightGuard, Node, Role};
use crate::sse::{classify, EventKind, EventSplitter, Usage};
use crate::state::AppState;

pub const SESSION_HEADER: &str = "x-session-id";

/// An OpenAI-style error response: `{"error": {"message", "type", "param", "code"}}`.
pub fn openai_error(
    status: StatusCode,
    message: impl Into<String>,
    kind: &str,
    code: &str,
) -> Response {
    let body = serde_json::json!({"error": {"message": message.into(), "type": kind, "param": null, "code": code}});
    (
        status,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn unavailable(message: impl Into<String>) -> Response {
    let mut r = openai_error(
        StatusCode::SERVICE_UNAVAILABLE,
        message,
        "service_unavailable",
        "no_eligible_node",
    );
    r.headers_mut()
        .insert("retry-after", HeaderValue::from_static("1"));
    r
}

/// Marks a response already counted in `ppd_requests_total` (a routed request).
#[derive(Clone, Copy)]
pub struct Counted;

/// Which OpenAI endpoint a request came in on (and goes out to).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    // The discriminants index `Node::endpoint_urls`.
    Chat = 0,
    Completions = 1,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }

    /// A POST to this endpoint on `node`, from the URL the registry parsed once.
    fn post(self, client: &reqwest::Client, node: &Node) -> reqwest::RequestBuilder {
        match &node.endpoint_urls {
            Some(urls) => client.post(urls[self as usize].clone()),
            // Unparseable: the client reports why when the request is sent.
            None => client.post(format!("{}{}", node.url, self.path())),
        }
    }
}

/// What bookkeeping needs once the answer is complete.
struct Ticket {
    state: Arc<AppState>,
    conv: String,
    turn: u32,
    n_in: u32,
    route: Route,
    p: Option<Arc<Node>>,
    d: Arc<Node>,
    started: Instant,
    status: u16,
}

impl Ticket {
    fn count(&self, status: u16) {
        self.state
            .metrics
            .requests
            .get_or_create(&RequestLabels {
                path: self.route.path.as_str(),
                reason: self.route.reason.as_str(),
                status,
            })
            .inc();
    }

    /// A complete answer: session, latencies, KV accounting, node health.
    fn finish(&self, usage: Option<Usage>, first_token: Option<Instant>, end: Instant) {
        let st = &self.state;
        let now = st.now_ms();
        let d_id = self.d.id;
        let p_id = self.p.as_ref().map(|p| p.id);
        let prev = st.sessions.peek(&self.conv).and_then(|s| s.d);
        st.sessions.update(&self.conv, now, |s: &mut Session| {
            s.turns = s.turns.max(self.turn);
            s.d = Some(d_id);
            if p_id.is_some() {
                s.p = p_id;
            }
            if let Some(u) = usage {
                s.record_usage(u.prompt_tokens, u.completion_tokens, now);
            }
        });
        if prev != Some(d_id) {
            self.d.sessions.fetch_add(1, Ordering::Relaxed);
        }
        st.registry.record_success(&self.d);
        let path = PathLabel {
            path: self.route.path.as_str(),
        };
        if let Some(ft) = first_token {
            st.metrics
                .ttft
                .get_or_create(&path)
                .observe((ft - self.started).as_secs_f64());
            if let Some(u) = usage.filter(|u| u.completion_tokens > 1) {
                let tpot = (end - ft).as_secs_f64() / f64::from(u.completion_tokens - 1);
                st.metrics.tpot.get_or_create(&path).observe(tpot);
            }
        }
        if let Some(u) = usage {
            let per_token = st.cfg.kv_bytes_per_token;
            match self.route.path {
                Path::Pd if st.kv != KvProtocol::None => {
                    st.metrics
                        .kv_bytes_moved
                        .inc_by(u64::from(u.prompt_tokens) * per_token);
                }
                Path::Local => {
                    let cached = u.prompt_tokens.saturating_sub(self.n_in);
                    st.metrics
                        .kv_bytes_avoided
                        .inc_by(u64::from(cached) * per_token);
                }
                _ => {}
            }
        }
        self.count(self.status);
    }
}

fn now_route_headers(resp: &mut Response, route: &Route, conv: &str, node: &Node) {
    resp.extensions_mut().insert(Counted);
    // Names as constants: a `&str` name is parsed on every insert.
    const PATH: HeaderName = HeaderName::from_static("x-ppd-path");
    const REASON: HeaderName = HeaderName::from_static("x-ppd-reason");
    const SESSION: HeaderName = HeaderName::from_static("x-ppd-session");
    const NODE: HeaderName = HeaderName::from_static("x-ppd-node");
    let h = resp.headers_mut();
    h.insert(PATH, HeaderValue::from_static(route.path.as_str()));
    h.insert(REASON, HeaderValue::from_static(route.reason.as_str()));
    if let Ok(v) = HeaderValue::from_str(conv) {
        h.insert(SESSION, v);
    }
    if let Some(v) = &node.url_header {
        h.insert(NODE, v.clone());
    }
}

/// Sets `stream_options.include_usage` when the client streams without it,
/// keeping any other stream options; returns whether the router added it.
fn usage_edit<'a>(text: &str, view: &RequestView<'_>) -> Option<Edit<'a>> {
    if !view.is_stream() || view.wants_usage() {
        return None;
    }
    if view.stream_options.is_none() {
        // The usual case: no options to keep, so no second parse of the body.
        return Some(Edit::Set(
            "stream_options",
            Cow::Borrowed(r#"{"include_usage":true}"#),
        ));
    }
    #[derive(serde::Deserialize)]
    struct Opts {
        #[serde(default)]
        stream_options: Option<serde_json::Map<String, serde_json::Value>>,
    }
    let mut opts = serde_json::from_str::<Opts>(text)
        .ok()
        .and_then(|o| o.stream_options)
        .unwrap_or_default();
    opts.insert("include_usage".into(), serde_json::Value::Bool(true));
    Some(Edit::Set(
        "stream_options",
        Cow::Owned(serde_json::Value::Object(opts).to_string()),
    ))
}

pub async fn completions(
    st: Arc<AppState>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = Instant::now();
    let bytes = match axum::body::to_bytes(body, st.cfg.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => {
            let too_big = std::error::Error::source(&e)
                .is_some_and(|s| s.to_string().contains("length limit"))
                || e.to_string().contains("length limit");
            return if too_big {
                openai_error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "request body exceeds the limit of {} bytes",
                        st.cfg.max_body_bytes
                    ),
                    "invalid_request_error",
                    "body_too_large",
                )
            } else {
                openai_error(
                    StatusCode::BAD_REQUEST,
                    format!("cannot read request body: {e}"),
                    "invalid_request_error",
                    "bad_body",
                )
            };
        }
    };
    let text = match std::str::from_utf8(&bytes) {
        Ok(t) => t,
        Err(_) => {
            return openai_error(
                StatusCode::BAD_REQUEST,
                "request body is not UTF-8",
                "invalid_request_error",
                "invalid_json",
            )
        }
    };
    let view = match parse_request(text) {
        Ok(v) => v,
        Err(e) => {
            return openai_error(
                StatusCode::BAD_REQUEST,
                e.to_string(),
                "invalid_request_error",
                "invalid_request",
            )
        }
    };
    if endpoint == Endpoint::Chat && view.messages.is_none() {
        return openai_error(
            StatusCode::BAD_REQUEST,
            "chat completions need `messages`",
            "invalid_request_error",
            "invalid_request",
        );
    }
    if endpoint == Endpoint::Completions && view.prompt.is_none() {
        return openai_error(
            StatusCode::BAD_REQUEST,
            "completions need `prompt`",
            "invalid_request_error",
            "invalid_request",
        );
    }
    if let Some(model) = view.model.as_deref() {
        let models = st.models.load();
        if !models.is_empty()
            && !models
                .iter()
                .any(|m| m.get("id").and_then(|v| v.as_str()) == Some(model))
        {
            return openai_error(
                StatusCode::NOT_FOUND,
                format!("The model `{model}` does not exist."),
                "invalid_request_error",
                "model_not_found",
            );
        }
    }

    // identity and features
    let header_id = headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok());
    let conv = match conversation_id(header_id, &view) {
        Ok(c) => c,
        Err(e) => {
            return openai_error(
                StatusCode::BAD_REQUEST,
                e.to_string(),
                "invalid_request_error",
                "invalid_request",
            )
        }
    };
    let now = st.now_ms();
    let session = st.sessions.get(&conv.id, now);
    let table = st.engine.table();
    let f = match features(
        &view,
        st.counter.as_ref(),
        session.as_ref(),
        table.default_n_out(),
    ) {
        Ok(f) => f,
        Err(e) => {
            return openai_error(
                StatusCode::BAD_REQUEST,
                e.to_string(),
                "invalid_request_error",
                "invalid_request",
            )
        }
    };
    let qps = {
        let mut q = st.qps.lock();
        if f.turn == 1 {
            q.record(now);
        }
        q.rate(now)
    };

    // policy
    let holder = session.and_then(|s| s.d).and_then(|id| st.registry.get(id));
    let input = DecisionInput {
        turn: f.turn,
        n_in: f.n_in,
        n_out: f.n_out,
        n_ctx: f.n_ctx,
        qps,
        conv_hash: hash_id(&conv.id),
        has_session: session.is_some_and(|s| s.d.is_some()),
        d_available: holder.as_ref().is_some_and(|n| n.available(now)),
        d_overloaded: holder.as_ref().is_some_and(|n| {
            st.cfg.overload_inflight > 0 && n.inflight() >= st.cfg.overload_inflight
        }),
        d_local_capable: holder.as_ref().is_some_and(|n| n.role == Role::PD),
        replica_share: st.replica_share(),
        session_on_replica: holder.as_ref().is_some_and(|n| n.role == Role::R),
    };
    let route = match st.engine.decide(&input) {
        Ok(r) => r,
        Err(e) => {
            return openai_error(
                StatusCode::BAD_REQUEST,
                e.to_string(),
                "invalid_request_error",
                "invalid_request",
            )
        }
    };
    st.metrics.decision.observe(started.elapsed().as_secs_f64());
    let cell = route.scored.map(|s| {
        let (c, w, q) = table.describe(s.cell_at);
        (c.to_owned(), w.to_owned(), q)
    });
    st.record_decision(route.path, route.reason, cell);
    tracing::debug!(conv = %conv.id, turn = f.turn, path = route.path.as_str(), reason = route.reason.as_str(), "route");

    let ctx = Request {
        st: &st,
        endpoint,
        text,
        view: &view,
        conv: conv.id,
        turn: f.turn,
        n_in: f.n_in,
        route,
        started,
        unreachable: AtomicBool::new(false),
    };
    match route.path {
        Path::Local => match holder {
            Some(d) => {
                let resp = ctx.local(d).await;
                if !ctx.unreachable.load(Ordering::Acquire) {
                    return resp;
                }
                // The pD died since the last health check and nothing was sent:
                // decide again knowing it is gone (the engine names the reason).
                let again = DecisionInput {
                    d_available: false,
                    ..input
                };
                let route = match st.engine.decide(&again) {
                    Ok(r) => r,
                    Err(_) => return resp,
                };
                st.record_decision(route.path, route.reason, None);
                let retry = Request {
                    route,
                    unreachable: AtomicBool::new(false),
                    ..ctx
                };
                retry.pd(None).await
            }
            None => ctx.fail(
                StatusCode::SERVICE_UNAVAILABLE,
                unavailable("the session's decode node is gone"),
            ),
        },
        Path::Replica => ctx.replica(holder).await,
        Path::Pd => ctx.pd(holder).await,
    }
}

struct Request<'a> {
    st: &'a Arc<AppState>,
    endpoint: Endpoint,
    text: &'a str,
    view: &'a RequestView<'a>,
    conv: String,
    turn: u32,
    n_in: u32,
    route: Route,
    started: Instant,
    /// Set when a local forward found its node unreachable before sending anything.
    unreachable: AtomicBool,
}

enum PrefillError {
    /// Nothing reached the client; another P may be tried.
    Retryable(String),
    /// P answered with a client error: pass it on.
    Answer(Response),
}

impl Request<'_> {
    fn ticket(&self, p: Option<Arc<Node>>, d: Arc<Node>) -> Ticket {
        Ticket {
            state: Arc::clone(self.st),
            conv: self.conv.clone(),
            turn: self.turn,
            n_in: self.n_in,
            route: self.route,
            p,
            d,
            started: self.started,
            status: 200,
        }
    }

    fn fail(&self, status: StatusCode, resp: Response) -> Response {
        let mut resp = resp;
        resp.extensions_mut().insert(Counted);
        if self.unreachable.load(Ordering::Acquire) {
            // Retried on the pd path; the client never sees this answer.
            return resp;
        }
        self.st
            .metrics
            .requests
            .get_or_create(&RequestLabels {
                path: self.route.path.as_str(),
                reason: self.route.reason.as_str(),
                status: status.as_u16(),
            })
            .inc();
        resp
    }

    fn upstream_error(&self, role: Role, kind: &'static str) {
        self.st
            .metrics
            .upstream_errors
            .get_or_create(&ErrorLabels {
                role: role.as_str(),
                kind,
            })
            .inc();
    }

    async fn local(&self, d: Arc<Node>) -> Response {
        let edits: Vec<Edit<'_>> = usage_edit(self.text, self.view).into_iter().collect();
        self.forward(None, d, edits, None).await
    }

    async fn replica(&self, holder: Option<Arc<Node>>) -> Response {
        let now = self.st.now_ms();
        let r = match holder.filter(|n| n.role == Role::R && n.available(now)) {
            Some(r) => r,
            None => match self.st.registry.least_loaded(&[Role::R], &[], now) {
                Some(r) => r,
                None => {
                    return self.fail(
                        StatusCode::SERVICE_UNAVAILABLE,
                        unavailable("no healthy replica node"),
                    )
                }
            },
        };
        let edits: Vec<Edit<'_>> = usage_edit(self.text, self.view).into_iter().collect();
        self.forward(None, r, edits, None).await
    }

    /// P prefills, its KV moves to D, D decodes; a P that fails before
    /// answering is replaced by another P.
    async fn pd(&self, holder: Option<Arc<Node>>) -> Response {
        let now = self.st.now_ms();
        let d = match holder.filter(|n| n.role.decodes() && n.available(now)) {
            Some(d) => d,
            None => match self
                .st
                .registry
                .least_loaded(&[Role::D, Role::PD], &[], now)
            {
                Some(d) => d,
                None => {
                    return self.fail(
                        StatusCode::SERVICE_UNAVAILABLE,
                        unavailable("no healthy decode node"),
                    )
                }
            },
        };
        if self.st.kv == KvProtocol::None {
            let edits: Vec<Edit<'_>> = usage_edit(self.text, self.view).into_iter().collect();
            return self.forward(None, d, edits, None).await;
        }
        let request_id = format!("ppd-{}", uuid::Uuid::new_v4().simple());
        let mut tried = Vec::new();
        loop {
            let Some(p) = self
                .st
                .registry
                .least_loaded(&[Role::P], &tried, self.st.now_ms())
            else {
                let msg = if tried.is_empty() {
                    "no healthy prefill node"
                } else {
                    "every prefill node failed"
                };
                return self.fail(StatusCode::SERVICE_UNAVAILABLE, unavailable(msg));
            };
            tried.push(p.id);
            let rid = match self.st.kv {
                KvProtocol::P2pNccl => match (&p.zmq, &d.zmq) {
                    (Some(pz), Some(dz)) => format!(
                        "___prefill_addr_{pz}___decode_addr_{dz}_{}",
                        uuid::Uuid::new_v4().simple()
                    ),
                    _ => return self.fail(
                        StatusCode::SERVICE_UNAVAILABLE,
                        unavailable(
                            "p2pnccl needs a zmq address for both the prefill and the decode node",
                        ),
                    ),
                },
                _ => request_id.clone(),
            };
            match self.prefill(&p, &rid).await {
                Ok(kv_params) => {
                    self.st.registry.record_success(&p);
                    let mut edits: Vec<Edit<'_>> = Vec::new();
                    if let Some(kv) = kv_params {
                        edits.push(Edit::Set("kv_transfer_params", Cow::Owned(kv)));
                    }
                    edits.extend(usage_edit(self.text, self.view));
                    return self.forward(Some(p), d, edits, Some(rid)).await;
                }
                Err(PrefillError::Answer(resp)) => {
                    let status = resp.status();
                    return self.fail(status, resp);
                }
                Err(PrefillError::Retryable(why)) => {
                    tracing::warn!(node = %p.url, %why, "prefill failed; trying another P");
                    self.st.registry.record_failure(&p, self.st.now_ms());
                    self.st.metrics.retries.inc();
                }
            }
        }
    }

    /// Runs P's prefill and returns the raw `kv_transfer_params` it answered (NIXL).
    async fn prefill(
        &self,
        p: &Arc<Node>,
        request_id: &str,
    ) -> Result<Option<String>, PrefillError> {
        let _g = InflightGuard::new(Arc::clone(p));
        let mut edits = vec![
            Edit::Set("stream", Cow::Borrowed("false")),
            Edit::Set("max_tokens", Cow::Borrowed("1")),
            Edit::Remove("stream_options"),
            Edit::Remove("min_tokens"),
        ];
        if self.view.max_completion_tokens.is_some() {
            edits.push(Edit::Set("max_completion_tokens", Cow::Borrowed("1")));
        }
        if self.st.kv == KvProtocol::Nixl {
            edits.push(Edit::Set(
                "kv_transfer_params",
                Cow::Borrowed(r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#),
            ));
        }
        let body = rewrite(self.text, &edits)
            .map_err(|e| PrefillError::Retryable(format!("body rewrite: {e}")))?;
        let send = self
            .endpoint
            .post(self.st.client(), p)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header("x-request-id", request_id)
            .body(body)
            .send();
        let timeout = Duration::from_secs_f64(self.st.cfg.prefill_timeout);
        let resp = match tokio::time::timeout(timeout, send).await {
            Err(_) => {
                self.upstream_error(Role::P, "timeout");
                return Err(PrefillError::Retryable(format!(
                    "no answer within {timeout:?}"
                )));
            }
            Ok(Err(e)) => {
                self.upstream_error(Role::P, "connect");
                return Err(PrefillError::Retryable(e.to_string()));
            }
            Ok(Ok(r)) => r,
        };
        let status = resp.status();
        let bytes = match tokio::time::timeout(timeout, resp.bytes()).await {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                self.upstream_error(Role::P, "body");
                return Err(PrefillError::Retryable(e.to_string()));
            }
            Err(_) => {
                self.upstream_error(Role::P, "timeout");
                return Err(PrefillError::Retryable("prefill body timed out".into()));
            }
        };
        if status.is_server_error() {
            self.upstream_error(Role::P, "status_5xx");
            return Err(PrefillError::Retryable(format!("HTTP {status}")));
        }
        if !status.is_success() {
            return Err(PrefillError::Answer(passthrough(status, bytes)));
        }
        if self.st.kv != KvProtocol::Nixl {
            return Ok(None);
        }
        #[derive(serde::Deserialize)]
        struct PrefillAnswer<'a> {
            #[serde(borrow, default)]
            kv_transfer_params: Option<&'a serde_json::value::RawValue>,
        }
        let parsed: PrefillAnswer<'_> = serde_json::from_slice(&bytes)
            .map_err(|e| PrefillError::Retryable(format!("prefill answer is not JSON: {e}")))?;
        match parsed.kv_transfer_params {
            Some(kv) if kv.get() != "null" => Ok(Some(kv.get().to_owned())),
            _ => {
                self.upstream_error(Role::P, "no_kv_params");
                Err(PrefillError::Retryable(
                    "prefill answer has no kv_transfer_params (is P a NIXL kv_producer?)".into(),
                ))
            }
        }
    }

    /// Sends the (edited) body to the decoding node and relays its answer.
    async fn forward(
        &self,
        p: Option<Arc<Node>>,
        d: Arc<Node>,
        edits: Vec<Edit<'_>>,
        request_id: Option<String>,
    ) -> Response {
        let dropping_usage = edits
            .iter()
            .any(|e| matches!(e, Edit::Set("stream_options", _)));
        let body: Bytes = if edits.is_empty() {
            Bytes::copy_from_slice(self.text.as_bytes())
        } else {
            match rewrite(self.text, &edits) {
                Ok(b) => Bytes::from(b),
                Err(e) => {
                    return self.fail(
                        StatusCode::BAD_REQUEST,
                        openai_error(
                            StatusCode::BAD_REQUEST,
                            e.to_string(),
                            "invalid_request_error",
                            "invalid_json",
                        ),
                    )
                }
            }
        };
        let guard = InflightGuard::new(Arc::clone(&d));
        let mut req = self
            .endpoint
            .post(self.st.client(), &d)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .body(body);
        if let Some(rid) = &request_id {
            req = req.header("x-request-id", rid);
        }
        let role = d.role;
        let timeout = Duration::from_secs_f64(self.st.cfg.request_timeout);
        let resp = match tokio::time::timeout(timeout, req.send()).await {
            Err(_) => {
                self.upstream_error(role, "timeout");
                self.st.registry.record_failure(&d, self.st.now_ms());
                return self.fail(
                    StatusCode::GATEWAY_TIMEOUT,
                    openai_error(
                        StatusCode::GATEWAY_TIMEOUT,
                        format!("{} did not answer within {timeout:?}", d.url),
                        "upstream_error",
                        "upstream_timeout",
                    ),
                );
            }
            Ok(Err(e)) => {
                self.upstream_error(role, "connect");
                self.st.registry.record_failure(&d, self.st.now_ms());
                if e.is_connect() && self.route.path == Path::Local {
                    d.set_healthy(false);
                    self.unreachable.store(true, Ordering::Release);
                }
                return self.fail(
                    StatusCode::BAD_GATEWAY,
                    openai_error(
                        StatusCode::BAD_GATEWAY,
                        format!("{}: {e}", d.url),
                        "upstream_error",
                        "upstream_unreachable",
                    ),
                );
            }
            Ok(Ok(r)) => r,
        };
        let status = resp.status();
        if !status.is_success() {
            if status.is_server_error() {
                self.upstream_error(role, "status_5xx");
                self.st.registry.record_failure(&d, self.st.now_ms());
            }
            let bytes = tokio::time::timeout(timeout, resp.bytes())
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default();
            let mut out = passthrough(status, bytes);
            now_route_headers(&mut out, &self.route, &self.conv, &d);
            return self.fail(status, out);
        }
        let content_type = resp.headers().get("content-type").cloned();
        let ticket = self.ticket(p, Arc::clone(&d));
        let mut out = if self.view.is_stream() {
            let relay = Relay {
                upstream: Box::pin(resp.bytes_stream()),
                idle: Duration::from_secs_f64(self.st.cfg.stream_idle_timeout),
                sleep: None,
                splitter: EventSplitter::default(),
                drop_usage: dropping_usage,
                usage: None,
                first_token: None,
                ticket: Some(ticket),
                done: false,
                _guard: guard,
            };
            let mut r = Response::new(Body::from_stream(relay));
            r.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
            r.headers_mut()
                .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            r
        } else {
            let bytes = match tokio::time::timeout(timeout, resp.bytes()).await {
                Ok(Ok(b)) => b,
                _ => {
                    self.upstream_error(role, "body");
                    self.st.registry.record_failure(&d, self.st.now_ms());
                    return self.fail(
                        StatusCode::BAD_GATEWAY,
                        openai_error(
                            StatusCode::BAD_GATEWAY,
                            format!("{} failed while answering", d.url),
                            "upstream_error",
                            "upstream_failed",
                        ),
                    );
                }
            };
            #[derive(serde::Deserialize)]
            struct WithUsage {
                #[serde(default)]
                usage: Option<Usage>,
            }
            let usage = serde_json::from_slice::<WithUsage>(&bytes)
                .ok()
                .and_then(|u| u.usage);
            let end = Instant::now();
            ticket.finish(usage, Some(end), end);
            drop(guard);
            let mut r = Response::new(Body::from(bytes));
            r.headers_mut().insert(
                "content-type",
                content_type.unwrap_or(HeaderValue::from_static("application/json")),
            );
            r
        };
        now_route_headers(&mut out, &self.route, &self.conv, &d);
        out
    }
}

/// An upstream error answer, passed on with its status; a body that is not
/// JSON is wrapped in an OpenAI-style error.
fn passthrough(status: StatusCode, bytes: Bytes) -> Response {
    if serde_json::from_slice::<serde::de::IgnoredAny>(&bytes).is_ok() {
        return (status, [("content-type", "application/json")], bytes).into_response();
    }
    let msg = String::from_utf8_lossy(&bytes).trim().to_owned();
    let msg = if msg.is_empty() {
        format!("upstream answered HTTP {status}")
    } else {
        msg
    };
    openai_error(status, msg, "upstream_error", "upstream_status")
}

type ByteStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// Relays an upstream SSE stream event by event: the client gets the bytes vLLM
/// sent, minus the usage chunk the router asked for itself; a failure mid-stream
/// becomes an SSE error event and the end of the stream.
struct Relay {
    upstream: ByteStream,
    idle: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    splitter: EventSplitter,
    drop_usage: bool,
    usage: Option<Usage>,
    first_token: Option<Instant>,
    ticket: Option<Ticket>,
    done: bool,
    _guard: InflightGuard,
}

fn sse_error(message: &str) -> Bytes {
    let body = serde_json::json!({"error": {"message": message, "type": "upstream_error", "param": null, "code": 502}});
    Bytes::from(format!("data: {body}\n\n"))
}

impl Relay {
    /// Events ready to send from what has been buffered (without a copy
    /// unless the router's own usage chunk has to be cut out).
    fn drain(&mut self) -> Option<Bytes> {
        let Relay {
            splitter,
            drop_usage,
            usage,
            first_token,
            ticket,
            ..
        } = self;
        splitter.take_events(|ev| {
            match classify(ev) {
                EventKind::UsageOnly(u) => {
                    *usage = Some(u);
                    if *drop_usage {
                        return false;
                    }
                }
                EventKind::Data { usage: u } => {
                    if first_token.is_none() {
                        *first_token = Some(Instant::now());
                    }
                    if u.is_some() {
                        *usage = u;
                    }
                }
                EventKind::Error => {
                    if let Some(t) = ticket.as_ref() {
                        t.state.registry.record_failure(&t.d, t.state.now_ms());
                    }
                }
                EventKind::Done | EventKind::Other => {}
            }
            true
        })
    }

    fn fail(&mut self, message: &str, kind: &'static str) -> Bytes {
        self.done = true;
        if let Some(t) = self.ticket.take() {
            let st = &t.state;
            st.metrics
                .upstream_errors
                .get_or_create(&ErrorLabels {
                    role: t.d.role.as_str(),
                    kind,
                })
                .inc();
            st.registry.record_failure(&t.d, st.now_ms());
            t.count(502);
        }
        sse_error(message)
    }
}

impl Stream for Relay {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            match this.upstream.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(chunk))) => {
                    this.sleep = None;
                    this.splitter.push(&chunk);
                    if let Some(out) = this.drain() {
                        return Poll::Ready(Some(Ok(out)));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    let msg = format!("upstream stream failed: {e}");
                    return Poll::Ready(Some(Ok(this.fail(&msg, "stream"))));
                }
                Poll::Ready(None) => {
                    this.done = true;
                    let rest = this.splitter.take_rest();
                    if let Some(t) = this.ticket.take() {
                        t.finish(this.usage, this.first_token, Instant::now());
                    }
                    return Poll::Ready(rest.map(Ok));
                }
                Poll::Pending => {
                    let idle = this.idle;
                    let sleep = this
                        .sleep
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                    if sleep.as_mut().poll(cx).is_ready() {
                        let msg = format!("upstream sent nothing for {idle:?}");
                        return Poll::Ready(Some(Ok(this.fail(&msg, "stream_idle"))));
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // The client went away before the end: dropping the upstream stream
        // closes its connection, which aborts the request on the node.
        if let Some(t) = self.ticket.take() {
            t.count(499);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_requested_only_for_streams_that_did_not_ask() {
        let body = r#"{"stream":true,"messages":[{"role":"user","content":"x"}]}"#;
        let v = parse_request(body).unwrap();
        let e = usage_edit(body, &v).unwrap();
        let out = rewrite(body, &[e]).unwrap();
        assert!(
            out.contains(r#""stream_options":{"include_usage":true}"#),
            "{out}"
        );
        let body = r#"{"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"x"}]}"#;
        assert!(usage_edit(body, &parse_request(body).unwrap()).is_none());
        let body = r#"{"stream":false,"messages":[{"role":"user","content":"x"}]}"#;
        assert!(usage_edit(body, &parse_request(body).unwrap()).is_none());
        let body = r#"{"stream":true,"stream_options":{"continuous_usage_stats":true},"messages":[{"role":"user","content":"x"}]}"#;
        let out = rewrite(
            body,
            &[usage_edit(body, &parse_request(body).unwrap()).unwrap()],
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            v["stream_options"],
            serde_json::json!({"continuous_usage_stats": true, "include_usage": true})
        );
    }

    #[test]
    fn non_json_upstream_errors_are_wrapped() {
        let r = passthrough(StatusCode::BAD_GATEWAY, Bytes::from_static(b"oops"));
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
    }
}
