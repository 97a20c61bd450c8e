//! Synthetic logprobs in vLLM's shapes: the emulator has no model to score tokens, but a client
//! asking for logprobs gets the fields, types and counts vLLM gives, with values ≤ 0 and the
//! sampled token always the likeliest (as greedy decoding would make it).

use ppd_model::engine::mix64;
use ppd_model::text::Generator;
use serde_json::{json, Map, Value};

/// One generated token with its logprob and the alternatives asked for (sampled first).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Scored {
    pub token: String,
    pub logprob: f64,
    /// The top tokens, the sampled one first, at most `k` (chat) or `max(k, 1)` (completions).
    pub top: Vec<(String, f64)>,
}

fn unit(x: u64) -> f64 {
    (mix64(x) >> 11) as f64 / (1u64 << 53) as f64
}

/// Token `i` of the answer for `key`, scored with `k` alternatives.
pub(crate) fn score(gen: &Generator, key: u64, i: u32, k: u32) -> Scored {
    let token = gen.piece(key, i);
    let salt = mix64(key ^ mix64(u64::from(i) ^ 0x10C9_9A0B));
    let logprob = -(0.05 + 2.0 * unit(salt));
    let mut top = Vec::with_capacity(k.max(1) as usize);
    top.push((token.clone(), logprob));
    let mut lp = logprob;
    for (r, w) in gen
        .alternatives(key, i, k.saturating_sub(1))
        .into_iter()
        .enumerate()
    {
        lp -= 0.1 + unit(salt ^ (r as u64 + 1));
        top.push((
            if i == 0 {
                w.to_owned()
            } else {
                format!(" {w}")
            },
            lp,
        ));
    }
    Scored {
        token,
        logprob,
        top,
    }
}

/// A choice's (or one chunk's) logprobs as vLLM writes them, built token by token.
#[derive(Debug, Clone, Default)]
pub(crate) struct Logprobs {
    chat: bool,
    /// Alternatives asked for per token.
    k: u32,
    /// Completions: where the next token starts in the choice's text.
    offset: usize,
    tokens: Vec<Scored>,
}

impl Logprobs {
    pub(crate) fn new(chat: bool, k: u32, offset: usize) -> Logprobs {
        Logprobs {
            chat,
            k,
            offset,
            tokens: Vec::new(),
        }
    }

    pub(crate) fn push(&mut self, s: Scored) {
        self.tokens.push(s);
    }

    pub(crate) fn to_json(&self) -> Value {
        if self.chat {
            let entry =
                |t: &str, lp: f64| json!({"token": t, "logprob": lp, "bytes": t.as_bytes()});
            let content: Vec<Value> = self
                .tokens
                .iter()
                .map(|s| {
                    let top: Vec<Value> = s
                        .top
                        .iter()
                        .take(self.k as usize)
                        .map(|(t, lp)| entry(t, *lp))
                        .collect();
                    let mut e = entry(&s.token, s.logprob);
                    e["top_logprobs"] = Value::Array(top);
                    e
                })
                .collect();
            return json!({"content": content});
        }
        let mut offsets = Vec::with_capacity(self.tokens.len());
        let mut at = self.offset;
        for s in &self.tokens {
            offsets.push(at);
            at += s.token.len();
        }
        let top: Vec<Value> = self
            .tokens
            .iter()
            .map(|s| {
                let m: Map<String, Value> = s
                    .top
                    .iter()
                    .take(self.k.max(1) as usize)
                    .map(|(t, lp)| (t.clone(), json!(lp)))
                    .collect();
                Value::Object(m)
            })
            .collect();
        json!({
            "text_offset": offsets,
            "token_logprobs": self.tokens.iter().map(|s| s.logprob).collect::<Vec<_>>(),
            "tokens": self.tokens.iter().map(|s| s.token.as_str()).collect::<Vec<_>>(),
            "top_logprobs": top,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sampled_token_leads_and_every_logprob_is_at_most_zero() {
        let g = Generator::new(3);
        for i in 0..50 {
            let s = score(&g, 99, i, 5);
            assert_eq!(s.token, g.piece(99, i));
            assert_eq!(s.top.len(), 5);
            assert_eq!(s.top[0], (s.token.clone(), s.logprob));
            assert!(s.top.windows(2).all(|w| w[0].1 > w[1].1), "{s:?}");
            assert!(s.top.iter().all(|(_, lp)| *lp <= 0.0));
            let distinct: std::collections::HashSet<_> = s.top.iter().map(|t| &t.0).collect();
            assert_eq!(distinct.len(), 5);
        }
    }

    #[test]
    fn completions_get_four_parallel_lists_with_running_offsets() {
        let g = Generator::new(1);
        let mut lp = Logprobs::new(false, 2, 0);
        for i in 0..3 {
            lp.push(score(&g, 7, i, 2));
        }
        let v = lp.to_json();
        let tokens: Vec<String> = (0..3).map(|i| g.piece(7, i)).collect();
        assert_eq!(v["tokens"], json!(tokens));
        let o0 = tokens[0].len();
        assert_eq!(v["text_offset"], json!([0, o0, o0 + tokens[1].len()]));
        assert_eq!(v["top_logprobs"][1].as_object().unwrap().len(), 2);
        // logprobs: 0 still names the sampled token.
        let mut lp0 = Logprobs::new(false, 0, 10);
        lp0.push(score(&g, 7, 0, 0));
        assert_eq!(
            lp0.to_json()["top_logprobs"][0].as_object().unwrap().len(),
            1
        );
        assert_eq!(lp0.to_json()["text_offset"], json!([10]));
    }

    #[test]
    fn chat_gets_content_entries_with_bytes_and_exactly_k_alternatives() {
        let g = Generator::new(1);
        for k in [0, 1, 3] {
            let mut lp = Logprobs::new(true, k, 0);
            lp.push(score(&g, 5, 1, k));
            let v = lp.to_json();
            let e = &v["content"][0];
            assert_eq!(e["bytes"], json!(e["token"].as_str().unwrap().as_bytes()));
            assert_eq!(e["top_logprobs"].as_array().unwrap().len(), k as usize);
        }
    }
}
