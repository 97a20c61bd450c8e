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

// ---- Refusals of the transport (listener.rs, connection.rs, intake.rs) ----

/// `resp` with `connection: close`: the connection ends after this answer.
pub fn with_close(mut resp: Response) -> Response {
    resp.headers_mut()
        .insert("connection", HeaderValue::from_static("close"));
    resp
}

/// A 413 for a body over `limit` bytes; the connection closes after it.
pub fn body_too_large(limit: usize) -> Response {
    with_close(openai_error(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("request body exceeds the limit of {limit} bytes"),
        "invalid_request_error",
        "body_too_large",
    ))
}

/// A 408 for a body that did not arrive in time; the connection closes after it.
pub fn body_timeout(seconds: f64) -> Response {
    with_close(openai_error(
        StatusCode::REQUEST_TIMEOUT,
        format!("request body not received completely within {seconds} s"),
        "invalid_request_error",
        "body_timeout",
    ))
}

/// A 405 for a known path asked with a method it does not serve.
pub fn method_not_allowed(method: &str, path: &str) -> Response {
    openai_error(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method {method} is not allowed on {path}"),
        "invalid_request_error",
        "method_not_allowed",
    )
}

/// A whole HTTP/1.1 answer, as bytes, with the OpenAI error body and
/// `connection: close`, for refusals written to the socket before (or
/// instead of) the HTTP stack: over-capacity 503s, malformed heads,
/// head timeouts. `extra` is more header lines, each ending in `\r\n`.
pub fn raw_openai_error(
    status: StatusCode,
    message: &str,
    kind: &str,
    code: &str,
    extra: &str,
) -> Vec<u8> {
    let body = serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
        .to_string();
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{extra}\r\n{body}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len(),
    )
    .into_bytes()
}
