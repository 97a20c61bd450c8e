//! The OpenAI endpoints' front door: reads and checks a request, then sends it down the layers once — identify, route, orchestrate.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use std::sync::Arc;
use std::time::Instant;

use ppd_core::request::{parse_request, RequestView};

use crate::bookkeeping::Counted;
use crate::error::{invalid_request, openai_error};
use crate::metrics::RequestLabels;
use crate::orchestrate::{self, Call, Unreachable};
use crate::state::AppState;
use crate::upstream::Endpoint;
use crate::{identify, route};

pub(crate) async fn chat(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    count_rejected(&st, completions(&st, Endpoint::Chat, &headers, body).await)
}

pub(crate) async fn complete(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    count_rejected(
        &st,
        completions(&st, Endpoint::Completions, &headers, body).await,
    )
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
) -> Response {
    let started = Instant::now();
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
    let id = match identify::identify(st, headers, &view) {
        Ok(id) => id,
        Err(e) => return invalid_request(e.to_string(), "invalid_request"),
    };
    let plan = match route::plan(st, &id, started) {
        Ok(p) => p,
        Err(e) => return invalid_request(e.to_string(), "invalid_request"),
    };
    let call = Call {
        st,
        endpoint,
        text,
        view: &view,
        conv: &id.conv,
        turn: id.features.turn,
        n_in: id.features.n_in,
        started,
    };
    let mut plan = plan;
    loop {
        match orchestrate::run(&call, &plan).await {
            Ok(resp) => return resp,
            // The local pD refused the connection before anything was sent:
            // route again knowing it is gone (never local again, so this ends).
            Err(Unreachable) => match route::without_holder(st, &plan) {
                Ok(p) => plan = p,
                Err(e) => return invalid_request(e.to_string(), "invalid_request"),
            },
        }
    }
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
