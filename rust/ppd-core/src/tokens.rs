//! Token counting: the "word rule" shared with the emulator, or a real `tokenizer.json`.
//!
//! The word rule: a token is a maximal run of alphanumeric characters, or any
//! single other non-whitespace character; whitespace is no token. The emulator
//! tokenizes with the same rule, so the router's estimate is exact against it.
//!
//! A chat prompt is rendered like Llama-3's template: one begin-of-text token,
//! then per message a 3-token header (start, role, end) and an end-of-turn
//! token around its content, then a 3-token header for the assistant's answer.

/// Tokens a rendered prompt carries before the first message (begin-of-text).
pub const PROMPT_PREFIX_TOKENS: u32 = 1;
/// Template tokens around each message's content (3-token header + end of turn).
pub const MESSAGE_OVERHEAD_TOKENS: u32 = 4;
/// Template tokens that open the assistant's answer (the generation prompt).
pub const GENERATION_PROMPT_TOKENS: u32 = 3;

/// Counts the tokens of a piece of text.
pub trait TokenCounter: Send + Sync {
    fn count(&self, text: &str) -> u32;
    /// A short name for logs and stats, e.g. `word-rule` or `tokenizer.json`.
    fn name(&self) -> &str;
}

/// The emulator's tokenizer rule (see the module doc); O(bytes), no allocation.
#[derive(Debug, Default, Clone, Copy)]
pub struct WordRule;

impl TokenCounter for WordRule {
    fn count(&self, text: &str) -> u32 {
        word_rule_count(text)
    }
    fn name(&self) -> &str {
        "word-rule"
    }
}

/// Counts tokens under the word rule.
pub fn word_rule_count(text: &str) -> u32 {
    let mut count: u32 = 0;
    let mut in_word = false;
    if text.is_ascii() {
        for &b in text.as_bytes() {
            if b.is_ascii_alphanumeric() {
                if !in_word {
                    count = count.saturating_add(1);
                    in_word = true;
                }
            } else {
                in_word = false;
                if !b.is_ascii_whitespace() {
                    count = count.saturating_add(1);
                }
            }
        }
        return count;
    }
    for c in text.chars() {
        if c.is_alphanumeric() {
            if !in_word {
                count = count.saturating_add(1);
                in_word = true;
            }
        } else {
            in_word = false;
            if !c.is_whitespace() {
                count = count.saturating_add(1);
            }
        }
    }
    count
}

/// Splits text into word-rule tokens (the emulator's tokenizer).
pub fn word_rule_tokens(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        let start = rest.find(|c: char| !c.is_whitespace())?;
        rest = &rest[start..];
        let first = rest.chars().next()?;
        let end = if first.is_alphanumeric() {
            rest.find(|c: char| !c.is_alphanumeric())
                .unwrap_or(rest.len())
        } else {
            first.len_utf8()
        };
        let (token, tail) = rest.split_at(end);
        rest = tail;
        Some(token)
    })
}

/// Exact counts from a Hugging Face `tokenizer.json` (the model's own tokenizer).
#[cfg(feature = "hf-tokenizer")]
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
}

#[cfg(feature = "hf-tokenizer")]
impl HfTokenizer {
    pub fn from_file(path: &str) -> Result<Self, crate::error::Error> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| crate::error::Error::Tokenizer(format!("{path}: {e}")))?;
        Ok(Self { inner })
    }
}

#[cfg(feature = "hf-tokenizer")]
impl TokenCounter for HfTokenizer {
    fn count(&self, text: &str) -> u32 {
        // An encoding failure (it has none for valid UTF-8) falls back to the rule
        // rather than reporting zero tokens.
        match self.inner.encode_fast(text, false) {
            Ok(enc) => u32::try_from(enc.len()).unwrap_or(u32::MAX),
            Err(_) => word_rule_count(text),
        }
    }
    fn name(&self) -> &str {
        "tokenizer.json"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_and_punctuation_count_one_each() {
        assert_eq!(word_rule_count("Hello, world!"), 4);
        assert_eq!(word_rule_count("  a  b\tc\n"), 3);
        assert_eq!(word_rule_count(""), 0);
        assert_eq!(word_rule_count("x1y2 3"), 2);
    }

    #[test]
    fn unicode_follows_the_same_rule() {
        assert_eq!(word_rule_count("héllo wörld"), 2);
        assert_eq!(word_rule_count("日本語 — ok"), 3);
    }

    #[test]
    fn splitting_agrees_with_counting() {
        for s in ["Hello, world!", "a-b c", "héllo, 日本 ...", "   ", "x"] {
            assert_eq!(
                word_rule_tokens(s).count() as u32,
                word_rule_count(s),
                "{s:?}"
            );
        }
        let toks: Vec<_> = word_rule_tokens("ab, cd!").collect();
        assert_eq!(toks, vec!["ab", ",", "cd", "!"]);
    }

    #[test]
    fn concatenation_with_a_space_adds_counts() {
        // The prefix property the emulator relies on across turns.
        let a = "turn one text.";
        let b = "and the answer";
        assert_eq!(
            word_rule_count(&format!("{a} {b}")),
            word_rule_count(a) + word_rule_count(b)
        );
    }
}
