//! Publishes a node's KV events as vLLM's ZMQ publisher does, so the router's residency runs against emulated nodes too.
//!
//! vLLM's `ZmqEventPublisher` with a non-wildcard endpoint *connects* a PUB
//! socket to it (the subscriber binds) and sends `[topic, seq (8 bytes, big
//! endian), msgpack batch]` per scheduler step that produced events. So does
//! this. Until the connection stands, batches are dropped with their sequence
//! numbers spent, as a PUB socket drops them without a subscriber: the
//! subscriber sees the gap.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ppd_core::kv_events::encode_batch;
use ppd_core::residency::KvEvent;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketSend, ZmqMessage};

/// Where a node publishes (vLLM's `--kv-events-config` `endpoint` and `topic`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    pub endpoint: String,
    pub topic: String,
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

async fn connect(endpoint: &str) -> Option<zeromq::PubSocket> {
    let mut sock = zeromq::PubSocket::new();
    sock.connect(endpoint).await.ok()?;
    tokio::time::sleep(HANDSHAKE).await;
    Some(sock)
}

async fn run(cfg: KvEventsConfig, mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>) {
    let mut seq: u64 = 0;
    let mut sock: Option<zeromq::PubSocket> = None;
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
        let Some(s) = sock.as_mut() else { continue };
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let mut msg = ZmqMessage::from(cfg.topic.clone().into_bytes());
        msg.push_back(this.to_be_bytes().to_vec().into());
        msg.push_back(encode_batch(ts, &events).into());
        if s.send(msg).await.is_err() {
            sock = None;
        }
    }
}
