//! The answer the client sees: a node's stream relayed event by event, a whole JSON answer, or a node's error, with the route's headers.

use axum::body::{Body, Bytes};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderName, HeaderValue};
use axum::response::Response;
use futures_util::{Stream, StreamExt};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use ppd_core::identity::ContentHasher;
use ppd_core::Route;

use crate::body::answer_without_router_fields;
use crate::bookkeeping::{Counted, Ticket};
use crate::client::Answer;
use crate::config::{RouteHeaders, RouterConfig};
use crate::registry::{InflightGuard, Node};
use crate::sse::{
    classify, is_done, vllm_chunk, without_router_fields, EventKind, EventSplitter, Pass, Usage,
    VllmChunk,
};
use crate::upstream::read_all;

/// Marks the answer as routed and says how, as far as `route_headers`
/// allows: `x-ppd-path`, `x-ppd-reason`, `x-ppd-session`, `x-ppd-node`.
pub(crate) fn route_headers(
    resp: &mut Response,
    route: &Route,
    conv: &str,
    node: &Node,
    cfg: &RouterConfig,
) {
    resp.extensions_mut().insert(Counted);
    // Names as constants: a `&str` name is parsed on every insert.
    const PATH: HeaderName = HeaderName::from_static("x-ppd-path");
    const REASON: HeaderName = HeaderName::from_static("x-ppd-reason");
    const SESSION: HeaderName = HeaderName::from_static("x-ppd-session");
    const NODE: HeaderName = HeaderName::from_static("x-ppd-node");
    if cfg.route_headers == RouteHeaders::None {
        return;
    }
    let h = resp.headers_mut();
    h.insert(PATH, HeaderValue::from_static(route.path.as_str()));
    if cfg.route_headers == RouteHeaders::Path {
        return;
    }
    h.insert(REASON, HeaderValue::from_static(route.reason.as_str()));
    if let Ok(v) = HeaderValue::from_str(conv) {
        h.insert(SESSION, v);
    }
    // A node's address is internal: only an operator who asks for it gets it.
    if cfg.expose_node_header {
        if let Some(v) = &node.url_header {
            h.insert(NODE, v.clone());
        }
    }
}

/// A non-streamed answer, read whole; `None` when the node failed while
/// sending it. The ticket is settled with the answer's usage.
pub(crate) async fn whole(
    ticket: Ticket,
    resp: Answer,
    inflight: InflightGuard,
) -> Option<Response> {
    let content_type = resp.headers().get(CONTENT_TYPE).cloned();
    let bytes = read_all(&ticket.state, resp).await?;
    let answer = crate::answer::whole(&bytes);
    if let Some(pin) = answer
        .pin
        .as_ref()
        .filter(|_| ticket.state.cfg.bidirectional_kv_xfer)
    {
        ticket.record_pin(pin, answer.digest);
    }
    let end = Instant::now();
    ticket.finish(answer.usage, answer.digest, Some(end), end);
    drop(inflight);
    let bytes = answer_without_router_fields(&bytes).map_or(bytes, Bytes::from);
    let mut r = Response::new(Body::from(bytes));
    r.headers_mut().insert(
        CONTENT_TYPE,
        content_type.unwrap_or(HeaderValue::from_static("application/json")),
    );
    Some(r)
}

/// A streamed answer, relayed as it arrives (see [`Relay`]).
pub(crate) fn streamed(relay: Relay) -> Response {
    let mut r = Response::new(Body::from_stream(relay));
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r.headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes, hyper::Error>> + Send>>;

/// Relays an upstream SSE stream event by event: the client gets the bytes vLLM
/// sent, minus the usage chunk the router asked for itself; a failure mid-stream
/// becomes an SSE error event and the end of the stream.
pub(crate) struct Relay {
    upstream: ByteStream,
    idle: Duration,
    /// When the node last sent something; the idle timer is moved to
    /// `last_data + idle` only when it fires, not re-armed per chunk.
    last_data: Instant,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    splitter: EventSplitter,
    drop_usage: bool,
    usage: Option<Usage>,
    /// The answer's text so far, hashed (for a chat's next-turn key).
    answer: Option<ContentHasher>,
    first_token: Option<Instant>,
    ticket: Option<Ticket>,
    done: bool,
    /// `first_event` left events in the splitter for the first poll.
    read_ahead: bool,
    inflight: InflightGuard,
}

fn sse_error(message: &str) -> Bytes {
    let body = serde_json::json!({"error": {"message": message, "type": "upstream_error", "param": null, "code": 502}});
    Bytes::from(format!("data: {body}\n\n"))
}

impl Relay {
    pub fn new(ticket: Ticket, resp: Answer, inflight: InflightGuard, drop_usage: bool) -> Relay {
        Relay {
            upstream: Box::pin(http_body_util::BodyDataStream::new(resp.into_body())),
            idle: Duration::from_secs_f64(ticket.state.cfg.stream_idle_timeout),
            last_data: Instant::now(),
            sleep: None,
            splitter: EventSplitter::default(),
            drop_usage,
            usage: None,
            answer: ticket.history.is_some().then(ContentHasher::new),
            first_token: None,
            ticket: Some(ticket),
            done: false,
            read_ahead: false,
            inflight,
        }
    }

    /// Waits for the stream's first whole event, before anything is sent to
    /// the client, so that a node that breaks or stays silent before its first
    /// token can still be replaced. An error event first is a failure too.
    pub async fn first_event(&mut self) -> Result<(), &'static str> {
        loop {
            match self.upstream.next().await {
                Some(Ok(chunk)) => {
                    self.splitter.push(&chunk);
                    self.read_ahead = true;
                    if let Some(first) = self.splitter.peek_event() {
                        return match classify(first) {
                            EventKind::Error => Err("an error event"),
                            EventKind::Data { .. } => {
                                self.first_token = Some(Instant::now());
                                Ok(())
                            }
                            _ => Ok(()),
                        };
                    }
                }
                Some(Err(_)) => return Err("the stream broke"),
                None => return Err("the stream ended empty"),
            }
        }
    }

    /// Drops a relay whose stream is abandoned for a retry: its request is
    /// neither answered nor counted here.
    pub fn discard(mut self) {
        self.ticket = None;
    }

    /// Events ready to send from what has been buffered (without a copy
    /// unless the router's own usage chunk has to be cut out).
    fn drain(&mut self) -> Option<Bytes> {
        let Relay {
            splitter,
            drop_usage,
            usage,
            answer,
            first_token,
            ticket,
            inflight,
            ..
        } = self;
        let progress = inflight.progress();
        splitter.take_events(|ev| {
            // Nearly every event is vLLM's token chunk: read in one pass.
            let kind = match vllm_chunk(ev) {
                Some(VllmChunk::Token(text)) => {
                    if first_token.is_none() {
                        *first_token = Some(Instant::now());
                    }
                    if let Some(p) = progress {
                        p.token();
                    }
                    if let Some(h) = answer.as_mut() {
                        h.update(&text);
                    }
                    return Pass::Keep;
                }
                Some(VllmChunk::Usage(u)) => EventKind::UsageOnly(u),
                None if is_done(ev) => EventKind::Done,
                None => classify(ev),
            };
            match kind {
                EventKind::UsageOnly(u) => {
                    *usage = Some(u);
                    if *drop_usage {
                        return Pass::Drop;
                    }
                }
                EventKind::Data { usage: u } => {
                    if first_token.is_none() {
                        *first_token = Some(Instant::now());
                    }
                    if u.is_some() {
                        *usage = u;
                    }
                    if let Some(p) = progress {
                        p.token();
                    }
                    if let Some(h) = answer.as_mut() {
                        crate::answer::feed_event(ev, h);
                    }
                }
                EventKind::Error => {
                    if let Some(t) = ticket.as_ref() {
                        t.state.registry.record_failure(&t.d, t.state.now_ms());
                    }
                }
                EventKind::Done | EventKind::Other => {}
            }
            without_router_fields(ev).map_or(Pass::Keep, Pass::Replace)
        })
    }

    fn fail(&mut self, message: &str, kind: &'static str) -> Bytes {
        self.done = true;
        if let Some(t) = self.ticket.take() {
            t.fail(kind, self.first_token);
        }
        sse_error(message)
    }
}

impl Stream for Relay {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        // Events read ahead by `first_event` go out first.
        if std::mem::take(&mut this.read_ahead) {
            if let Some(out) = this.drain() {
                return Poll::Ready(Some(Ok(out)));
            }
        }
        loop {
            match this.upstream.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(chunk))) => {
                    this.last_data = Instant::now();
                    this.splitter.push(&chunk);
                    if let Some(out) = this.drain() {
                        return Poll::Ready(Some(Ok(out)));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    if let Some(t) = &this.ticket {
                        tracing::warn!(node = %t.d.url, error = %e, "stream broke");
                    }
                    return Poll::Ready(Some(Ok(this.fail("the upstream stream broke", "stream"))));
                }
                Poll::Ready(None) => {
                    this.done = true;
                    let rest = this.splitter.take_rest();
                    if let Some(t) = this.ticket.take() {
                        let answer = this.answer.as_ref().map(ContentHasher::digest);
                        t.finish(this.usage, answer, this.first_token, Instant::now());
                    }
                    return Poll::Ready(rest.map(Ok));
                }
                Poll::Pending => {
                    let (idle, deadline) = (this.idle, this.last_data + this.idle);
                    let sleep = this
                        .sleep
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline.into())));
                    while sleep.as_mut().poll(cx).is_ready() {
                        if Instant::now() >= deadline {
                            let msg = format!("upstream sent nothing for {idle:?}");
                            return Poll::Ready(Some(Ok(this.fail(&msg, "stream_idle"))));
                        }
                        // Data came since the timer was set: wait out the rest.
                        sleep.as_mut().reset(deadline.into());
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // The client went away before the end: dropping the upstream stream
        // closes its connection, which aborts the request on the node. After
        // a first token D holds the prompt's KV, so the session keeps it.
        if let Some(t) = self.ticket.take() {
            if self.first_token.is_some() {
                t.abort(
                    self.answer.as_ref().map(ContentHasher::digest),
                    self.first_token,
                );
            } else {
                t.settle(499, None);
            }
        }
    }
}
