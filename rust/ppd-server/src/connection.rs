//! One client connection: hyper's HTTP/1 server under the axum Router, with
//! the header-read and keep-alive timeouts, OpenAI-style answers for what
//! hyper refuses itself, and lingering close.
//!
//! A connection is in one of three phases, kept in [`ConnState`] and changed
//! only from inside its own task (the socket wrapper [`Io`] when bytes come,
//! the service [`Svc`] when a head is routed, the answer's body [`Tracked`]
//! when it is done), so each change is one relaxed store:
//!
//! - `WAITING` for the first byte of a request head: a new connection has
//!   `header_read_timeout` from accept, a kept-alive one `keep_alive_timeout`
//!   from its last answer; past it the connection is closed silently.
//! - `HEAD`: head bytes are arriving; `header_read_timeout` (from accept, or
//!   from the first byte of a later request); past it a 408, then close.
//! - `ROUTED`: the router has the request until its answer's body is done;
//!   the body-read timeout is the handler's (`intake.rs`), the rest the
//!   upstream's (`request_timeout`, `stream_idle_timeout`).
//!
//! One timer per connection does all of it. It is re-armed when it fires,
//! or pulled in when a wait begins that ends before it; a request whose head
//! comes whole is routed in the same poll and changes no timer, so the
//! request path adds no timer, lock or allocation.

use crate::head::HeadScan;
use axum::body::Body;
use axum::http::{header, Request, Response, StatusCode};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;
use tower_service::Service;

use crate::config::{seconds, RouterConfig};
use crate::error::{invalid_request, raw_openai_error, with_close};

const WAITING: u8 = 0;
const HEAD: u8 = 1;
const ROUTED: u8 = 2;

/// How long a connection that hyper or the router has finished with keeps
/// reading (and discarding) what its client still sends, so that the client
/// reads the answer instead of a reset (nginx's lingering close).
pub(crate) const LINGER: Duration = Duration::from_secs(5);
/// The most bytes discarded while lingering.
pub(crate) const LINGER_BYTES: usize = 256 << 20;
/// Lingering after a refusal of the transport itself (a head timeout).
const LINGER_SHORT: Duration = Duration::from_secs(1);
/// The most time spent writing a refusal to a client that does not read.
pub(crate) const WRITE_REFUSAL: Duration = Duration::from_secs(1);
/// The largest request head (request line and header fields) read, bytes;
/// a longer one is answered 431. Also hyper's largest read buffer.
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;

/// What every connection of a listener shares: the app, hyper's settings,
/// the timeouts, and the 408 written without hyper.
pub(crate) struct Transport {
    router: Router,
    http: hyper::server::conn::http1::Builder,
    header_read: Duration,
    keep_alive: Duration,
    /// The 408 for a head not complete in time.
    head_timeout: Vec<u8>,
}

impl Transport {
    pub(crate) fn new(router: Router, cfg: &RouterConfig) -> Transport {
        let mut http = hyper::server::conn::http1::Builder::new();
        http.keep_alive(true)
            // The head's clock is the connection's own (see the module's
            // doc), which also tells a head from a keep-alive wait.
            .header_read_timeout(None)
            .max_buf_size(MAX_HEAD_BYTES);
        let head_timeout = raw_openai_error(
            StatusCode::REQUEST_TIMEOUT,
            &format!(
                "request head not received completely within {} s (header_read_timeout)",
                cfg.header_read_timeout
            ),
            "invalid_request_error",
            "header_timeout",
            "",
        );
        Transport {
            router,
            http,
            header_read: seconds(cfg.header_read_timeout),
            keep_alive: seconds(cfg.keep_alive_timeout),
            head_timeout,
        }
    }
}

/// What one connection is doing, shared by its socket wrapper, its service,
/// its answers' bodies and its task (all in the same task).
pub(crate) struct ConnState {
    born: Instant,
    phase: AtomicU8,
    /// Start of the current wait, in ms after `born`.
    since_ms: AtomicU64,
    /// An answer has been sent: a wait for a head is a keep-alive wait.
    served: AtomicBool,
    /// The router has been handed the head being read; when it has not, an
    /// answer hyper writes is hyper's own (a parse error).
    routed: AtomicBool,
    /// The raw head carried a `Content-Length` line (hyper drops it when a
    /// `Transfer-Encoding` comes with it, so only the raw bytes tell).
    raw_content_length: AtomicBool,
    /// The status of the answer hyper wrote itself (and that [`Io`] kept
    /// from the socket), for the OpenAI-style answer written instead.
    hyper_status: AtomicU16,
    /// A wait began (head bytes came, or an answer ended): the task looks at
    /// its timer after polling hyper.
    changed: AtomicBool,
}

impl ConnState {
    fn new(born: Instant) -> ConnState {
        ConnState {
            born,
            phase: AtomicU8::new(WAITING),
            since_ms: AtomicU64::new(0),
            served: AtomicBool::new(false),
            routed: AtomicBool::new(false),
            raw_content_length: AtomicBool::new(false),
            hyper_status: AtomicU16::new(0),
            changed: AtomicBool::new(false),
        }
    }

    fn mark_now(&self) {
        let ms = Instant::now()
            .saturating_duration_since(self.born)
            .as_millis() as u64;
        self.since_ms.store(ms, Relaxed);
    }

    /// When the current wait runs out; `None` while the router has the request.
    fn deadline(&self, header_read: Duration, keep_alive: Duration) -> Option<Instant> {
        let limit = match self.phase.load(Relaxed) {
            WAITING if self.served.load(Relaxed) => keep_alive,
            WAITING | HEAD => header_read,
            _ => return None,
        };
        Some(self.born + Duration::from_millis(self.since_ms.load(Relaxed)) + limit)
    }
}

/// The client's socket as hyper sees it: marks the phase when head bytes
/// come, scans heads for `Content-Length`, and keeps the answers hyper makes
/// up itself (empty-bodied 4xx for heads it cannot parse) from the client.
pub(crate) struct Io {
    tcp: TcpStream,
    conn: Arc<ConnState>,
    scan: HeadScan,
}

impl Io {
    fn on_bytes(&mut self, bytes: &[u8]) {
        let c = &*self.conn;
        match c.phase.load(Relaxed) {
            WAITING => {
                c.phase.store(HEAD, Relaxed);
                if c.served.load(Relaxed) {
                    c.mark_now();
                }
                c.routed.store(false, Relaxed);
                c.raw_content_length.store(false, Relaxed);
                c.changed.store(true, Relaxed);
                self.scan.reset();
            }
            HEAD => {}
            _ => return,
        }
        if self.scan.feed(bytes) {
            c.raw_content_length.store(true, Relaxed);
        }
    }

    /// Whether `head` (the start of a write) is an answer hyper made up for a
    /// head it could not parse: a 4xx with no body and no content type, while
    /// the router has not seen the request. Records its status.
    fn is_hyper_refusal(&self, head: &[u8]) -> bool {
        if self.conn.routed.load(Relaxed) || !head.starts_with(b"HTTP/1.1 4") || head.len() < 12 {
            return false;
        }
        let end = memchr::memmem::find(head, b"\r\n\r\n").unwrap_or(head.len());
        let lines = &head[..end];
        let has = |name: &[u8]| {
            lines
                .split(|&b| b == b'\n')
                .any(|l| l.len() >= name.len() && l[..name.len()].eq_ignore_ascii_case(name))
        };
        if has(b"content-type:") || !has(b"content-length: 0") {
            return false;
        }
        let status = std::str::from_utf8(&head[9..12])
            .ok()
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(400);
        self.conn.hyper_status.store(status, Relaxed);
        true
    }
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.tcp).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            let phase = this.conn.phase.load(Relaxed);
            if phase != ROUTED {
                this.on_bytes(&buf.filled()[before..]);
            }
        }
        polled
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if !this.conn.routed.load(Relaxed) && this.is_hyper_refusal(buf) {
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut this.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if !this.conn.routed.load(Relaxed) {
            if let Some(first) = bufs.iter().find(|b| !b.is_empty()) {
                if this.is_hyper_refusal(first) {
                    return Poll::Ready(Ok(bufs.iter().map(|b| b.len()).sum()));
                }
            }
        }
        Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.conn.hyper_status.load(Relaxed) != 0 {
            // Hyper closes after its own refusal; ours is still to be written.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.tcp).poll_shutdown(cx)
    }
}

/// The axum Router as this connection's hyper service.
struct Svc {
    router: Router,
    conn: Arc<ConnState>,
}

impl hyper::service::Service<Request<Incoming>> for Svc {
    type Response = Response<Tracked>;
    type Error = Infallible;
    type Future = Answer;

    fn call(&self, req: Request<Incoming>) -> Answer {
        let c = &*self.conn;
        c.phase.store(ROUTED, Relaxed);
        c.routed.store(true, Relaxed);
        let raw_cl = c.raw_content_length.swap(false, Relaxed);
        if raw_cl && req.headers().contains_key(header::TRANSFER_ENCODING) {
            // Request smuggling's classic shape: refused, and the connection closed.
            return Answer {
                routed: None,
                now: Some(with_close(invalid_request(
                    "a request must not carry both Content-Length and Transfer-Encoding",
                    "invalid_framing",
                ))),
                conn: Some(Arc::clone(&self.conn)),
            };
        }
        Answer {
            routed: Some(self.router.clone().call(req)),
            now: None,
            conn: Some(Arc::clone(&self.conn)),
        }
    }
}

pin_project_lite::pin_project! {
    /// The router's answer, its body wrapped to mark the end of the exchange.
    pub(crate) struct Answer {
        #[pin]
        routed: Option<axum::routing::future::RouteFuture<Infallible>>,
        now: Option<Response<Body>>,
        conn: Option<Arc<ConnState>>,
    }
}

impl Future for Answer {
    type Output = Result<Response<Tracked>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let resp = match this.now.take() {
            Some(r) => r,
            None => match this.routed.as_pin_mut() {
                Some(f) => match f.poll(cx) {
                    Poll::Ready(Ok(r)) => r,
                    Poll::Ready(Err(never)) => match never {},
                    Poll::Pending => return Poll::Pending,
                },
                None => unreachable!("Answer polled after completion"),
            },
        };
        let conn = this.conn.take();
        Poll::Ready(Ok(resp.map(|body| Tracked { body, conn })))
    }
}

/// An answer's body: when hyper is done with it (sent, or dropped), the
/// connection waits for its next request, and the keep-alive clock starts.
pub(crate) struct Tracked {
    body: Body,
    conn: Option<Arc<ConnState>>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Some(c) = &self.conn {
            c.served.store(true, Relaxed);
            c.mark_now();
            c.phase.store(WAITING, Relaxed);
            c.changed.store(true, Relaxed);
            // A head already buffered behind this one (pipelining) is not
            // routed yet: an empty 4xx written for it would be hyper's. (This
            // answer's own head may still be unwritten; it is the router's,
            // and has a content type, so it is never taken for hyper's.)
            c.routed.store(false, Relaxed);
        }
    }
}

impl http_body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// How a connection's service ended.
enum Ended {
    /// Hyper finished (the client closed, or an answer closed the connection, or an error).
    Served(Result<(), hyper::Error>),
    /// No (complete) head within its time.
    TimedOut { partial_head: bool },
    /// The router is stopping and the connection had no request in flight.
    Stopped,
}

/// Serves one accepted connection until it ends; `_slot` (its place in the
/// connection budget) is held until the socket is closed.
pub(crate) async fn serve<Slot: Send + 'static>(
    tcp: TcpStream,
    transport: Arc<Transport>,
    mut stop: watch::Receiver<bool>,
    _slot: Slot,
) {
    let header_read = transport.header_read;
    let keep_alive = transport.keep_alive;
    let accepted = Instant::now();
    let timer = tokio::time::sleep_until(accepted + header_read);
    tokio::pin!(timer);

    // Until its first byte, a connection is a socket and this task only:
    // hyper's buffers are made when there is something to read. (A peek, not
    // `readable()`, which may wake up with nothing to read.)
    let mut first_byte = [0u8; 1];
    let first = tokio::select! {
        biased;
        r = tcp.peek(&mut first_byte) => matches!(r, Ok(n) if n > 0),
        () = &mut timer => false,
        _ = stop.changed() => false,
    };
    if !first {
        return;
    }

    // The first head's clock runs from accept.
    let conn = Arc::new(ConnState::new(accepted));
    let mut io = TokioIo::new(Io {
        tcp,
        conn: Arc::clone(&conn),
        scan: HeadScan::default(),
    });
    let ended = {
        let svc = Svc {
            router: transport.router.clone(),
            conn: Arc::clone(&conn),
        };
        let http = transport.http.serve_connection(&mut io, svc);
        tokio::pin!(http);
        let mut stopping = false;
        loop {
            tokio::select! {
                biased;
                r = http.as_mut() => break Ended::Served(r),
                // Polled right after hyper: a wait that began in that poll and
                // ends before the timer pulls the timer in. (Most requests come
                // whole, are routed in the same poll and need no timer change.)
                () = std::future::poll_fn(|cx| {
                    if conn.changed.swap(false, Relaxed) {
                        if let Some(at) = conn.deadline(header_read, keep_alive) {
                            if at < timer.deadline() {
                                timer.as_mut().reset(at);
                            }
                        }
                    }
                    timer.as_mut().poll(cx)
                }) => match conn.deadline(header_read, keep_alive) {
                    Some(at) if at <= Instant::now() => break Ended::TimedOut {
                        partial_head: conn.phase.load(Relaxed) == HEAD,
                    },
                    Some(at) => timer.as_mut().reset(at),
                    // The router has the request: look again later.
                    None => timer.as_mut().reset(Instant::now() + keep_alive.max(header_read)),
                },
                _ = stop.changed(), if !stopping => {
                    stopping = true;
                    if conn.phase.load(Relaxed) != ROUTED {
                        break Ended::Stopped;
                    }
                    // Let the request in flight finish; hyper closes after its answer.
                    http.as_mut().graceful_shutdown();
                }
            }
        }
    };
    // From here on the connection no longer holds up a shutdown.
    drop(stop);
    let tcp = &mut io.inner_mut().tcp;
    match ended {
        Ended::Served(result) => {
            let status = conn.hyper_status.load(Relaxed);
            if status != 0 {
                let answer = parse_refusal(status);
                let _ = tokio::time::timeout(WRITE_REFUSAL, tcp.write_all(&answer)).await;
            } else if let Err(e) = &result {
                tracing::debug!("connection ended: {e}");
            }
            linger(tcp, LINGER).await;
        }
        Ended::TimedOut { partial_head } => {
            if partial_head {
                let _ = tokio::time::timeout(WRITE_REFUSAL, tcp.write_all(&transport.head_timeout))
                    .await;
                linger(tcp, LINGER_SHORT).await;
            }
        }
        Ended::Stopped => {}
    }
}

/// Closes the sending side, then reads and discards what the client still
/// sends, until it closes too, for at most `budget` and [`LINGER_BYTES`]:
/// a socket closed with unread bytes sends a reset, and a reset makes the
/// client drop the answer it has not read yet.
pub(crate) async fn linger(tcp: &mut TcpStream, budget: Duration) {
    let _ = tcp.shutdown().await;
    let deadline = Instant::now() + budget;
    let mut drained = 0usize;
    let mut buf: Vec<u8> = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, tcp.readable()).await {
            Ok(Ok(())) => {}
            _ => return,
        }
        let read = if buf.is_empty() {
            try_read_small(tcp)
        } else {
            tcp.try_read(&mut buf)
        };
        match read {
            Ok(0) => return,
            Ok(n) => {
                drained += n;
                if drained > LINGER_BYTES {
                    return;
                }
                if buf.is_empty() {
                    buf = vec![0; 64 * 1024];
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

/// A first read into a small buffer of its own: most connections have
/// nothing more to send (the read sees the end at once) and need no buffer.
fn try_read_small(tcp: &TcpStream) -> io::Result<usize> {
    let mut small = [0u8; 256];
    tcp.try_read(&mut small)
}

/// The OpenAI-style answer for a head hyper refused with `status`.
fn parse_refusal(status: u16) -> Vec<u8> {
    let max_head_bytes = MAX_HEAD_BYTES;
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
    let (message, code) = match status {
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => (
            format!("request head larger than {max_head_bytes} bytes, or too many header fields"),
            "header_too_large",
        ),
        StatusCode::URI_TOO_LONG => ("request target too long".to_owned(), "uri_too_long"),
        _ => ("malformed HTTP request head".to_owned(), "bad_request"),
    };
    raw_openai_error(status, &message, "invalid_request_error", code, "")
}
