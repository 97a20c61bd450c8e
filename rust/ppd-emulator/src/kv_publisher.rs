//! Publishes a node's KV events as vLLM's ZMQ publisher does, so the router's residency runs against emulated nodes too.
//!
//! vLLM's `ZmqEventPublisher` with a non-wildcard endpoint *connects* a PUB
//! socket to it (the subscriber binds) and sends `[topic, seq (8 bytes, big
//! endian), msgpack batch]` per scheduler step that produced events. So does
//! this. Until the connection stands, batches are dropped with their sequence
//! numbers spent, as a PUB socket drops them without a subscriber: the
//! subscriber sees the gap. A subscriber that goes away (the router restarts,
//! or drops the node and adds it again) is reconnected to, as pyzmq does.
//! Given a wildcard endpoint (`tcp://*:PORT`) vLLM binds instead, and any
//! number of subscribers (router replicas) connect; so does this, and with
//! `bind` on any address (tests bind loopback only).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ppd_core::kv_events::encode_batch;
use ppd_core::residency::KvEvent;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketEvent, SocketSend, ZmqMessage};

/// Where a node publishes (vLLM's `--kv-events-config` `endpoint` and `topic`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    pub endpoint: String,
    pub topic: String,
    /// Bind the endpoint (subscribers connect) rather than connect to it.
    pub bind: bool,
}

impl KvEventsConfig {
    /// vLLM's rule: a wildcard host binds (as all interfaces); else `bind` says.
    pub fn new(endpoint: &str, topic: &str, bind: bool) -> KvEventsConfig {
        let wildcard = endpoint.contains('*');
        KvEventsConfig {
            endpoint: endpoint.replace('*', "0.0.0.0"),
            topic: topic.to_owned(),
            bind: bind || wildcard,
        }
    }
}

/// Starts the publisher task; the engine driver sends it each step's events.
pub(crate) fn start(cfg: KvEventsConfig) -> mpsc::UnboundedSender<Vec<KvEvent>> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(run(cfg, rx));
    tx
}

/// How long a fresh connection gets for the subscriber's SUBSCRIBE to reach
/// us; a PUB socket drops what it sends before that.
const HANDSHAKE: Duration = Duration::from_millis(200);

/// A connected PUB socket and its monitor, which reports the subscriber leaving.
struct Conn {
    sock: zeromq::PubSocket,
    events: futures_channel::mpsc::Receiver<SocketEvent>,
}

impl Conn {
    /// Whether the subscriber went away since the last look.
    fn lost(&mut self) -> bool {
        let mut lost = false;
        while let Ok(e) = self.events.try_recv() {
            lost |= matches!(e, SocketEvent::Disconnected(_));
        }
        lost
    }
}

async fn connect(endpoint: &str) -> Option<Conn> {
    let mut sock = zeromq::PubSocket::new();
    let events = sock.monitor();
    sock.connect(endpoint).await.ok()?;
    tokio::time::sleep(HANDSHAKE).await;
    Some(Conn { sock, events })
}

async fn run(cfg: KvEventsConfig, rx: mpsc::UnboundedReceiver<Vec<KvEvent>>) {
    if cfg.bind {
        run_bound(cfg, rx).await
    } else {
        run_connected(cfg, rx).await
    }
}

/// `[topic, seq, batch]` as vLLM sends it.
fn message(topic: &str, seq: u64, events: &[KvEvent]) -> ZmqMessage {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let mut msg = ZmqMessage::from(topic.as_bytes().to_vec());
    msg.push_back(seq.to_be_bytes().to_vec().into());
    msg.push_back(encode_batch(ts, events).into());
    msg
}

/// A bound PUB socket: what no subscriber hears is lost, sequence spent.
async fn run_bound(cfg: KvEventsConfig, mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>) {
    let mut sock = zeromq::PubSocket::new();
    // The address may still be held by the node's previous process for a moment.
    while sock.bind(&cfg.endpoint).await.is_err() {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let mut seq: u64 = 0;
    while let Some(events) = rx.recv().await {
        // A send without subscribers, or to one that just left, drops the batch, as a PUB socket does.
        let _ = sock.send(message(&cfg.topic, seq, &events)).await;
        seq += 1;
    }
}

async fn run_connected(cfg: KvEventsConfig, mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>) {
    let mut seq: u64 = 0;
    let mut sock: Option<Conn> = None;
    // Connected from the start, not at the first batch: a PUB socket drops
    // what it sends before the subscriber's handshake completes.
    let mut retry_at = tokio::time::Instant::now();
    loop {
        if sock.is_none() && tokio::time::Instant::now() >= retry_at {
            sock = connect(&cfg.endpoint).await;
            retry_at = tokio::time::Instant::now() + Duration::from_millis(500);
        }
        let events = tokio::select! {
            got = rx.recv() => match got {
                Some(events) => events,
                None => return,
            },
            _ = tokio::time::sleep_until(retry_at), if sock.is_none() => continue,
        };
        let this = seq;
        seq += 1;
        if sock.as_mut().is_some_and(Conn::lost) {
            sock = None;
            retry_at = tokio::time::Instant::now();
        }
        let Some(s) = sock.as_mut() else { continue };
        if s.sock
            .send(message(&cfg.topic, this, &events))
            .await
            .is_err()
        {
            sock = None;
        }
    }
}
