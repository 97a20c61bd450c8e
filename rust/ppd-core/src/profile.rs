//! The calibrated numbers of one engine (hardware × model): step-time model, KV link, pool sizes.
//!
//! A profile is plain data (serde), so the emulator loads it from TOML and the
//! simulator receives it already parsed; nothing here reads files.

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Time of one engine step (one forward pass over the scheduled batch), in ms.
///
/// `t = overhead + per_token·(prefill tokens + decode seqs) + per_seq·seqs
///      + attn·Σ chunk·(ctx_before + chunk/2)/1e6 + decode_ctx·Σ decode context/1e3`
///
/// The attention term is what separates a full prefill (large chunk, quadratic
/// in its own length) from an append-prefill (few new tokens over a cached
/// context): the paper's Figure 2.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepModel {
    /// Fixed cost of a step (weights read once, launch, sampling), ms.
    pub overhead_ms: f64,
    /// Linear compute per scheduled token (prefill token or decode token), ms.
    pub per_token_ms: f64,
    /// Per sequence in the batch (bookkeeping, sampling), ms.
    #[serde(default)]
    pub per_seq_ms: f64,
    /// Extra linear cost of a prefill token over a decode token (prefill is
    /// compute-bound, decode memory-bound), ms.
    #[serde(default)]
    pub prefill_token_ms: f64,
    /// Prefill attention per million (new token × attended key) pairs, ms.
    pub attn_ms_per_mpair: f64,
    /// Decode attention: KV read per thousand context tokens across the decode batch, ms.
    pub decode_ctx_ms_per_ktoken: f64,
}

impl StepModel {
    /// Step time of a batch summarised by [`BatchShape`].
    #[inline]
    pub fn step_ms(&self, b: &BatchShape) -> f64 {
        if b.seqs == 0 {
            return 0.0;
        }
        self.overhead_ms
            + self.per_token_ms * (b.prefill_tokens + b.decode_seqs) as f64
            + self.prefill_token_ms * b.prefill_tokens as f64
            + self.per_seq_ms * b.seqs as f64
            + self.attn_ms_per_mpair * b.prefill_pairs / 1e6
            + self.decode_ctx_ms_per_ktoken * b.decode_ctx_tokens as f64 / 1e3
    }
}

/// What a step's cost depends on; accumulated while scheduling.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BatchShape {
    pub seqs: u32,
    pub prefill_tokens: u64,
    /// Σ over prefill chunks of chunk × (context before it + chunk / 2).
    pub prefill_pairs: f64,
    pub decode_seqs: u64,
    pub decode_ctx_tokens: u64,
}

impl BatchShape {
    #[inline]
    pub fn add_prefill(&mut self, ctx_before: u32, chunk: u32) {
        self.seqs += 1;
        self.prefill_tokens += chunk as u64;
        self.prefill_pairs += chunk as f64 * (ctx_before as f64 + chunk as f64 / 2.0);
    }
    #[inline]
    pub fn add_decode(&mut self, ctx: u32) {
        self.seqs += 1;
        self.decode_seqs += 1;
        self.decode_ctx_tokens += ctx as u64;
    }
}

/// The P→D KV link: per-transfer latency, then the bandwidth shared by all
/// transfers in flight (processor sharing), so transfers queue under load.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkModel {
    /// Effective bandwidth in gigabytes (1e9 B) per second.
    pub gbps: f64,
    /// Fixed cost of one transfer (handshake, metadata, completion notice), ms.
    pub latency_ms: f64,
    /// Move the whole prompt's KV even where D already caches a prefix (P2pNccl,
    /// the paper's connector). `false` pulls only what D lacks (vLLM's NIXL).
    #[serde(default)]
    pub full_prompt_transfer: bool,
    /// P pushes a finished prefill's KV to D inside the step that finishes it
    /// (P2pNccl: a send per layer, and the step waits until its send queue is
    /// empty), so that step takes this much longer per such request, ms.
    /// 0 = the transfer costs P nothing (NIXL: D pulls).
    #[serde(default)]
    pub push_ms: f64,
    /// A D can keep a finished request's KV for a P to read back (vLLM's
    /// NIXL connector with `bidirectional_kv_xfer`), so a later turn may take
    /// the pull path. P2pNccl only pushes P→D: no pull.
    #[serde(default)]
    pub pull: bool,
}

impl LinkModel {
    /// Time of one transfer alone on the link (Equation 2's B/β plus latency).
    pub fn alone_ms(&self, bytes: u64) -> f64 {
        self.latency_ms + bytes as f64 / (self.gbps * 1e6)
    }
}

/// Costs outside the engine: HTTP front end of a node, and the router/harness hops
/// of the simulated cluster (the measured rows include them).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiModel {
    /// Per request on a node before it reaches the scheduler (parse, tokenize), ms.
    pub request_overhead_ms: f64,
    /// Per request forwarded by the router (one hop), ms; the simulator adds it per hop.
    #[serde(default)]
    pub router_hop_ms: f64,
    /// Extra router cost of the local (x = 1) path: the measured PPD proxy spent it
    /// on session lookup and routing before forwarding to the pD, ms (simulator only).
    #[serde(default)]
    pub local_path_extra_ms: f64,
}

/// How the measured rows were produced (the paper's load harness), for the simulator only.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Harness {
    /// Conversations the client keeps in flight; later arrivals wait for a slot
    /// (their Turn-1 TTFT includes the wait). 0 = unbounded.
    #[serde(default)]
    pub max_conversations: u32,
    /// Whether a turn's re-rendered history hits the cache for the previous
    /// answer (true with the emulator's tokenizer; the measured client's did not).
    #[serde(default = "yes")]
    pub answer_prefix_hit: bool,
    /// Share of Turn 2+ requests that the measured proxy took for new conversations
    /// (0–1). It keys a conversation by the prompt's first `User:`…`Assistant:` span,
    /// or by its first 200 characters when there is none, and the client renders each
    /// turn's new input in one of three formats at random (`User:`, `Question:`,
    /// `<|user|>`): a Turn 2 whose Turn 1 was not a `User:` prompt (2 of 3) but whose
    /// new input is (1 of 3) gets a new key. Such a turn is routed like a Turn 1: a
    /// full prefill on P and a push to a D chosen afresh, even on a pD deployment.
    #[serde(default)]
    pub new_conversation_share: f64,
    /// Whether nodes are chosen as the measured proxy chose them: a new
    /// conversation's P, D (or pD) and R each by Python's `hash()` of its key
    /// modulo the node count — random per proxy process, so a uniform draw
    /// per conversation — and kept for its later turns. Otherwise the
    /// simulated router's own choice: round-robin over P per request and
    /// over D and R per conversation.
    #[serde(default)]
    pub hashed_placement: bool,
}

fn yes() -> bool {
    true
}

impl Default for Harness {
    fn default() -> Self {
        Harness {
            max_conversations: 0,
            answer_prefix_hit: true,
            new_conversation_share: 0.0,
            hashed_placement: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub hardware: String,
    /// Tokens per KV block (vLLM's `--block-size`, 16 on CUDA).
    pub block_size: u32,
    /// Bytes of KV per token (131,072 for Llama-3.1-8B BF16: 32 layers × 8 KV heads × 128 × 2 × 2 B).
    pub kv_bytes_per_token: u64,
    /// KV blocks of the pool (vLLM's `num_gpu_blocks`).
    pub kv_blocks: u32,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    /// Longest prompt + output a request may have (the model's context window).
    pub max_model_len: u32,
    /// How long P holds KV that no D has pulled (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT), s.
    pub kv_lease_s: f64,
    pub step: StepModel,
    pub link: LinkModel,
    pub api: ApiModel,
    #[serde(default)]
    pub harness: Harness,
}

impl Profile {
    /// Checks that every number is usable; errors name the field.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |f: &str, v: f64| {
            Error::Config(format!("profile {}: {f} = {v} is out of range", self.name))
        };
        let nonneg = [
            ("step.overhead_ms", self.step.overhead_ms),
            ("step.per_token_ms", self.step.per_token_ms),
            ("step.per_seq_ms", self.step.per_seq_ms),
            ("step.prefill_token_ms", self.step.prefill_token_ms),
            ("step.attn_ms_per_mpair", self.step.attn_ms_per_mpair),
            (
                "step.decode_ctx_ms_per_ktoken",
                self.step.decode_ctx_ms_per_ktoken,
            ),
            ("link.latency_ms", self.link.latency_ms),
            ("link.push_ms", self.link.push_ms),
            ("api.request_overhead_ms", self.api.request_overhead_ms),
            ("api.router_hop_ms", self.api.router_hop_ms),
            ("api.local_path_extra_ms", self.api.local_path_extra_ms),
            ("kv_lease_s", self.kv_lease_s),
        ];
        for (f, v) in nonneg {
            if !v.is_finite() || v < 0.0 {
                return Err(bad(f, v));
            }
        }
        if !self.link.gbps.is_finite() || self.link.gbps <= 0.0 {
            return Err(bad("link.gbps", self.link.gbps));
        }
        // A step must take time, or a busy engine would never let virtual time advance.
        if self.step.overhead_ms + self.step.per_token_ms <= 0.0 {
            return Err(bad("step.overhead_ms + step.per_token_ms", 0.0));
        }
        for (f, v) in [
            ("block_size", self.block_size),
            ("kv_blocks", self.kv_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ] {
            if v == 0 {
                return Err(bad(f, 0.0));
            }
        }
        if self.kv_bytes_per_token == 0 {
            return Err(bad("kv_bytes_per_token", 0.0));
        }
        let share = self.harness.new_conversation_share;
        if !(0.0..=1.0).contains(&share) {
            return Err(bad("harness.new_conversation_share", share));
        }
        Ok(())
    }

    /// A profile for unit tests: round numbers, small pool.
    pub fn test_profile() -> Profile {
        Profile {
            name: "test".into(),
            model: "test-model".into(),
            hardware: "none".into(),
            block_size: 16,
            kv_bytes_per_token: 131_072,
            kv_blocks: 1024,
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            max_model_len: 16_384,
            kv_lease_s: 60.0,
            step: StepModel {
                overhead_ms: 5.0,
                per_token_ms: 0.05,
                per_seq_ms: 0.01,
                prefill_token_ms: 0.0,
                attn_ms_per_mpair: 5.0,
                decode_ctx_ms_per_ktoken: 0.02,
            },
            link: LinkModel {
                gbps: 10.0,
                latency_ms: 2.0,
                full_prompt_transfer: false,
                push_ms: 0.0,
                pull: true,
            },
            api: ApiModel {
                request_overhead_ms: 1.0,
                router_hop_ms: 1.0,
                local_path_extra_ms: 0.0,
            },
            harness: Harness::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_prefill_costs_far_more_than_append_of_the_same_context() {
        let m = Profile::test_profile().step;
        let mut full = BatchShape::default();
        full.add_prefill(0, 1024);
        let mut append = BatchShape::default();
        append.add_prefill(1008, 16);
        assert!(m.step_ms(&full) > 5.0 * m.step_ms(&append));
    }

    #[test]
    fn an_empty_batch_takes_no_time() {
        assert_eq!(
            Profile::test_profile().step.step_ms(&BatchShape::default()),
            0.0
        );
    }

    #[test]
    fn validation_names_the_bad_field() {
        let mut p = Profile::test_profile();
        p.link.gbps = 0.0;
        let e = p.validate().unwrap_err().to_string();
        assert!(e.contains("link.gbps"), "{e}");
        let mut p = Profile::test_profile();
        p.step.per_token_ms = f64::NAN;
        assert!(p
            .validate()
            .unwrap_err()
            .to_string()
            .contains("per_token_ms"));
        assert!(Profile::test_profile().validate().is_ok());
    }

    #[test]
    fn link_alone_time_is_latency_plus_bytes_over_bandwidth() {
        let l = LinkModel {
            gbps: 25.0,
            latency_ms: 0.0,
            full_prompt_transfer: false,
            push_ms: 0.0,
            pull: false,
        };
        // Paper B.6: 5,115 tokens × 128 KiB over 25 GB/s ≈ 27 ms.
        let t = l.alone_ms(5115 * 131_072);
        assert!((t - 26.8).abs() < 0.5, "{t}");
    }
}
