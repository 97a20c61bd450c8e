//! The emulator's tokenizer and text generator, built on the word rule of [`ppd_core::tokens`].
//!
//! A chat prompt renders as Llama-3's template does, token for token:
//! `<|begin_of_text|>`, then per message `<|start_header_id|> role <|end_header_id|>`
//! and content and `<|eot_id|>`, then the assistant header. Generated text is words
//! that are one token each, joined by single spaces, so turn N's prompt plus
//! its answer is a token prefix of turn N+1's prompt and the prefix cache hits.

use crate::engine::mix64;
pub use ppd_core::prompt::{
    push_text, render_chat, render_chat_ending, render_prompt, token_id, ChatEnd, BEGIN_OF_TEXT,
    END_HEADER, END_OF_TURN, START_HEADER,
};

/// Words of the generated text: all alphanumeric, so each is exactly one token.
const VOCAB: [&str; 64] = [
    "the", "model", "answers", "with", "words", "that", "each", "count", "as", "one", "token",
    "and", "a", "cache", "prefix", "keeps", "every", "turn", "cheap", "so", "decode", "runs", "on",
    "its", "node", "while", "prefill", "waits", "for", "batch", "time", "step", "moves", "blocks",
    "between", "nodes", "over", "link", "when", "load", "rises", "router", "picks", "local",
    "path", "or", "sends", "it", "back", "to", "first", "then", "next", "request", "gets",
    "served", "fast", "under", "steady", "traffic", "in", "this", "small", "test",
];

/// The deterministic generator: the answer depends only on the seed and the prompt.
#[derive(Debug, Clone, Copy)]
pub struct Generator {
    seed: u64,
}

impl Generator {
    pub fn new(seed: u64) -> Generator {
        Generator { seed }
    }

    /// A key for a prompt: the answer to the same prompt is the same text.
    pub fn key(&self, prompt: &[u64]) -> u64 {
        prompt.iter().fold(mix64(self.seed), |h, &t| mix64(h ^ t))
    }

    /// Output length when the request sets no limit: 16–255 tokens, then `stop`.
    pub fn natural_len(&self, key: u64) -> u32 {
        16 + (mix64(key ^ 0xA5A5) % 240) as u32
    }

    /// Word `i` of the answer for `key`.
    #[inline]
    pub fn word(&self, key: u64, i: u32) -> &'static str {
        VOCAB[(mix64(key ^ mix64(i as u64 ^ self.seed)) % VOCAB.len() as u64) as usize]
    }

    /// Appends the ids of the first `n` answer tokens to `out`.
    pub fn push_ids(&self, key: u64, n: u32, out: &mut Vec<u64>) {
        out.extend((0..n).map(|i| token_id(self.word(key, i))));
    }

    /// `k` distinct words other than word `i` of the answer for `key`: the
    /// alternatives shown to a client asking for logprobs.
    pub fn alternatives(&self, key: u64, i: u32, k: u32) -> Vec<&'static str> {
        let chosen = self.word(key, i);
        let start = mix64(key ^ mix64(u64::from(i) ^ 0xA17E)) as usize;
        (0..VOCAB.len())
            .map(|j| VOCAB[(start + j) % VOCAB.len()])
            .filter(|w| *w != chosen)
            .take(k as usize)
            .collect()
    }

    /// The text of answer token `i` as streamed: a leading space after the first.
    pub fn piece(&self, key: u64, i: u32) -> String {
        let w = self.word(key, i);
        if i == 0 {
            w.to_owned()
        } else {
            format!(" {w}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ppd_core::tokens::word_rule_count;

    #[test]
    fn next_turn_renders_to_an_extension_of_prompt_plus_answer() {
        let g = Generator::new(7);
        let t1 = render_chat([("user", "Tell me about caches.")]);
        let key = g.key(&t1);
        let answer: String = (0..30).map(|i| g.piece(key, i)).collect();
        let mut seq = t1.clone();
        g.push_ids(key, 30, &mut seq);
        let t2 = render_chat([
            ("user", "Tell me about caches."),
            ("assistant", answer.as_str()),
            ("user", "And more?"),
        ]);
        assert_eq!(&t2[..seq.len()], &seq[..]);
        assert_eq!(
            word_rule_count(&answer),
            30,
            "each generated word is one token"
        );
    }

    #[test]
    fn the_seed_decides_the_text() {
        let p = render_prompt("same prompt");
        let a = Generator::new(1);
        let b = Generator::new(2);
        let text = |g: &Generator| (0..20).map(|i| g.piece(g.key(&p), i)).collect::<String>();
        assert_eq!(text(&a), text(&Generator::new(1)));
        assert_ne!(text(&a), text(&b));
    }
}
