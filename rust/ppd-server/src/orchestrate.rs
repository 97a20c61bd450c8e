//! Orchestration: runs a planned route on its nodes — local, replica, or pd through the KV connector chosen at start-up — and returns the client's answer.

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::Response;
use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use ppd_core::request::RequestView;
use ppd_core::Path;

use crate::body::{drop_router_fields, rewrite, Edit};
use crate::bookkeeping::{count, upstream_error, Counted, Ticket};
use crate::connector::prefill_body;
use crate::error::{invalid_request, openai_error, unavailable};
use crate::registry::{InflightGuard, Node};
use crate::relay::{route_headers, streamed, whole};
use crate::route::{prefill_node, Plan, Target};
use crate::state::AppState;
use crate::upstream::{self, Endpoint, PrefillError, SendError};

/// One request as the nodes will see it.
pub(crate) struct Call<'a> {
    pub st: &'a Arc<AppState>,
    pub endpoint: Endpoint,
    pub text: &'a str,
    pub view: &'a RequestView<'a>,
    pub conv: &'a str,
    pub turn: u32,
    pub n_in: u32,
    pub started: Instant,
}

/// The local path's pD refused the connection before anything was sent: the
/// route step decides again (nothing was answered or counted).
pub(crate) struct Unreachable;

/// Runs `plan` and returns the client's answer.
pub(crate) async fn run(call: &Call<'_>, plan: &Plan) -> Result<Response, Unreachable> {
    let run = Run { call, plan };
    match &plan.target {
        Target::Local(d) | Target::Replica(d) => {
            let edits = drop_router_fields(call.view)
                .chain(usage_edit(call.text, call.view))
                .collect();
            run.forward(None, Arc::clone(d), edits, None).await
        }
        Target::Pd(d) => Ok(run.pd(Arc::clone(d)).await),
        Target::Unavailable(why) => {
            Ok(run.fail(StatusCode::SERVICE_UNAVAILABLE, unavailable(*why)))
        }
    }
}

struct Run<'a> {
    call: &'a Call<'a>,
    plan: &'a Plan,
}

impl Run<'_> {
    fn st(&self) -> &Arc<AppState> {
        self.call.st
    }

    /// A refusal of a routed request, counted under its route.
    fn fail(&self, status: StatusCode, mut resp: Response) -> Response {
        resp.extensions_mut().insert(Counted);
        count(self.st(), &self.plan.route, status.as_u16());
        resp
    }

    /// P prefills, its KV moves to D, D decodes; a P that fails before
    /// answering is replaced by another P.
    async fn pd(&self, d: Arc<Node>) -> Response {
        let st = self.st();
        let connector = st.connector.as_ref();
        let ask_usage = usage_edit(self.call.text, self.call.view);
        if !connector.prefills() {
            let edits = drop_router_fields(self.call.view)
                .chain(ask_usage)
                .collect();
            return self
                .forward(None, Arc::clone(&d), edits, None)
                .await
                .unwrap_or_else(|Unreachable| self.fail(StatusCode::BAD_GATEWAY, unreachable(&d)));
        }
        let body = match prefill_body(connector, self.call.text, self.call.view) {
            Ok(b) => Bytes::from(b),
            Err(e) => {
                return self.fail(
                    StatusCode::BAD_REQUEST,
                    invalid_request(e.to_string(), "invalid_json"),
                )
            }
        };
        let mut tried = Vec::new();
        loop {
            let Some(p) = prefill_node(st, &tried) else {
                let msg = if tried.is_empty() {
                    "no healthy prefill node"
                } else {
                    "every prefill node failed"
                };
                return self.fail(StatusCode::SERVICE_UNAVAILABLE, unavailable(msg));
            };
            tried.push(p.id);
            let rid = match connector.request_id(&p, &d) {
                Ok(rid) => rid,
                Err(why) => return self.fail(StatusCode::SERVICE_UNAVAILABLE, unavailable(why)),
            };
            let why = match upstream::prefill(st, self.call.endpoint, &p, body.clone(), &rid).await
            {
                Ok(answer) => match connector.handoff(&answer) {
                    Ok(handoff) => {
                        st.registry.record_success(&p);
                        let edits = drop_router_fields(self.call.view)
                            .chain(handoff)
                            .chain(ask_usage)
                            .collect();
                        return self
                            .forward(Some(p), Arc::clone(&d), edits, Some(rid))
                            .await
                            .unwrap_or_else(|Unreachable| {
                                self.fail(StatusCode::BAD_GATEWAY, unreachable(&d))
                            });
                    }
                    Err(e) => {
                        if let Some(kind) = e.kind {
                            upstream_error(st, p.role, kind);
                        }
                        e.message
                    }
                },
                Err(PrefillError::Answer(resp)) => {
                    let status = resp.status();
                    return self.fail(status, resp);
                }
                Err(PrefillError::Retryable(why)) => why,
            };
            tracing::warn!(node = %p.url, %why, "prefill failed; trying another P");
            st.registry.record_failure(&p, st.now_ms());
            st.metrics.retries.inc();
        }
    }

    /// Sends the (edited) body to the decoding node and relays its answer.
    async fn forward(
        &self,
        p: Option<Arc<Node>>,
        d: Arc<Node>,
        edits: Vec<Edit<'_>>,
        request_id: Option<String>,
    ) -> Result<Response, Unreachable> {
        let st = self.st();
        let route = &self.plan.route;
        let drop_usage = edits
            .iter()
            .any(|e| matches!(e, Edit::Set("stream_options", _)));
        let body: Bytes = if edits.is_empty() {
            Bytes::copy_from_slice(self.call.text.as_bytes())
        } else {
            match rewrite(self.call.text, &edits) {
                Ok(b) => Bytes::from(b),
                Err(e) => {
                    return Ok(self.fail(
                        StatusCode::BAD_REQUEST,
                        invalid_request(e.to_string(), "invalid_json"),
                    ))
                }
            }
        };
        let inflight = InflightGuard::new(Arc::clone(&d));
        let role = d.role;
        let resp =
            match upstream::send(st, self.call.endpoint, &d, body, request_id.as_deref()).await {
                Ok(r) => r,
                Err(SendError::Timeout(timeout)) => {
                    upstream_error(st, role, "timeout");
                    st.registry.record_failure(&d, st.now_ms());
                    return Ok(self.fail(
                        StatusCode::GATEWAY_TIMEOUT,
                        openai_error(
                            StatusCode::GATEWAY_TIMEOUT,
                            format!("{} did not answer within {timeout:?}", d.url),
                            "upstream_error",
                            "upstream_timeout",
                        ),
                    ));
                }
                Err(SendError::Connect { message, refused }) => {
                    upstream_error(st, role, "connect");
                    st.registry.record_failure(&d, st.now_ms());
                    if refused && route.path == Path::Local {
                        // Down since the last health check; nothing was sent.
                        d.set_healthy(false);
                        return Err(Unreachable);
                    }
                    return Ok(self.fail(
                        StatusCode::BAD_GATEWAY,
                        openai_error(
                            StatusCode::BAD_GATEWAY,
                            format!("{}: {message}", d.url),
                            "upstream_error",
                            "upstream_unreachable",
                        ),
                    ));
                }
            };
        let status = resp.status();
        if !status.is_success() {
            if status.is_server_error() {
                upstream_error(st, role, "status_5xx");
                st.registry.record_failure(&d, st.now_ms());
            }
            let mut out = upstream::error_answer(st, status, resp).await;
            route_headers(&mut out, route, self.call.conv, &d);
            return Ok(self.fail(status, out));
        }
        let ticket = Ticket {
            state: Arc::clone(st),
            conv: self.call.conv.to_owned(),
            turn: self.call.turn,
            n_in: self.call.n_in,
            route: *route,
            p,
            d: Arc::clone(&d),
            started: self.call.started,
        };
        let mut out = if self.call.view.is_stream() {
            streamed(ticket, resp, inflight, drop_usage)
        } else {
            match whole(ticket, resp, inflight).await {
                Some(r) => r,
                None => {
                    upstream_error(st, role, "body");
                    st.registry.record_failure(&d, st.now_ms());
                    return Ok(self.fail(
                        StatusCode::BAD_GATEWAY,
                        openai_error(
                            StatusCode::BAD_GATEWAY,
                            format!("{} failed while answering", d.url),
                            "upstream_error",
                            "upstream_failed",
                        ),
                    ));
                }
            }
        };
        route_headers(&mut out, route, self.call.conv, &d);
        Ok(out)
    }
}

/// Only a local forward reports an unreachable node for the route step; a pd
/// forward that met one answers it as the refused connection it was.
fn unreachable(d: &Node) -> Response {
    openai_error(
        StatusCode::BAD_GATEWAY,
        format!("{}: connection refused", d.url),
        "upstream_error",
        "upstream_unreachable",
    )
}

/// Sets `stream_options.include_usage` when the client streams without it,
/// keeping any other stream options: the router reads the usage for its
/// bookkeeping and drops that chunk from the client's stream.
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

#[cfg(test)]
mod tests {
    use super::*;
    use ppd_core::request::parse_request;

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
}
