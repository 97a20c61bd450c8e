//! Which prefix-cache blocks a node holds, rebuilt from its KV events, and how many leading tokens of a prompt they cover.
//!
//! vLLM names a block by a hash seeded per process and configurable in
//! algorithm (`--prefix-caching-hash-algo`, `PYTHONHASHSEED`), so a router
//! cannot recompute the node's own hashes. It does not need to: every
//! `BlockStored` event carries the block's token ids and its parent's hash.
//! The index keys each block by a chained hash of its tokens of its own
//! ([`block_hash`]) and keeps the node's hash only to find parents and removals,
//! as NVIDIA Dynamo's KV router does. A prompt's resident prefix is then the
//! number of its leading full blocks whose chained hashes the node holds —
//! the same block-aligned count vLLM reports as `cached_tokens`.

use ahash::AHashMap;
use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// One KV event of a node, decoded (the node's own block hashes reduced to 64 bits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive full blocks were cached: `hashes[i]` holds
    /// `tokens[i * block_size..(i + 1) * block_size]`, and the first follows
    /// `parent` (`None`: the first block of a prompt).
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u64>,
        block_size: u32,
    },
    /// Blocks were evicted.
    Removed { hashes: Vec<u64> },
    /// The node dropped its whole prefix cache.
    Cleared,
}

/// What applying one event did, for the per-node counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Ok,
    /// A stored block whose parent the index never saw (an event was missed,
    /// or the subscription started mid-stream): it cannot be placed in a chain.
    OrphanParent,
    /// The event's token count does not fit its blocks (e.g. a partial block).
    BadShape,
    Cleared,
}

/// Seed of [`block_hash`] ("ppd_kv"; any fixed value).
const SEED: u64 = 0x7070_645f_6b76;

/// The chained hash of a block: its parent's chained hash and its tokens.
pub fn block_hash(parent: u64, tokens: &[u64]) -> u64 {
    hash_into(&mut Vec::with_capacity(4 * tokens.len()), parent, tokens)
}

/// [`block_hash`] over a reused buffer, in two steps: the block's tokens are
/// hashed on their own, then that hash is chained to the parent's by a
/// cheap mixing step. Only the short second step depends on the previous
/// block, so the CPU hashes consecutive blocks in parallel instead of
/// waiting on each parent (bench/results/core.md has the lookup's time);
/// hashing is most of a lookup's cost. A token goes in as 4 bytes (its two
/// halves folded): exact for every tokenizer's ids, which fit in 32 bits.
#[inline]
fn hash_into(buf: &mut Vec<u8>, parent: u64, tokens: &[u64]) -> u64 {
    buf.resize(4 * tokens.len(), 0);
    for (dst, &t) in buf.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&((t as u32) ^ ((t >> 32) as u32)).to_le_bytes());
    }
    let content = xxh3_64_with_seed(buf, SEED);
    chain_step(parent, content)
}

/// Joins a block's content hash to its parent's chained hash: two multiplies
/// (murmur3's finalizer, a bijection, over content xor a scrambled parent),
/// cheaper than a second xxh3 call on the path every lookup waits on.
#[inline]
fn chain_step(parent: u64, content: u64) -> u64 {
    let mut x = content ^ parent.rotate_left(29).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Members of `present` are already hashes: use them as they are.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 keys")
    }
    fn write_u64(&mut self, h: u64) {
        self.0 = h;
    }
}

/// One node's cached blocks (bytes per block: see [`BlockIndex::BYTES_PER_BLOCK`]).
#[derive(Debug, Default, Clone)]
pub struct BlockIndex {
    /// The node's block hash → our chained hash of the same block.
    by_node_hash: AHashMap<u64, u64>,
    /// Our chained hashes present: the set a lookup probes, 8 bytes a block
    /// so that a large node's set stays in a core's cache.
    present: HashSet<u64, BuildHasherDefault<Prehashed>>,
    /// How many more node hashes name a present block than one (a node can
    /// hold the same content twice, e.g. in two KV-cache groups; rare).
    also_named: AHashMap<u64, u32>,
    block_size: u32,
}

impl BlockIndex {
    /// Memory of one cached block in the index: a 16-byte map entry and an
    /// 8-byte set entry at the tables' load factor, with control bytes
    /// (`examples/residency_rss.rs` measures it; bench/results/core.md).
    pub const BYTES_PER_BLOCK: usize = 56;

    /// The block size of the node's events (0 until the first `Stored`).
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.by_node_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_node_hash.is_empty()
    }

    /// Applies one event.
    pub fn apply(&mut self, event: &KvEvent) -> Applied {
        match event {
            KvEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
            } => self.store(hashes, *parent, tokens, *block_size),
            KvEvent::Removed { hashes } => {
                for h in hashes {
                    self.remove(*h);
                }
                Applied::Ok
            }
            KvEvent::Cleared => {
                self.by_node_hash.clear();
                self.present.clear();
                self.also_named.clear();
                Applied::Cleared
            }
        }
    }

    fn store(&mut self, hashes: &[u64], parent: Option<u64>, tokens: &[u64], bs: u32) -> Applied {
        if bs == 0 || tokens.len() != hashes.len() * bs as usize {
            return Applied::BadShape;
        }
        let mut ours = match parent {
            None => 0,
            Some(p) => match self.by_node_hash.get(&p) {
                Some(&h) => h,
                None => return Applied::OrphanParent,
            },
        };
        self.block_size = bs;
        let mut buf = Vec::with_capacity(8 + 4 * bs as usize);
        for (node_hash, block) in hashes.iter().zip(tokens.chunks_exact(bs as usize)) {
            ours = hash_into(&mut buf, ours, block);
            // vLLM re-announces blocks a request reused from the cache: idempotent.
            if self.by_node_hash.insert(*node_hash, ours).is_none() && !self.present.insert(ours) {
                *self.also_named.entry(ours).or_insert(0) += 1;
            }
        }
        Applied::Ok
    }

    fn remove(&mut self, node_hash: u64) {
        let Some(ours) = self.by_node_hash.remove(&node_hash) else {
            return;
        };
        match self.also_named.get_mut(&ours) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.also_named.remove(&ours);
            }
            None => {
                self.present.remove(&ours);
            }
        }
    }

    /// Leading blocks of `chain` (chained hashes at this node's block size) held here.
    pub fn leading_blocks(&self, chain: &[u64]) -> usize {
        chain
            .iter()
            .take_while(|h| self.present.contains(h))
            .count()
    }

    /// Leading tokens of `tokens` this node holds, block-aligned (what vLLM
    /// would report as `cached_tokens` if the prompt came now). A prompt that
    /// is entirely cached still recomputes its last token, as vLLM does.
    /// Blocks are chained only up to the first one the node lacks; `buf` is
    /// the hashing buffer, kept by the caller across calls.
    pub fn cached_prefix_tokens(&self, tokens: &[u64], buf: &mut Vec<u8>) -> u32 {
        if self.block_size == 0 {
            return 0;
        }
        let bs = self.block_size as usize;
        // vLLM caps a hit at all tokens but the last (it must compute one to sample).
        let max_blocks = tokens.len().saturating_sub(1) / bs;
        // Hash a group of blocks, then look the group up: the lookups (cache
        // misses in a large index) overlap instead of waiting on each hash,
        // and a miss ends the walk after at most one group.
        const GROUP: usize = 32;
        let mut group = [0u64; GROUP];
        let mut parent = 0u64;
        let mut blocks = 0;
        for chunk in tokens[..max_blocks * bs].chunks(GROUP * bs) {
            let n = chunk.len() / bs;
            for (slot, block) in group.iter_mut().zip(chunk.chunks_exact(bs)) {
                parent = hash_into(buf, parent, block);
                *slot = parent;
            }
            let held = self.leading_blocks(&group[..n]);
            blocks += held;
            if held < n {
                break;
            }
        }
        u32::try_from(blocks * bs).unwrap_or(u32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stored(idx: &mut BlockIndex, node: &[u64], parent: Option<u64>, toks: &[u64], bs: u32) {
        let e = KvEvent::Stored {
            hashes: node.to_vec(),
            parent,
            tokens: toks.to_vec(),
            block_size: bs,
        };
        assert_eq!(idx.apply(&e), Applied::Ok);
    }

    #[test]
    fn a_prompt_matches_the_full_blocks_the_node_stored() {
        let mut idx = BlockIndex::default();
        let toks: Vec<u64> = (0..10).collect();
        stored(&mut idx, &[100, 101], None, &toks[..8], 4);
        let mut s = vec![];
        // 10 tokens: two full blocks cached, the partial third never is.
        assert_eq!(idx.cached_prefix_tokens(&toks, &mut s), 8);
        // A prompt that diverges in the second block keeps only the first.
        let mut other = toks.clone();
        other[5] = 99;
        assert_eq!(idx.cached_prefix_tokens(&other, &mut s), 4);
        // Divergence in the first token: nothing.
        other[0] = 98;
        assert_eq!(idx.cached_prefix_tokens(&other, &mut s), 0);
    }

    #[test]
    fn a_chain_continues_across_events_through_the_parent_hash() {
        let mut idx = BlockIndex::default();
        let toks: Vec<u64> = (0..13).collect();
        stored(&mut idx, &[7], None, &toks[..4], 4);
        stored(&mut idx, &[8, 9], Some(7), &toks[4..12], 4);
        let mut s = vec![];
        assert_eq!(idx.cached_prefix_tokens(&toks, &mut s), 12);
        assert_eq!(idx.len(), 3);
    }

    #[test]
    fn a_fully_cached_prompt_still_computes_its_last_block() {
        let mut idx = BlockIndex::default();
        let toks: Vec<u64> = (0..8).collect();
        stored(&mut idx, &[1, 2], None, &toks, 4);
        assert_eq!(idx.cached_prefix_tokens(&toks, &mut vec![]), 4);
    }

    #[test]
    fn removal_and_clear_drop_blocks() {
        let mut idx = BlockIndex::default();
        let toks: Vec<u64> = (0..12).collect();
        stored(&mut idx, &[1, 2, 3], None, &toks, 4);
        let mut probe = toks.clone();
        probe.push(0);
        assert_eq!(
            idx.apply(&KvEvent::Removed { hashes: vec![2] }),
            Applied::Ok
        );
        assert_eq!(idx.cached_prefix_tokens(&probe, &mut vec![]), 4);
        assert_eq!(idx.apply(&KvEvent::Cleared), Applied::Cleared);
        assert!(idx.is_empty());
        assert_eq!(idx.cached_prefix_tokens(&probe, &mut vec![]), 0);
        // Removing what is not there is harmless.
        idx.apply(&KvEvent::Removed { hashes: vec![42] });
    }

    #[test]
    fn an_orphan_or_misshapen_event_changes_nothing() {
        let mut idx = BlockIndex::default();
        let e = KvEvent::Stored {
            hashes: vec![5],
            parent: Some(4),
            tokens: vec![1, 2, 3, 4],
            block_size: 4,
        };
        assert_eq!(idx.apply(&e), Applied::OrphanParent);
        let e = KvEvent::Stored {
            hashes: vec![5],
            parent: None,
            tokens: vec![1, 2],
            block_size: 4,
        };
        assert_eq!(idx.apply(&e), Applied::BadShape);
        assert!(idx.is_empty());
    }

    #[test]
    fn re_announced_blocks_are_counted_once() {
        let mut idx = BlockIndex::default();
        let toks: Vec<u64> = (0..4).collect();
        stored(&mut idx, &[1], None, &toks, 4);
        stored(&mut idx, &[1], None, &toks, 4);
        idx.apply(&KvEvent::Removed { hashes: vec![1] });
        assert!(idx.is_empty());
        assert_eq!(idx.leading_blocks(&[block_hash(0, &toks)]), 0);
    }

    #[test]
    fn content_named_twice_stays_until_both_names_go() {
        let mut idx = BlockIndex::default();
        let toks: Vec<u64> = (0..4).collect();
        stored(&mut idx, &[1], None, &toks, 4);
        stored(&mut idx, &[2], None, &toks, 4);
        let chain = [block_hash(0, &toks)];
        idx.apply(&KvEvent::Removed { hashes: vec![1] });
        assert_eq!(idx.leading_blocks(&chain), 1, "still named by 2");
        idx.apply(&KvEvent::Removed { hashes: vec![2] });
        assert_eq!(idx.leading_blocks(&chain), 0);
        stored(&mut idx, &[3], None, &toks, 4);
        assert_eq!(idx.leading_blocks(&chain), 1, "named again after both went");
    }

    proptest! {
        // Whatever the split of a prompt into events, the index covers
        // exactly its full blocks, and a prompt extending it matches them all.
        #[test]
        fn any_event_split_gives_the_same_residency(
            n in 1usize..80, bs in 1u32..9, cuts in proptest::collection::vec(0usize..20, 0..6),
        ) {
            let toks: Vec<u64> = (0..n as u64).map(|t| t * 31 + 7).collect();
            let blocks = n / bs as usize;
            let mut idx = BlockIndex::default();
            let mut start = 0usize;
            let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (blocks + 1)).collect();
            bounds.push(blocks);
            bounds.sort_unstable();
            for end in bounds {
                if end <= start { continue; }
                let hashes: Vec<u64> = (start..end).map(|b| 1000 + b as u64).collect();
                let parent = (start > 0).then(|| 1000 + start as u64 - 1);
                let e = KvEvent::Stored {
                    hashes,
                    parent,
                    tokens: toks[start * bs as usize..end * bs as usize].to_vec(),
                    block_size: bs,
                };
                prop_assert_eq!(idx.apply(&e), Applied::Ok);
                start = end;
            }
            prop_assert_eq!(idx.len(), blocks);
            let mut longer = toks.clone();
            longer.push(1);
            prop_assert_eq!(idx.cached_prefix_tokens(&longer, &mut vec![]) as usize, blocks * bs as usize);
        }
    }
}
