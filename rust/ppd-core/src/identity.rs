//! Which conversation a request belongs to, and its features ψ = (turn, n_in, n_ctx, n_out).

use md5::{Digest, Md5};

use crate::error::Error;
use crate::request::{ContentText, PromptText, RequestView};
use crate::session::Session;
use crate::tokens::{
    TokenCounter, GENERATION_PROMPT_TOKENS, MESSAGE_OVERHEAD_TOKENS, PROMPT_PREFIX_TOKENS,
};

/// Bytes of a plain `/v1/completions` prompt that identify its conversation when
/// no id is given: the first paragraph (up to a blank line), at most this long.
pub const COMPLETION_ID_BLOCK_BYTES: usize = 1024;

/// Longest conversation id kept as given; a longer one is replaced by its hash,
/// so an id costs bounded memory in the session table and in `x-ppd-session`.
pub const MAX_ID_BYTES: usize = 256;

/// Where the conversation id came from (first match wins, in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdSource {
    Header,
    ConversationId,
    SessionId,
    FirstUserMessage,
    /// A chat without user messages (system only): its first message.
    FirstMessage,
    PromptBlock,
}

impl IdSource {
    pub fn as_str(self) -> &'static str {
        match self {
            IdSource::Header => "header",
            IdSource::ConversationId => "conversation_id",
            IdSource::SessionId => "session_id",
            IdSource::FirstUserMessage => "first_user_message",
            IdSource::FirstMessage => "first_message",
            IdSource::PromptBlock => "prompt_block",
        }
    }
}

/// A conversation's identity: its id string and a stable 64-bit hash of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConversationId {
    pub id: String,
    pub source: IdSource,
}

impl ConversationId {
    /// Stable across processes and versions (XXH3), so fraction shares reproduce.
    pub fn hash64(&self) -> u64 {
        hash_id(&self.id)
    }
}

pub fn hash_id(id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(id.as_bytes())
}

fn md5_hex(text: &str) -> String {
    let digest = Md5::digest(text.as_bytes());
    let mut out = String::with_capacity(32);
    for b in digest {
        use std::fmt::Write;
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// The first paragraph of a prompt, capped at [`COMPLETION_ID_BLOCK_BYTES`]
/// (cut at a character boundary).
fn prompt_block(text: &str) -> &str {
    let para = text.split("\n\n").next().unwrap_or(text);
    if para.len() <= COMPLETION_ID_BLOCK_BYTES {
        return para;
    }
    let mut end = COMPLETION_ID_BLOCK_BYTES;
    while !para.is_char_boundary(end) {
        end -= 1;
    }
    &para[..end]
}

fn non_empty(s: Option<&str>) -> Option<&str> {
    s.map(str::trim).filter(|s| !s.is_empty())
}

/// A client's id as the session key: control characters are refused (they
/// would end up in logs and headers), and an id longer than [`MAX_ID_BYTES`]
/// is replaced by `md5:` and its hash.
fn explicit_id(id: &str) -> Result<String, Error> {
    if id.chars().any(char::is_control) {
        return Err(Error::BadRequest(
            "the conversation id must not contain control characters".into(),
        ));
    }
    if id.len() > MAX_ID_BYTES {
        return Ok(format!("md5:{}", md5_hex(id)));
    }
    Ok(id.to_owned())
}

/// Identifies the conversation: `X-Session-ID` header, body `conversation_id`,
/// body `session_id`, else MD5 of the first user message (paper B.3), or for a
/// plain prompt a hash of its first block.
pub fn conversation_id(
    header: Option<&str>,
    req: &RequestView<'_>,
) -> Result<ConversationId, Error> {
    let given = [
        (non_empty(header), IdSource::Header),
        (
            non_empty(req.conversation_id.as_deref()),
            IdSource::ConversationId,
        ),
        (non_empty(req.session_id.as_deref()), IdSource::SessionId),
    ];
    if let Some((Some(id), source)) = given.into_iter().find(|(id, _)| id.is_some()) {
        return Ok(ConversationId {
            id: explicit_id(id)?,
            source,
        });
    }
    if let Some(messages) = &req.messages {
        let (first, source) = match messages.iter().find(|m| m.role == "user") {
            Some(m) => (m, IdSource::FirstUserMessage),
            None => (
                messages
                    .first()
                    .ok_or_else(|| Error::BadRequest("messages must not be empty".into()))?,
                IdSource::FirstMessage,
            ),
        };
        let text = ContentText::parse(first.content)?;
        return Ok(ConversationId {
            id: md5_hex(&text.joined()),
            source,
        });
    }
    let raw = req
        .prompt
        .ok_or_else(|| Error::BadRequest("body has neither `messages` nor `prompt`".into()))?;
    let id = match PromptText::parse(raw)? {
        PromptText::Text(t) => md5_hex(prompt_block(&t)),
        PromptText::TokenIds(ids) => {
            let head: Vec<String> = ids.iter().take(64).map(u32::to_string).collect();
            md5_hex(&head.join(","))
        }
    };
    Ok(ConversationId {
        id,
        source: IdSource::PromptBlock,
    })
}

/// Where n_out came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutSource {
    Request,
    SessionMean,
    TableDefault,
}

/// Where n_ctx came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtxSource {
    /// Counted from the request's history.
    Estimated,
    /// The previous turn's prompt + completion tokens, as upstream reported them.
    SessionUsage,
}

/// The request's features ψ (paper B.1), QPS excluded (it is system state).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Features {
    pub turn: u32,
    pub n_in: u32,
    pub n_ctx: u32,
    pub n_out: u32,
    pub ctx_source: CtxSource,
    pub out_source: OutSource,
}

/// Derives the features. `session` is what the table knows of the conversation.
pub fn features(
    req: &RequestView<'_>,
    counter: &dyn TokenCounter,
    session: Option<&Session>,
    default_n_out: u32,
) -> Result<Features, Error> {
    let (turn, n_in, mut n_ctx) = match &req.messages {
        Some(messages) => chat_counts(messages, counter)?,
        None => prompt_counts(req, counter, session)?,
    };
    let mut ctx_source = CtxSource::Estimated;
    // The last usage is exact when this request continues the turn it recorded.
    if let Some(s) = session {
        if let Some(ctx) = s.context_tokens() {
            if req.messages.is_none() || turn == s.turns + 1 {
                n_ctx = ctx;
                ctx_source = CtxSource::SessionUsage;
            }
        }
    }
    let (n_out, out_source) = match req.output_limit() {
        Some(n) => (u32::try_from(n).unwrap_or(u32::MAX), OutSource::Request),
        None => match session.and_then(Session::mean_output_tokens) {
            Some(mean) => (mean, OutSource::SessionMean),
            None => (default_n_out, OutSource::TableDefault),
        },
    };
    Ok(Features {
        turn,
        n_in,
        n_ctx,
        n_out,
        ctx_source,
        out_source,
    })
}

/// Turn = number of user messages (a chat without any, e.g. system only, is a
/// Turn 1); n_in = tokens after the last assistant message (with the
/// generation prompt); n_ctx = tokens before them.
fn chat_counts(
    messages: &[crate::request::MessageView<'_>],
    counter: &dyn TokenCounter,
) -> Result<(u32, u32, u32), Error> {
    let users = messages.iter().filter(|m| m.role == "user").count();
    let turn = u32::try_from(users.max(1)).unwrap_or(u32::MAX);
    let split = messages
        .iter()
        .rposition(|m| m.role == "assistant")
        .map_or(0, |i| i + 1);
    let mut n_ctx = PROMPT_PREFIX_TOKENS;
    let mut n_in = GENERATION_PROMPT_TOKENS;
    for (i, m) in messages.iter().enumerate() {
        let tokens = ContentText::parse(m.content)?
            .count(counter)
            .saturating_add(MESSAGE_OVERHEAD_TOKENS);
        if i < split {
            n_ctx = n_ctx.saturating_add(tokens);
        } else {
            n_in = n_in.saturating_add(tokens);
        }
    }
    Ok((turn, n_in, n_ctx))
}

/// A plain prompt carries no turn structure: the turn follows the session, and
/// the new input is what exceeds the context the session already holds.
fn prompt_counts(
    req: &RequestView<'_>,
    counter: &dyn TokenCounter,
    session: Option<&Session>,
) -> Result<(u32, u32, u32), Error> {
    let raw = req
        .prompt
        .ok_or_else(|| Error::BadRequest("body has neither `messages` nor `prompt`".into()))?;
    let total = match PromptText::parse(raw)? {
        PromptText::Text(t) => counter.count(&t).saturating_add(PROMPT_PREFIX_TOKENS),
        PromptText::TokenIds(ids) => u32::try_from(ids.len()).unwrap_or(u32::MAX),
    };
    let turn = session.map_or(1, |s| s.turns.saturating_add(1));
    let ctx = session
        .and_then(Session::context_tokens)
        .unwrap_or(0)
        .min(total);
    Ok((turn, total - ctx, ctx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse_request;
    use crate::tokens::WordRule;

    fn chat(msgs: &[(&str, &str)]) -> String {
        let m: Vec<_> = msgs
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
            .collect();
        serde_json::json!({ "messages": m }).to_string()
    }

    #[test]
    fn header_beats_body_fields_beats_hash() {
        let body = r#"{"conversation_id":"c1","session_id":"s1","messages":[{"role":"user","content":"x"}]}"#;
        let v = parse_request(body).unwrap();
        let id = conversation_id(Some("h1"), &v).unwrap();
        assert_eq!((id.id.as_str(), id.source), ("h1", IdSource::Header));
        let id = conversation_id(None, &v).unwrap();
        assert_eq!(
            (id.id.as_str(), id.source),
            ("c1", IdSource::ConversationId)
        );
        let v = parse_request(r#"{"session_id":"s1","messages":[{"role":"user","content":"x"}]}"#)
            .unwrap();
        assert_eq!(conversation_id(Some("  "), &v).unwrap().id, "s1");
    }

    #[test]
    fn first_user_message_md5_is_stable_across_turns() {
        let t1 = chat(&[("system", "be brief"), ("user", "hello")]);
        let t2 = chat(&[
            ("system", "be brief"),
            ("user", "hello"),
            ("assistant", "hi"),
            ("user", "more"),
        ]);
        let a = conversation_id(None, &parse_request(&t1).unwrap()).unwrap();
        let b = conversation_id(None, &parse_request(&t2).unwrap()).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.id, "5d41402abc4b2a76b9719d911017c592"); // md5("hello")
        assert_eq!(a.source, IdSource::FirstUserMessage);
    }

    #[test]
    fn part_lists_hash_like_their_joined_text() {
        let parts = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hello"}]}]}"#;
        let id = conversation_id(None, &parse_request(parts).unwrap()).unwrap();
        assert_eq!(id.id, md5_hex("hello"));
    }

    #[test]
    fn completion_prompt_hashes_its_first_block() {
        let a = parse_request(r#"{"prompt":"System text.\n\nUser: hi"}"#).unwrap();
        let b = parse_request(r#"{"prompt":"System text.\n\nUser: hi\n\nAssistant: yo"}"#).unwrap();
        assert_eq!(
            conversation_id(None, &a).unwrap(),
            conversation_id(None, &b).unwrap()
        );
        let long = "é".repeat(2000);
        assert!(prompt_block(&long).len() <= COMPLETION_ID_BLOCK_BYTES);
    }

    #[test]
    fn turn_counts_user_messages_and_splits_at_last_assistant() {
        let body = chat(&[
            ("system", "sys"),
            ("user", "one two"),
            ("assistant", "three"),
            ("user", "four five six"),
        ]);
        let f = features(&parse_request(&body).unwrap(), &WordRule, None, 100).unwrap();
        assert_eq!(f.turn, 2);
        // ctx: prefix 1 + (4+1) + (4+2) + (4+1); in: (4+3) + generation prompt 3
        assert_eq!(f.n_ctx, 1 + 5 + 6 + 5);
        assert_eq!(f.n_in, 7 + 3);
        assert_eq!((f.n_out, f.out_source), (100, OutSource::TableDefault));
        assert_eq!(f.ctx_source, CtxSource::Estimated);
    }

    #[test]
    fn n_out_prefers_request_then_session_mean() {
        let mut s = Session::new(0);
        s.record_usage(10, 40, 1);
        s.record_usage(60, 60, 2);
        let body = r#"{"max_tokens":7,"messages":[{"role":"user","content":"a"}]}"#;
        let f = features(&parse_request(body).unwrap(), &WordRule, Some(&s), 100).unwrap();
        assert_eq!((f.n_out, f.out_source), (7, OutSource::Request));
        let body = r#"{"max_tokens":7,"max_completion_tokens":9,"messages":[{"role":"user","content":"a"}]}"#;
        assert_eq!(
            features(&parse_request(body).unwrap(), &WordRule, Some(&s), 100)
                .unwrap()
                .n_out,
            9
        );
        let body = r#"{"messages":[{"role":"user","content":"a"}]}"#;
        let f = features(&parse_request(body).unwrap(), &WordRule, Some(&s), 100).unwrap();
        assert_eq!((f.n_out, f.out_source), (50, OutSource::SessionMean));
    }

    #[test]
    fn session_usage_gives_exact_context_for_the_next_turn() {
        let mut s = Session::new(0);
        s.turns = 1;
        s.record_usage(30, 20, 1);
        let body = chat(&[("user", "a"), ("assistant", "b"), ("user", "c")]);
        let f = features(&parse_request(&body).unwrap(), &WordRule, Some(&s), 1).unwrap();
        assert_eq!((f.n_ctx, f.ctx_source), (50, CtxSource::SessionUsage));
        // A request that does not continue the recorded turn is estimated.
        let body = chat(&[("user", "a")]);
        let f = features(&parse_request(&body).unwrap(), &WordRule, Some(&s), 1).unwrap();
        assert_eq!(f.ctx_source, CtxSource::Estimated);
    }

    #[test]
    fn plain_prompt_turn_follows_the_session() {
        let mut s = Session::new(0);
        s.turns = 2;
        s.record_usage(8, 2, 1);
        let body = r#"{"prompt":"a b c d e f g h i j k l"}"#;
        let f = features(&parse_request(body).unwrap(), &WordRule, Some(&s), 1).unwrap();
        assert_eq!((f.turn, f.n_ctx, f.n_in), (3, 10, 13 - 10));
        let f = features(&parse_request(body).unwrap(), &WordRule, None, 1).unwrap();
        assert_eq!((f.turn, f.n_ctx, f.n_in), (1, 0, 13));
    }

    #[test]
    fn a_system_only_chat_is_a_first_turn_named_by_its_first_message() {
        // vLLM and OpenAI answer these; the router must not refuse them.
        let body = chat(&[("system", "x")]);
        let f = features(&parse_request(&body).unwrap(), &WordRule, None, 1).unwrap();
        assert_eq!(f.turn, 1);
        let id = conversation_id(None, &parse_request(&body).unwrap()).unwrap();
        assert_eq!((id.id, id.source), (md5_hex("x"), IdSource::FirstMessage));
        let empty = r#"{"messages":[]}"#;
        assert!(conversation_id(None, &parse_request(empty).unwrap()).is_err());
    }

    #[test]
    fn client_ids_are_bounded_and_free_of_control_characters() {
        let body = chat(&[("user", "x")]);
        let v = parse_request(&body).unwrap();
        let long = "a".repeat(4 * 1024 * 1024);
        let id = conversation_id(Some(&long), &v).unwrap();
        assert_eq!(id.id, format!("md5:{}", md5_hex(&long)));
        assert!(id.id.len() <= MAX_ID_BYTES);
        let exact = "b".repeat(MAX_ID_BYTES);
        assert_eq!(conversation_id(Some(&exact), &v).unwrap().id, exact);
        for bad in ["a\r\nx-injected: 1", "nul\0", "tab\tinside"] {
            let e = conversation_id(Some(bad), &v).unwrap_err().to_string();
            assert!(e.contains("control characters"), "{bad:?}: {e}");
        }
        let body = format!(
            r#"{{"conversation_id":"{}","messages":[{{"role":"user","content":"x"}}]}}"#,
            "c".repeat(300)
        );
        assert!(conversation_id(None, &parse_request(&body).unwrap())
            .unwrap()
            .id
            .starts_with("md5:"));
    }
}
