//! A request's trail: its id (the client's `X-Request-Id`, checked, or one made here), its W3C trace context, and the one log line it ends with.
//!
//! The id is echoed in the answer, written in the log and sent to every node
//! the request reaches, so one grep finds a request in the router's and the
//! nodes' logs. The log line says where the request went and how long it
//! took, never what it said: the conversation appears only as a hash.

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use ppd_core::Route;

use crate::registry::Node;

/// The header that carries a request's id, in and out.
pub(crate) const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// W3C Trace Context's header.
pub(crate) const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
/// The log target of the per-request line (`--log warn,ppd_router::request=info`
/// turns on that line alone).
pub(crate) const REQUEST_TARGET: &str = "ppd_router::request";

/// The target of the request spans (exported with `otlp_traces_endpoint`,
/// never logged): `request`, and within it `identity`, `decision`,
/// `prefill`, `kv_handoff`, `decode_first_token`.
pub(crate) const TRACE_TARGET: &str = "ppd_router::trace";

/// The longest client id taken as it is; vLLM makes ids of this size too.
const MAX_ID_LEN: usize = 128;

/// A client's `X-Request-Id` when it is one: 1 to 128 visible ASCII
/// characters. Anything else (empty, too long, spaces, control or non-ASCII
/// bytes) is not passed to the nodes, where it could forge headers or
/// flood their logs.
fn acceptable_id(raw: &[u8]) -> bool {
    (1..=MAX_ID_LEN).contains(&raw.len()) && raw.iter().all(|b| b.is_ascii_graphic())
}

/// A request's id: the client's, or a fresh one.
pub(crate) fn request_id(headers: &HeaderMap) -> String {
    match headers.get(REQUEST_ID) {
        // Visible ASCII is UTF-8.
        Some(v) if acceptable_id(v.as_bytes()) => {
            String::from_utf8_lossy(v.as_bytes()).into_owned()
        }
        _ => uuid::Uuid::new_v4().simple().to_string(),
    }
}

/// What every layer of a request knows about it from its first byte on.
#[derive(Debug)]
pub(crate) struct Trail {
    pub id: String,
    pub trace: Option<Trace>,
    pub endpoint: &'static str,
    pub started: Instant,
    /// The request's span (disabled unless spans are exported); it ends when
    /// the trail does, with the answer's last byte.
    pub span: tracing::Span,
    /// The client's `Authorization`, when it is passed on to the nodes
    /// ([`crate::auth::forwarded`]).
    pub authorization: Option<HeaderValue>,
}

impl Trail {
    pub fn begin(
        headers: &HeaderMap,
        endpoint: &'static str,
        authorization: Option<HeaderValue>,
    ) -> Arc<Trail> {
        let id = request_id(headers);
        let span = tracing::info_span!(target: TRACE_TARGET, "request", request_id = %id, endpoint);
        if !span.is_disabled() {
            // The client's trace, if it sent one; else the span starts a trace.
            let parent = TraceContextPropagator::new().extract(&Headers(headers));
            let _ = span.set_parent(parent);
        }
        Arc::new(Trail {
            id,
            trace: trace_of(headers),
            endpoint,
            started: Instant::now(),
            span,
            authorization,
        })
    }

    /// The `traceparent` a node call made within `span` carries: that
    /// span's context when spans are exported, else the client's trace under
    /// the router's span id, else none.
    pub fn traceparent(&self, span: &tracing::Span) -> Option<HeaderValue> {
        if !span.is_disabled() {
            let cx = span.context();
            let sc = cx.span().span_context().clone();
            if sc.is_valid() {
                let tp = format!(
                    "00-{}-{}-{:02x}",
                    sc.trace_id(),
                    sc.span_id(),
                    sc.trace_flags().to_u8()
                );
                return HeaderValue::from_str(&tp).ok();
            }
        }
        self.trace.as_ref().map(|t| t.to_nodes.clone())
    }

    /// The answer carries the request's id back to the client.
    pub fn echo(&self, resp: &mut axum::response::Response) {
        if let Ok(v) = HeaderValue::from_str(&self.id) {
            resp.headers_mut().insert(REQUEST_ID, v);
        }
    }
}

/// The trace a request belongs to, from a valid `traceparent`; nodes get it
/// with the router's own span as their parent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Trace {
    /// 32 lowercase hex digits.
    pub trace_id: String,
    /// The `traceparent` the nodes get: same trace and flags, the router's span id.
    pub to_nodes: HeaderValue,
}

/// A request's headers as OpenTelemetry's propagator reads them.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// Parses `00-<trace id>-<parent id>-<flags>` (W3C Trace Context, version
/// 00, or a later version's first four fields); an all-zero id or a
/// malformed header is no trace, as the standard asks.
pub(crate) fn trace_of(headers: &HeaderMap) -> Option<Trace> {
    let raw = headers.get(TRACEPARENT)?.to_str().ok()?.trim();
    let mut parts = raw.split('-');
    let (version, trace_id, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| {
        s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    let valid = hex(version, 2)
        && version != "ff"
        && (version != "00" || parts.next().is_none())
        && hex(trace_id, 32)
        && hex(parent, 16)
        && hex(flags, 2)
        && trace_id.bytes().any(|b| b != b'0')
        && parent.bytes().any(|b| b != b'0');
    if !valid {
        return None;
    }
    let span = span_id();
    let to_nodes = HeaderValue::from_str(&format!("00-{trace_id}-{span}-{flags}")).ok()?;
    Some(Trace {
        trace_id: trace_id.to_owned(),
        to_nodes,
    })
}

/// A random, non-zero 64-bit span id as 16 hex digits.
fn span_id() -> String {
    let v = uuid::Uuid::new_v4().as_u64_pair().0.max(1);
    format!("{v:016x}")
}

/// A conversation as the log shows it: a 64-bit hash of its key, so that a
/// client's own id never reaches the log while its turns still group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConvHash(u64);

impl ConvHash {
    pub fn of(key: &str) -> ConvHash {
        ConvHash(xxhash_rust::xxh3::xxh3_64(key.as_bytes()))
    }
}

impl fmt::Display for ConvHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// What a request's log line says.
pub(crate) struct Line<'a> {
    pub trail: &'a Trail,
    pub conv: Option<ConvHash>,
    pub turn: Option<u32>,
    pub route: Option<&'a Route>,
    pub p: Option<&'a Node>,
    pub d: Option<&'a Node>,
    pub status: u16,
    pub ttft: Option<Duration>,
}

impl Line<'_> {
    /// The request's one info line. Its fields are only computed when the
    /// line is enabled (tracing's macro checks the level first).
    pub fn emit(&self) {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        tracing::info!(
            target: REQUEST_TARGET,
            request_id = self.trail.id.as_str(),
            trace_id = self.trail.trace.as_ref().map(|t| t.trace_id.as_str()),
            endpoint = self.trail.endpoint,
            conversation = self.conv.map(tracing::field::display),
            turn = self.turn,
            path = self.route.map_or("none", |r| r.path.as_str()),
            reason = self.route.map_or("rejected", |r| r.reason.as_str()),
            prefill_node = self.p.map(|n| n.url.as_str()),
            node = self.d.map(|n| n.url.as_str()),
            status = self.status,
            ttft_ms = self.ttft.map(ms),
            duration_ms = ms(self.trail.started.elapsed()),
            "request"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(name: HeaderName, v: &[u8]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(name, HeaderValue::from_bytes(v).unwrap());
        h
    }

    #[test]
    fn a_clients_id_is_kept_when_it_is_visible_ascii_of_bounded_length() {
        let id = request_id(&headers(REQUEST_ID, b"req-42_ABC.def"));
        assert_eq!(&*id, "req-42_ABC.def");
    }

    #[test]
    fn an_unfit_client_id_is_replaced_by_a_fresh_one() {
        let long = vec![b'a'; MAX_ID_LEN + 1];
        for bad in [&b"has space"[..], b"tab\tin", &long, b"caf\xc3\xa9"] {
            let id = request_id(&headers(REQUEST_ID, bad));
            assert_eq!(id.len(), 32, "{bad:?}");
            assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
        }
        let a = request_id(&HeaderMap::new());
        let b = request_id(&HeaderMap::new());
        assert_ne!(a, b);
    }

    #[test]
    fn a_valid_traceparent_reaches_the_nodes_under_the_routers_span() {
        let tp = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t = trace_of(&headers(TRACEPARENT, tp)).unwrap();
        assert_eq!(t.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        let out = t.to_nodes.to_str().unwrap();
        assert!(out.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
        assert!(out.ends_with("-01"));
        let span = &out[36..52];
        assert_ne!(span, "00f067aa0ba902b7");
        assert!(span.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn a_malformed_or_zero_traceparent_is_no_trace() {
        for bad in [
            &b"00-00000000000000000000000000000000-00f067aa0ba902b7-01"[..],
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            b"00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            b"garbage",
        ] {
            assert!(trace_of(&headers(TRACEPARENT, bad)).is_none(), "{bad:?}");
        }
        assert!(trace_of(&HeaderMap::new()).is_none());
    }

    #[test]
    fn without_exported_spans_nodes_get_the_clients_trace_or_none() {
        let tp = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let traced = Trail::begin(&headers(TRACEPARENT, tp), "/v1/completions", None);
        let sent = traced.traceparent(&tracing::Span::none()).unwrap();
        assert_eq!(sent, traced.trace.as_ref().unwrap().to_nodes);
        let untraced = Trail::begin(&HeaderMap::new(), "/v1/completions", None);
        assert!(untraced.traceparent(&tracing::Span::none()).is_none());
    }

    #[test]
    fn a_conversation_is_logged_as_a_stable_hash_not_its_key() {
        let shown = ConvHash::of("alice-secret-session").to_string();
        assert_eq!(shown.len(), 16);
        assert!(!shown.contains("alice"));
        assert_eq!(shown, ConvHash::of("alice-secret-session").to_string());
        assert_ne!(shown, ConvHash::of("bob").to_string());
    }
}
