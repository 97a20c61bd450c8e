//! The OpenAI endpoints' front door: reads and checks a request, then sends it down the layers once — identify, route, orchestrate.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use std::sync::Arc;

use ppd_core::request::{parse_request, RequestView};

use ppd_core::Route;

use crate::admission::{Admitted, Shed};
use crate::bookkeeping::{counted, Counted, Ticketed};
use crate::error::{invalid_request, openai_error};
use crate::metrics::{AdmissionLabels, RequestLabels, RetryLabels};
use crate::orchestrate::{self, Call, Retry};
use crate::route::Plan;
use crate::state::AppState;
use crate::trail::{ConvHash, Line, Trail, TRACE_TARGET};
use crate::upstream::Endpoint;
use crate::{identify, route};
use tracing::Instrument;

pub(crate) async fn chat(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    serve(&st, Endpoint::Chat, &headers, body).await
}

pub(crate) async fn complete(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    serve(&st, Endpoint::Completions, &headers, body).await
}

/// What the request's log line needs from the layers below, filled in as
/// they run (a request refused before identity has neither).
#[derive(Default)]
struct Seen {
    conv: Option<ConvHash>,
    turn: Option<u32>,
}

/// One request with its trail: counted, its id echoed, and its log line
/// written here unless its answer's ticket writes it at the answer's end.
async fn serve(
    st: &Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    let trail = Trail::begin(
        headers,
        endpoint.path(),
        crate::auth::forwarded(&st.cfg, headers),
    );
    let mut seen = Seen::default();
    let answered = match crate::auth::client_refusal(&st.cfg, headers) {
        Some(refused) => refused,
        None => {
            completions(st, endpoint, headers, body, &trail, &mut seen)
                .instrument(trail.span.clone())
                .await
        }
    };
    let mut resp = count_rejected(st, answered);
    trail.echo(&mut resp);
    if resp.extensions().get::<Ticketed>().is_none() {
        Line {
            trail: &trail,
            conv: seen.conv,
            turn: seen.turn,
            route: resp.extensions().get::<Route>(),
            p: None,
            d: None,
            status: resp.status().as_u16(),
            ttft: None,
        }
        .emit();
    }
    resp
}

/// Requests refused before routing (bad body, unknown model, …) are counted
/// too, under path `none`, so every request shows up in the metrics.
fn count_rejected(st: &AppState, resp: Response) -> Response {
    if resp.extensions().get::<Counted>().is_none() {
        st.metrics
            .requests
            .get_or_create(&RequestLabels {
                path: "none",
                reason: "rejected",
                status: resp.status().as_u16(),
            })
            .inc();
    }
    resp
}

/// One request, top to bottom.
async fn completions(
    st: &Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Body,
    trail: &Arc<Trail>,
    seen: &mut Seen,
) -> Response {
    let started = trail.started;
    if let Err(shed) = st.admission.arrival() {
        return shed_answer(st, shed);
    }
    if !is_json(headers) {
        return openai_error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Content-Type must be application/json",
            "invalid_request_error",
            "unsupported_media_type",
        );
    }
    let bytes = match read_body(st, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let Ok(text) = std::str::from_utf8(&bytes) else {
        return invalid_request("request body is not UTF-8", "invalid_json");
    };
    let view = match checked_view(st, endpoint, text) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let identity = tracing::info_span!(target: TRACE_TARGET, "identity");
    let id = match identity.in_scope(|| identify::identify(st, headers, &view)) {
        Ok(id) => id,
        Err(e) => return invalid_request(e.to_string(), "invalid_request"),
    };
    seen.conv = Some(ConvHash::of(&id.conv));
    seen.turn = Some(id.features.turn);
    let decision = tracing::info_span!(
        target: TRACE_TARGET,
        "decision",
        path = tracing::field::Empty,
        reason = tracing::field::Empty
    );
    let plan = decision.in_scope(|| route::plan(st, &id, started));
    if let Ok(p) = &plan {
        decision.record("path", p.route.path.as_str());
        decision.record("reason", p.route.reason.as_str());
    }
    drop(decision);
    let plan = match plan {
        Ok(p) => p,
        Err(e) => return invalid_request(e.to_string(), "invalid_request"),
    };
    let call = Call {
        st,
        endpoint,
        text,
        view: &view,
        conv: &id.conv,
        source: id.source,
        history: id.history,
        turn: id.features.turn,
        n_in: id.features.n_in,
        trail,
    };
    // One retry, when a node failed before anything reached the client.
    let prompt_tokens = id.features.n_ctx.saturating_add(id.features.n_in);
    let mut plan = plan;
    let mut may_retry = true;
    loop {
        let admitted = match admit(st, &plan, prompt_tokens).await {
            Ok(a) => a,
            Err(shed) => return counted(st, &plan.route, shed_answer(st, shed)),
        };
        match orchestrate::run(&call, &plan, admitted, may_retry).await {
            Ok(resp) => return resp,
            Err(retry) => {
                may_retry = false;
                let cause = match retry {
                    Retry::NodeFailed { .. } => "node_failed",
                    Retry::NoPrefill => "no_prefill",
                };
                st.metrics
                    .request_retries
                    .get_or_create(&RetryLabels { cause })
                    .inc();
                plan = match retry {
                    Retry::NodeFailed { node, answer } => {
                        match route::after_failure(st, &plan, &node) {
                            Ok(Some(p)) => p,
                            // No other node: the failure is the answer.
                            Ok(None) => return counted(st, &plan.route, answer),
                            Err(e) => return invalid_request(e.to_string(), "invalid_request"),
                        }
                    }
                    Retry::NoPrefill => route::without_prefill(st, &plan),
                };
            }
        }
    }
}

/// Room for the request on the node that will decode it (admission.rs).
async fn admit(st: &AppState, plan: &Plan, prompt_tokens: u32) -> Result<Option<Admitted>, Shed> {
    let Some(node) = plan.target.decoder() else {
        return Ok(None);
    };
    let (admitted, waited) = st.admission.admit(&node.slots, prompt_tokens).await?;
    let outcome = if waited { "queued" } else { "admitted" };
    st.metrics
        .admission
        .get_or_create(&AdmissionLabels { outcome })
        .inc();
    Ok(Some(admitted))
}

/// A shed request's answer, counted by why it was shed.
fn shed_answer(st: &AppState, shed: Shed) -> Response {
    st.metrics
        .admission
        .get_or_create(&AdmissionLabels {
            outcome: shed.as_str(),
        })
        .inc();
    shed.response()
}

/// Whether the body is declared JSON. Requiring it keeps browsers from sending
/// a cross-site "simple" request (text/plain, form data) that needs no preflight.
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"))
}

/// The body, within the configured size limit and body-read timeout.
async fn read_body(st: &AppState, body: Body) -> Result<Bytes, Response> {
    crate::intake::read_within(body, st.cfg.max_body_bytes, st.cfg.body_read_timeout).await
}

/// The parsed request, refused when it lacks what its endpoint needs or names
/// a model the nodes do not serve.
fn checked_view<'a>(
    st: &AppState,
    endpoint: Endpoint,
    text: &'a str,
) -> Result<RequestView<'a>, Response> {
    let view =
        parse_request(text).map_err(|e| invalid_request(e.to_string(), "invalid_request"))?;
    if endpoint == Endpoint::Chat && view.messages.is_none() {
        return Err(invalid_request(
            "chat completions need `messages`",
            "invalid_request",
        ));
    }
    if endpoint == Endpoint::Completions && view.prompt.is_none() {
        return Err(invalid_request(
            "completions need `prompt`",
            "invalid_request",
        ));
    }
    if let Some(model) = view.model.as_deref() {
        let models = st.models.load();
        if !models.is_empty()
            && !models
                .iter()
                .any(|m| m.get("id").and_then(|v| v.as_str()) == Some(model))
        {
            return Err(openai_error(
                StatusCode::NOT_FOUND,
                format!("The model `{model}` does not exist."),
                "invalid_request_error",
                "model_not_found",
            ));
        }
    }
    Ok(view)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_json_bodies_are_taken() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_TYPE, v.parse().unwrap());
            is_json(&h)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        for simple in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/jsonx",
        ] {
            assert!(!with(simple), "{simple}");
        }
        assert!(!is_json(&HeaderMap::new()));
    }
}
