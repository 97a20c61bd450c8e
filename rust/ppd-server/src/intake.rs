//! Reading a request body: within a size limit and a time limit, or refused with an OpenAI error (413, 408, 400).

use crate::config::seconds;
use crate::error::{body_timeout, body_too_large, invalid_request};
use axum::body::{Body, Bytes, HttpBody};
use axum::response::Response;

/// The whole body, at most `limit` bytes, arrived within `timeout` seconds.
///
/// A body whose declared length is over the limit is refused before any of
/// it is read; the connection then closes after the 413 (the transport
/// drains what the client still sends, so the client reads the answer: see
/// `connection::linger`). A body that has not arrived in time gets a 408 and
/// the connection closes.
pub(crate) async fn read_within(body: Body, limit: usize, timeout: f64) -> Result<Bytes, Response> {
    if body.size_hint().lower() > limit as u64 {
        return Err(body_too_large(limit));
    }
    let read = axum::body::to_bytes(body, limit);
    match tokio::time::timeout(seconds(timeout), read).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => {
            let too_big = std::error::Error::source(&e)
                .is_some_and(|s| s.to_string().contains("length limit"))
                || e.to_string().contains("length limit");
            Err(if too_big {
                body_too_large(limit)
            } else {
                invalid_request(format!("cannot read request body: {e}"), "bad_body")
            })
        }
        Err(_) => Err(body_timeout(timeout)),
    }
}
