//! OpenAI-style error answers: the one body shape every refusal of the router takes.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// `{"error": {"message", "type", "param", "code"}}` with `status`.
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

/// A 400 for a request the router cannot route.
pub fn invalid_request(message: impl Into<String>, code: &str) -> Response {
    openai_error(
        StatusCode::BAD_REQUEST,
        message,
        "invalid_request_error",
        code,
    )
}

/// A 503 with `Retry-After`: no node can take the request now.
pub fn unavailable(message: impl Into<String>) -> Response {
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
