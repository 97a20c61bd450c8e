//! Subscribes to a node's KV events (vLLM's ZMQ publisher) and keeps the node's block index, so the route step knows exactly what the node caches.
//!
//! vLLM connects its PUB socket to a non-wildcard endpoint, so the router
//! binds a SUB socket there, one per node (`kv_events=`); given a wildcard
//! (`tcp://*:PORT`, vLLM's default) vLLM binds, and the router connects
//! (`kv_events_from=`), as every router replica may: PUB/SUB fans out. Every message is counted: read,
//! malformed (logged, skipped), or missed (a gap in the publisher's sequence
//! numbers: the index may lack blocks, so it under-reports, never invents).
//! A sequence that starts over, or `AllBlocksCleared`, means the node's cache
//! is empty: the index is cleared and the node's cache epoch bumped, so
//! sessions on it stop counting on their KV. The route step reads the index
//! under a read lock that the subscriber takes for writing once per batch.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use ppd_core::kv_events::{decode_message, Batch};
use ppd_core::residency::{Applied, BlockIndex};
use serde::Serialize;
use zeromq::{Socket, SocketEvent, SocketRecv};

use crate::load::NodeLoad;

/// How the router knows what a node caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// From the node's KV events, matched token for token.
    Exact,
    /// From the session alone (last turn's node, its cache epoch).
    Approx,
}

impl Mode {
    pub const ALL: [Mode; 2] = [Mode::Exact, Mode::Approx];
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Exact => "exact",
            Mode::Approx => "approx",
        }
    }
}

/// Where the router hears a node's KV events, and which side binds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Endpoint {
    pub address: String,
    pub attach: Attach,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Attach {
    /// The router binds; the node's publisher connects (vLLM given a host
    /// address). One router per address.
    Bind,
    /// The node's publisher binds (vLLM given `tcp://*:PORT`); the router
    /// connects, as any number of router replicas may.
    Connect,
}

impl Endpoint {
    pub fn bind(address: &str) -> Endpoint {
        Endpoint {
            address: address.to_owned(),
            attach: Attach::Bind,
        }
    }

    pub fn connect(address: &str) -> Endpoint {
        Endpoint {
            address: address.to_owned(),
            attach: Attach::Connect,
        }
    }
}

/// Counts of a node's KV-event stream.
#[derive(Debug, Default, Serialize, Clone, Copy, PartialEq, Eq)]
pub struct EventCounts {
    pub batches: u64,
    pub events: u64,
    /// Messages lost between publisher and router (sequence gaps).
    pub missed: u64,
    pub malformed: u64,
    /// Stored blocks whose parent was never seen (not placed in the index).
    pub orphaned: u64,
    /// Events of a type or KV medium the index does not track.
    pub skipped: u64,
    /// Times the node's cache was found emptied (restart or clear).
    pub resets: u64,
}

const NO_SEQ: u64 = u64::MAX;

/// A node's KV-event endpoint, index and counters.
#[derive(Debug, Default)]
pub struct NodeKv {
    /// Where the router hears this node (`None`: no events).
    pub endpoint: Option<Endpoint>,
    index: RwLock<BlockIndex>,
    last_seq: AtomicU64,
    batches: AtomicU64,
    events: AtomicU64,
    missed: AtomicU64,
    malformed: AtomicU64,
    orphaned: AtomicU64,
    skipped: AtomicU64,
    resets: AtomicU64,
    /// Router clock (ms) of the last reset the event stream showed.
    reset_at_ms: AtomicU64,
    /// The node left the registry: its subscriber stops and frees the endpoint.
    closed: AtomicBool,
    stop: tokio::sync::Notify,
}

impl NodeKv {
    pub fn new(endpoint: Option<Endpoint>) -> NodeKv {
        NodeKv {
            endpoint,
            last_seq: AtomicU64::new(NO_SEQ),
            ..NodeKv::default()
        }
    }

    /// Stops the node's subscriber (the node was removed), which unbinds its endpoint.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.stop.notify_waiters();
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Exact once the node's events flow (a batch arrived since the router
    /// started), approximate otherwise.
    pub fn mode(&self) -> Mode {
        if self.endpoint.is_some() && self.batches.load(Ordering::Relaxed) > 0 {
            Mode::Exact
        } else {
            Mode::Approx
        }
    }

    /// Leading tokens of `tokens` the node caches (block-aligned, as vLLM counts a hit).
    pub fn cached_prefix_tokens(&self, tokens: &[u64]) -> u32 {
        // One block's bytes (parent + 16 tokens for vLLM's default block size); grown if larger.
        let mut buf = Vec::with_capacity(8 + 8 * 16);
        self.index.read().cached_prefix_tokens(tokens, &mut buf)
    }

    /// Blocks in the index.
    pub fn blocks(&self) -> usize {
        self.index.read().len()
    }

    pub fn counts(&self) -> EventCounts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EventCounts {
            batches: l(&self.batches),
            events: l(&self.events),
            missed: l(&self.missed),
            malformed: l(&self.malformed),
            orphaned: l(&self.orphaned),
            skipped: l(&self.skipped),
            resets: l(&self.resets),
        }
    }

    /// Whether the event stream itself showed the cache emptied within
    /// `window_ms` of `now_ms` (the scraper then need not report it again).
    pub fn reset_within(&self, now_ms: u64, window_ms: u64) -> bool {
        let at = self.reset_at_ms.load(Ordering::Relaxed);
        at > 0 && now_ms.saturating_sub(at) <= window_ms
    }

    /// Empties the index (the node restarted).
    pub fn clear(&self) {
        self.index
            .write()
            .apply(&ppd_core::residency::KvEvent::Cleared);
    }

    fn reset(&self, load: &NodeLoad, now_ms: u64) {
        self.clear();
        load.cache_cleared();
        self.resets.fetch_add(1, Ordering::Relaxed);
        self.reset_at_ms.store(now_ms.max(1), Ordering::Relaxed);
    }

    /// Applies one decoded message; what it showed of the stream.
    pub fn apply(&self, batch: &Batch, load: &NodeLoad, now_ms: u64) {
        let last = self.last_seq.swap(batch.seq, Ordering::Relaxed);
        if last != NO_SEQ {
            if batch.seq <= last {
                // The publisher started over: a new vLLM process, an empty cache.
                tracing::warn!(
                    seq = batch.seq,
                    last,
                    "KV events restarted: node cache is empty"
                );
                self.reset(load, now_ms);
            } else if batch.seq > last + 1 {
                self.missed
                    .fetch_add(batch.seq - last - 1, Ordering::Relaxed);
            }
        }
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.events
            .fetch_add(batch.events.len() as u64, Ordering::Relaxed);
        self.skipped
            .fetch_add(u64::from(batch.skipped), Ordering::Relaxed);
        let mut cleared = false;
        {
            let mut index = self.index.write();
            for e in &batch.events {
                match index.apply(e) {
                    Applied::Ok => {}
                    Applied::OrphanParent => {
                        self.orphaned.fetch_add(1, Ordering::Relaxed);
                    }
                    Applied::BadShape => {
                        self.skipped.fetch_add(1, Ordering::Relaxed);
                    }
                    Applied::Cleared => cleared = true,
                }
            }
        }
        if cleared {
            load.cache_cleared();
            self.resets.fetch_add(1, Ordering::Relaxed);
            self.reset_at_ms.store(now_ms.max(1), Ordering::Relaxed);
        }
    }

    fn malformed(&self, why: &dyn std::fmt::Display) {
        let n = self.malformed.fetch_add(1, Ordering::Relaxed);
        // The first few say why; a publisher stuck on a bad format must not flood the log.
        if n < 5 {
            tracing::warn!(endpoint = ?self.endpoint, "malformed KV event message: {why}");
        }
    }
}

/// Receives the node's events until the node leaves the registry. A bind
/// or connect that fails is retried (a previous router may hold the address
/// for a moment; a publisher may not be up yet), and a connected publisher
/// that goes away (its node restarted) is connected to again: its sequence
/// then starts over, which [`NodeKv::apply`] reads as an emptied cache.
pub async fn run(kv: Arc<NodeKv>, load: Arc<NodeLoad>, now_ms: impl Fn() -> u64) {
    let Some(endpoint) = kv.endpoint.clone() else {
        return;
    };
    loop {
        let Some(mut conn) = attached(&kv, &endpoint).await else {
            return;
        };
        let lost = receive(&kv, &load, &now_ms, &mut conn).await;
        let _ = conn.sock.close().await;
        if !lost {
            return;
        }
        tracing::info!(endpoint = %endpoint.address, "KV-event publisher went away; connecting again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A subscribed socket, and for a connected one the monitor that reports
/// its publisher leaving.
struct Conn {
    sock: zeromq::SubSocket,
    monitor: Option<futures_channel::mpsc::Receiver<SocketEvent>>,
}

/// Binds or connects until it works, or `None` once the node left.
async fn attached(kv: &NodeKv, ep: &Endpoint) -> Option<Conn> {
    loop {
        if kv.is_closed() {
            return None;
        }
        let mut sock = zeromq::SubSocket::new();
        let attached = match ep.attach {
            Attach::Bind => sock.bind(&ep.address).await.map(|_| None),
            Attach::Connect => {
                let monitor = sock.monitor();
                sock.connect(&ep.address).await.map(|()| Some(monitor))
            }
        };
        match attached {
            Ok(monitor) if sock.subscribe("").await.is_ok() => return Some(Conn { sock, monitor }),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(endpoint = %ep.address, attach = ?ep.attach, "cannot attach to the KV-event endpoint: {e}; retrying")
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Applies messages until the node leaves (`false`) or a connected
/// publisher goes away (`true`).
async fn receive(kv: &NodeKv, load: &NodeLoad, now_ms: &impl Fn() -> u64, conn: &mut Conn) -> bool {
    use futures_util::StreamExt;
    loop {
        let stopped = kv.stop.notified();
        if kv.is_closed() {
            return false;
        }
        let peer_left = async {
            match conn.monitor.as_mut() {
                Some(m) => loop {
                    match m.next().await {
                        Some(SocketEvent::Disconnected(_)) | None => break,
                        Some(_) => {}
                    }
                },
                None => std::future::pending().await,
            }
        };
        let received = tokio::select! {
            r = conn.sock.recv() => r,
            () = stopped => return false,
            () = peer_left => return true,
        };
        match received {
            Ok(msg) => {
                let frames: Vec<&[u8]> = msg.iter().map(|f| f.as_ref()).collect();
                match decode_message(&frames) {
                    Ok(batch) => kv.apply(&batch, load, now_ms()),
                    Err(e) => kv.malformed(&e),
                }
            }
            Err(e) => {
                // A peer that vanished mid-message is not the end of the socket.
                kv.malformed(&e);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ppd_core::residency::KvEvent;

    fn batch(seq: u64, events: Vec<KvEvent>) -> Batch {
        Batch {
            seq,
            events,
            skipped: 0,
        }
    }

    fn stored(hash: u64, tokens: Vec<u64>) -> KvEvent {
        KvEvent::Stored {
            hashes: vec![hash],
            parent: None,
            block_size: tokens.len() as u32,
            tokens,
        }
    }

    #[test]
    fn events_make_the_node_exact_and_fill_its_index() {
        let kv = NodeKv::new(Some(Endpoint::bind("tcp://127.0.0.1:1")));
        let load = NodeLoad::default();
        assert_eq!(kv.mode(), Mode::Approx);
        kv.apply(&batch(0, vec![stored(1, vec![1, 2])]), &load, 10);
        assert_eq!(kv.mode(), Mode::Exact);
        assert_eq!(kv.cached_prefix_tokens(&[1, 2, 3]), 2);
        assert_eq!(kv.counts().events, 1);
    }

    #[test]
    fn a_sequence_gap_is_counted_as_missed() {
        let kv = NodeKv::new(Some(Endpoint::bind("e")));
        let load = NodeLoad::default();
        kv.apply(&batch(3, vec![]), &load, 1);
        kv.apply(&batch(7, vec![]), &load, 2);
        assert_eq!(kv.counts().missed, 3);
        assert_eq!(load.epoch(), 0);
    }

    #[test]
    fn a_sequence_starting_over_empties_the_cache_and_bumps_the_epoch() {
        let kv = NodeKv::new(Some(Endpoint::bind("e")));
        let load = NodeLoad::default();
        kv.apply(&batch(5, vec![stored(1, vec![1, 2])]), &load, 1);
        kv.apply(&batch(0, vec![]), &load, 1000);
        assert_eq!(kv.cached_prefix_tokens(&[1, 2, 3]), 0);
        assert_eq!(load.epoch(), 1);
        assert!(kv.reset_within(1500, 1000));
        assert!(!kv.reset_within(3000, 1000));
    }

    #[test]
    fn all_blocks_cleared_empties_the_cache_and_bumps_the_epoch() {
        let kv = NodeKv::new(Some(Endpoint::bind("e")));
        let load = NodeLoad::default();
        kv.apply(
            &batch(0, vec![stored(1, vec![1, 2]), KvEvent::Cleared]),
            &load,
            1,
        );
        assert_eq!(kv.blocks(), 0);
        assert_eq!((load.epoch(), kv.counts().resets), (1, 1));
    }
}
