//! Bearer tokens: the client API key on `/v1/*`, and which credentials a node call carries.
//!
//! The rule (README, "Auth and TLS"):
//! - with `api_key`, a client must send `Authorization: Bearer <api_key>` on
//!   `/v1/*` (else 401, OpenAI's `authentication_error`); that token is the
//!   router's own and is never passed on to a node;
//! - with `upstream_api_key`, every node call carries it (the HTTP client's
//!   default header, [`crate::state`]), and a client's `Authorization` is
//!   never passed on;
//! - with neither, the client's `Authorization` goes to the nodes that serve
//!   its request (P and D), as vllm-router does, so that nodes started with
//!   vLLM's `--api-key` see their clients' keys; background calls (health
//!   checks, scrapes) carry none, which vLLM's `/health` and `/metrics`
//!   accept (its `--api-key` guards only paths under `/v1`).
//!
//! `/health` and `/metrics` of the router stay open (load balancers and
//! Prometheus); the admin API has its own token ([`crate::admin`]).

use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use subtle::ConstantTimeEq;

use crate::config::RouterConfig;
use crate::error::openai_error;

/// Whether `headers` carry `Authorization: Bearer <token>`, compared as given
/// (no trimming, case-sensitive scheme) and in constant time, so the time of
/// a refusal tells nothing about how much of a guess was right.
pub(crate) fn bearer_matches(headers: &HeaderMap, token: &str) -> bool {
    headers
        .get(AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .is_some_and(|g| bool::from(g.ct_eq(token.as_bytes())))
}

/// The 401 for a client request on `/v1/*` without the router's `api_key`;
/// `None` when it may pass (or no `api_key` is set).
pub(crate) fn client_refusal(cfg: &RouterConfig, headers: &HeaderMap) -> Option<Response> {
    let key = cfg.client_secret.get()?;
    if bearer_matches(headers, key) {
        return None;
    }
    let mut r = openai_error(
        StatusCode::UNAUTHORIZED,
        "missing or wrong API key: send Authorization: Bearer <api key>",
        "authentication_error",
        "invalid_api_key",
    );
    r.headers_mut()
        .insert("www-authenticate", HeaderValue::from_static("Bearer"));
    Some(r)
}

/// The client's `Authorization` that the nodes serving its request get: only
/// when the router has neither `api_key` nor `upstream_api_key`.
pub(crate) fn forwarded(cfg: &RouterConfig, headers: &HeaderMap) -> Option<HeaderValue> {
    if cfg.client_secret.get().is_some() || cfg.upstream_secret.get().is_some() {
        return None;
    }
    let mut v = headers.get(AUTHORIZATION)?.clone();
    v.set_sensitive(true);
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_auth(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        h
    }

    fn keyed(api: Option<&str>, upstream: Option<&str>) -> RouterConfig {
        RouterConfig {
            api_key: api.map(str::to_owned),
            upstream_api_key: upstream.map(str::to_owned),
            ..RouterConfig::default()
        }
        .validate()
        .unwrap()
        .config()
        .clone()
    }

    #[test]
    fn the_client_key_is_compared_as_given() {
        let cfg = keyed(Some("k1"), None);
        assert!(client_refusal(&cfg, &with_auth("Bearer k1")).is_none());
        for wrong in [
            "Bearer k",
            "Bearer k1x",
            "bearer k1",
            "k1",
            "Bearer  k1",
            "Basic k1",
        ] {
            let r = client_refusal(&cfg, &with_auth(wrong)).expect(wrong);
            assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        }
        assert!(client_refusal(&cfg, &HeaderMap::new()).is_some());
        // Without a key, every request passes.
        assert!(client_refusal(&keyed(None, None), &HeaderMap::new()).is_none());
    }

    #[test]
    fn the_clients_authorization_is_forwarded_only_without_either_key() {
        let h = with_auth("Bearer client");
        assert_eq!(
            forwarded(&keyed(None, None), &h).unwrap(),
            HeaderValue::from_static("Bearer client")
        );
        assert!(forwarded(&keyed(None, None), &HeaderMap::new()).is_none());
        assert!(forwarded(&keyed(Some("k"), None), &h).is_none());
        assert!(forwarded(&keyed(None, Some("u")), &h).is_none());
        assert!(forwarded(&keyed(Some("k"), Some("u")), &h).is_none());
    }
}
