//! Calls to the nodes: the endpoint URLs, the prefill call on P, and the request whose answer is relayed from D (or a pD or R).
//!
//! Each call is bounded by its stage's timeout and reports a failure as a
//! typed result; what to do about it (retry, reroute, answer) is decided
//! by the caller.

use axum::body::Bytes;
use axum::http::header::{AUTHORIZATION, HOST};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Duration;

use ppd_core::Role;

use crate::body::answer_without_router_fields;
use crate::bookkeeping::upstream_error;
use crate::client::{read_body, Answer, CallError, NodeClient};
use crate::error::openai_error;
use crate::load::Work;
use crate::metrics::ResultLabel;
use crate::registry::{InflightGuard, Node};
use crate::state::AppState;
use crate::trail::{REQUEST_ID, TRACEPARENT};

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

    /// POSTs `body` to this endpoint on `node`, at the URL the registry parsed once.
    async fn post(
        self,
        client: &NodeClient,
        node: &Node,
        mut headers: HeaderMap,
        body: Bytes,
    ) -> Result<Answer, CallError> {
        if let Some(host) = &node.host_header {
            headers.insert(HOST, host.clone());
        }
        let uri = match &node.endpoint_urls {
            Some(urls) => urls[self as usize].clone(),
            None => {
                let url = format!("{}{}", node.url, self.path());
                url.parse::<Uri>().map_err(|e| CallError {
                    message: format!("{url}: {e}"),
                    connect: true,
                })?
            }
        };
        client.post_json(uri, headers, body).await
    }
}

/// The headers every node call carries: the request id the node logs and
/// answers under, and the W3C trace context when the client sent one.
pub(crate) struct NodeHeaders<'a> {
    pub request_id: &'a str,
    pub traceparent: Option<HeaderValue>,
    /// The client's `Authorization`, when it is passed on ([`crate::auth`]).
    pub authorization: Option<HeaderValue>,
}

impl NodeHeaders<'_> {
    fn into_map(self) -> HeaderMap {
        let mut h = HeaderMap::with_capacity(4);
        // A request id is a token the router made or checked at the door.
        if let Ok(v) = HeaderValue::from_str(self.request_id) {
            h.insert(REQUEST_ID, v);
        }
        if let Some(a) = self.authorization {
            h.insert(AUTHORIZATION, a);
        }
        if let Some(tp) = self.traceparent {
            h.insert(TRACEPARENT, tp);
        }
        h
    }
}

/// A prefill on P that did not succeed.
pub(crate) enum PrefillError {
    /// Nothing reached the client; another P may be tried.
    Retryable(String),
    /// P answered with a client error: pass it on.
    Answer(Response),
}

/// Runs a prefill on `p` and returns its answer's bytes (a 2xx).
pub(crate) async fn prefill(
    st: &AppState,
    endpoint: Endpoint,
    p: &Arc<Node>,
    body: Bytes,
    headers: NodeHeaders<'_>,
    work: Work,
) -> Result<Bytes, PrefillError> {
    let _inflight = InflightGuard::new(Arc::clone(p)).with_work(work);
    let send = endpoint.post(st.client(), p, headers.into_map(), body);
    let timeout = Duration::from_secs_f64(st.cfg.prefill_timeout);
    let failed = |kind: &'static str, why: String| {
        upstream_error(st, Role::P, kind);
        PrefillError::Retryable(why)
    };
    let resp = match tokio::time::timeout(timeout, send).await {
        Err(_) => return Err(failed("timeout", format!("no answer within {timeout:?}"))),
        Ok(Err(e)) => return Err(failed("connect", e.to_string())),
        Ok(Ok(r)) => r,
    };
    let status = resp.status();
    let bytes = match tokio::time::timeout(timeout, read_body(resp)).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return Err(failed("body", e.to_string())),
        Err(_) => return Err(failed("timeout", "prefill body timed out".into())),
    };
    if status.is_server_error() {
        return Err(failed("status_5xx", format!("HTTP {status}")));
    }
    if !status.is_success() {
        return Err(PrefillError::Answer(passthrough(status, bytes)));
    }
    Ok(bytes)
}

/// Why a call to the decoding node got no answer.
pub(crate) enum SendError {
    Timeout(Duration),
    /// The connection failed; `refused` when nothing was sent at all.
    Connect {
        message: String,
        refused: bool,
    },
}

/// Sends `body` to the decoding node `d` and returns its answer's head
/// within `timeout` (the body is read, or relayed, by the caller).
pub(crate) async fn send(
    st: &AppState,
    endpoint: Endpoint,
    d: &Node,
    body: Bytes,
    headers: NodeHeaders<'_>,
    timeout: Duration,
) -> Result<Answer, SendError> {
    let send = endpoint.post(st.client(), d, headers.into_map(), body);
    match tokio::time::timeout(timeout, send).await {
        Err(_) => Err(SendError::Timeout(timeout)),
        Ok(Err(e)) => Err(SendError::Connect {
            refused: e.connect,
            message: e.message,
        }),
        Ok(Ok(r)) => Ok(r),
    }
}

/// Sends a connector's release request for KV staged on a P: to `via` (the D
/// it was staged for) unless `via` failed, else to another decoding node. Any
/// answer will do (D refuses it by design); only an unreachable node is tried
/// past.
pub(crate) async fn release_staged(
    st: Arc<AppState>,
    via: Arc<Node>,
    via_failed: bool,
    body: String,
) {
    let now = st.now_ms();
    let others = st.registry.nodes();
    let candidates = (!via_failed).then_some(&via).into_iter().chain(
        others
            .iter()
            .filter(|n| n.id != via.id && n.role.decodes() && n.available(now)),
    );
    let timeout = Duration::from_secs_f64(st.cfg.connect_timeout + 5.0);
    for node in candidates.take(3) {
        let send = Endpoint::Completions.post(
            st.client(),
            node,
            HeaderMap::new(),
            Bytes::from(body.clone()),
        );
        if let Ok(Ok(_)) = tokio::time::timeout(timeout, send).await {
            st.metrics
                .kv_releases
                .get_or_create(&ResultLabel { result: "sent" })
                .inc();
            tracing::info!(node = %node.url, "asked a decode node to free KV staged on P");
            return;
        }
    }
    st.metrics
        .kv_releases
        .get_or_create(&ResultLabel { result: "failed" })
        .inc();
    tracing::warn!(via = %via.url, "could not ask any decode node to free KV staged on P; P's lease will");
}

/// The whole body of an answer, within the request timeout.
pub(crate) async fn read_all(st: &AppState, resp: Answer) -> Option<Bytes> {
    let timeout = Duration::from_secs_f64(st.cfg.request_timeout);
    tokio::time::timeout(timeout, read_body(resp))
        .await
        .ok()
        .and_then(Result::ok)
}

/// An upstream error answer, passed on with its status; a body that is not
/// JSON is wrapped in an OpenAI-style error.
fn passthrough(status: StatusCode, bytes: Bytes) -> Response {
    let bytes = answer_without_router_fields(&bytes).map_or(bytes, Bytes::from);
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

/// A node's error answer, passed on with its status.
pub(crate) async fn error_answer(st: &AppState, status: StatusCode, resp: Answer) -> Response {
    passthrough(status, read_all(st, resp).await.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_json_upstream_errors_are_wrapped() {
        let r = passthrough(StatusCode::BAD_GATEWAY, Bytes::from_static(b"oops"));
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
        let r = passthrough(
            StatusCode::BAD_REQUEST,
            Bytes::from_static(b"{\"error\":1}"),
        );
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    }
}
