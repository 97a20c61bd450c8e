//! The admin API (bearer-token protected JSON): nodes, sessions, table, weights, policy, decision statistics.

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ppd_core::builtin::load_table;
use ppd_core::{PolicyKind, Role, Weights};

use crate::error::openai_error;
use crate::intake::read_within;
use crate::kv_subscriber::Endpoint;
use crate::registry::Source;
use crate::state::AppState;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/admin/nodes", get(nodes).post(register).delete(deregister))
        .route("/admin/sessions", get(sessions))
        .route("/admin/table", get(table))
        .route("/admin/table/reload", post(reload))
        .route("/admin/weights", get(weights).put(set_weights))
        .route("/admin/policy", get(policy).put(set_policy))
        .route("/admin/model", get(model))
        .route("/admin/stats", get(stats))
        .route("/admin/residency", post(residency))
}

/// Refuses without the configured bearer token (and always when none is configured).
///
/// The token presented is compared as given (no trimming: hyper already drops
/// the whitespace around a header value) and in constant time, so the time
/// of a refusal tells nothing about how much of a guess was right.
fn refusal(st: &AppState, headers: &HeaderMap) -> Option<Response> {
    let Some(token) = st.cfg.admin_secret.get() else {
        return Some(openai_error(
            StatusCode::FORBIDDEN,
            "the admin API is disabled; start the router with an admin token \
             (admin_token_file, PPD_ADMIN_TOKEN or admin_token)",
            "permission_error",
            "admin_disabled",
        ));
    };
    if !crate::auth::bearer_matches(headers, token) {
        return Some(openai_error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong admin bearer token",
            "authentication_error",
            "bad_token",
        ));
    }
    None
}

/// Most bytes an admin request body may have.
const ADMIN_BODY_BYTES: usize = 1 << 20;

/// An admin request's body, within [`ADMIN_BODY_BYTES`] and `body_read_timeout`.
async fn read(st: &AppState, body: Body) -> Result<Bytes, Response> {
    read_within(body, ADMIN_BODY_BYTES, st.cfg.body_read_timeout).await
}

fn bad_request(msg: impl Into<String>) -> Response {
    openai_error(
        StatusCode::BAD_REQUEST,
        msg,
        "invalid_request_error",
        "invalid_request",
    )
}

macro_rules! authorized {
    ($st:expr, $h:expr) => {
        if let Some(r) = refusal(&$st, &$h) {
            return r;
        }
    };
}

pub fn node_list(st: &AppState) -> serde_json::Value {
    let now = st.now_ms();
    let nodes: Vec<_> = st
        .registry
        .nodes()
        .iter()
        .map(|n| {
            json!({
                "id": n.id.get(), "url": n.url, "role": n.role.as_str(), "state": n.state(now).as_str(),
                "source": n.source, "zmq_address": n.zmq, "inflight": n.inflight(),
                "sessions": st.sessions.count_on(n.id), "served": n.served.load(Ordering::Relaxed),
                "failed": n.failed.load(Ordering::Relaxed),
                "last_heartbeat_age_s": now.saturating_sub(n.last_heartbeat_ms()) as f64 / 1000.0,
                "load": n.load_snapshot(now, crate::load::stale_after_ms(st.cfg.load_interval)),
                "cache_epoch": n.load.epoch(), "restarts": n.load.restarts(),
                "scrape_failures": n.load.scrape_failures(),
                "residency": {"mode": n.kv.mode(), "kv_events": n.kv.endpoint, "blocks": n.kv.blocks(),
                              "events": n.kv.counts()},
            })
        })
        .collect();
    json!({ "nodes": nodes })
}

async fn nodes(State(st): State<Arc<AppState>>, h: HeaderMap) -> Response {
    authorized!(st, h);
    Json(node_list(&st)).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegisterBody {
    url: String,
    role: String,
    #[serde(default)]
    zmq_address: Option<String>,
    /// Where the node publishes its KV events (`tcp://HOST:PORT`, which the
    /// router binds), as `URL;kv_events=...` in the node lists.
    #[serde(default)]
    kv_events: Option<String>,
    /// Where the node's publisher binds (the router connects), as
    /// `URL;kv_events_from=...` in the node lists.
    #[serde(default)]
    kv_events_from: Option<String>,
}

async fn register(State(st): State<Arc<AppState>>, h: HeaderMap, body: Body) -> Response {
    authorized!(st, h);
    let body = match read(&st, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let b: RegisterBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            return bad_request(format!(
            "body: {e}; expected {{\"url\", \"role\": P|D|pD|R, \"zmq_address\"?, \"kv_events\"? or \"kv_events_from\"?}}"
        ))
        }
    };
    let Ok(role) = Role::parse(&b.role) else {
        return bad_request(format!("role {:?}: expected P, D, pD or R", b.role));
    };
    let spec = match crate::config::parse_node("url", &b.url) {
        Ok(s) => s,
        Err(e) => return bad_request(e.to_string()),
    };
    let kv_events =
        match (b.kv_events, b.kv_events_from) {
            (Some(_), Some(_)) => return bad_request(
                "give kv_events (the router binds) or kv_events_from (the node binds), not both",
            ),
            (Some(e), None) => match tcp("kv_events", &e) {
                Ok(a) => Some(Endpoint::bind(a)),
                Err(r) => return r,
            },
            (None, Some(e)) => match tcp("kv_events_from", &e) {
                Ok(a) => Some(Endpoint::connect(a)),
                Err(r) => return r,
            },
            (None, None) => spec.kv_events,
        };
    let spec = crate::config::NodeSpec {
        zmq: b.zmq_address.or(spec.zmq),
        kv_events,
        ..spec
    };
    let (node, new) = crate::membership::register_node(&st, &spec, role, Source::Admin);
    let status = if new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    (
        status,
        Json(json!({"id": node.id.get(), "url": node.url, "role": node.role.as_str(), "new": new})),
    )
        .into_response()
}

/// A KV-event address as given, or the client's error.
fn tcp<'a>(field: &str, address: &'a str) -> Result<&'a str, Response> {
    let a = address.trim();
    if a.starts_with("tcp://") {
        Ok(a)
    } else {
        Err(bad_request(format!(
            "{field} {address:?}: expected tcp://HOST:PORT"
        )))
    }
}

#[derive(Deserialize)]
struct UrlQuery {
    url: String,
}

async fn deregister(
    State(st): State<Arc<AppState>>,
    h: HeaderMap,
    q: Result<Query<UrlQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    authorized!(st, h);
    let Ok(Query(q)) = q else {
        return bad_request("give the node as ?url=...");
    };
    let gone = crate::membership::deregister_node(&st, &q.url);
    if gone.is_empty() {
        return openai_error(
            StatusCode::NOT_FOUND,
            format!("no node {}", q.url),
            "invalid_request_error",
            "node_not_found",
        );
    }
    Json(json!({"removed": gone.iter().map(|n| n.url.clone()).collect::<Vec<_>>()})).into_response()
}

#[derive(Deserialize)]
struct Page {
    #[serde(default)]
    offset: usize,
    #[serde(default = "default_limit")]
    limit: usize,
}

fn default_limit() -> usize {
    100
}

async fn sessions(
    State(st): State<Arc<AppState>>,
    h: HeaderMap,
    q: Result<Query<Page>, axum::extract::rejection::QueryRejection>,
) -> Response {
    authorized!(st, h);
    let page = match q {
        Ok(Query(p)) => p,
        Err(e) => return bad_request(format!("query: {e}")),
    };
    let limit = page.limit.min(10_000);
    let names: BTreeMap<u32, String> = st
        .registry
        .nodes()
        .iter()
        .map(|n| (n.id.get(), n.url.clone()))
        .collect();
    let page_items = st.sessions.page(page.offset, limit);
    let items: Vec<_> = page_items
        .iter()
        .map(|(id, s)| s.view(id, |n| names.get(&n.get()).cloned()))
        .collect();
    Json(json!({"offset": page.offset, "limit": limit, "total": st.sessions.len(), "sessions": items, "stats": session_stats(&st)})).into_response()
}

fn session_stats(st: &AppState) -> serde_json::Value {
    serde_json::to_value(st.sessions.stats()).unwrap_or_default()
}

async fn table(State(st): State<Arc<AppState>>, h: HeaderMap) -> Response {
    authorized!(st, h);
    let t = st.engine.table();
    let doc = serde_json::to_value(t.doc()).unwrap_or_default();
    Json(json!({"source": *st.table_spec.lock(), "table": doc})).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReloadBody {
    #[serde(default)]
    path: Option<String>,
}

/// How many leading tokens of a request's prompt each node caches, as the
/// route step would see it now (the body is a chat or completions request;
/// nothing is sent to any node).
async fn residency(State(st): State<Arc<AppState>>, h: HeaderMap, body: Body) -> Response {
    authorized!(st, h);
    let body = match read(&st, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let Some(renderer) = st.renderer.as_deref() else {
        return openai_error(
            StatusCode::CONFLICT,
            "no prompt renderer: set `tokenizer` (or prompt_renderer = \"word-rule\" for emulated nodes)",
            "invalid_request_error",
            "no_renderer",
        );
    };
    let text = match std::str::from_utf8(&body) {
        Ok(t) => t,
        Err(_) => return bad_request("body is not UTF-8"),
    };
    let ids = match ppd_core::request::parse_request(text)
        .and_then(|v| ppd_core::prompt::request_ids(&v, renderer))
    {
        Ok(ids) => ids,
        Err(e) => return bad_request(e.to_string()),
    };
    let nodes: Vec<_> = st
        .registry
        .nodes()
        .iter()
        .filter(|n| n.role != Role::P)
        .map(|n| {
            let mode = n.kv.mode();
            let cached = (mode == crate::kv_subscriber::Mode::Exact)
                .then(|| n.kv.cached_prefix_tokens(&ids));
            json!({"url": n.url, "mode": mode, "cached_tokens": cached})
        })
        .collect();
    Json(json!({"prompt_tokens": ids.len(), "renderer": renderer.name(), "nodes": nodes}))
        .into_response()
}

async fn reload(State(st): State<Arc<AppState>>, h: HeaderMap, body: Body) -> Response {
    authorized!(st, h);
    let body = match read(&st, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let b: ReloadBody = if body.is_empty() {
        ReloadBody { path: None }
    } else {
        match serde_json::from_slice(&body) {
            Ok(b) => b,
            Err(e) => return bad_request(format!("body: {e}; expected {{\"path\"?}}")),
        }
    };
    let spec = b.path.unwrap_or_else(|| st.table_spec.lock().clone());
    match load_table(&spec) {
        Ok(t) => {
            let cells = t.doc().cells.len();
            st.engine.set_table(t);
            tracing::info!(table = %spec, cells, "admin: table reloaded");
            *st.table_spec.lock() = spec.clone();
            Json(json!({"reloaded": spec, "cells": cells})).into_response()
        }
        // The old table stays in force.
        Err(e) => openai_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            e.to_string(),
            "invalid_request_error",
            "bad_table",
        ),
    }
}

async fn weights(State(st): State<Arc<AppState>>, h: HeaderMap) -> Response {
    authorized!(st, h);
    let w = st.engine.weights();
    Json(json!({"w_ttft": w.w_ttft, "w_tpot": w.w_tpot})).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WeightsBody {
    w_ttft: f64,
    w_tpot: f64,
}

async fn set_weights(State(st): State<Arc<AppState>>, h: HeaderMap, body: Body) -> Response {
    authorized!(st, h);
    let body = match read(&st, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let b: WeightsBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return bad_request(format!("body: {e}; expected {{\"w_ttft\", \"w_tpot\"}}")),
    };
    match Weights::new(b.w_ttft, b.w_tpot) {
        Ok(w) => {
            st.engine.set_weights(w);
            tracing::info!(w_ttft = w.w_ttft, w_tpot = w.w_tpot, "admin: weights set");
            Json(json!({"w_ttft": w.w_ttft, "w_tpot": w.w_tpot})).into_response()
        }
        Err(e) => bad_request(e.to_string()),
    }
}

/// The cost model `ppd-live` predicts with: its profile, the SLOs, and the
/// corrections learnt per node (observed ÷ predicted; 1 = the profile holds).
async fn model(State(st): State<Arc<AppState>>, h: HeaderMap) -> Response {
    authorized!(st, h);
    let Some(m) = st.engine.cost_model() else {
        return Json(json!({"profile": null})).into_response();
    };
    let nodes: Vec<_> = m
        .corrections
        .view()
        .into_iter()
        .map(|c| {
            let url = st.registry.get(ppd_core::session::NodeId::new(c.node)?)?.url.clone();
            Some(json!({
                "node": url,
                "ttft_factor": {"local": c.ttft[0], "pull": c.ttft[1], "pd": c.ttft[2]},
                "ttft_samples": {"local": c.ttft_samples[0], "pull": c.ttft_samples[1], "pd": c.ttft_samples[2]},
                "size_classes_tokens": [256, 2048, null],
                "tpot_factor": c.tpot,
                "tpot_samples": c.tpot_samples,
            }))
        })
        .collect();
    Json(json!({
        "policy": st.engine.policy().to_string(),
        "profile": m.profile().name,
        "slo": st.engine.slo(),
        "weights": {"w_ttft": st.engine.weights().w_ttft, "w_tpot": st.engine.weights().w_tpot},
        "nodes": nodes,
    }))
    .into_response()
}

async fn policy(State(st): State<Arc<AppState>>, h: HeaderMap) -> Response {
    authorized!(st, h);
    Json(json!({"policy": st.engine.policy().to_string()})).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyBody {
    policy: String,
}

async fn set_policy(State(st): State<Arc<AppState>>, h: HeaderMap, body: Body) -> Response {
    authorized!(st, h);
    let body = match read(&st, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let b: PolicyBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return bad_request(format!("body: {e}; expected {{\"policy\"}}")),
    };
    match PolicyKind::parse(&b.policy) {
        Ok(p) => {
            st.engine.set_policy(p);
            tracing::info!(policy = %p, "admin: policy set");
            Json(json!({"policy": p.to_string()})).into_response()
        }
        Err(e) => bad_request(e.to_string()),
    }
}

async fn stats(State(st): State<Arc<AppState>>, h: HeaderMap) -> Response {
    authorized!(st, h);
    let mut by_path: BTreeMap<&str, u64> = BTreeMap::new();
    let mut by_reason: BTreeMap<&str, u64> = BTreeMap::new();
    let mut by_path_reason = Vec::new();
    {
        let s = st.stats.lock();
        for ((p, r), n) in &s.by_path_reason {
            *by_path.entry(p.as_str()).or_default() += n;
            *by_reason.entry(r.as_str()).or_default() += n;
            by_path_reason.push(json!({"path": p.as_str(), "reason": r.as_str(), "count": n}));
        }
    }
    Json(json!({
        "by_path": by_path, "by_reason": by_reason, "by_path_reason": by_path_reason,
        "by_cell": st.cell_counts(), "sessions": session_stats(&st),
        "qps": st.qps.lock().rate(st.now_ms()),
    }))
    .into_response()
}
