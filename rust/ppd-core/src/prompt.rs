//! The token ids a node computes for a request, rendered as the node renders them, so the router can match them against the node's cached blocks.
//!
//! Two renderers: the emulator's word-rule template (exact against emulated
//! nodes, which render with this very code) and, behind the `hf-tokenizer`
//! feature, a model's own chat template and `tokenizer.json` (exact against
//! vLLM where the template renders the same under minijinja as under Jinja2).

use crate::error::Error;
use crate::request::{ContentText, PromptText, RequestView};
use crate::tokens::{
    word_rule_tokens, GENERATION_PROMPT_TOKENS, MESSAGE_OVERHEAD_TOKENS, PROMPT_PREFIX_TOKENS,
};

/// Ids of the word-rule template's special tokens (no word hashes to these in practice).
pub const BEGIN_OF_TEXT: u64 = 0xF000_0000_0000_0001;
pub const START_HEADER: u64 = 0xF000_0000_0000_0002;
pub const END_HEADER: u64 = 0xF000_0000_0000_0003;
pub const END_OF_TURN: u64 = 0xF000_0000_0000_0004;

// The template's shape is what the router's token estimate assumes.
const _: () = assert!(
    PROMPT_PREFIX_TOKENS == 1 && MESSAGE_OVERHEAD_TOKENS == 4 && GENERATION_PROMPT_TOKENS == 3
);

/// Id of one word-rule token.
#[inline]
pub fn token_id(token: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(token.as_bytes())
}

/// Id of a client-given token id in a word-rule prompt (tagged apart from word hashes).
#[inline]
pub fn given_token_id(id: u32) -> u64 {
    (1u64 << 62) | u64::from(id)
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

/// Word-rule ids of a chat prompt with the generation prompt, rendered like
/// Llama-3's template: begin-of-text, per message a 3-token header, the
/// content and end-of-turn, then the assistant's header.
pub fn render_chat<'a>(messages: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<u64> {
    render_chat_ending(messages, ChatEnd::GenerationPrompt)
}

/// How a rendered chat ends: vLLM's `add_generation_prompt` (the default)
/// and `continue_final_message` request fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatEnd {
    /// The assistant's header follows the last message.
    GenerationPrompt,
    /// The last message is closed and nothing follows.
    Closed,
    /// The last message is left open (no end-of-turn), to be continued: its
    /// ids are a prefix of any later prompt that carries it whole.
    OpenFinal,
}

/// Word-rule ids of a chat prompt ending as `end` says.
pub fn render_chat_ending<'a>(
    messages: impl IntoIterator<Item = (&'a str, &'a str)>,
    end: ChatEnd,
) -> Vec<u64> {
    let mut out = Vec::with_capacity(256);
    out.push(BEGIN_OF_TEXT);
    for (role, content) in messages {
        push_header(&mut out, role);
        push_text(&mut out, content);
        out.push(END_OF_TURN);
    }
    match end {
        ChatEnd::GenerationPrompt => push_header(&mut out, "assistant"),
        ChatEnd::Closed => {}
        ChatEnd::OpenFinal => {
            // Only a message's end-of-turn closes it; an empty chat has none.
            if out.len() > 1 {
                out.pop();
            }
        }
    }
    out
}

/// Word-rule ids of a completions prompt (begin-of-text, then the text).
pub fn render_prompt(text: &str) -> Vec<u64> {
    let mut out = Vec::with_capacity(text.len() / 4 + 2);
    out.push(BEGIN_OF_TEXT);
    push_text(&mut out, text);
    out
}

/// Renders a request into the token ids its node computes.
pub trait PromptRenderer: Send + Sync {
    /// A chat's messages as (role, joined text).
    fn chat(&self, messages: &[(&str, &str)]) -> Result<Vec<u64>, Error>;
    /// A plain completions prompt.
    fn text(&self, prompt: &str) -> Result<Vec<u64>, Error>;
    /// A completions prompt given as token ids.
    fn ids(&self, ids: &[u32]) -> Vec<u64>;
    /// For logs and `/admin/nodes`.
    fn name(&self) -> &str;
}

/// The request's prompt as token ids, by `renderer`.
pub fn request_ids(
    req: &RequestView<'_>,
    renderer: &dyn PromptRenderer,
) -> Result<Vec<u64>, Error> {
    if let Some(msgs) = &req.messages {
        let texts = msgs
            .iter()
            .map(|m| ContentText::parse(m.content).map(|c| c.joined().into_owned()))
            .collect::<Result<Vec<_>, _>>()?;
        let pairs: Vec<(&str, &str)> = msgs
            .iter()
            .zip(&texts)
            .map(|(m, t)| (m.role.as_ref(), t.as_str()))
            .collect();
        return renderer.chat(&pairs);
    }
    let raw = req
        .prompt
        .ok_or_else(|| Error::BadRequest("body has neither `messages` nor `prompt`".into()))?;
    match PromptText::parse(raw)? {
        PromptText::Text(t) => renderer.text(&t),
        PromptText::TokenIds(ids) => Ok(renderer.ids(&ids)),
    }
}

/// The emulator's template and tokenizer.
#[derive(Debug, Default, Clone, Copy)]
pub struct WordRuleRenderer;

impl PromptRenderer for WordRuleRenderer {
    fn chat(&self, messages: &[(&str, &str)]) -> Result<Vec<u64>, Error> {
        Ok(render_chat(messages.iter().copied()))
    }
    fn text(&self, prompt: &str) -> Result<Vec<u64>, Error> {
        Ok(render_prompt(prompt))
    }
    fn ids(&self, ids: &[u32]) -> Vec<u64> {
        ids.iter().map(|&i| given_token_id(i)).collect()
    }
    fn name(&self) -> &str {
        "word-rule"
    }
}

#[cfg(feature = "hf-tokenizer")]
pub use hf::HfRenderer;

#[cfg(feature = "hf-tokenizer")]
mod hf {
    use super::*;
    use std::path::Path;

    /// A model's `tokenizer.json` and the chat template of its
    /// `tokenizer_config.json` (or `chat_template.jinja`), rendered with
    /// minijinja as vLLM renders it with Jinja2 (`add_generation_prompt`,
    /// then tokenized without adding special tokens: the template has them).
    pub struct HfRenderer {
        tokenizer: tokenizers::Tokenizer,
        env: minijinja::Environment<'static>,
        bos: String,
        eos: String,
    }

    fn config_error(path: &Path, e: impl std::fmt::Display) -> Error {
        Error::Tokenizer(format!("{}: {e}", path.display()))
    }

    /// A special token as `tokenizer_config.json` writes it: a string or `{"content": ...}`.
    fn special(cfg: &serde_json::Value, key: &str) -> String {
        match &cfg[key] {
            serde_json::Value::String(s) => s.clone(),
            v => v["content"].as_str().unwrap_or_default().to_owned(),
        }
    }

    impl HfRenderer {
        /// From a `tokenizer.json`; the template is looked for beside it.
        pub fn from_tokenizer_file(path: &str) -> Result<Self, Error> {
            let tok_path = Path::new(path);
            let tokenizer = tokenizers::Tokenizer::from_file(tok_path)
                .map_err(|e| config_error(tok_path, e))?;
            let dir = tok_path.parent().unwrap_or(Path::new("."));
            let cfg_path = dir.join("tokenizer_config.json");
            let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
                Ok(text) => serde_json::from_str(&text).map_err(|e| config_error(&cfg_path, e))?,
                Err(_) => serde_json::Value::Null,
            };
            let template = match cfg["chat_template"].as_str() {
                Some(t) => t.to_owned(),
                None => {
                    let jinja = dir.join("chat_template.jinja");
                    std::fs::read_to_string(&jinja).map_err(|e| {
                        config_error(
                            &jinja,
                            format!("no chat template beside the tokenizer: {e}"),
                        )
                    })?
                }
            };
            let mut env = minijinja::Environment::new();
            // Python's str methods (`.strip()`, `.startswith()`) that HF templates call.
            env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
            env.add_template_owned("chat", template)
                .map_err(|e| config_error(&cfg_path, format!("chat template: {e}")))?;
            Ok(HfRenderer {
                tokenizer,
                env,
                bos: special(&cfg, "bos_token"),
                eos: special(&cfg, "eos_token"),
            })
        }

        fn encode(&self, text: &str) -> Result<Vec<u64>, Error> {
            let enc = self
                .tokenizer
                .encode_fast(text, false)
                .map_err(|e| Error::Tokenizer(e.to_string()))?;
            Ok(enc.get_ids().iter().map(|&i| u64::from(i)).collect())
        }
    }

    impl PromptRenderer for HfRenderer {
        fn chat(&self, messages: &[(&str, &str)]) -> Result<Vec<u64>, Error> {
            let msgs: Vec<_> = messages
                .iter()
                .map(|(r, c)| minijinja::context! { role => r, content => c })
                .collect();
            let text = self
                .env
                .get_template("chat")
                .and_then(|t| {
                    t.render(minijinja::context! {
                        messages => msgs,
                        add_generation_prompt => true,
                        bos_token => &self.bos,
                        eos_token => &self.eos,
                    })
                })
                .map_err(|e| Error::Tokenizer(format!("chat template: {e}")))?;
            self.encode(&text)
        }
        fn text(&self, prompt: &str) -> Result<Vec<u64>, Error> {
            // vLLM's completions add the tokenizer's special tokens (BOS).
            let enc = self
                .tokenizer
                .encode_fast(prompt, true)
                .map_err(|e| Error::Tokenizer(e.to_string()))?;
            Ok(enc.get_ids().iter().map(|&i| u64::from(i)).collect())
        }
        fn ids(&self, ids: &[u32]) -> Vec<u64> {
            ids.iter().map(|&i| u64::from(i)).collect()
        }
        fn name(&self) -> &str {
            "tokenizer.json"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse_request;
    use crate::tokens::word_rule_count;

    #[test]
    fn a_chat_renders_to_the_length_the_estimate_assumes() {
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
    fn a_history_left_open_at_its_last_answer_is_a_prefix_of_the_next_turn() {
        let history = [
            ("user", "Tell me about caches."),
            ("assistant", "They keep things."),
        ];
        let open = render_chat_ending(history, ChatEnd::OpenFinal);
        let next = render_chat([
            ("user", "Tell me about caches."),
            ("assistant", "They keep things."),
            ("user", "Which things?"),
        ]);
        assert_eq!(open[..], next[..open.len()]);
        assert_eq!(
            *open.last().unwrap(),
            token_id("."),
            "the answer's last token"
        );
        let closed = render_chat_ending(history, ChatEnd::Closed);
        assert_eq!(closed.len(), open.len() + 1);
        assert_eq!(*closed.last().unwrap(), END_OF_TURN);
        assert_eq!(render_chat_ending([], ChatEnd::OpenFinal), [BEGIN_OF_TEXT]);
    }

    #[test]
    fn a_request_renders_like_its_messages() {
        let body =
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi there"}]}]}"#;
        let ids = request_ids(&parse_request(body).unwrap(), &WordRuleRenderer).unwrap();
        assert_eq!(ids, render_chat([("user", "hi there")]));
        let body = r#"{"prompt":[5, 6]}"#;
        let ids = request_ids(&parse_request(body).unwrap(), &WordRuleRenderer).unwrap();
        assert_eq!(ids, vec![given_token_id(5), given_token_id(6)]);
    }

    #[test]
    fn the_next_turn_extends_the_previous_prompt_and_answer() {
        let t1 = render_chat([("user", "Tell me.")]);
        let mut seq = t1.clone();
        push_text(&mut seq, "it is so");
        let t2 = render_chat([
            ("user", "Tell me."),
            ("assistant", "it is so"),
            ("user", "More"),
        ]);
        assert_eq!(&t2[..seq.len()], &seq[..]);
    }

    #[cfg(feature = "hf-tokenizer")]
    #[test]
    fn a_missing_tokenizer_is_a_clear_error() {
        let e = HfRenderer::from_tokenizer_file("/nonexistent/tokenizer.json")
            .err()
            .unwrap();
        assert!(e.to_string().contains("/nonexistent/tokenizer.json"), "{e}");
    }
}
