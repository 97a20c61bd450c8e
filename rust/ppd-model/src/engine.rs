//! One vLLM-like engine in virtual time: continuous batching under `max_num_seqs`
//! and a token budget with chunked prefill, the prefix-cached block pool,
//! preemption by recompute, the KV link, and P's held KV leases.
//!
//! Pure: the caller passes the time in. The emulator drives it from the wall
//! clock, the simulator from its event queue; both get the same behaviour.

use std::collections::VecDeque;
use std::sync::Arc;

use ahash::AHashMap;

use crate::kv::{BlockPool, PoolStats};
use crate::link::Link;
use crate::profile::{BatchShape, Profile};
use ppd_core::residency::KvEvent;

/// The tokens of a request: explicit token ids (prompt then the output it will
/// generate), or a synthetic conversation whose token `i` depends only on
/// `(key, i)` — so every turn of it is a prefix-extension of the last.
#[derive(Debug, Clone)]
pub enum Content {
    Explicit(Arc<[u64]>),
    Synthetic(u64),
    /// Like `Synthetic`, but blocks from `stable_blocks` on are salted: a client
    /// whose re-rendered history differs from what was generated (so the last
    /// answer misses the cache) is modelled with a salt per turn.
    SyntheticSalted {
        key: u64,
        stable_blocks: u32,
        salt: u64,
    },
}

/// SplitMix64 finaliser: a cheap, well-mixed 64-bit hash.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Content {
    /// Hash of block `j` given the hash of block `j-1` (`parent`, 0 for the first).
    fn block_hash(&self, j: usize, parent: u64, block_size: usize) -> u64 {
        match self {
            Content::Synthetic(key) => mix64(key ^ mix64(j as u64 + 1)),
            Content::SyntheticSalted {
                key,
                stable_blocks,
                salt,
            } => {
                let k = if (j as u32) < *stable_blocks {
                    *key
                } else {
                    key ^ mix64(*salt)
                };
                mix64(k ^ mix64(j as u64 + 1))
            }
            Content::Explicit(toks) => {
                let mut h = mix64(parent ^ 0x5bd1_e995);
                for &t in &toks[j * block_size..(j + 1) * block_size] {
                    h = mix64(h ^ t);
                }
                h
            }
        }
    }
    /// The tokens of block `j`, when the content has real tokens (not synthetic).
    fn block_tokens(&self, j: usize, block_size: usize) -> Option<&[u64]> {
        match self {
            Content::Explicit(toks) => toks.get(j * block_size..(j + 1) * block_size),
            Content::Synthetic(_) | Content::SyntheticSalted { .. } => None,
        }
    }
    fn len_available(&self) -> usize {
        match self {
            Content::Synthetic(_) | Content::SyntheticSalted { .. } => usize::MAX,
            Content::Explicit(t) => t.len(),
        }
    }
}

/// How a request relates to the KV connector (vLLM's `kv_transfer_params`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A plain request: computed here with this node's prefix cache.
    Local,
    /// `do_remote_decode`: prefill here, then hold the KV for a D to pull.
    RemoteDecode,
    /// `do_remote_prefill`: pull the prompt's KV over the link, then decode here.
    RemotePrefill,
}

#[derive(Debug, Clone)]
pub struct Submit {
    pub id: u64,
    pub content: Content,
    pub prompt_len: u32,
    pub max_tokens: u32,
    pub kind: Kind,
    /// Leading prompt tokens whose KV a remote engine holds and this one pulls
    /// before computing the rest (vLLM's bidirectional NIXL: P reads the
    /// conversation's KV from D); 0 for none.
    pub remote_prefix: u32,
    /// Keep the finished request's blocks this long (ms) for a later pull
    /// (vLLM's `decoder_kv_blocks_ttl` on a bidirectional D); `None`: free them.
    pub pin_ms: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// Reached `max_tokens` (vLLM's `length`).
    Length,
    Aborted,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens not computed here: local prefix hits plus KV pulled from P.
    pub cached_tokens: u32,
    /// Of those, tokens whose KV came over the link.
    pub external_tokens: u32,
    pub preemptions: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Output token `index` (0-based) of a request exists at time `t`.
    Token { id: u64, index: u32, t: f64 },
    Finished {
        id: u64,
        t: f64,
        finish: Finish,
        usage: Usage,
    },
    /// A RemotePrefill request's KV has arrived (the caller tells P to free it).
    TransferDone { id: u64, t: f64 },
    /// P's held KV of a request expired unpulled.
    LeaseExpired { id: u64, t: f64 },
}

/// Why a request was refused at submission (vLLM answers these with 400).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    #[error("This model's maximum context length is {max} tokens. However, you requested {total} tokens ({prompt} in the messages, {out} in the completion). Please reduce the length of the messages or completion.")]
    TooLong {
        max: u32,
        total: u64,
        prompt: u32,
        out: u32,
    },
    #[error("the request needs {need} KV blocks but the pool has only {have}")]
    TooLargeForPool { need: u64, have: u32 },
    #[error("prompt must have at least one token")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    NoOutput,
    #[error("request id {0} is already in use")]
    DuplicateId(u64),
    #[error("explicit content has {have} tokens but prompt + max_tokens needs {need}")]
    ShortContent { have: usize, need: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The slot holds no request.
    Free,
    Waiting,
    WaitingRemote,
    Running,
}

/// What every step reads and writes of a request, in an array of its own
/// (`Engine::hot`, by slot): a thousand-node simulation's nodes cannot keep
/// their state cached between their steps, and 28 bytes per sequence side by
/// side cost a step far fewer cache misses than the whole request would.
#[derive(Debug, Clone, Copy)]
struct Hot {
    prompt_len: u32,
    max_out: u32,
    computed: u32,
    out: u32,
    /// Leading blocks registered in the prefix cache.
    committed: u32,
    /// `Seq::blocks.len()`, kept beside the counters it is compared with.
    n_blocks: u32,
    kind: Kind,
    state: State,
}

impl Hot {
    fn num_tokens(&self) -> u32 {
        self.prompt_len + self.out
    }
}

/// The rest of a request: what only admission, a block boundary or the end touches.
#[derive(Debug)]
struct Seq {
    id: u64,
    first_scheduled: bool,
    blocks: Vec<u32>,
    hashes: Vec<u64>,
    content: Content,
    usage: Usage,
    remote_prefix: u32,
    pin_ms: Option<f64>,
    /// Tokens computed once the KV being pulled has arrived.
    pull_to: u32,
}

impl Seq {
    /// Adds blocks, keeping `hot.n_blocks` in step.
    fn add_blocks(&mut self, hot: &mut Hot, ids: &[u32]) {
        self.blocks.extend_from_slice(ids);
        hot.n_blocks = self.blocks.len() as u32;
    }
    /// Hashes of the first `n` blocks, computing any not yet known.
    fn ensure_hashes(&mut self, n: usize, bs: usize) {
        while self.hashes.len() < n {
            let j = self.hashes.len();
            // Only explicit tokens chain on the parent: a synthetic block's hash
            // reads nothing back (a cache miss per block boundary at 1,000 nodes).
            let parent = match (&self.content, j) {
                (Content::Explicit(_), 1..) => self.hashes[j - 1],
                _ => 0,
            };
            let h = self.content.block_hash(j, parent, bs);
            self.hashes.push(h);
        }
    }
}

/// Counters the node exports as vLLM metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    pub steps: u64,
    pub busy_ms: f64,
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub finished: u64,
    pub external_queries: u64,
    pub external_hits: u64,
    pub transfers: u64,
    pub transfer_bytes: u64,
    pub leases_expired: u64,
    /// Prompt tokens by where their KV came from, counted when a request is
    /// first scheduled (vLLM's `prompt_tokens_by_source`).
    pub prompt_local_compute: u64,
    pub prompt_local_cache_hit: u64,
    pub prompt_external: u64,
}

/// A snapshot for `/metrics` and for routing (load).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    pub waiting_remote: usize,
    pub kv_usage: f64,
    pub held: usize,
    pub pool: PoolStats,
    pub stats: EngineStats,
}

/// The KV of a finished request kept for another engine to pull: P's for a
/// `RemoteDecode` request (its lease), or D's pin for a later turn's pull.
#[derive(Debug, Clone)]
pub struct Hold {
    pub blocks: Vec<u32>,
    pub tokens: u32,
    pub expires: f64,
}

struct InFlight {
    end: f64,
    items: Vec<(usize, u32)>,
}

pub struct Engine {
    bs: u32,
    kv_bytes: u64,
    max_seqs: usize,
    budget: u32,
    max_model_len: u32,
    lease_ms: f64,
    full_transfer: bool,
    /// P2pNccl-style push of a finished prefill's KV inside P's step, ms.
    push_ms: f64,
    step_model: crate::profile::StepModel,
    emit_tokens: bool,
    pool: BlockPool,
    link: Link,
    link_next: Option<f64>,
    slots: Vec<Option<Seq>>,
    /// The per-step fields of the request in each slot (stale in a free slot).
    hot: Vec<Hot>,
    free_slots: Vec<usize>,
    by_id: AHashMap<u64, usize>,
    running: Vec<usize>,
    waiting: VecDeque<usize>,
    n_waiting_remote: usize,
    holds: AHashMap<u64, Hold>,
    lease_queue: VecDeque<(f64, u64)>,
    step: Option<InFlight>,
    now: f64,
    stats: EngineStats,
    scratch: Vec<u64>,
    /// The last finished step's item list, reused (a step is scheduled
    /// millions of times in a large simulation).
    spare_items: Vec<(usize, u32)>,
    /// Scratch for a step's new blocks and its finished slots, reused.
    spare_alloc: Vec<u32>,
    spare_finished: Vec<usize>,
    /// KV events not yet taken by the node's publisher (`None`: not published).
    kv_events: Option<Vec<KvEvent>>,
}

/// Registers `seq`'s blocks up to `full` in the prefix cache; with events on,
/// records the evictions before them and one `Stored` per run of new blocks,
/// in the order vLLM's block pool emits them.
fn commit_full(
    seq: &mut Seq,
    hot: &mut Hot,
    pool: &mut BlockPool,
    events: &mut Option<Vec<KvEvent>>,
    full: usize,
    bs: usize,
) {
    seq.ensure_hashes(full, bs);
    let from = hot.committed as usize;
    hot.committed = full as u32;
    let Some(events) = events.as_mut() else {
        for j in from..full {
            pool.commit(seq.blocks[j], seq.hashes[j]);
        }
        return;
    };
    flush_evictions(pool, events);
    let mut run: Option<(usize, Vec<u64>, Vec<u64>)> = None;
    for j in from..full {
        let new = pool.commit(seq.blocks[j], seq.hashes[j]);
        let tokens = seq.content.block_tokens(j, bs).filter(|_| new);
        match (tokens, run.as_mut()) {
            (Some(t), Some((_, hashes, toks))) => {
                hashes.push(seq.hashes[j]);
                toks.extend_from_slice(t);
            }
            (Some(t), None) => run = Some((j, vec![seq.hashes[j]], t.to_vec())),
            (None, _) => push_run(events, run.take(), &seq.hashes, bs),
        }
    }
    push_run(events, run, &seq.hashes, bs);
}

/// Prefetches the cache lines of `len` bytes from `p` (a no-op off x86-64).
#[inline]
fn prefetch_bytes(p: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..len).step_by(64) {
        // SAFETY: a prefetch is a hint that never faults, whatever the address;
        // `_mm_prefetch` is unsafe only for its target feature (SSE, which every
        // x86-64 has).
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                p.wrapping_add(off).cast(),
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
}

fn push_run(
    events: &mut Vec<KvEvent>,
    run: Option<(usize, Vec<u64>, Vec<u64>)>,
    all: &[u64],
    bs: usize,
) {
    if let Some((first, hashes, tokens)) = run {
        events.push(KvEvent::Stored {
            hashes,
            parent: first.checked_sub(1).map(|p| all[p]),
            tokens,
            block_size: bs as u32,
        });
    }
}

fn flush_evictions(pool: &mut BlockPool, events: &mut Vec<KvEvent>) {
    let mut gone = Vec::new();
    pool.take_evicted(&mut gone);
    if !gone.is_empty() {
        events.push(KvEvent::Removed { hashes: gone });
    }
}

impl Engine {
    /// An engine with the profile's pool and limits; `emit_tokens` = false skips
    /// per-token events (the simulator needs only first token and finish).
    pub fn new(p: &Profile, emit_tokens: bool) -> Engine {
        Engine {
            bs: p.block_size.max(1),
            kv_bytes: p.kv_bytes_per_token,
            max_seqs: p.max_num_seqs.max(1) as usize,
            budget: p.max_num_batched_tokens.max(1),
            max_model_len: p.max_model_len,
            lease_ms: p.kv_lease_s * 1000.0,
            full_transfer: p.link.full_prompt_transfer,
            push_ms: p.link.push_ms,
            step_model: p.step,
            emit_tokens,
            pool: BlockPool::new(p.kv_blocks),
            link: Link::new(p.link),
            link_next: None,
            slots: Vec::new(),
            hot: Vec::new(),
            free_slots: Vec::new(),
            by_id: AHashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            n_waiting_remote: 0,
            holds: AHashMap::new(),
            lease_queue: VecDeque::new(),
            step: None,
            now: 0.0,
            stats: EngineStats::default(),
            scratch: Vec::new(),
            spare_items: Vec::new(),
            spare_alloc: Vec::new(),
            spare_finished: Vec::new(),
            kv_events: None,
        }
    }

    /// Records KV events (vLLM's `BlockStored` / `BlockRemoved`) for a publisher.
    pub fn enable_kv_events(&mut self) {
        self.pool.record_evictions();
        self.kv_events.get_or_insert_with(Vec::new);
    }

    /// The KV events since the last call, in order.
    pub fn take_kv_events(&mut self, out: &mut Vec<KvEvent>) {
        if let Some(events) = self.kv_events.as_mut() {
            flush_evictions(&mut self.pool, events);
            out.append(events);
        }
    }

    pub fn now(&self) -> f64 {
        self.now
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            running: self.running.len(),
            waiting: self.waiting.len(),
            waiting_remote: self.n_waiting_remote,
            kv_usage: self.pool.usage(),
            held: self.holds.len(),
            pool: self.pool.stats,
            stats: self.stats,
        }
    }

    /// What a router sees of this engine for its cost model: the sequences
    /// decoding, the prompt work queued ahead of a new request, the link, the cache.
    pub fn load_view(&self) -> ppd_core::NodeView {
        let mut v = ppd_core::NodeView {
            waiting: self.waiting.len() as u32,
            link_bytes: self.link.bytes_in_flight(),
            kv_usage: self.pool.usage(),
            token_budget: self.budget,
            ..ppd_core::NodeView::default()
        };
        for &slot in &self.running {
            let seq = &self.hot[slot];
            if seq.computed >= seq.prompt_len {
                v.running += 1;
                v.decode_ctx_tokens += u64::from(seq.computed);
            } else {
                v.queued_prefill_tokens += u64::from(seq.prompt_len - seq.computed);
            }
        }
        for &slot in &self.waiting {
            let seq = &self.hot[slot];
            v.queued_prefill_tokens += u64::from(seq.prompt_len.saturating_sub(seq.computed));
        }
        v
    }

    /// The harmonic mean of the output lengths of the sequences decoding:
    /// the scale of a stall in their mean TPOT (a stall of t ms adds t/n to
    /// the TPOT of a sequence of n tokens). `None` with none decoding.
    pub fn mean_out_harmonic(&self) -> Option<f64> {
        let (mut n, mut inv) = (0u32, 0.0f64);
        for &slot in &self.running {
            let seq = &self.hot[slot];
            if seq.computed >= seq.prompt_len {
                n += 1;
                inv += 1.0 / f64::from(seq.max_out.max(1));
            }
        }
        (n > 0).then(|| f64::from(n) / inv)
    }

    /// The sequences decoding: (request id, tokens produced, tokens asked
    /// for) — how far each is from its end, for a router's deadline term.
    pub fn decoding(&self) -> impl Iterator<Item = (u64, u32, u32)> + '_ {
        self.running.iter().filter_map(|&slot| {
            let hot = &self.hot[slot];
            let seq = self.slots[slot].as_ref()?;
            (hot.computed >= hot.prompt_len).then_some((seq.id, hot.out, hot.max_out))
        })
    }

    /// Leading tokens of `content`'s first `prompt_len` that the prefix cache
    /// holds, capped as vLLM caps a hit (the last prompt token is computed).
    pub fn cached_prefix(&self, content: &Content, prompt_len: u32) -> u32 {
        let bs = self.bs as usize;
        let max_hit = (prompt_len.saturating_sub(1) / self.bs) as usize;
        // Hashed up to the first miss only, and into no list: a router asks this
        // for every Turn 2+.
        let (mut hit, mut parent) = (0, 0);
        while hit < max_hit {
            let h = content.block_hash(hit, parent, bs);
            if !self.pool.is_cached(h) {
                break;
            }
            (hit, parent) = (hit + 1, h);
        }
        hit as u32 * self.bs
    }

    /// Requests in the engine (running, waiting, pulling).
    pub fn in_flight(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_idle(&self) -> bool {
        self.by_id.is_empty() && self.holds.is_empty()
    }

    /// Asks the CPU to start fetching what this engine's next step reads (the
    /// engine, its per-step fields, its running list and step items) while the
    /// caller works on something else: a thousand-node simulation finds none of
    /// it cached. A hint only; nothing is read.
    pub fn prefetch(&self) {
        prefetch_bytes(self as *const Engine as *const u8, size_of::<Engine>());
        prefetch_bytes(self.hot.as_ptr().cast(), size_of_val(&self.hot[..]));
        prefetch_bytes(self.running.as_ptr().cast(), size_of_val(&self.running[..]));
        if let Some(step) = &self.step {
            prefetch_bytes(step.items.as_ptr().cast(), size_of_val(&step.items[..]));
        }
    }

    /// When something next happens without new input: a step ends, a transfer
    /// completes, a lease expires.
    pub fn next_event_time(&self) -> Option<f64> {
        let mut t = f64::INFINITY;
        if let Some(s) = &self.step {
            t = t.min(s.end);
        }
        if let Some(l) = self.link_next {
            t = t.min(l);
        }
        if let Some(&(e, _)) = self.lease_queue.front() {
            t = t.min(e);
        }
        t.is_finite().then_some(t)
    }

    /// Admits a request at `now` (events up to `now` are processed first).
    pub fn submit(
        &mut self,
        now: f64,
        req: Submit,
        ev: &mut Vec<Event>,
    ) -> Result<(), SubmitError> {
        if req.prompt_len == 0 {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(SubmitError::NoOutput);
        }
        let total = req.prompt_len as u64 + req.max_tokens as u64;
        if total > self.max_model_len as u64 {
            return Err(SubmitError::TooLong {
                max: self.max_model_len,
                total,
                prompt: req.prompt_len,
                out: req.max_tokens,
            });
        }
        let need = total.div_ceil(self.bs as u64);
        if need > self.pool.num_blocks() as u64 {
            return Err(SubmitError::TooLargeForPool {
                need,
                have: self.pool.num_blocks(),
            });
        }
        // The last output token's KV is never computed, so it need not exist.
        let need_tokens = total - 1;
        if (req.content.len_available() as u64) < need_tokens {
            return Err(SubmitError::ShortContent {
                have: req.content.len_available(),
                need: need_tokens,
            });
        }
        if self.by_id.contains_key(&req.id) || self.holds.contains_key(&req.id) {
            return Err(SubmitError::DuplicateId(req.id));
        }
        self.advance(now, ev);
        // Room for every block the request can fill: no regrowth per block.
        let max_blocks = (req.prompt_len.saturating_add(req.max_tokens) / self.bs) as usize + 1;
        let hot = Hot {
            prompt_len: req.prompt_len,
            max_out: req.max_tokens,
            computed: 0,
            out: 0,
            committed: 0,
            n_blocks: 0,
            kind: req.kind,
            state: State::Waiting,
        };
        let seq = Seq {
            id: req.id,
            content: req.content,
            blocks: Vec::with_capacity(max_blocks),
            hashes: Vec::with_capacity(max_blocks),
            first_scheduled: false,
            usage: Usage {
                prompt_tokens: req.prompt_len,
                ..Usage::default()
            },
            remote_prefix: req.remote_prefix,
            pin_ms: req.pin_ms,
            pull_to: 0,
        };
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s] = Some(seq);
                self.hot[s] = hot;
                s
            }
            None => {
                self.slots.push(Some(seq));
                self.hot.push(hot);
                self.slots.len() - 1
            }
        };
        self.by_id.insert(req.id, slot);
        self.waiting.push_back(slot);
        if self.step.is_none() {
            self.start_step(self.now, ev);
        }
        Ok(())
    }

    /// Cancels a request (client went away); its blocks return to the pool.
    pub fn abort(&mut self, now: f64, id: u64, ev: &mut Vec<Event>) -> bool {
        self.advance(now, ev);
        let Some(&slot) = self.by_id.get(&id) else {
            return false;
        };
        // A request in the running step is removed from the step's items too.
        if let Some(s) = &mut self.step {
            s.items.retain(|&(x, _)| x != slot);
        }
        self.running.retain(|&x| x != slot);
        self.waiting.retain(|&x| x != slot);
        let state = self.hot[slot].state;
        let seq = self.take(slot);
        if state == State::WaitingRemote {
            self.n_waiting_remote -= 1;
            self.link.cancel(id);
            self.link_next = self.link.next_completion();
        }
        self.pool.release(&seq.blocks);
        ev.push(Event::Finished {
            id,
            t: self.now,
            finish: Finish::Aborted,
            usage: seq.usage,
        });
        true
    }

    /// A D starts pulling the held KV of `id`: the hold is released to it.
    pub fn take_hold(&mut self, now: f64, id: u64, ev: &mut Vec<Event>) -> Option<Hold> {
        self.advance(now, ev);
        let h = self.holds.remove(&id)?;
        self.pool.release(&h.blocks);
        Some(h)
    }

    /// Whether P still holds `id`'s KV (not pulled, not expired).
    pub fn holds(&self, id: u64) -> Option<&Hold> {
        self.holds.get(&id)
    }

    fn take(&mut self, slot: usize) -> Seq {
        let seq = self.slots[slot].take().expect("slot in use");
        self.hot[slot].state = State::Free;
        self.by_id.remove(&seq.id);
        self.free_slots.push(slot);
        seq
    }

    /// Processes everything that happens up to `now`, in time order.
    pub fn advance(&mut self, now: f64, ev: &mut Vec<Event>) {
        loop {
            let t_step = self.step.as_ref().map_or(f64::INFINITY, |s| s.end);
            let t_link = self.link_next.unwrap_or(f64::INFINITY);
            let t_lease = self.lease_queue.front().map_or(f64::INFINITY, |x| x.0);
            let t = t_step.min(t_link).min(t_lease);
            if t > now || !t.is_finite() {
                break;
            }
            self.now = self.now.max(t);
            if t == t_link {
                self.finish_transfers(t, ev);
            } else if t == t_lease {
                self.expire_leases(t, ev);
            } else {
                self.finish_step(t, ev);
            }
            if self.step.is_none() {
                self.start_step(t, ev);
            }
        }
        if now > self.now {
            self.now = now;
        }
        if self.step.is_none() {
            self.start_step(self.now, ev);
        }
    }

    fn expire_leases(&mut self, t: f64, ev: &mut Vec<Event>) {
        while let Some(&(e, id)) = self.lease_queue.front() {
            if e > t {
                break;
            }
            self.lease_queue.pop_front();
            // Entries of pulled holds are stale; only a hold with this expiry counts.
            if self.holds.get(&id).is_some_and(|h| h.expires == e) {
                if let Some(h) = self.holds.remove(&id) {
                    self.pool.release(&h.blocks);
                    self.stats.leases_expired += 1;
                    ev.push(Event::LeaseExpired { id, t });
                }
            }
        }
    }

    fn finish_transfers(&mut self, t: f64, ev: &mut Vec<Event>) {
        let mut done = std::mem::take(&mut self.scratch);
        done.clear();
        self.link.advance(t, &mut done);
        self.link_next = self.link.next_completion();
        for &id in &done {
            let Some(&slot) = self.by_id.get(&id) else {
                continue;
            };
            let bs = self.bs as usize;
            let Some(seq) = self.slots[slot].as_mut() else {
                continue;
            };
            let hot = &mut self.hot[slot];
            hot.state = State::Waiting;
            hot.computed = seq.pull_to;
            // The pulled blocks join D's prefix cache, as vLLM's NIXL consumer does.
            let full = (hot.computed / self.bs) as usize;
            commit_full(seq, hot, &mut self.pool, &mut self.kv_events, full, bs);
            self.n_waiting_remote -= 1;
            self.waiting.push_front(slot);
        }
        ev.extend(done.iter().map(|&id| Event::TransferDone { id, t }));
        self.scratch = done;
    }
}

impl Engine {
    /// Counts a request's prompt by source when it is first scheduled.
    fn count_prompt_sources(&mut self, prompt_len: u32, local_hit: u32, external: u32) {
        let s = &mut self.stats;
        s.prompt_local_cache_hit += u64::from(local_hit);
        s.prompt_external += u64::from(external);
        s.prompt_local_compute += u64::from(prompt_len.saturating_sub(local_hit + external));
    }

    fn blocks_for(&self, tokens: u32) -> usize {
        tokens.div_ceil(self.bs) as usize
    }

    /// Recompute-preemption, as vLLM V1: blocks freed, progress lost, back to the queue front.
    fn preempt(&mut self, slot: usize) {
        let blocks = {
            let hot = &mut self.hot[slot];
            hot.computed = 0;
            hot.committed = 0;
            hot.state = State::Waiting;
            hot.n_blocks = 0;
            let seq = self.slots[slot].as_mut().expect("scheduled slot in use");
            seq.usage.preemptions += 1;
            std::mem::take(&mut seq.blocks)
        };
        self.pool.release(&blocks);
        self.stats.preemptions += 1;
        self.waiting.push_front(slot);
    }

    fn start_step(&mut self, t: f64, _ev: &mut Vec<Event>) {
        if self.running.is_empty() && self.waiting.is_empty() {
            return;
        }
        let bs = self.bs;
        let mut budget = self.budget;
        let mut items = std::mem::take(&mut self.spare_items);
        items.clear();
        let mut shape = BatchShape::default();
        let mut preempted = false;
        let mut i = 0;
        let mut alloc = std::mem::take(&mut self.spare_alloc);
        while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let (n, need) = {
                let seq = &self.hot[slot];
                let n = (seq.num_tokens() - seq.computed).min(budget);
                let need = self
                    .blocks_for(seq.computed + n)
                    .saturating_sub(seq.n_blocks as usize);
                (n, need)
            };
            let mut self_preempted = false;
            while need as u32 > self.pool.num_free() {
                let last = self.running.len() - 1;
                let victim = self.running[last];
                self.running.truncate(last);
                self.preempt(victim);
                preempted = true;
                if last == i {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                break;
            }
            let hot = &mut self.hot[slot];
            if need > 0 {
                // Only a block boundary reaches past the per-step fields.
                alloc.clear();
                let ok = self.pool.allocate(need as u32, &mut alloc);
                debug_assert!(ok);
                let seq = self.slots[slot].as_mut().expect("running slot");
                seq.add_blocks(hot, &alloc);
            }
            let seq = &*hot;
            if n > 1 || seq.computed < seq.prompt_len {
                shape.add_prefill(seq.computed, n);
            } else {
                shape.add_decode(seq.computed);
            }
            items.push((slot, n));
            budget -= n;
            i += 1;
        }
        // vLLM schedules no new request in a step that had to preempt.
        while !preempted && budget > 0 && self.running.len() < self.max_seqs {
            let Some(&slot) = self.waiting.front() else {
                break;
            };
            let bsz = bs as usize;
            let fresh = self.hot[slot].n_blocks == 0 && self.hot[slot].computed == 0;
            if fresh {
                let (hit_blocks, hit_free, num_tokens, kind, first, remote_prefix) = {
                    let hot = &self.hot[slot];
                    let seq = self.slots[slot].as_mut().expect("waiting slot");
                    let max_hit = ((hot.num_tokens() - 1) / bs) as usize;
                    seq.ensure_hashes(max_hit, bsz);
                    let (hit, hit_free) = self.pool.match_prefix_free(&seq.hashes[..max_hit]);
                    let remote = seq.remote_prefix;
                    (
                        hit,
                        hit_free,
                        hot.num_tokens(),
                        hot.kind,
                        !seq.first_scheduled,
                        remote,
                    )
                };
                let hit_tokens = hit_blocks as u32 * bs;
                let last_prompt = self.hot[slot].prompt_len - 1;
                // Pulled: the whole prompt but its last token (D of a pd turn),
                // or the remote's share of it (P reading D's conversation KV).
                let pull_to = match kind {
                    Kind::RemotePrefill if first => last_prompt,
                    _ if first => remote_prefix.min(last_prompt),
                    _ => 0,
                };
                let external = pull_to.saturating_sub(hit_tokens);
                // P2pNccl-style connectors resend the whole prompt; NIXL pulls the rest only.
                let pull = if kind == Kind::RemotePrefill && first && self.full_transfer {
                    self.hot[slot].prompt_len - 1
                } else {
                    external
                };
                if pull > 0 {
                    let need = self.blocks_for(pull_to) - hit_blocks;
                    // The cached blocks it takes out of the free list count too.
                    if need as u32 + hit_free > self.pool.num_free() {
                        break;
                    }
                    alloc.clear();
                    let seq = self.slots[slot].as_mut().expect("waiting slot");
                    let hot = &mut self.hot[slot];
                    self.pool
                        .take_cached(&seq.hashes[..hit_blocks], &mut seq.blocks);
                    self.pool.allocate(need as u32, &mut alloc);
                    seq.add_blocks(hot, &alloc);
                    hot.committed = hit_blocks as u32;
                    hot.computed = hit_tokens;
                    seq.first_scheduled = true;
                    hot.state = State::WaitingRemote;
                    seq.pull_to = pull_to;
                    seq.usage.cached_tokens = hit_tokens + external;
                    seq.usage.external_tokens = pull;
                    let id = seq.id;
                    let prompt_len = hot.prompt_len;
                    self.count_prompt_sources(prompt_len, hit_tokens, external);
                    self.pool.stats.queries += num_tokens as u64;
                    self.pool.stats.hits += hit_tokens as u64;
                    self.stats.external_queries += pull as u64;
                    self.stats.external_hits += pull as u64;
                    let bytes = pull as u64 * self.kv_bytes;
                    self.stats.transfers += 1;
                    self.stats.transfer_bytes += bytes;
                    self.waiting.pop_front();
                    self.n_waiting_remote += 1;
                    self.link.start(t, id, bytes);
                    self.link_next = self.link.next_completion();
                    continue;
                }
                let n = (num_tokens - hit_tokens).min(budget);
                let need = self.blocks_for(hit_tokens + n) - hit_blocks;
                if need as u32 + hit_free > self.pool.num_free() {
                    break;
                }
                alloc.clear();
                let seq = self.slots[slot].as_mut().expect("waiting slot");
                let hot = &mut self.hot[slot];
                self.pool
                    .take_cached(&seq.hashes[..hit_blocks], &mut seq.blocks);
                self.pool.allocate(need as u32, &mut alloc);
                seq.add_blocks(hot, &alloc);
                hot.committed = hit_blocks as u32;
                hot.computed = hit_tokens;
                let prompt_len = hot.prompt_len;
                if first {
                    seq.usage.cached_tokens = hit_tokens;
                }
                seq.first_scheduled = true;
                if first {
                    self.stats.prompt_tokens += prompt_len as u64;
                    self.count_prompt_sources(prompt_len, hit_tokens, 0);
                }
                self.pool.stats.queries += num_tokens as u64;
                self.pool.stats.hits += hit_tokens as u64;
                shape.add_prefill(hit_tokens, n);
                items.push((slot, n));
                budget -= n;
            } else {
                // Back from a KV pull: its blocks are in place, the last prompt token remains.
                let (n, need) = {
                    let seq = &self.hot[slot];
                    let n = (seq.num_tokens() - seq.computed).min(budget);
                    (
                        n,
                        self.blocks_for(seq.computed + n)
                            .saturating_sub(seq.n_blocks as usize),
                    )
                };
                if need as u32 > self.pool.num_free() {
                    break;
                }
                alloc.clear();
                self.pool.allocate(need as u32, &mut alloc);
                let seq = self.slots[slot].as_mut().expect("waiting slot");
                let hot = &mut self.hot[slot];
                seq.add_blocks(hot, &alloc);
                if !seq.first_scheduled {
                    self.stats.prompt_tokens += hot.prompt_len as u64;
                }
                seq.first_scheduled = true;
                shape.add_prefill(hot.computed, n);
                items.push((slot, n));
                budget -= n;
            }
            self.waiting.pop_front();
            self.hot[slot].state = State::Running;
            self.running.push(slot);
        }
        self.spare_alloc = alloc;
        if items.is_empty() {
            self.spare_items = items;
            return;
        }
        let mut dt = self.step_model.step_ms(&shape);
        if self.push_ms > 0.0 {
            // A RemoteDecode prefill that completes its prompt in this step pushes
            // the prompt's KV to D before the step ends (P2pNccl's wait for sends).
            for &(slot, n) in &items {
                let seq = &self.hot[slot];
                if seq.kind == Kind::RemoteDecode
                    && seq.computed < seq.prompt_len
                    && seq.computed + n >= seq.prompt_len
                {
                    dt += self.push_ms;
                }
            }
        }
        self.stats.steps += 1;
        self.stats.busy_ms += dt;
        self.step = Some(InFlight { end: t + dt, items });
    }

    fn finish_step(&mut self, t: f64, ev: &mut Vec<Event>) {
        let Some(step) = self.step.take() else { return };
        let bs = self.bs;
        let mut finished = std::mem::take(&mut self.spare_finished);
        finished.clear();
        for &(slot, n) in &step.items {
            // A free slot reads `Free`: never in a step's items, but checked as before.
            let hot = &mut self.hot[slot];
            if hot.state != State::Running {
                continue;
            }
            hot.computed += n;
            let full = ((hot.computed / bs) as usize).min(hot.n_blocks as usize);
            // Nothing to register (most decode steps): skip the call, unless
            // a publisher waits for the evictions it flushes.
            if full != hot.committed as usize || self.kv_events.is_some() {
                let seq = self.slots[slot].as_mut().expect("running slot");
                commit_full(
                    seq,
                    hot,
                    &mut self.pool,
                    &mut self.kv_events,
                    full,
                    bs as usize,
                );
            }
            if hot.computed == hot.num_tokens() {
                let index = hot.out;
                hot.out += 1;
                self.stats.generation_tokens += 1;
                if index == 0 || self.emit_tokens {
                    let seq = self.slots[slot].as_ref().expect("running slot");
                    ev.push(Event::Token {
                        id: seq.id,
                        index,
                        t,
                    });
                }
                if hot.out >= hot.max_out {
                    finished.push(slot);
                }
            }
        }
        self.spare_items = step.items;
        if finished.is_empty() {
            self.spare_finished = finished;
            return;
        }
        self.running.retain(|s| !finished.contains(s));
        for &slot in &finished {
            let hot = self.hot[slot];
            let mut seq = self.take(slot);
            seq.usage.completion_tokens = hot.out;
            self.stats.finished += 1;
            // P holds a prefill for its D; a pinning D holds what it computed
            // (all but the last output token) for a later turn's pull.
            let kept = match (hot.kind, seq.pin_ms) {
                (Kind::RemoteDecode, _) => Some((self.lease_ms, hot.prompt_len)),
                (_, Some(ms)) => Some((ms, hot.num_tokens() - 1)),
                _ => None,
            };
            match kept {
                Some((ms, tokens)) => {
                    let expires = t + ms;
                    // Leases and pins may differ in length: keep expiry order.
                    let at = self.lease_queue.partition_point(|&(e, _)| e <= expires);
                    self.lease_queue.insert(at, (expires, seq.id));
                    self.holds.insert(
                        seq.id,
                        Hold {
                            blocks: std::mem::take(&mut seq.blocks),
                            tokens,
                            expires,
                        },
                    );
                }
                None => self.pool.release(&seq.blocks),
            }
            ev.push(Event::Finished {
                id: seq.id,
                t,
                finish: Finish::Length,
                usage: seq.usage,
            });
        }
        self.spare_finished = finished;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(p: &Profile) -> Engine {
        Engine::new(p, true)
    }

    fn run_until_idle(e: &mut Engine, ev: &mut Vec<Event>) {
        let mut guard = 0;
        while let Some(t) = e.next_event_time() {
            e.advance(t, ev);
            guard += 1;
            assert!(guard < 1_000_000, "engine did not settle");
            if e.in_flight() == 0
                && e.next_event_time()
                    .is_none_or(|_| e.holds.is_empty() && e.link.in_flight() == 0)
            {
                break;
            }
        }
    }

    fn req(id: u64, key: u64, prompt: u32, out: u32) -> Submit {
        Submit {
            id,
            content: Content::Synthetic(key),
            prompt_len: prompt,
            max_tokens: out,
            kind: Kind::Local,
            remote_prefix: 0,
            pin_ms: None,
        }
    }

    fn finished(ev: &[Event], id: u64) -> (f64, Usage) {
        ev.iter()
            .find_map(|e| match e {
                Event::Finished {
                    id: i, t, usage, ..
                } if *i == id => Some((*t, *usage)),
                _ => None,
            })
            .expect("request finished")
    }

    fn first_token(ev: &[Event], id: u64) -> f64 {
        ev.iter()
            .find_map(|e| match e {
                Event::Token { id: i, index: 0, t } if *i == id => Some(*t),
                _ => None,
            })
            .expect("first token")
    }

    #[test]
    fn a_request_produces_exactly_max_tokens() {
        let p = Profile::test_profile();
        let mut e = engine(&p);
        let mut ev = vec![];
        e.submit(0.0, req(1, 9, 100, 10), &mut ev).unwrap();
        run_until_idle(&mut e, &mut ev);
        let toks = ev
            .iter()
            .filter(|e| matches!(e, Event::Token { id: 1, .. }))
            .count();
        assert_eq!(toks, 10);
        let (_, u) = finished(&ev, 1);
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            (100, 10, 0)
        );
        assert_eq!(e.snapshot().kv_usage, 0.0, "all blocks back in the pool");
    }

    #[test]
    fn the_next_turn_hits_the_prefix_cache_of_prompt_and_answer() {
        let p = Profile::test_profile();
        let mut e = engine(&p);
        let mut ev = vec![];
        // Turn 1: 100 prompt + 60 out; turn 2 extends the same conversation.
        e.submit(0.0, req(1, 42, 100, 60), &mut ev).unwrap();
        run_until_idle(&mut e, &mut ev);
        let t = e.now() + 10.0;
        e.submit(t, req(2, 42, 100 + 60 + 40, 5), &mut ev).unwrap();
        run_until_idle(&mut e, &mut ev);
        let (_, u) = finished(&ev, 2);
        // Full blocks of the first 159 tokens whose KV exists (the last output token's never does).
        assert_eq!(u.cached_tokens, 144);
        // A different conversation shares nothing.
        e.submit(e.now() + 1.0, req(3, 43, 200, 1), &mut ev)
            .unwrap();
        run_until_idle(&mut e, &mut ev);
        assert_eq!(finished(&ev, 3).1.cached_tokens, 0);
    }

    #[test]
    fn append_prefill_is_faster_than_full_prefill_of_the_same_prompt() {
        let p = Profile::test_profile();
        let mut e = engine(&p);
        let mut ev = vec![];
        e.submit(0.0, req(1, 1, 2000, 2), &mut ev).unwrap();
        run_until_idle(&mut e, &mut ev);
        let t0 = e.now() + 1.0;
        e.submit(t0, req(2, 1, 2050, 1), &mut ev).unwrap();
        run_until_idle(&mut e, &mut ev);
        let append = first_token(&ev, 2) - t0;
        let t1 = e.now() + 1.0;
        e.submit(t1, req(3, 2, 2050, 1), &mut ev).unwrap();
        run_until_idle(&mut e, &mut ev);
        let full = first_token(&ev, 3) - t1;
        assert!(full > 3.0 * append, "full {full} ms vs append {append} ms");
    }

    #[test]
    fn chunked_prefill_splits_a_prompt_over_the_token_budget() {
        let mut p = Profile::test_profile();
        p.max_num_batched_tokens = 512;
        let mut e = engine(&p);
        let mut ev = vec![];
        e.submit(0.0, req(1, 1, 2000, 1), &mut ev).unwrap();
        run_until_idle(&mut e, &mut ev);
        assert_eq!(
            e.snapshot().stats.steps,
            4,
            "2000 tokens in 512-token chunks"
        );
    }

    #[test]
    fn max_num_seqs_bounds_the_running_batch() {
        let mut p = Profile::test_profile();
        p.max_num_seqs = 3;
        let mut e = engine(&p);
        let mut ev = vec![];
        for i in 0..5 {
            e.submit(0.0, req(i, i, 20, 50), &mut ev).unwrap();
        }
        // The first step started with request 0 alone; the next one fills to the limit.
        let t = e.next_event_time().unwrap();
        e.advance(t, &mut ev);
        let s = e.snapshot();
        assert_eq!((s.running, s.waiting), (3, 2));
        run_until_idle(&mut e, &mut ev);
        assert_eq!(e.snapshot().stats.finished, 5);
    }

    #[test]
    fn running_out_of_blocks_preempts_and_still_completes_everything() {
        let mut p = Profile::test_profile();
        p.kv_blocks = 40; // 640 tokens for 4 requests that grow to 300 each
        let mut e = engine(&p);
        let mut ev = vec![];
        for i in 0..4 {
            e.submit(0.0, req(i, i, 100, 200), &mut ev).unwrap();
        }
        run_until_idle(&mut e, &mut ev);
        let s = e.snapshot();
        assert!(
            s.stats.preemptions > 0,
            "the pool is too small for all four"
        );
        assert_eq!(s.stats.finished, 4);
        for i in 0..4 {
            assert_eq!(finished(&ev, i).1.completion_tokens, 200);
        }
        assert!(ev
            .iter()
            .any(|x| matches!(x, Event::Finished { usage, .. } if usage.preemptions > 0)));
    }

    #[test]
    fn remote_decode_holds_blocks_until_pulled_or_expired() {
        let p = Profile::test_profile();
        let mut e = engine(&p);
        let mut ev = vec![];
        let mut r = req(1, 5, 320, 1);
        r.kind = Kind::RemoteDecode;
        e.submit(0.0, r, &mut ev).unwrap();
        let mut r2 = req(2, 6, 320, 1);
        r2.kind = Kind::RemoteDecode;
        e.submit(0.0, r2, &mut ev).unwrap();
        while e.in_flight() > 0 {
            let t = e.next_event_time().unwrap();
            e.advance(t, &mut ev);
        }
        assert_eq!(e.snapshot().held, 2);
        assert!(e.snapshot().kv_usage > 0.0);
        let h = e.take_hold(e.now(), 1, &mut ev).expect("held");
        assert_eq!((h.blocks.len(), h.tokens), (20, 320));
        assert!(
            e.take_hold(e.now(), 1, &mut ev).is_none(),
            "a hold is pulled once"
        );
        // The other expires after the lease.
        e.advance(e.now() + p.kv_lease_s * 1000.0 + 1.0, &mut ev);
        assert!(ev
            .iter()
            .any(|x| matches!(x, Event::LeaseExpired { id: 2, .. })));
        assert_eq!(e.snapshot().kv_usage, 0.0);
    }

    #[test]
    fn a_push_lengthens_the_step_that_finishes_a_prefill_for_d_only() {
        // P2pNccl: P's forward waits for the KV sends of the prefills it completes.
        let done = |push_ms: f64, kind: Kind| {
            let mut p = Profile::test_profile();
            p.link.push_ms = push_ms;
            let mut e = engine(&p);
            let mut ev = vec![];
            let mut r = req(1, 5, 320, 1);
            r.kind = kind;
            e.submit(0.0, r, &mut ev).unwrap();
            while e.in_flight() > 0 {
                let t = e.next_event_time().unwrap();
                e.advance(t, &mut ev);
            }
            finished(&ev, 1).0
        };
        let base = done(0.0, Kind::RemoteDecode);
        assert!((done(25.0, Kind::RemoteDecode) - base - 25.0).abs() < 1e-9);
        assert_eq!(done(25.0, Kind::Local), done(0.0, Kind::Local));
    }

    #[test]
    fn a_pinning_d_holds_what_it_computed_until_pulled_or_its_ttl() {
        let p = Profile::test_profile();
        let mut e = engine(&p);
        let mut ev = vec![];
        let mut r = req(1, 5, 320, 9);
        r.pin_ms = Some(5_000.0);
        e.submit(0.0, r, &mut ev).unwrap();
        let mut r2 = req(2, 6, 320, 9);
        r2.pin_ms = Some(60_000.0);
        e.submit(0.0, r2, &mut ev).unwrap();
        while e.in_flight() > 0 {
            let t = e.next_event_time().unwrap();
            e.advance(t, &mut ev);
        }
        assert_eq!(e.snapshot().held, 2);
        // Prompt and output but the last token, whose KV is never computed.
        assert_eq!(e.holds(1).unwrap().tokens, 320 + 9 - 1);
        // The shorter pin expires first although it was queued after none.
        e.advance(e.now() + 5_001.0, &mut ev);
        assert!(ev
            .iter()
            .any(|x| matches!(x, Event::LeaseExpired { id: 1, .. })));
        assert!(e.holds(2).is_some(), "the longer pin still holds");
        let h = e.take_hold(e.now(), 2, &mut ev).expect("pinned");
        assert_eq!(h.tokens, 328);
        assert_eq!(e.snapshot().held, 0);
        // Released blocks stay in the prefix cache: the next turn hits them.
        e.submit(e.now() + 1.0, req(3, 6, 400, 1), &mut ev).unwrap();
        run_until_idle(&mut e, &mut ev);
        assert!(finished(&ev, 3).1.cached_tokens >= 320);
    }

    #[test]
    fn a_remote_prefix_is_pulled_and_only_the_new_tokens_are_computed() {
        let p = Profile::test_profile();
        let mut e = engine(&p);
        let mut ev = vec![];
        let mut r = req(1, 77, 1700, 1);
        r.kind = Kind::RemoteDecode;
        r.remote_prefix = 1600;
        e.submit(0.0, r, &mut ev).unwrap();
        assert_eq!(e.snapshot().waiting_remote, 1);
        while e.in_flight() > 0 {
            let t = e.next_event_time().unwrap();
            e.advance(t, &mut ev);
        }
        let (_, u) = finished(&ev, 1);
        assert_eq!((u.cached_tokens, u.external_tokens), (1600, 1600));
        let s = e.snapshot().stats;
        assert_eq!(
            (
                s.prompt_local_compute,
                s.prompt_external,
                s.prompt_local_cache_hit
            ),
            (100, 1600, 0)
        );
        // The whole prompt is then held for its D, as any RemoteDecode prefill.
        assert_eq!(e.holds(1).unwrap().tokens, 1700);
        // A prefix no longer than what is cached locally pulls nothing.
        let mut again = req(2, 77, 1700, 1);
        again.kind = Kind::RemoteDecode;
        again.remote_prefix = 1600;
        e.submit(e.now() + 1.0, again, &mut ev).unwrap();
        assert_eq!(e.snapshot().waiting_remote, 0);
    }

    #[test]
    fn remote_prefill_pulls_over_the_link_then_decodes_and_caches_the_prefix() {
        let p = Profile::test_profile();
        let mut d = engine(&p);
        let mut ev = vec![];
        let mut r = req(1, 77, 1601, 4);
        r.kind = Kind::RemotePrefill;
        d.submit(0.0, r, &mut ev).unwrap();
        assert_eq!(d.snapshot().waiting_remote, 1);
        run_until_idle(&mut d, &mut ev);
        let done = ev
            .iter()
            .find_map(|x| match x {
                Event::TransferDone { id: 1, t } => Some(*t),
                _ => None,
            })
            .unwrap();
        // 1600 tokens × 128 KiB at 10 GB/s + 2 ms latency.
        let expect = 2.0 + 1600.0 * 131_072.0 / 1e7;
        assert!((done - expect).abs() < 1e-6, "{done} vs {expect}");
        let (_, u) = finished(&ev, 1);
        assert_eq!((u.cached_tokens, u.external_tokens), (1600, 1600));
        assert!(first_token(&ev, 1) > done);
        // The pulled KV is now D's prefix cache: a local next turn hits it.
        d.submit(d.now() + 1.0, req(2, 77, 1700, 1), &mut ev)
            .unwrap();
        run_until_idle(&mut d, &mut ev);
        assert!(finished(&ev, 2).1.cached_tokens >= 1600);
    }

    #[test]
    fn concurrent_pulls_contend_for_the_link() {
        let p = Profile::test_profile();
        let one = {
            let mut d = engine(&p);
            let mut ev = vec![];
            let mut r = req(1, 1, 1601, 1);
            r.kind = Kind::RemotePrefill;
            d.submit(0.0, r, &mut ev).unwrap();
            run_until_idle(&mut d, &mut ev);
            first_token(&ev, 1)
        };
        let mut d = engine(&p);
        let mut ev = vec![];
        for i in 0..4 {
            let mut r = req(i, 100 + i, 1601, 1);
            r.kind = Kind::RemotePrefill;
            d.submit(0.0, r, &mut ev).unwrap();
        }
        run_until_idle(&mut d, &mut ev);
        let last = (0..4).map(|i| first_token(&ev, i)).fold(0.0, f64::max);
        assert!(
            last > 3.0 * one,
            "4 shared transfers {last} ms vs one alone {one} ms"
        );
    }

    #[test]
    fn bad_submissions_are_refused_with_reasons() {
        let p = Profile::test_profile();
        let mut e = engine(&p);
        let mut ev = vec![];
        assert_eq!(
            e.submit(0.0, req(1, 1, 0, 5), &mut ev),
            Err(SubmitError::EmptyPrompt)
        );
        assert_eq!(
            e.submit(0.0, req(1, 1, 5, 0), &mut ev),
            Err(SubmitError::NoOutput)
        );
        assert!(matches!(
            e.submit(0.0, req(1, 1, 16_000, 1000), &mut ev),
            Err(SubmitError::TooLong { .. })
        ));
        e.submit(0.0, req(1, 1, 5, 5), &mut ev).unwrap();
        assert_eq!(
            e.submit(0.0, req(1, 1, 5, 5), &mut ev),
            Err(SubmitError::DuplicateId(1))
        );
        let short = Submit {
            id: 9,
            content: Content::Explicit(Arc::from(vec![1u64, 2, 3])),
            prompt_len: 3,
            max_tokens: 5,
            kind: Kind::Local,
            remote_prefix: 0,
            pin_ms: None,
        };
        assert!(matches!(
            e.submit(0.0, short, &mut ev),
            Err(SubmitError::ShortContent { .. })
        ));
    }

    #[test]
    fn abort_returns_the_blocks() {
        let p = Profile::test_profile();
        let mut e = engine(&p);
        let mut ev = vec![];
        e.submit(0.0, req(1, 1, 500, 100), &mut ev).unwrap();
        e.advance(50.0, &mut ev);
        assert!(e.abort(50.0, 1, &mut ev));
        run_until_idle(&mut e, &mut ev);
        assert_eq!(e.snapshot().kv_usage, 0.0);
        assert!(ev.iter().any(|x| matches!(
            x,
            Event::Finished {
                id: 1,
                finish: Finish::Aborted,
                ..
            }
        )));
    }

    #[test]
    fn same_inputs_give_the_same_event_stream() {
        let p = Profile::test_profile();
        let run = || {
            let mut e = engine(&p);
            let mut ev = vec![];
            for i in 0..20u64 {
                e.submit(
                    i as f64 * 3.0,
                    req(i, i % 5, 50 + (i as u32 * 37) % 400, 20),
                    &mut ev,
                )
                .unwrap();
            }
            run_until_idle(&mut e, &mut ev);
            ev
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn explicit_tokens_share_blocks_only_on_equal_prefixes() {
        let p = Profile::test_profile();
        let mut e = engine(&p);
        let mut ev = vec![];
        let a: Vec<u64> = (0..100).collect();
        let mut b = a.clone();
        b[40] = 9999; // differs inside block 2
        let s = |id, v: &Vec<u64>| Submit {
            id,
            content: Content::Explicit(Arc::from(v.clone())),
            prompt_len: 90,
            max_tokens: 5,
            kind: Kind::Local,
            remote_prefix: 0,
            pin_ms: None,
        };
        e.submit(0.0, s(1, &a), &mut ev).unwrap();
        run_until_idle(&mut e, &mut ev);
        e.submit(e.now() + 1.0, s(2, &b), &mut ev).unwrap();
        run_until_idle(&mut e, &mut ev);
        assert_eq!(finished(&ev, 2).1.cached_tokens, 32);
    }

    #[test]
    fn kv_events_rebuild_the_prefix_cache_a_router_can_match() {
        // A router applying the node's events predicts the next prompt's hit exactly.
        let p = Profile::test_profile();
        let mut e = engine(&p);
        e.enable_kv_events();
        let mut ev = vec![];
        let a: Vec<u64> = (0..200).map(|t| t * 7 + 1).collect();
        let s = |id, v: &Vec<u64>, n| Submit {
            id,
            content: Content::Explicit(Arc::from(v.clone())),
            prompt_len: n,
            max_tokens: 5,
            kind: Kind::Local,
            remote_prefix: 0,
            pin_ms: None,
        };
        e.submit(0.0, s(1, &a, 150), &mut ev).unwrap();
        run_until_idle(&mut e, &mut ev);
        let mut index = ppd_core::residency::BlockIndex::default();
        let mut events = vec![];
        e.take_kv_events(&mut events);
        assert!(!events.is_empty());
        for x in &events {
            assert_eq!(index.apply(x), ppd_core::residency::Applied::Ok);
        }
        let predicted = index.cached_prefix_tokens(&a[..190], &mut vec![]);
        e.submit(e.now() + 1.0, s(2, &a, 190), &mut ev).unwrap();
        run_until_idle(&mut e, &mut ev);
        assert_eq!(predicted, finished(&ev, 2).1.cached_tokens);
        assert!(predicted > 0);
    }
}
