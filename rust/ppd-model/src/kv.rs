//! The paged KV pool with vLLM's block-hash prefix cache and LRU eviction of unreferenced blocks.
//!
//! Like vLLM's `BlockPool`: a block whose last reference is dropped goes to the
//! tail of a free queue but keeps its hash, so a later request can take it back
//! (a prefix-cache hit); allocation takes from the head, evicting the hash of
//! the least recently freed block. Intrusive list: every operation is O(1).

use std::collections::hash_map::Entry;

use ahash::AHashMap;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    hash: Option<u64>,
    refs: u32,
    prev: u32,
    next: u32,
    in_free: bool,
}

/// Counters of the pool, in tokens where vLLM counts tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Prompt tokens looked up in the prefix cache.
    pub queries: u64,
    /// Of those, tokens found cached.
    pub hits: u64,
    /// Cached blocks whose hash was dropped to make room.
    pub evictions: u64,
}

#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    free: u32,
    cached: AHashMap<u64, u32>,
    pub stats: PoolStats,
    /// Hashes evicted since the last [`BlockPool::take_evicted`], when the
    /// node publishes KV events (`None`: not recorded).
    evicted: Option<Vec<u64>>,
}

impl BlockPool {
    pub fn new(num_blocks: u32) -> BlockPool {
        let n = num_blocks.max(1);
        let blocks = (0..n)
            .map(|i| Block {
                hash: None,
                refs: 0,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == n { NIL } else { i + 1 },
                in_free: true,
            })
            .collect();
        BlockPool {
            blocks,
            head: 0,
            tail: n - 1,
            free: n,
            cached: AHashMap::with_capacity(n as usize),
            stats: PoolStats::default(),
            evicted: None,
        }
    }

    /// Starts recording evicted hashes (for `BlockRemoved` events).
    pub fn record_evictions(&mut self) {
        self.evicted.get_or_insert_with(Vec::new);
    }

    /// The hashes evicted since the last call.
    pub fn take_evicted(&mut self, out: &mut Vec<u64>) {
        if let Some(e) = self.evicted.as_mut() {
            out.append(e);
        }
    }

    pub fn num_blocks(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks that an allocation may take (unreferenced, cached or not).
    pub fn num_free(&self) -> u32 {
        self.free
    }

    /// vLLM's `kv_cache_usage_perc` as a fraction: referenced blocks over all.
    pub fn usage(&self) -> f64 {
        1.0 - self.free as f64 / self.blocks.len() as f64
    }

    /// Blocks holding a hash (the prefix cache's size).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Whether the prefix cache holds `hash`.
    pub fn is_cached(&self, hash: u64) -> bool {
        self.cached.contains_key(&hash)
    }

    /// Number of leading `hashes` present in the cache (no side effects).
    pub fn match_prefix(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// [`match_prefix`](Self::match_prefix), and how many of those blocks
    /// sit unreferenced in the free list: taking them leaves that many fewer
    /// free blocks for the rest of the request, so admission counts them as
    /// vLLM's KV manager does.
    pub fn match_prefix_free(&self, hashes: &[u64]) -> (usize, u32) {
        let mut free = 0;
        let n = hashes
            .iter()
            .map_while(|h| self.cached.get(h))
            .inspect(|&&id| free += u32::from(self.blocks[id as usize].refs == 0))
            .count();
        (n, free)
    }

    /// Takes a reference on the cached blocks of `hashes[..n]` and returns their ids.
    /// `n` must come from [`match_prefix`](Self::match_prefix) in the same step.
    pub fn take_cached(&mut self, hashes: &[u64], out: &mut Vec<u32>) {
        for h in hashes {
            let Some(&id) = self.cached.get(h) else {
                break;
            };
            self.add_ref(id);
            out.push(id);
        }
    }

    fn add_ref(&mut self, id: u32) {
        if self.blocks[id as usize].in_free {
            self.unlink(id);
        }
        self.blocks[id as usize].refs += 1;
    }

    fn unlink(&mut self, id: u32) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        b.in_free = false;
        self.free -= 1;
    }

    fn push_tail(&mut self, id: u32) {
        let tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
            b.in_free = true;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.free += 1;
    }

    /// Allocates `n` fresh blocks (evicting LRU cached ones), or none if fewer are free.
    pub fn allocate(&mut self, n: u32, out: &mut Vec<u32>) -> bool {
        if n > self.free {
            return false;
        }
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            let b = &mut self.blocks[id as usize];
            b.refs = 1;
            if let Some(h) = b.hash.take() {
                // Another block may have re-registered the same hash since.
                // (One probe: an entry checked and removed in place.)
                if let Entry::Occupied(e) = self.cached.entry(h) {
                    if *e.get() == id {
                        e.remove();
                        if let Some(e) = self.evicted.as_mut() {
                            e.push(h);
                        }
                    }
                }
                self.stats.evictions += 1;
            }
            out.push(id);
        }
        true
    }

    /// Drops one reference on each block; the tail of a sequence is freed first
    /// so that it is evicted first (vLLM frees in reverse order).
    pub fn release(&mut self, ids: &[u32]) {
        for &id in ids.iter().rev() {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.refs > 0, "double free of block {id}");
            b.refs = b.refs.saturating_sub(1);
            if b.refs == 0 {
                if b.hash.is_some() {
                    self.push_tail(id);
                } else {
                    // An uncached block has nothing to offer: reuse it first.
                    self.push_head(id);
                }
            }
        }
    }

    fn push_head(&mut self, id: u32) {
        let head = self.head;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = NIL;
            b.next = head;
            b.in_free = true;
        }
        if head == NIL {
            self.tail = id;
        } else {
            self.blocks[head as usize].prev = id;
        }
        self.head = id;
        self.free += 1;
    }

    /// Registers a now-full block under its content hash (first writer wins,
    /// as in vLLM); whether the cache gained the hash.
    pub fn commit(&mut self, id: u32, hash: u64) -> bool {
        let b = &mut self.blocks[id as usize];
        if b.hash.is_some() {
            return false;
        }
        if let Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(id);
            b.hash = Some(hash);
            return true;
        }
        false
    }

    /// Whether a block is referenced (for tests and invariants).
    pub fn refs(&self, id: u32) -> u32 {
        self.blocks[id as usize].refs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn freed_blocks_stay_cached_until_evicted() {
        let mut p = BlockPool::new(4);
        let mut ids = vec![];
        assert!(p.allocate(2, &mut ids));
        p.commit(ids[0], 10);
        p.commit(ids[1], 11);
        p.release(&ids);
        assert_eq!(p.num_free(), 4);
        assert_eq!(p.match_prefix(&[10, 11, 12]), 2);
        let mut got = vec![];
        p.take_cached(&[10, 11], &mut got);
        assert_eq!(got, ids);
        assert_eq!(p.num_free(), 2);
    }

    #[test]
    fn allocation_evicts_the_least_recently_freed_hash() {
        let mut p = BlockPool::new(3);
        let mut a = vec![];
        let mut b = vec![];
        assert!(p.allocate(1, &mut a));
        assert!(p.allocate(1, &mut b));
        p.commit(a[0], 1);
        p.commit(b[0], 2);
        p.release(&a);
        p.release(&b);
        // One uncached block first, then the oldest cached (hash 1).
        let mut c = vec![];
        assert!(p.allocate(2, &mut c));
        assert_eq!(p.match_prefix(&[1]), 0);
        assert_eq!(p.match_prefix(&[2]), 1);
        assert_eq!(p.stats.evictions, 1);
    }

    #[test]
    fn allocation_fails_whole_when_too_few_are_free() {
        let mut p = BlockPool::new(2);
        let mut ids = vec![];
        assert!(!p.allocate(3, &mut ids));
        assert!(ids.is_empty());
        assert_eq!(p.num_free(), 2);
    }

    proptest! {
        #[test]
        fn free_count_matches_unreferenced_blocks(ops in proptest::collection::vec((0u8..3, 1u32..4), 1..60)) {
            let mut p = BlockPool::new(16);
            let mut held: Vec<Vec<u32>> = vec![];
            let mut next_hash = 0u64;
            for (op, n) in ops {
                match op {
                    0 => { let mut v = vec![]; if p.allocate(n, &mut v) { for &id in &v { next_hash += 1; p.commit(id, next_hash); } held.push(v); } }
                    1 => { if let Some(v) = held.pop() { p.release(&v); } }
                    _ => { let hs: Vec<u64> = (1..=next_hash).collect(); let k = p.match_prefix(&hs); let mut v = vec![]; p.take_cached(&hs[..k], &mut v); held.push(v); }
                }
                let referenced: std::collections::HashSet<u32> = held.iter().flatten().copied().collect();
                prop_assert_eq!(p.num_free() as usize, 16 - referenced.len());
            }
        }
    }
}
