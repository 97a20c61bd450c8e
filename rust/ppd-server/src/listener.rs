//! The router's accept loop: TCP_NODELAY on every socket, a cap on open
//! client connections shared by all I/O threads (503 JSON with `Retry-After`
//! beyond it, then close), one task per connection (`connection.rs`), and a
//! graceful stop that lets requests in flight finish.

use axum::http::StatusCode;
use axum::Router;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::config::RouterConfig;
use crate::connection::{self, linger, Transport, WRITE_REFUSAL};
use crate::error::raw_openai_error;
/// Connections being refused (503 written, lingering) at most at once; past
/// it a refused connection is closed without an answer.
const MAX_REFUSING: usize = 512;
/// How long a refused connection waits for its client to read the 503 and close.
const REFUSAL_LINGER: Duration = Duration::from_secs(2);
/// Open connections at most on the admin listener (a budget of its own, so
/// that a flood of the main port leaves the admin API reachable).
pub(crate) const ADMIN_MAX_CONNECTIONS: usize = 64;

/// Open client connections, against a cap, shared by every acceptor of a listener.
pub(crate) struct Budget {
    open: AtomicUsize,
    refusing: AtomicUsize,
    max: usize,
}

impl Budget {
    pub(crate) fn new(max: usize) -> Arc<Budget> {
        Arc::new(Budget {
            open: AtomicUsize::new(0),
            refusing: AtomicUsize::new(0),
            max,
        })
    }

    /// A place for one more connection, or `None` at the cap.
    fn take(self: &Arc<Self>) -> Option<Slot> {
        if self.open.fetch_add(1, Ordering::AcqRel) >= self.max {
            self.open.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Slot(Arc::clone(self)))
    }
}

/// One connection's place in the budget, given back when the socket closes.
pub(crate) struct Slot(Arc<Budget>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What every acceptor of a listener shares: what its connections share
/// ([`Transport`]), the connection budget, and the 503 beyond it.
pub(crate) struct Shared {
    transport: Arc<Transport>,
    budget: Arc<Budget>,
    /// The 503 for a connection over the cap.
    over_capacity: Vec<u8>,
}

impl Shared {
    pub(crate) fn new(router: Router, cfg: &RouterConfig, budget: Arc<Budget>) -> Arc<Shared> {
        let over_capacity = raw_openai_error(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!(
                "the router has {} open connections, its limit (max_connections); retry later",
                budget.max
            ),
            "service_unavailable",
            "too_many_connections",
            "retry-after: 1\r\n",
        );
        Arc::new(Shared {
            transport: Arc::new(Transport::new(router, cfg)),
            budget,
            over_capacity,
        })
    }

    /// Answers a connection over the cap with a 503 and closes it, unless
    /// too many are being refused already: then it is closed at once.
    fn refuse(self: &Arc<Self>, mut tcp: TcpStream) {
        let budget = &self.budget;
        if budget.refusing.fetch_add(1, Ordering::AcqRel) >= MAX_REFUSING {
            budget.refusing.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        let shared = Arc::clone(self);
        tokio::spawn(async move {
            let _ = tokio::time::timeout(WRITE_REFUSAL, tcp.write_all(&shared.over_capacity)).await;
            linger(&mut tcp, REFUSAL_LINGER).await;
            drop(tcp);
            shared.budget.refusing.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

/// Accepts on `listener` until `stop` turns true (or its sender goes), then
/// lets this acceptor's connections finish their requests in flight
/// (connections waiting for a request close at once) and returns.
pub(crate) async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    // Connections hold a receiver of `conns`; when every one is gone, all are done.
    let (conns_tx, conns_rx) = watch::channel(false);
    loop {
        let accepted = tokio::select! {
            biased;
            _ = stop.wait_for(|stopped| *stopped) => break,
            r = listener.accept() => r,
        };
        let tcp = match accepted {
            Ok((tcp, _peer)) => tcp,
            Err(e) => {
                if !is_connection_error(&e) {
                    // Out of file descriptors, most likely: wait for some to close.
                    tracing::error!("accept: {e}");
                    tokio::select! {
                        _ = stop.wait_for(|stopped| *stopped) => break,
                        () = tokio::time::sleep(Duration::from_millis(100)) => {}
                    }
                }
                continue;
            }
        };
        // Small SSE chunks must leave at once: without TCP_NODELAY a chunk
        // written while the answer's head is still unacknowledged waits for
        // the client's (delayed) ACK. The upstream side sets it in the HTTP client.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY on an accepted socket: {e}");
        }
        match shared.budget.take() {
            Some(slot) => {
                tokio::spawn(connection::serve(
                    tcp,
                    Arc::clone(&shared.transport),
                    conns_rx.clone(),
                    slot,
                ));
            }
            None => shared.refuse(tcp),
        }
    }
    drop(listener);
    let _ = conns_tx.send(true);
    drop(conns_rx);
    conns_tx.closed().await;
}

fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}
