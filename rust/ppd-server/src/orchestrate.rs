//! Orchestration: runs a planned route on its nodes — local, replica, direct, or pd through the KV connector chosen at start-up — and returns the client's answer.
//!
//! A node that fails before the answer's first byte reached the client is
//! reported back as a [`Retry`] (once per request: `may_retry`), so that the
//! route step can place the request again; after that, or once bytes went
//! out, the failure is the answer.

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::Response;
use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use ppd_core::identity::{History, IdSource};
use ppd_core::request::RequestView;
use ppd_core::Role;

use crate::admission::Admitted;
use crate::body::{drop_router_fields, rewrite, Edit};
use crate::bookkeeping::{counted, upstream_error, Ticket, Ticketed};
use crate::connector::prefill_body;
use crate::error::{invalid_request, openai_error, unavailable};
use crate::pull::Handle;
use crate::registry::{InflightGuard, Node};
use crate::relay::{route_headers, streamed, whole, Relay};
use crate::route::{prefill_node, Pin, Plan, Target};
use crate::state::AppState;
use crate::trail::{Trail, TRACE_TARGET};
use crate::upstream::{self, Endpoint, NodeHeaders, PrefillError, SendError};
use tracing::Instrument;

/// One request as the nodes will see it.
pub(crate) struct Call<'a> {
    pub st: &'a Arc<AppState>,
    pub endpoint: Endpoint,
    pub text: &'a str,
    pub view: &'a RequestView<'a>,
    pub conv: &'a str,
    pub source: IdSource,
    pub history: Option<History>,
    pub turn: u32,
    pub n_in: u32,
    pub trail: &'a Arc<Trail>,
}

/// Nothing reached the client and the route step should place the request
/// again (nothing was answered or counted).
pub(crate) enum Retry {
    /// This node failed: refused, timed out, answered 5xx, or broke before
    /// the first token. `answer` is the failure, for when no other node can
    /// take the request (not yet counted).
    NodeFailed { node: Arc<Node>, answer: Response },
    /// No P is left to prefill (all failed or went away).
    NoPrefill,
}

/// Runs `plan` and returns the client's answer, or a [`Retry`] when
/// `may_retry` and a node failed before anything was sent.
/// `admitted` is the request's room on the decoding node, held until its answer ends.
pub(crate) async fn run(
    call: &Call<'_>,
    plan: &Plan,
    admitted: Option<Admitted>,
    may_retry: bool,
) -> Result<Response, Retry> {
    let run = Run {
        call,
        plan,
        may_retry,
    };
    match &plan.target {
        Target::Local(d) | Target::Replica(d) | Target::Direct(d) => {
            let st = call.st;
            // Only a whole answer names the pin (vLLM 0.32), so only then pin.
            let pin = (st.cfg.bidirectional_kv_xfer && d.role.decodes() && !call.view.is_stream())
                .then(|| st.connector.pin_edit())
                .flatten();
            let edits = drop_router_fields(call.view)
                .chain(usage_edit(call.text, call.view))
                .chain(pin)
                .collect();
            run.forward(None, Arc::clone(d), admitted, edits, &call.trail.id, None)
                .await
        }
        Target::Pd(d) => run.pd(Arc::clone(d), admitted, None).await,
        Target::Pull(d, Pin::Held(h)) => run.pd(Arc::clone(d), admitted, Some(h)).await,
        Target::Pull(d, Pin::Ask) => {
            let asked = run.ask_pin(d).await;
            run.pd(Arc::clone(d), admitted, asked.as_ref()).await
        }
        Target::Unavailable(why) => Ok(run.fail(unavailable(*why))),
    }
}

struct Run<'a> {
    call: &'a Call<'a>,
    plan: &'a Plan,
    may_retry: bool,
}

impl Run<'_> {
    fn st(&self) -> &Arc<AppState> {
        self.call.st
    }

    /// What every call to a node carries besides the body: the request's id
    /// (as the connector made it for this call) and the trace context of
    /// `span`, the call's.
    fn node_headers<'h>(&self, request_id: &'h str, span: &tracing::Span) -> NodeHeaders<'h> {
        NodeHeaders {
            request_id,
            traceparent: self.call.trail.traceparent(span),
            authorization: self.call.trail.authorization.clone(),
        }
    }

    /// A refusal of a routed request, counted under its route.
    fn fail(&self, resp: Response) -> Response {
        counted(self.st(), &self.plan.route, resp)
    }

    /// `node` failed before anything reached the client: counted against its
    /// breaker, then retried elsewhere if this request may still be, else
    /// answered with `answer`.
    fn node_failed(
        &self,
        node: &Arc<Node>,
        kind: &'static str,
        answer: Response,
    ) -> Result<Response, Retry> {
        let st = self.st();
        upstream_error(st, node.role, kind);
        st.registry.record_failure(node, st.now_ms());
        tracing::warn!(request_id = %self.call.trail.id, node = %node.url, kind, retry = self.may_retry, "node failed before the first byte");
        if self.may_retry {
            return Err(Retry::NodeFailed {
                node: Arc::clone(node),
                answer,
            });
        }
        Ok(self.fail(answer))
    }

    /// Asks `d` for a pin of the conversation (no whole answer named one);
    /// `None` when it names none, and the turn's P then prefills it all.
    async fn ask_pin(&self, d: &Arc<Node>) -> Option<Handle> {
        let st = self.st();
        let pin = st.connector.pin_edit()?;
        let Edit::Set(_, params) = &pin else {
            return None;
        };
        let body = crate::pin::ask_body(self.call.text, params)?;
        let rid = format!("{}-pin", self.call.trail.id);
        let span =
            tracing::info_span!(target: TRACE_TARGET, "pin", node = %d.url, request_id = %rid);
        let headers = self.node_headers(&rid, &span);
        crate::pin::ask(st, d, body, headers).instrument(span).await
    }

    /// P prefills, its KV moves to D, D decodes; a P that fails before
    /// answering is replaced by another P, and with none left the route step
    /// runs the turn on D alone. With `pull`, the first P also reads the
    /// conversation's KV back from D's pin; a replacement P prefills it all
    /// (the first may have read the pin, which frees it).
    async fn pd(
        &self,
        d: Arc<Node>,
        admitted: Option<Admitted>,
        pull: Option<&Handle>,
    ) -> Result<Response, Retry> {
        let st = self.st();
        let connector = st.connector.as_ref();
        let prefill = |pull: Option<&Handle>| {
            prefill_body(
                connector,
                self.call.text,
                self.call.view,
                pull.map(|h| h.prefill_params.as_str()),
            )
            .map(Bytes::from)
        };
        let mut body = match prefill(pull) {
            Ok(b) => b,
            Err(e) => return Ok(self.fail(invalid_request(e.to_string(), "invalid_json"))),
        };
        let mut pulling = pull;
        let mut tried = Vec::new();
        loop {
            let Some(p) = prefill_node(st, &tried) else {
                if self.may_retry {
                    return Err(Retry::NoPrefill);
                }
                let msg = if tried.is_empty() {
                    "no healthy prefill node"
                } else {
                    "every prefill node failed"
                };
                return Ok(self.fail(unavailable(msg)));
            };
            tried.push(p.id);
            let rid = match connector.request_id(&p, &d, &self.call.trail.id) {
                Ok(rid) => rid,
                Err(why) => return Ok(self.fail(unavailable(why))),
            };
            let work = self.plan.prefill_work(st.cfg.kv_bytes_per_token);
            let span = tracing::info_span!(target: TRACE_TARGET, "prefill", node = %p.url, request_id = %rid);
            let headers = self.node_headers(&rid, &span);
            let why =
                match upstream::prefill(st, self.call.endpoint, &p, body.clone(), headers, work)
                    .instrument(span)
                    .await
                {
                    Ok(answer) => match tracing::info_span!(target: TRACE_TARGET, "kv_handoff")
                        .in_scope(|| connector.handoff(&answer))
                    {
                        Ok(handoff) => {
                            st.registry.record_success(&p);
                            if let Some(h) = pulling {
                                st.metrics
                                    .kv_bytes_pulled
                                    .inc_by(u64::from(h.tokens) * st.cfg.kv_bytes_per_token);
                            }
                            let mut staged = Staged {
                                st: Arc::clone(st),
                                via: Arc::clone(&d),
                                via_failed: false,
                                release: handoff.as_ref().and_then(|h| connector.release_body(h)),
                            };
                            let edits = drop_router_fields(self.call.view)
                                .chain(handoff)
                                .chain(usage_edit(self.call.text, self.call.view))
                                .collect();
                            let answer = self
                                .forward(Some(p), d, admitted, edits, &rid, Some(&mut staged))
                                .await;
                            // Still staged here: D failed, so another D must carry the release.
                            staged.via_failed = true;
                            return answer;
                        }
                        Err(e) => {
                            if let Some(kind) = e.kind {
                                upstream_error(st, p.role, kind);
                            }
                            e.message
                        }
                    },
                    Err(PrefillError::Answer(resp)) => return Ok(self.fail(resp)),
                    Err(PrefillError::Retryable(why)) => why,
                };
            tracing::warn!(request_id = %self.call.trail.id, node = %p.url, %why, "prefill failed; trying another P");
            st.registry.record_failure(&p, st.now_ms());
            st.metrics.retries.inc();
            if pulling.take().is_some() {
                body = match prefill(None) {
                    Ok(b) => b,
                    Err(e) => return Ok(self.fail(invalid_request(e.to_string(), "invalid_json"))),
                };
            }
        }
    }

    /// Sends the (edited) body to the decoding node and relays its answer.
    async fn forward(
        &self,
        p: Option<Arc<Node>>,
        d: Arc<Node>,
        admitted: Option<Admitted>,
        edits: Vec<Edit<'_>>,
        request_id: &str,
        mut staged: Option<&mut Staged>,
    ) -> Result<Response, Retry> {
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
                Err(e) => return Ok(self.fail(invalid_request(e.to_string(), "invalid_json"))),
            }
        };
        let inflight = match admitted {
            Some(a) => InflightGuard::admitted(Arc::clone(&d), a),
            None => InflightGuard::new(Arc::clone(&d)),
        };
        let work = self
            .plan
            .decoder_work(st.cfg.kv_bytes_per_token, st.connector.moves_kv());
        // Only ppd-live weighs deadlines; under other policies the request
        // path skips following each decode (a decode begun before a switch
        // to ppd-live goes unseen until it ends).
        let inflight = if st.engine.policy().predicts() {
            // The router gives up on a request after its request timeout.
            inflight.with_decode(work, st.now_ms() + (st.cfg.request_timeout * 1000.0) as u64)
        } else {
            inflight.with_work(work)
        };
        let who = node_name(d.role);
        let stream = self.call.view.is_stream();
        // A stream's head comes at once and its first token soon after: both
        // within first_token_timeout. A whole answer comes when it is done.
        let whole_answer = Duration::from_secs_f64(st.cfg.request_timeout);
        let first_token = Duration::from_secs_f64(st.cfg.first_token_timeout).min(whole_answer);
        let deadline =
            tokio::time::Instant::now() + if stream { first_token } else { whole_answer };
        let wait = deadline - tokio::time::Instant::now();
        // Until D's first token: for the pd path, D's pull of P's KV is in it.
        let first = tracing::info_span!(target: TRACE_TARGET, "decode_first_token", node = %d.url);
        let sent = upstream::send(
            st,
            self.call.endpoint,
            &d,
            body,
            self.node_headers(request_id, &first),
            wait,
        );
        let resp = match sent.instrument(first.clone()).await {
            Ok(r) => r,
            Err(SendError::Timeout(timeout)) => {
                let answer = upstream_failure(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("the {who} did not answer within {timeout:?}"),
                    "upstream_timeout",
                );
                return self.node_failed(&d, "timeout", answer);
            }
            Err(SendError::Connect { refused, message }) => {
                tracing::warn!(request_id = %self.call.trail.id, node = %d.url, error = %message, "request to node failed");
                let answer = upstream_failure(
                    StatusCode::BAD_GATEWAY,
                    format!("the {who} could not be reached"),
                    "upstream_unreachable",
                );
                if refused && route.path == ppd_core::Path::Local {
                    // Down since the last health check: the route step must not pick it again.
                    d.set_healthy(false);
                }
                return self.node_failed(&d, "connect", answer);
            }
        };
        let status = resp.status();
        if status.is_server_error() {
            let mut answer = upstream::error_answer(st, status, resp).await;
            route_headers(&mut answer, route, self.call.conv, &d, &st.cfg);
            return self.node_failed(&d, "status_5xx", answer);
        }
        if !status.is_success() {
            // D refused the request itself; vLLM's own cleanup tells P.
            if let Some(s) = staged.as_mut() {
                s.handed_over();
            }
            let mut out = upstream::error_answer(st, status, resp).await;
            route_headers(&mut out, route, self.call.conv, &d, &st.cfg);
            return Ok(self.fail(out));
        }
        let ticket = Ticket {
            state: Arc::clone(st),
            conv: self.call.conv.to_owned(),
            source: self.call.source,
            history: self.call.history,
            turn: self.call.turn,
            n_in: self.call.n_in,
            route: *route,
            decided: *self.plan.input(),
            p,
            d: Arc::clone(&d),
            trail: Arc::clone(self.call.trail),
            model: crate::bookkeeping::model_name(st, self.call.view.model.as_deref()),
        };
        let mut out = if stream {
            let mut relay = Relay::new(ticket, resp, inflight, drop_usage);
            match tokio::time::timeout_at(deadline, relay.first_event())
                .instrument(first)
                .await
            {
                Ok(Ok(())) => {
                    // A first token means D has the KV.
                    if let Some(s) = staged.as_mut() {
                        s.handed_over();
                    }
                    streamed(relay)
                }
                Ok(Err(why)) => {
                    relay.discard();
                    let answer = upstream_failure(
                        StatusCode::BAD_GATEWAY,
                        format!("the {who} failed before its first token ({why})"),
                        "upstream_failed",
                    );
                    return self.node_failed(&d, "stream", answer);
                }
                Err(_) => {
                    relay.discard();
                    let answer = upstream_failure(
                        StatusCode::GATEWAY_TIMEOUT,
                        format!("the {who} sent no token within {first_token:?}"),
                        "upstream_timeout",
                    );
                    return self.node_failed(&d, "first_token", answer);
                }
            }
        } else {
            match whole(ticket, resp, inflight).instrument(first).await {
                Some(r) => {
                    if let Some(s) = staged.as_mut() {
                        s.handed_over();
                    }
                    r
                }
                None => {
                    let answer = upstream_failure(
                        StatusCode::BAD_GATEWAY,
                        format!("the {who} failed while answering"),
                        "upstream_failed",
                    );
                    return self.node_failed(&d, "body", answer);
                }
            }
        };
        route_headers(&mut out, route, self.call.conv, &d, &st.cfg);
        out.extensions_mut().insert(Ticketed);
        Ok(out)
    }
}

/// KV a P holds for a hand-off to D. Until D shows it has the KV (its first
/// token, or its whole answer) the hand-off may still fail: the client can
/// leave (dropping this request's future) or D can fail. Dropped before that,
/// this asks a D to tell P to free the blocks at once, instead of P holding
/// them for its whole KV lease (vLLM 0.32: 30 s; older versions 480 s).
pub(crate) struct Staged {
    st: Arc<AppState>,
    /// The D the KV was staged for, tried first unless it failed.
    via: Arc<Node>,
    via_failed: bool,
    /// The connector's release request; `None` once handed over (or when the
    /// protocol stages nothing).
    release: Option<String>,
}

impl Staged {
    fn handed_over(&mut self) {
        self.release = None;
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        let Some(body) = self.release.take() else {
            return;
        };
        // A request's future is dropped inside its runtime; without one (a
        // runtime shutting down) P's lease frees the blocks.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(upstream::release_staged(
                Arc::clone(&self.st),
                Arc::clone(&self.via),
                self.via_failed,
                body,
            ));
        }
    }
}

/// How client-facing errors name a node: by its role, never its address.
fn node_name(role: Role) -> &'static str {
    match role {
        Role::P => "prefill node",
        Role::D | Role::PD => "decode node",
        Role::R => "replica node",
    }
}

fn upstream_failure(status: StatusCode, message: String, code: &str) -> Response {
    openai_error(status, message, "upstream_error", code)
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

    #[test]
    fn client_facing_errors_name_roles_not_addresses() {
        assert_eq!(node_name(Role::PD), "decode node");
        assert_eq!(node_name(Role::R), "replica node");
    }
}
