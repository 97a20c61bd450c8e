//! The emulator's tokenizer and text generator, built on the word rule of [`ppd_core::tokens`].
//!
//! A chat prompt renders as Llama-3's template does, token for token:
//! `<|begin_of_text|>`, then per message `<|start_header_id|> role <|end_header_id|>`
//! and content and `<|eot_id|>`, then the assistant header. Generated text is words
//! that are one token each, joined by single spaces, so turn N's prompt plus
//! its answer is a token prefix of turn N+1's prompt and the prefix cache hits.

use xxhash_rust::xxh3::xxh3_64;

use crate::engine::mix64;
use ppd_core::tokens::{
    word_rule_tokens, GENERATION_PROMPT_TOKENS, MESSAGE_OVERHEAD_TOKENS, PROMPT_PREFIX_TOKENS,
};

/// Ids of the template's special tokens (no word-rule token hashes to these in practice).
pub const BEGIN_OF_TEXT: u64 = 0xF000_0000_0000_0001;
pub const START_HEADER: u64 = 0xF000_0000_0000_0002;
pub const END_HEADER: u64 = 0xF000_0000_0000_0003;
pub const END_OF_TURN: u64 = 0xF000_0000_0000_0004;

/// Id of one word-rule token.
#[inline]
pub fn token_id(token: &str) -> u64 {
    xxh3_64(token.as_bytes())
}

/// Appends the ids of `text`'s word-rule tokens.
pub fn push_text(out: &mut Vec<u64>, text: &str) {
    out.extend(word_rule_tokens(text).map(token_id));
}

fn push_header(out: &mut Vec<u64>, role: &str) {
    out.push(START_HEADER);
    out.push(token_id(role));
    out.push(END_HEADER);
}

/// Token ids of a chat prompt with the generation prompt; `messages` are (role, content).
pub fn render_chat<'a>(messages: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<u64> {
    let mut out = Vec::with_capacity(256);
    out.push(BEGIN_OF_TEXT);
    for (role, content) in messages {
        push_header(&mut out, role);
        push_text(&mut out, content);
        out.push(END_OF_TURN);
    }
    push_header(&mut out, "assistant");
    out
}

/// Token ids of a completions prompt (begin-of-text, then the text).
pub fn render_prompt(text: &str) -> Vec<u64> {
    let mut out = Vec::with_capacity(text.len() / 4 + 2);
    out.push(BEGIN_OF_TEXT);
    push_text(&mut out, text);
    out
}

// Template constants must agree with the router's estimator.
const _: () = assert!(
    PROMPT_PREFIX_TOKENS == 1 && MESSAGE_OVERHEAD_TOKENS == 4 && GENERATION_PROMPT_TOKENS == 3
);

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
    fn chat_prompt_length_matches_the_router_estimate_formula() {
        let msgs = [
            ("system", "Be brief."),
            ("user", "Hello, world! How are you?"),
        ];
        let ids = render_chat(msgs);
        let expect = PROMPT_PREFIX_TOKENS
            + msgs
                .iter()
                .map(|(_, c)| MESSAGE_OVERHEAD_TOKENS + word_rule_count(c))
                .sum::<u32>()
            + GENERATION_PROMPT_TOKENS;
        assert_eq!(ids.len() as u32, expect);
    }

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
