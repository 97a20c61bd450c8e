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
use ppd_core::cost::CORRECTED_PATHS;
use ppd_core::table::Table;
use ppd_core::{PolicyKind, Role, Weights};

use crate::error::openai_error;
use crate::intake::read_within;
use crate::kv_subscriber::{Attach, Endpoint};
use crate::registry::{Node, Source};
use crate::shared::Change;
use crate::state::AppState;

/// Applies a change from another replica (replicas.rs) through the same
/// functions the admin API uses, one per kind. Every value is checked again:
/// what comes from the state store is input like a request body.
pub(crate) fn apply(st: &Arc<AppState>, change: &Change, by: &str) -> Result<(), String> {
    match change {
        Change::Weights { w_ttft, w_tpot } => set_weights_now(st, *w_ttft, *w_tpot, by).map(drop),
        Change::Policy { policy } => set_policy_now(st, policy, by).map(drop),
        Change::Table { source, table } => {
            let t = Table::from_json(table, source).map_err(|e| e.to_string())?;
            set_table_now(st, t, source, by);
            Ok(())
        }
        Change::NodeAdded {
            url,
            role,
            zmq_address,
            kv_events,
            kv_events_from,
        } => {
            let events = match (kv_events, kv_events_from) {
                (_, Some(a)) => Some(Endpoint::connect(a)),
                (Some(a), None) => Some(Endpoint::bind(a)),
                (None, None) => None,
            };
            add_node_now(st, url, role, zmq_address, events).map(drop)
        }
        Change::NodeRemoved { url } => {
            crate::membership::deregister_node(st, url);
            Ok(())
        }
    }
}

fn set_weights_now(st: &AppState, w_ttft: f64, w_tpot: f64, by: &str) -> Result<Weights, String> {
    let w = Weights::new(w_ttft, w_tpot).map_err(|e| e.to_string())?;
    st.engine.set_weights(w);
    tracing::info!(
        w_ttft = w.w_ttft,
        w_tpot = w.w_tpot,
        by,
        "admin: weights set"
    );
    Ok(w)
}

fn set_policy_now(st: &AppState, policy: &str, by: &str) -> Result<PolicyKind, String> {
    let p = PolicyKind::parse(policy).map_err(|e| e.to_string())?;
    st.engine.set_policy(p);
    tracing::info!(policy = %p, by, "admin: policy set");
    Ok(p)
}

/// Puts a (valid) table in force; returns its number of cells.
fn set_table_now(st: &AppState, t: Table, source: &str, by: &str) -> usize {
    let cells = t.doc().cells.len();
    st.engine.set_table(t);
    tracing::info!(table = %source, cells, by, "admin: table reloaded");
    *st.table_spec.lock() = source.to_owned();
    cells
}

/// Registers a node of `role` at `url` (with its P2pNccl and KV-event
/// addresses); the node and whether it is new.
fn add_node_now(
    st: &Arc<AppState>,
    url: &str,
    role: &str,
    zmq_address: &Option<String>,
    kv_events: Option<Endpoint>,
) -> Result<(Arc<Node>, bool), String> {
    let Ok(r) = Role::parse(role) else {
        return Err(format!("role {role:?}: expected P, D, pD or R"));
    };
    let spec = crate::config::NodeSpec {
        zmq: zmq_address.clone(),
        kv_events,
        ..crate::config::parse_node("url", url).map_err(|e| e.to_string())?
    };
    Ok(crate::membership::register_node(
        st,
        &spec,
        r,
        Source::Admin,
    ))
}

/// Who applies a change made through this replica's admin API (the log's `by`).
const BY_ADMIN_API: &str = "admin API";

/// Applies a change made through the admin API with `apply`; with shared
/// state, in the order of every change applied here (the number it returns;
/// see [`crate::shared::Shared::in_order`]).
fn locally<T>(st: &AppState, apply: impl FnOnce() -> T) -> (T, u64) {
    match &st.shared {
        Some(shared) => shared.in_order(apply),
        None => (apply(), 0),
    }
}

/// An admin answer: `body`, with what became of sharing `change` (applied
/// here at `applied_at`) when the router shares its state (`"shared":
/// {...}`; absent otherwise).
async fn answer(
    st: &AppState,
    status: StatusCode,
    (change, applied_at): (Change, u64),
    mut body: serde_json::Value,
) -> Response {
    if let Some(shared) = &st.shared {
        body["shared"] = shared.share(change, applied_at).await.to_json();
    }
    (status, Json(body)).into_response()
}

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
                // The router's decodes here closest to their deadline (what ppd-live's deadline term weighs).
                "nearest_deadlines": n.load.at_risk(now).iter().collect::<Vec<_>>(),
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
    let zmq_address = b.zmq_address.or(spec.zmq);
    let (added, at) = locally(&st, || {
        add_node_now(&st, &spec.url, &b.role, &zmq_address, kv_events.clone())
    });
    let (node, new) = match added {
        Ok(added) => added,
        Err(e) => return bad_request(e),
    };
    let (kv_events, kv_events_from) = match kv_events {
        Some(Endpoint {
            address,
            attach: Attach::Bind,
        }) => (Some(address), None),
        Some(Endpoint {
            address,
            attach: Attach::Connect,
        }) => (None, Some(address)),
        None => (None, None),
    };
    let change = Change::NodeAdded {
        url: node.url.clone(),
        role: node.role.as_str().to_owned(),
        zmq_address,
        kv_events,
        kv_events_from,
    };
    let status = if new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let body =
        json!({"id": node.id.get(), "url": node.url, "role": node.role.as_str(), "new": new});
    answer(&st, status, (change, at), body).await
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
    let (gone, at) = locally(&st, || crate::membership::deregister_node(&st, &q.url));
    if gone.is_empty() {
        // Nothing changed here, so nothing is shared.
        return openai_error(
            StatusCode::NOT_FOUND,
            format!("no node {}", q.url),
            "invalid_request_error",
            "node_not_found",
        );
    }
    let body = json!({"removed": gone.iter().map(|n| n.url.clone()).collect::<Vec<_>>()});
    answer(
        &st,
        StatusCode::OK,
        (Change::NodeRemoved { url: q.url }, at),
        body,
    )
    .await
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
            // Shared as its content: the other replicas may not see this file.
            let change = Change::Table {
                source: spec.clone(),
                table: serde_json::to_string(t.doc()).unwrap_or_default(),
            };
            let (cells, at) = locally(&st, || set_table_now(&st, t, &spec, BY_ADMIN_API));
            answer(
                &st,
                StatusCode::OK,
                (change, at),
                json!({"reloaded": spec, "cells": cells}),
            )
            .await
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
    match locally(&st, || {
        set_weights_now(&st, b.w_ttft, b.w_tpot, BY_ADMIN_API)
    }) {
        (Ok(w), at) => {
            let change = Change::Weights {
                w_ttft: w.w_ttft,
                w_tpot: w.w_tpot,
            };
            let body = json!({"w_ttft": w.w_ttft, "w_tpot": w.w_tpot});
            answer(&st, StatusCode::OK, (change, at), body).await
        }
        (Err(e), _) => bad_request(e),
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
            let url = st
                .registry
                .get(ppd_core::session::NodeId::new(c.node)?)?
                .url
                .clone();
            Some(json!({
                "node": url,
                "ttft_factor": by_path(&c.ttft),
                "ttft_samples": by_path(&c.ttft_samples),
                "size_classes_tokens": [256, 2048, null],
                "tpot_factor": c.tpot,
                "tpot_samples": c.tpot_samples,
                "tpot_level_ms": c.tpot_level_ms,
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

/// A correction's cells keyed by their path's name.
fn by_path<T: serde::Serialize>(cells: &[T; 3]) -> serde_json::Value {
    let named = CORRECTED_PATHS.iter().zip(cells);
    serde_json::Value::Object(
        named
            .map(|(p, x)| (p.as_str().to_owned(), json!(x)))
            .collect(),
    )
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
    match locally(&st, || set_policy_now(&st, &b.policy, BY_ADMIN_API)) {
        (Ok(p), at) => {
            let change = Change::Policy {
                policy: p.to_string(),
            };
            answer(
                &st,
                StatusCode::OK,
                (change, at),
                json!({"policy": p.to_string()}),
            )
            .await
        }
        (Err(e), _) => bad_request(e),
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
    let qps = st.qps.lock().rate(st.now_ms());
    Json(json!({
        "by_path": by_path, "by_reason": by_reason, "by_path_reason": by_path_reason,
        "by_cell": st.cell_counts(), "sessions": session_stats(&st),
        "qps": qps,
        // The rate the decision uses: this replica's and the others' (with `state`).
        "fleet_qps": qps + st.shared.as_ref().map_or(0.0, |s| s.fleet.others_rate()),
    }))
    .into_response()
}
