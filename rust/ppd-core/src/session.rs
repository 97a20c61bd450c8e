//! The session table: which P and D hold a conversation, what it has cost so far, and when it expires.
//!
//! Sharded: each shard is its own LRU behind its own lock, so a lookup waits
//! only for writers of the same shard. The clock is passed in (`now_ms`): the
//! core has no I/O and no time source of its own.

use lru::LruCache;
use parking_lot::Mutex;
use serde::Serialize;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// A node of the registry; ids are never reused while a table refers to them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub NonZeroU32);

impl NodeId {
    pub fn new(raw: u32) -> Option<Self> {
        NonZeroU32::new(raw).map(NodeId)
    }
    pub fn get(self) -> u32 {
        self.0.get()
    }
}

/// What the router remembers of one conversation (64 bytes).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Session {
    /// Turns completed so far.
    pub turns: u32,
    /// The P that prefilled its last PD-path turn.
    pub p: Option<NodeId>,
    /// The D (or pD) whose prefix cache holds its KV.
    pub d: Option<NodeId>,
    /// That D's cache epoch when it served the last turn: a later epoch means
    /// the D restarted or cleared its cache since, and the KV is gone.
    pub d_epoch: u32,
    /// Prompt + completion tokens of the last turn (0 = unknown).
    context_tokens: u32,
    mean_out: f32,
    out_samples: u32,
    pub created_ms: u64,
    pub last_access_ms: u64,
    /// The histories the next turn of an explicitly named conversation may
    /// present (a conversation keyed by its history is checked by its key).
    pub expected: Expected,
}

/// The histories (through the last assistant message, as
/// [`crate::identity::HistoryHash::short`]) that continue a session: the one
/// its last turn's answer ended, and the one that turn itself continued (a
/// regeneration of that turn). 0 is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Expected {
    pub next: u64,
    pub previous: u64,
}

impl Expected {
    /// Whether a request whose history hashes to `prefix` continues the
    /// session; with nothing known, any does.
    pub fn admits(self, prefix: u64) -> bool {
        self.next == 0 || prefix == self.next || (self.previous != 0 && prefix == self.previous)
    }
}

impl Session {
    pub fn new(now_ms: u64) -> Self {
        Session {
            turns: 0,
            p: None,
            d: None,
            d_epoch: 0,
            context_tokens: 0,
            mean_out: 0.0,
            out_samples: 0,
            created_ms: now_ms,
            last_access_ms: now_ms,
            expected: Expected::default(),
        }
    }

    /// Records a finished turn's usage as upstream reported it.
    pub fn record_usage(&mut self, prompt_tokens: u32, completion_tokens: u32, now_ms: u64) {
        self.context_tokens = prompt_tokens.saturating_add(completion_tokens);
        self.out_samples = self.out_samples.saturating_add(1);
        self.mean_out += (completion_tokens as f32 - self.mean_out) / self.out_samples as f32;
        self.last_access_ms = self.last_access_ms.max(now_ms);
    }

    /// Context tokens the next turn starts from, when upstream has reported them.
    pub fn context_tokens(&self) -> Option<u32> {
        (self.context_tokens > 0).then_some(self.context_tokens)
    }

    /// Running mean of completion tokens, once at least one turn finished.
    pub fn mean_output_tokens(&self) -> Option<u32> {
        (self.out_samples > 0).then(|| self.mean_out.round().max(1.0) as u32)
    }

    pub fn output_samples(&self) -> u32 {
        self.out_samples
    }
}

/// A finished turn, as the end-of-turn bookkeeping reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnRecord {
    pub turn: u32,
    /// The P that prefilled it, when it took the pd path.
    pub p: Option<NodeId>,
    /// The node that decoded it and now holds its KV.
    pub d: NodeId,
    /// That node's cache epoch while it served the turn.
    pub d_epoch: u32,
    /// `(prompt_tokens, completion_tokens)` as upstream reported them.
    pub usage: Option<(u32, u32)>,
    /// What the next turn's history should be (unknown after an aborted answer).
    pub expected: Expected,
}

/// The one JSON shape of a session, for the admin API and the Python API.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionView<'a> {
    pub id: &'a str,
    pub turns: u32,
    /// The P and D by name (the router's node URLs).
    pub p: Option<String>,
    pub d: Option<String>,
    pub context_tokens: Option<u32>,
    pub mean_output_tokens: Option<u32>,
    pub created_ms: u64,
    pub last_access_ms: u64,
}

impl Session {
    /// Its JSON view, naming nodes with `name`.
    pub fn view<'a>(
        &self,
        id: &'a str,
        name: impl Fn(NodeId) -> Option<String>,
    ) -> SessionView<'a> {
        SessionView {
            id,
            turns: self.turns,
            p: self.p.and_then(&name),
            d: self.d.and_then(&name),
            context_tokens: self.context_tokens(),
            mean_output_tokens: self.mean_output_tokens(),
            created_ms: self.created_ms,
            last_access_ms: self.last_access_ms,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct SessionConfig {
    /// Idle time after which a session is forgotten (paper B.3: 60 minutes).
    pub ttl_ms: u64,
    /// Live sessions kept at most; beyond it the least recently used go.
    pub capacity: usize,
    /// Number of independently locked shards (rounded up to a power of two).
    pub shards: usize,
    /// Memory the sessions may take, keys included ([`ENTRY_OVERHEAD_BYTES`]
    /// + the id's length each); beyond it the least recently used go.
    pub max_bytes: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            ttl_ms: 60 * 60 * 1000,
            capacity: 1_000_000,
            shards: 64,
            max_bytes: 256 * 1024 * 1024,
        }
    }
}

/// What one session costs besides its id's bytes: the entry, the LRU links
/// and the hash slot (1M sessions with ~20-byte ids measured 164 B each,
/// bench/results/core.md, with the 48-byte session of then; it has grown
/// by its 16-byte [`Expected`] since).
pub const ENTRY_OVERHEAD_BYTES: usize = 160;

fn footprint(id_len: usize) -> usize {
    id_len + ENTRY_OVERHEAD_BYTES
}

/// Counters since the table was created (one JSON shape for the admin API and Python).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SessionStats {
    pub live: u64,
    pub created: u64,
    pub expired: u64,
    pub evicted_lru: u64,
    pub removed: u64,
    pub reassigned: u64,
    /// Memory the live sessions take, as counted against `max_bytes`.
    pub bytes: u64,
}

#[derive(Default)]
struct Counters {
    created: AtomicU64,
    expired: AtomicU64,
    evicted_lru: AtomicU64,
    removed: AtomicU64,
    reassigned: AtomicU64,
}

type Shard = LruCache<Box<str>, Session, ahash::RandomState>;

pub struct SessionTable {
    shards: Box<[Mutex<Shard>]>,
    shard_mask: usize,
    capacity: usize,
    /// Sessions held over all shards; the capacity bound is global, so an
    /// unevenly hashed shard does not evict while others have room.
    live: AtomicUsize,
    /// Their footprint; bounded by `max_bytes` like `live` by `capacity`.
    bytes: AtomicUsize,
    max_bytes: usize,
    ttl_ms: u64,
    picker: ahash::RandomState,
    counters: Counters,
}

impl SessionTable {
    pub fn new(config: SessionConfig) -> Result<Self, crate::error::Error> {
        if config.capacity == 0 {
            return Err(crate::error::Error::Config(
                "session capacity must be at least 1".into(),
            ));
        }
        if config.ttl_ms == 0 {
            return Err(crate::error::Error::Config(
                "session TTL must be positive".into(),
            ));
        }
        if config.max_bytes < footprint(0) {
            return Err(crate::error::Error::Config(format!(
                "session memory must hold at least one session ({} bytes)",
                footprint(0)
            )));
        }
        let n = config
            .shards
            .clamp(1, 4096)
            .next_power_of_two()
            .min(config.capacity.next_power_of_two());
        let seeds = ahash::RandomState::with_seeds(1, 2, 3, 4);
        // Unbounded maps grow with use; a preallocated 1M-entry map would cost
        // memory before the first session arrives.
        let shards = (0..n)
            .map(|_| Mutex::new(LruCache::unbounded_with_hasher(seeds.clone())))
            .collect();
        Ok(SessionTable {
            shards,
            shard_mask: n - 1,
            capacity: config.capacity,
            live: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            max_bytes: config.max_bytes,
            ttl_ms: config.ttl_ms,
            picker: ahash::RandomState::with_seeds(5, 6, 7, 8),
            counters: Counters::default(),
        })
    }

    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }

    fn shard(&self, id: &str) -> &Mutex<Shard> {
        let h = self.picker.hash_one(id) as usize;
        &self.shards[h & self.shard_mask]
    }

    fn expired(&self, s: &Session, now_ms: u64) -> bool {
        now_ms.saturating_sub(s.last_access_ms) > self.ttl_ms
    }

    /// The session, refreshed as recently used; an expired one is dropped.
    pub fn get(&self, id: &str, now_ms: u64) -> Option<Session> {
        let mut shard = self.shard(id).lock();
        let s = shard.get_mut(id)?;
        if self.expired(s, now_ms) {
            shard.pop(id);
            self.gone(id.len());
            self.counters.expired.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        s.last_access_ms = s.last_access_ms.max(now_ms);
        Some(*s)
    }

    /// The session as stored, without touching its recency or expiry.
    pub fn peek(&self, id: &str) -> Option<Session> {
        self.shard(id).lock().peek(id).copied()
    }

    /// Creates the session if needed (or if expired), applies `f`, and returns
    /// the result. The least recently used session of the shard goes when full.
    pub fn update<F: FnOnce(&mut Session)>(&self, id: &str, now_ms: u64, f: F) -> Session {
        let mut shard = self.shard(id).lock();
        let fresh = match shard.get_mut(id) {
            Some(s) if self.expired(s, now_ms) => {
                self.counters.expired.fetch_add(1, Ordering::Relaxed);
                *s = Session::new(now_ms);
                true
            }
            Some(_) => false,
            None => {
                let over_count = self.live.fetch_add(1, Ordering::AcqRel) >= self.capacity;
                let size = footprint(id.len());
                let bytes = self.bytes.fetch_add(size, Ordering::AcqRel) + size;
                if over_count {
                    self.evict_one(&mut shard);
                }
                // A long id may need several short ones to make room; each
                // round either frees one or finds every shard busy.
                let mut over = bytes.saturating_sub(self.max_bytes);
                while over > 0 {
                    match self.evict_one(&mut shard) {
                        Some(freed) => over = over.saturating_sub(freed),
                        None => break,
                    }
                }
                shard.put(id.into(), Session::new(now_ms));
                true
            }
        };
        if fresh {
            self.counters.created.fetch_add(1, Ordering::Relaxed);
        }
        let Some(s) = shard.get_mut(id) else {
            // Unreachable: the entry was inserted above under the same lock.
            return Session::new(now_ms);
        };
        f(s);
        s.last_access_ms = s.last_access_ms.max(now_ms);
        *s
    }

    /// Records a finished turn: the turn count, which P and D served it, and
    /// its usage. Returns the session as updated and the D it had before (a
    /// change of D moves the conversation's KV to another node).
    pub fn record_turn(
        &self,
        id: &str,
        now_ms: u64,
        rec: &TurnRecord,
    ) -> (Session, Option<NodeId>) {
        let mut before = None;
        let s = self.update(id, now_ms, |s| {
            before = s.d;
            s.turns = s.turns.max(rec.turn);
            s.d = Some(rec.d);
            s.d_epoch = rec.d_epoch;
            if rec.p.is_some() {
                s.p = rec.p;
            }
            if let Some((prompt, completion)) = rec.usage {
                s.record_usage(prompt, completion, now_ms);
            }
            s.expected = rec.expected;
        });
        (s, before)
    }

    /// Stores `session` under `id` too (replacing what was there): a
    /// conversation keyed by its history is found under the key of each
    /// history it reached, until the old keys age out (LRU, TTL).
    pub fn put(&self, id: &str, now_ms: u64, session: Session) -> Session {
        self.update(id, now_ms, |s| *s = session)
    }

    /// A session with an id of `id_len` bytes left the table.
    fn gone(&self, id_len: usize) {
        self.live.fetch_sub(1, Ordering::AcqRel);
        self.bytes.fetch_sub(footprint(id_len), Ordering::AcqRel);
    }

    /// Makes room for one session: the LRU of the inserting shard, else of the
    /// first other shard that is free to lock (never waiting, so no lock order
    /// can deadlock; a miss leaves the table one over until the next insert).
    /// Returns the bytes freed.
    fn evict_one(&self, own: &mut Shard) -> Option<usize> {
        let key_len = own.pop_lru().map(|(k, _)| k.len()).or_else(|| {
            self.shards.iter().find_map(|other| {
                other
                    .try_lock()
                    .and_then(|mut o| o.pop_lru().map(|(k, _)| k.len()))
            })
        })?;
        self.gone(key_len);
        self.counters.evicted_lru.fetch_add(1, Ordering::Relaxed);
        Some(footprint(key_len))
    }

    pub fn remove(&self, id: &str) -> Option<Session> {
        let s = self.shard(id).lock().pop(id);
        if s.is_some() {
            self.gone(id.len());
            self.counters.removed.fetch_add(1, Ordering::Relaxed);
        }
        s
    }

    /// Drops every session idle for longer than the TTL; returns how many.
    /// LRU order is last-access order, so each shard is trimmed from its tail.
    pub fn evict_expired(&self, now_ms: u64) -> usize {
        let mut n = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            while let Some((_, s)) = shard.peek_lru() {
                if !self.expired(s, now_ms) {
                    break;
                }
                if let Some((k, _)) = shard.pop_lru() {
                    self.gone(k.len());
                }
                n += 1;
            }
        }
        self.counters.expired.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Moves every session off a node that left: its D (or P) becomes `to`
    /// (None: chosen afresh on the next turn). Returns the sessions changed.
    pub fn reassign(&self, from: NodeId, to: Option<NodeId>) -> usize {
        let mut n = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            for (_, s) in shard.iter_mut() {
                let mut hit = false;
                if s.d == Some(from) {
                    s.d = to;
                    // The new D holds none of this conversation's KV.
                    s.context_tokens = 0;
                    hit = true;
                }
                if s.p == Some(from) {
                    s.p = None;
                    hit = true;
                }
                n += usize::from(hit);
            }
        }
        self.counters
            .reassigned
            .fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Sessions whose KV a node holds.
    pub fn count_on(&self, d: NodeId) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().iter().filter(|(_, v)| v.d == Some(d)).count())
            .sum()
    }

    pub fn len(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A page of sessions in a stable order (shard by shard, most recent first).
    pub fn page(&self, offset: usize, limit: usize) -> Vec<(String, Session)> {
        let mut out = Vec::with_capacity(limit.min(1024));
        let mut skipped = 0;
        for shard in self.shards.iter() {
            if out.len() >= limit {
                break;
            }
            let shard = shard.lock();
            if skipped + shard.len() <= offset {
                skipped += shard.len();
                continue;
            }
            for (k, v) in shard.iter() {
                if skipped < offset {
                    skipped += 1;
                    continue;
                }
                if out.len() >= limit {
                    break;
                }
                out.push((k.to_string(), *v));
            }
        }
        out
    }

    pub fn stats(&self) -> SessionStats {
        let c = &self.counters;
        SessionStats {
            live: self.len() as u64,
            created: c.created.load(Ordering::Relaxed),
            expired: c.expired.load(Ordering::Relaxed),
            evicted_lru: c.evicted_lru.load(Ordering::Relaxed),
            removed: c.removed.load(Ordering::Relaxed),
            reassigned: c.reassigned.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed) as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn table(ttl_ms: u64, capacity: usize, shards: usize) -> SessionTable {
        SessionTable::new(SessionConfig {
            ttl_ms,
            capacity,
            shards,
            ..SessionConfig::default()
        })
        .unwrap()
    }

    fn node(n: u32) -> NodeId {
        NodeId::new(n).unwrap()
    }

    #[test]
    fn a_session_admits_the_history_its_answer_ended_or_a_regeneration() {
        let unknown = Expected::default();
        assert!(unknown.admits(42));
        let e = Expected {
            next: 7,
            previous: 3,
        };
        assert!(e.admits(7) && e.admits(3));
        assert!(!e.admits(42));
        let first = Expected {
            next: 7,
            previous: 0,
        };
        assert!(!first.admits(0), "0 is unknown, never a history");
    }

    #[test]
    fn put_stores_a_copy_under_another_key() {
        let t = SessionTable::new(SessionConfig::default()).unwrap();
        let d = NodeId::new(1).unwrap();
        let rec = TurnRecord {
            turn: 1,
            p: None,
            d,
            d_epoch: 0,
            usage: Some((10, 5)),
            expected: Expected::default(),
        };
        let (s, _) = t.record_turn("old", 5, &rec);
        t.put("new", 6, s);
        assert_eq!(t.len(), 2);
        let new = t.peek("new").unwrap();
        assert_eq!(
            (new.turns, new.d, new.context_tokens()),
            (1, Some(d), Some(15))
        );
        assert!(
            t.peek("old").is_some(),
            "the presented key stays for a retry"
        );
    }

    #[test]
    fn session_is_forgotten_after_ttl_of_inactivity() {
        let t = table(1000, 10, 1);
        t.update("a", 0, |s| s.turns = 1);
        assert!(t.get("a", 1000).is_some());
        // Access at 1000 refreshed it; 2000 is exactly the TTL later.
        assert!(t.get("a", 2000).is_some());
        assert!(t.get("a", 3001).is_none());
        assert_eq!(t.stats().expired, 1);
        assert!(t.is_empty());
    }

    #[test]
    fn expired_session_is_recreated_fresh_on_update() {
        let t = table(1000, 10, 1);
        t.update("a", 0, |s| s.turns = 3);
        let s = t.update("a", 5000, |_| {});
        assert_eq!(s.turns, 0);
        assert_eq!(s.created_ms, 5000);
    }

    #[test]
    fn capacity_evicts_least_recently_used() {
        let t = table(u64::MAX, 3, 1);
        for (i, id) in ["a", "b", "c"].iter().enumerate() {
            t.update(id, i as u64, |_| {});
        }
        t.get("a", 10); // a is now most recent; b is the LRU
        t.update("d", 11, |_| {});
        assert_eq!(t.len(), 3);
        assert!(t.peek("b").is_none());
        assert!(t.peek("a").is_some());
        assert_eq!(t.stats().evicted_lru, 1);
    }

    #[test]
    fn sweep_drops_only_expired_sessions() {
        let t = table(100, 100, 4);
        for i in 0..20u64 {
            t.update(&format!("s{i}"), i * 10, |_| {});
        }
        // At 250, sessions last touched before 150 are expired: s0..s14.
        assert_eq!(t.evict_expired(250), 15);
        assert_eq!(t.len(), 5);
        assert!(t.peek("s15").is_some());
    }

    #[test]
    fn reassign_moves_sessions_off_a_departed_node() {
        let t = table(u64::MAX, 100, 4);
        t.update("a", 0, |s| {
            s.d = Some(node(1));
            s.p = Some(node(9));
            s.record_usage(5, 5, 0)
        });
        t.update("b", 0, |s| s.d = Some(node(2)));
        assert_eq!(t.count_on(node(1)), 1);
        assert_eq!(t.reassign(node(1), None), 1);
        let a = t.peek("a").unwrap();
        assert_eq!((a.d, a.p), (None, Some(node(9))));
        assert_eq!(a.context_tokens(), None);
        assert_eq!(t.peek("b").unwrap().d, Some(node(2)));
        assert_eq!(t.stats().reassigned, 1);
    }

    #[test]
    fn a_recorded_turn_keeps_the_last_p_and_reports_the_previous_d() {
        let t = table(u64::MAX, 100, 4);
        let first = TurnRecord {
            turn: 1,
            p: Some(node(7)),
            d: node(1),
            d_epoch: 0,
            usage: Some((100, 20)),
            expected: Expected::default(),
        };
        let (s, before) = t.record_turn("c", 0, &first);
        assert_eq!(before, None);
        assert_eq!(
            (s.turns, s.p, s.d, s.context_tokens()),
            (1, Some(node(7)), Some(node(1)), Some(120))
        );
        // A local turn: no P, same D, no usage reported.
        let local = TurnRecord {
            turn: 2,
            p: None,
            d: node(1),
            d_epoch: 0,
            usage: None,
            expected: Expected::default(),
        };
        let (s, before) = t.record_turn("c", 5, &local);
        assert_eq!(before, Some(node(1)));
        assert_eq!(
            (s.turns, s.p, s.context_tokens()),
            (2, Some(node(7)), Some(120))
        );
        // A late answer of an older turn never lowers the count.
        let (s, _) = t.record_turn(
            "c",
            6,
            &TurnRecord {
                turn: 1,
                p: None,
                d: node(2),
                d_epoch: 0,
                usage: Some((1, 1)),
                expected: Expected::default(),
            },
        );
        assert_eq!(
            (s.turns, s.d, s.mean_output_tokens()),
            (2, Some(node(2)), Some(11))
        );
    }

    #[test]
    fn the_json_view_names_nodes_and_hides_unknown_context() {
        let t = table(u64::MAX, 100, 4);
        let (s, _) = t.record_turn(
            "c",
            3,
            &TurnRecord {
                turn: 1,
                p: None,
                d: node(1),
                d_epoch: 0,
                usage: None,
                expected: Expected::default(),
            },
        );
        let v =
            serde_json::to_value(s.view("c", |n| Some(format!("http://n{}", n.get())))).unwrap();
        assert_eq!(v["id"], "c");
        assert_eq!(v["d"], "http://n1");
        assert!(v["p"].is_null() && v["context_tokens"].is_null());
        assert_eq!(v["created_ms"], 3);
    }

    #[test]
    fn pages_cover_every_session_once() {
        let t = table(u64::MAX, 1000, 8);
        for i in 0..57 {
            t.update(&format!("s{i}"), 0, |_| {});
        }
        let mut seen: Vec<String> = Vec::new();
        let mut off = 0;
        loop {
            let page = t.page(off, 10);
            if page.is_empty() {
                break;
            }
            off += page.len();
            seen.extend(page.into_iter().map(|(k, _)| k));
        }
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 57);
    }

    #[test]
    fn concurrent_updates_are_not_lost() {
        let t = Arc::new(table(u64::MAX, 100_000, 16));
        let threads: Vec<_> = (0..4)
            .map(|k| {
                let t = Arc::clone(&t);
                std::thread::spawn(move || {
                    for i in 0..2000 {
                        t.update(&format!("conv{}", i % 100), 0, |s| s.turns += 1);
                        t.update(&format!("own{k}-{i}"), 0, |_| {});
                    }
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        let total: u32 = (0..100)
            .map(|i| t.peek(&format!("conv{i}")).unwrap().turns)
            .sum();
        assert_eq!(total, 4 * 2000);
        assert_eq!(t.len(), 100 + 4 * 2000);
    }

    #[test]
    fn memory_is_bounded_as_well_as_entries() {
        let room = 20 * footprint(10);
        let t = SessionTable::new(SessionConfig {
            ttl_ms: u64::MAX,
            capacity: 1_000_000,
            shards: 4,
            max_bytes: room,
        })
        .unwrap();
        for i in 0..100 {
            t.update(&format!("id-{i:06}"), i, |_| {});
            assert!(t.stats().bytes as usize <= room, "{i}: {:?}", t.stats());
        }
        assert_eq!(t.len(), 20);
        // A long id evicts as many short ones as it needs.
        t.update(&"x".repeat(200), 1000, |_| {});
        let s = t.stats();
        assert!(s.bytes as usize <= room && t.len() < 20, "{s:?}");
        assert_eq!(
            s.bytes as usize,
            t.page(0, 100)
                .iter()
                .map(|(k, _)| footprint(k.len()))
                .sum::<usize>()
        );
        t.remove(&"x".repeat(200));
        t.evict_expired(u64::MAX);
        assert_eq!(t.stats().bytes as usize, t.len() * footprint(9));
    }

    #[test]
    fn zero_capacity_or_ttl_is_rejected() {
        assert!(SessionTable::new(SessionConfig {
            capacity: 0,
            ..Default::default()
        })
        .is_err());
        assert!(SessionTable::new(SessionConfig {
            ttl_ms: 0,
            ..Default::default()
        })
        .is_err());
    }

    proptest! {
        #[test]
        fn live_sessions_never_exceed_capacity(cap in 1usize..64, shards in 1usize..8, ids in proptest::collection::vec(0u16..500, 0..400)) {
            let t = table(u64::MAX, cap, shards);
            for id in &ids {
                t.update(&id.to_string(), 0, |_| {});
            }
            prop_assert!(t.len() <= cap);
            prop_assert_eq!(t.len(), t.shards.iter().map(|s| s.lock().len()).sum::<usize>());
            let s = t.stats();
            prop_assert_eq!(s.created - s.evicted_lru, t.len() as u64);
        }

        #[test]
        fn mean_output_is_the_running_mean(outs in proptest::collection::vec(1u32..5000, 1..50)) {
            let mut s = Session::new(0);
            for &o in &outs {
                s.record_usage(10, o, 0);
            }
            let mean = outs.iter().map(|&o| o as f64).sum::<f64>() / outs.len() as f64;
            let got = s.mean_output_tokens().unwrap() as f64;
            prop_assert!((got - mean).abs() <= 1.0, "got {} want {}", got, mean);
        }
    }
}
