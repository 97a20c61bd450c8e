//! Which conversation a request belongs to, and its features ψ = (turn, n_in, n_ctx, n_out).

use md5::{Digest, Md5};
use xxhash_rust::xxh3::Xxh3Default;

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
    /// The `X-Session-ID` header.
    SessionHeader,
    /// The `X-Correlation-ID` header (aiperf marks its conversations with it).
    CorrelationHeader,
    /// The `X-Session-Affinity` header.
    AffinityHeader,
    ConversationId,
    SessionId,
    /// OpenAI's `user` field, only where the operator opted in: it names an
    /// end user, who may hold many conversations at once.
    User,
    /// A chat with an assistant message and no id: the hash of its history
    /// through the last assistant message (see [`History`]).
    History,
    /// A chat without an assistant message and no id: a new conversation,
    /// named by the hash of its messages (it has no earlier session).
    Opening,
    /// A plain `/v1/completions` prompt: a hash of its first block.
    PromptBlock,
}

impl IdSource {
    /// The id headers, in priority order.
    pub const HEADERS: [IdSource; 3] = [
        IdSource::SessionHeader,
        IdSource::CorrelationHeader,
        IdSource::AffinityHeader,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            IdSource::SessionHeader => "x-session-id",
            IdSource::CorrelationHeader => "x-correlation-id",
            IdSource::AffinityHeader => "x-session-affinity",
            IdSource::ConversationId => "conversation_id",
            IdSource::SessionId => "session_id",
            IdSource::User => "user",
            IdSource::History => "history",
            IdSource::Opening => "opening",
            IdSource::PromptBlock => "prompt_block",
        }
    }

    /// The (lower-case) header name of a header source.
    pub fn header_name(self) -> Option<&'static str> {
        IdSource::HEADERS.contains(&self).then_some(self.as_str())
    }

    /// Whether the client named the conversation itself (else the router
    /// derived a key from the content).
    pub fn is_explicit(self) -> bool {
        !matches!(
            self,
            IdSource::History | IdSource::Opening | IdSource::PromptBlock
        )
    }
}

/// What may name a conversation besides its body.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdHints<'a> {
    /// The values of [`IdSource::HEADERS`], in that order.
    pub headers: [Option<&'a str>; 3],
    /// The operator lets the body's `user` field name the conversation.
    pub from_user: bool,
}

impl<'a> IdHints<'a> {
    /// Only an `X-Session-ID` value (the Python API's `session_header`).
    pub fn session_header(value: Option<&'a str>) -> Self {
        IdHints {
            headers: [value, None, None],
            from_user: false,
        }
    }
}

/// A conversation's identity: its id string, where it came from, and for a
/// chat the hashes of its history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConversationId {
    pub id: String,
    pub source: IdSource,
    /// `None` for a plain prompt (no turn structure).
    pub history: Option<History>,
}

impl ConversationId {
    /// Stable across processes and versions (XXH3), so fraction shares reproduce.
    pub fn hash64(&self) -> u64 {
        hash_id(&self.id)
    }

    /// The key that places the conversation ([`crate::placement`]): the
    /// same at every turn, in every router replica. A client's id is stable
    /// as given; a conversation keyed by its history moves its key each
    /// turn, so it places by its opening (strangers who open alike share a
    /// node, and with it their common prefix).
    pub fn placement_key(&self) -> u64 {
        match (self.source, self.history) {
            (IdSource::History | IdSource::Opening, Some(h)) => h.opening.0 as u64,
            _ => self.hash64(),
        }
    }
}

pub fn hash_id(id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(id.as_bytes())
}

/// The hash of one message's text, fed whole or in pieces (a streamed
/// answer's deltas): the same text gives the same digest however it is cut,
/// and nothing is buffered.
#[derive(Clone, Default)]
pub struct ContentHasher(Xxh3Default);

impl ContentHasher {
    pub fn new() -> Self {
        ContentHasher(Xxh3Default::new())
    }

    pub fn update(&mut self, text: &str) {
        self.0.update(text.as_bytes());
    }

    pub fn digest(&self) -> u128 {
        self.0.digest128()
    }

    /// A message's content as [`ContentText::joined`] reads it (parts joined
    /// by `\n`), without joining it.
    pub fn of(content: &ContentText<'_>) -> u128 {
        let mut h = ContentHasher::new();
        match content {
            ContentText::Empty => {}
            ContentText::One(t) => h.update(t),
            ContentText::Parts(ps) => {
                for (i, p) in ps.iter().enumerate() {
                    if i > 0 {
                        h.update("\n");
                    }
                    h.update(p);
                }
            }
        }
        h.digest()
    }
}

/// A chained hash of a chat history: each message folds its role and its
/// content's digest into the hash of the messages before it, so the hash of
/// a history plus one answer needs only the history's hash and the answer's
/// digest. Only role and content text count: fields clients commonly strip
/// or rewrite (`name`, `reasoning_content`, tool call ids) do not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HistoryHash(u128);

impl HistoryHash {
    /// The hash of no messages.
    pub const EMPTY: HistoryHash = HistoryHash(0x7070_6468_6973_746f_7279_0000_0000_0001);

    /// This history followed by a message. Role and digest are framed
    /// (role length first, digest fixed-size) so no two histories share a
    /// serialization.
    pub fn then(self, role: &str, content: u128) -> HistoryHash {
        let mut h = Xxh3Default::new();
        h.update(&self.0.to_le_bytes());
        h.update(&(role.len() as u64).to_le_bytes());
        h.update(role.as_bytes());
        h.update(&content.to_le_bytes());
        HistoryHash(h.digest128())
    }

    /// This history followed by an assistant answer of digest `answer`
    /// (see [`ContentHasher`]): the key the next turn will present.
    pub fn answered(self, answer: u128) -> HistoryHash {
        self.then("assistant", answer)
    }

    /// The session-table key: 32 hex digits.
    pub fn key(self) -> String {
        format!("{:032x}", self.0)
    }

    /// 64 bits of it, as a session remembers the history it expects
    /// (never 0, which means "unknown" there).
    pub fn short(self) -> u64 {
        (self.0 as u64).max(1)
    }
}

/// The hashes of a chat request's messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct History {
    /// All of them: followed by this turn's answer, the next turn's prefix.
    pub whole: HistoryHash,
    /// Those through the last assistant message: what the conversation's
    /// previous turn ended with. `None` when there is no assistant message
    /// (a Turn 1).
    pub prefix: Option<HistoryHash>,
    /// Those through the first user message: the same at every turn, so
    /// every turn of a conversation keyed by its history places alike.
    pub opening: HistoryHash,
}

impl History {
    pub fn of(messages: &[crate::request::MessageView<'_>]) -> Result<History, Error> {
        let last_assistant = messages.iter().rposition(|m| m.role == "assistant");
        let first_user = messages.iter().position(|m| m.role == "user");
        let mut h = HistoryHash::EMPTY;
        let mut prefix = None;
        let mut opening = None;
        for (i, m) in messages.iter().enumerate() {
            h = h.then(&m.role, ContentHasher::of(&ContentText::parse(m.content)?));
            if Some(i) == last_assistant {
                prefix = Some(h);
            }
            if Some(i) == first_user {
                opening = Some(h);
            }
        }
        Ok(History {
            whole: h,
            prefix,
            opening: opening.unwrap_or(h),
        })
    }
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

/// Identifies the conversation. An explicit id first: the headers
/// `X-Session-ID`, `X-Correlation-ID`, `X-Session-Affinity`, the body's
/// `conversation_id`, `session_id`, and `user` where `hints.from_user`.
/// Without one, a chat is keyed by its history through the last assistant
/// message ([`IdSource::History`]; the router records the key of the history
/// plus each answer, so conversations that open alike part at their first
/// answer), or is new ([`IdSource::Opening`]). A plain prompt has no turn
/// structure: a hash of its first block names it.
pub fn conversation_id(hints: IdHints<'_>, req: &RequestView<'_>) -> Result<ConversationId, Error> {
    let history = req.messages.as_deref().map(History::of).transpose()?;
    let [session, correlation, affinity] = hints.headers;
    let user = req.user.as_deref().filter(|_| hints.from_user);
    let given = [
        (session, IdSource::SessionHeader),
        (correlation, IdSource::CorrelationHeader),
        (affinity, IdSource::AffinityHeader),
        (req.conversation_id.as_deref(), IdSource::ConversationId),
        (req.session_id.as_deref(), IdSource::SessionId),
        (user, IdSource::User),
    ];
    if let Some((id, source)) = given
        .into_iter()
        .find_map(|(id, source)| non_empty(id).map(|id| (id, source)))
    {
        return Ok(ConversationId {
            id: explicit_id(id)?,
            source,
            history,
        });
    }
    if let Some(h) = history {
        if req.messages.as_ref().is_some_and(Vec::is_empty) {
            return Err(Error::BadRequest("messages must not be empty".into()));
        }
        let (key, source) = match h.prefix {
            Some(p) => (p, IdSource::History),
            None => (h.whole, IdSource::Opening),
        };
        return Ok(ConversationId {
            id: key.key(),
            source,
            history,
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
        history: None,
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

    fn hints(headers: [Option<&str>; 3]) -> IdHints<'_> {
        IdHints {
            headers,
            from_user: false,
        }
    }

    fn id_of(body: &str) -> ConversationId {
        conversation_id(IdHints::default(), &parse_request(body).unwrap()).unwrap()
    }

    #[test]
    fn every_turn_of_a_conversation_places_alike_and_other_openings_elsewhere() {
        let t1 = id_of(
            r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"q"}]}"#,
        );
        let t2 = id_of(
            r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"r"}]}"#,
        );
        let other = id_of(
            r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"p"}]}"#,
        );
        assert_ne!(t1.id, t2.id);
        assert_eq!(t1.placement_key(), t2.placement_key());
        assert_ne!(t1.placement_key(), other.placement_key());
        let named = conversation_id(
            IdHints::session_header(Some("c-1")),
            &parse_request(r#"{"messages":[{"role":"user","content":"q"}]}"#).unwrap(),
        )
        .unwrap();
        assert_eq!(named.placement_key(), hash_id("c-1"));
    }

    #[test]
    fn headers_beat_body_fields_in_their_order() {
        let body = r#"{"conversation_id":"c1","session_id":"s1","user":"u1","messages":[{"role":"user","content":"x"}]}"#;
        let v = parse_request(body).unwrap();
        let of = |h| {
            let id = conversation_id(hints(h), &v).unwrap();
            (id.id, id.source)
        };
        let s = |x: &str| x.to_owned();
        assert_eq!(
            of([Some("h1"), Some("h2"), Some("h3")]),
            (s("h1"), IdSource::SessionHeader)
        );
        assert_eq!(
            of([None, Some("h2"), Some("h3")]),
            (s("h2"), IdSource::CorrelationHeader)
        );
        assert_eq!(
            of([Some(" "), None, Some("h3")]),
            (s("h3"), IdSource::AffinityHeader)
        );
        assert_eq!(of([None; 3]), (s("c1"), IdSource::ConversationId));
        let v = parse_request(r#"{"session_id":"s1","messages":[{"role":"user","content":"x"}]}"#)
            .unwrap();
        assert_eq!(conversation_id(hints([None; 3]), &v).unwrap().id, "s1");
    }

    #[test]
    fn user_names_the_conversation_only_when_the_operator_allows_it() {
        let v = parse_request(r#"{"user":"alice","messages":[{"role":"user","content":"x"}]}"#)
            .unwrap();
        let off = conversation_id(IdHints::default(), &v).unwrap();
        assert_eq!(off.source, IdSource::Opening);
        let on = IdHints {
            from_user: true,
            ..IdHints::default()
        };
        let id = conversation_id(on, &v).unwrap();
        assert_eq!((id.id.as_str(), id.source), ("alice", IdSource::User));
        // A body field of higher rank still wins.
        let v = parse_request(
            r#"{"user":"alice","session_id":"s","messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap();
        assert_eq!(conversation_id(on, &v).unwrap().id, "s");
    }

    #[test]
    fn the_same_opener_parts_at_the_first_answer() {
        let t1 = chat(&[("system", "be brief"), ("user", "Hello")]);
        let opened = id_of(&t1);
        assert_eq!(opened.source, IdSource::Opening);
        assert_eq!(opened, id_of(&t1), "a retry of Turn 1 is the same opening");
        let a = id_of(&chat(&[
            ("system", "be brief"),
            ("user", "Hello"),
            ("assistant", "hi there"),
            ("user", "more"),
        ]));
        let b = id_of(&chat(&[
            ("system", "be brief"),
            ("user", "Hello"),
            ("assistant", "good day"),
            ("user", "more"),
        ]));
        assert_eq!((a.source, b.source), (IdSource::History, IdSource::History));
        assert_ne!(a.id, b.id);
        assert_ne!(a.id, opened.id);
    }

    #[test]
    fn the_key_recorded_after_a_turn_is_the_key_of_the_next() {
        let t1 = chat(&[("system", "s"), ("user", "Hello")]);
        let id1 = id_of(&t1);
        let recorded = id1
            .history
            .unwrap()
            .whole
            .answered(ContentHasher::of(&ContentText::One("hi there".into())));
        let t2 = chat(&[
            ("system", "s"),
            ("user", "Hello"),
            ("assistant", "hi there"),
            ("user", "and then?"),
        ]);
        let id2 = id_of(&t2);
        assert_eq!(id2.id, recorded.key());
        let t3 = parse_request(&t2).unwrap();
        let after2 = History::of(t3.messages.as_deref().unwrap())
            .unwrap()
            .whole
            .answered(ContentHasher::of(&ContentText::One("a third".into())));
        let id3 = id_of(&chat(&[
            ("system", "s"),
            ("user", "Hello"),
            ("assistant", "hi there"),
            ("user", "and then?"),
            ("assistant", "a third"),
            ("user", "go on"),
        ]));
        assert_eq!(id3.id, after2.key());
    }

    #[test]
    fn a_streamed_answer_hashes_like_the_whole_one() {
        let mut streamed = ContentHasher::new();
        for piece in ["hi", " the", "re", "", " é", "!"] {
            streamed.update(piece);
        }
        assert_eq!(
            streamed.digest(),
            ContentHasher::of(&ContentText::One("hi there é!".into()))
        );
        // Content parts hash as their joined text.
        let parts = ContentText::Parts(vec!["a".into(), "b".into()]);
        assert_eq!(
            ContentHasher::of(&parts),
            ContentHasher::of(&ContentText::One("a\nb".into()))
        );
    }

    #[test]
    fn only_role_and_content_text_make_the_history() {
        let plain = id_of(
            r#"{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"r"}]}"#,
        );
        let decorated = id_of(
            r#"{"messages":[{"role":"user","name":"bob","content":[{"type":"text","text":"q"}]},{"role":"assistant","content":"a","reasoning_content":"hmm"},{"role":"user","content":"r"}]}"#,
        );
        assert_eq!(plain.id, decorated.id);
        // Roles count: the same text said by another role is another history.
        let swapped = id_of(
            r#"{"messages":[{"role":"system","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"r"}]}"#,
        );
        assert_ne!(plain.id, swapped.id);
        // Message boundaries count.
        let a = HistoryHash::EMPTY.then("user", ContentHasher::of(&ContentText::One("ab".into())));
        let b = HistoryHash::EMPTY
            .then("user", ContentHasher::of(&ContentText::One("a".into())))
            .then("user", ContentHasher::of(&ContentText::One("b".into())));
        assert_ne!(a, b);
    }

    #[test]
    fn completion_prompt_hashes_its_first_block() {
        let a = parse_request(r#"{"prompt":"System text.\n\nUser: hi"}"#).unwrap();
        let b = parse_request(r#"{"prompt":"System text.\n\nUser: hi\n\nAssistant: yo"}"#).unwrap();
        let of = |v| conversation_id(IdHints::default(), v).unwrap();
        assert_eq!(of(&a), of(&b));
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
    fn a_system_only_chat_is_a_first_turn_and_an_opening() {
        // vLLM and OpenAI answer these; the router must not refuse them.
        let body = chat(&[("system", "x")]);
        let f = features(&parse_request(&body).unwrap(), &WordRule, None, 1).unwrap();
        assert_eq!(f.turn, 1);
        let id = id_of(&body);
        assert_eq!(id.source, IdSource::Opening);
        let empty = r#"{"messages":[]}"#;
        assert!(conversation_id(IdHints::default(), &parse_request(empty).unwrap()).is_err());
    }

    #[test]
    fn client_ids_are_bounded_and_free_of_control_characters() {
        let body = chat(&[("user", "x")]);
        let v = parse_request(&body).unwrap();
        let long = "a".repeat(4 * 1024 * 1024);
        let header = |h: &str| conversation_id(IdHints::session_header(Some(h)), &v);
        let id = header(&long).unwrap();
        assert_eq!(id.id, format!("md5:{}", md5_hex(&long)));
        assert!(id.id.len() <= MAX_ID_BYTES);
        let exact = "b".repeat(MAX_ID_BYTES);
        assert_eq!(header(&exact).unwrap().id, exact);
        for bad in ["a\r\nx-injected: 1", "nul\0", "tab\tinside"] {
            let e = header(bad).unwrap_err().to_string();
            assert!(e.contains("control characters"), "{bad:?}: {e}");
        }
        let body = format!(
            r#"{{"conversation_id":"{}","messages":[{{"role":"user","content":"x"}}]}}"#,
            "c".repeat(300)
        );
        assert!(id_of(&body).id.starts_with("md5:"));
    }
}
