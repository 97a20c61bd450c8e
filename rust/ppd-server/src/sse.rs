//! Splits an SSE byte stream into whole events, so the relay can read usage and drop the chunk it asked for.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use std::borrow::Cow;

/// Token usage as vLLM reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: u32,
    #[serde(default)]
    pub completion_tokens: u32,
}

#[derive(Deserialize)]
struct ChunkView {
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    choices: Option<Vec<serde::de::IgnoredAny>>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
}

/// What one event is, for the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// A chunk with choices (content, role or finish).
    Data { usage: Option<Usage> },
    /// The final usage-only chunk (`choices: []` with usage).
    UsageOnly(Usage),
    /// `data: [DONE]`.
    Done,
    /// An error object sent in the stream.
    Error,
    /// Comments, keep-alives, or data we do not understand (passed through).
    Other,
}

/// Whether `data` holds `"choices"` but neither `"usage"` nor `"error"`.
/// The searchers are built once: building one costs more than a search.
fn plain_token_chunk(data: &[u8]) -> bool {
    use memchr::memmem::Finder;
    use std::sync::LazyLock;
    static CHOICES: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"choices\""));
    static USAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\""));
    static ERROR: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"error\""));
    CHOICES.find(data).is_some() && USAGE.find(data).is_none() && ERROR.find(data).is_none()
}

/// The data of an event that is one `data:` line and its blank line, the
/// shape of (nearly) every event vLLM sends.
pub(crate) fn single_data_line(event: &[u8]) -> Option<&[u8]> {
    let rest = event.strip_prefix(b"data:")?;
    let rest = rest.strip_prefix(b" ").unwrap_or(rest);
    let data = rest.strip_suffix(b"\n\n")?;
    memchr::memchr2(b'\n', b'\r', data)
        .is_none()
        .then_some(data)
}

/// The data lines of an event, joined by newlines; an event almost always
/// has exactly one, which is borrowed rather than copied. `None` without any.
fn joined_data(text: &str) -> Option<Cow<'_, str>> {
    let mut lines = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|rest| rest.strip_prefix(' ').unwrap_or(rest));
    match (lines.next(), lines.next()) {
        (None, _) => None,
        (Some(one), None) => Some(Cow::Borrowed(one)),
        (Some(a), Some(b)) => {
            let mut s = format!("{a}\n{b}");
            for rest in lines {
                s.push('\n');
                s.push_str(rest);
            }
            Some(Cow::Owned(s))
        }
    }
}

/// The data of an event (its data lines joined), for readers of its JSON.
pub fn event_data(event: &[u8]) -> Option<Cow<'_, str>> {
    if let Some(data) = single_data_line(event) {
        return std::str::from_utf8(data).ok().map(Cow::Borrowed);
    }
    joined_data(std::str::from_utf8(event).ok()?)
}

pub fn classify(event: &[u8]) -> EventKind {
    // Token chunks are most of a stream: one without "usage" or "error" in it
    // needs no JSON parse (nor line splitting, nor UTF-8 check) to be known
    // as data; the relay passes its bytes on as they came.
    if let Some(data) = single_data_line(event) {
        if data.trim_ascii_start().starts_with(b"{") && plain_token_chunk(data) {
            return EventKind::Data { usage: None };
        }
    }
    let text = match std::str::from_utf8(event) {
        Ok(t) => t,
        Err(_) => return EventKind::Other,
    };
    let Some(data) = joined_data(text) else {
        return EventKind::Other;
    };
    let data = data.trim();
    if data.is_empty() {
        return EventKind::Other;
    }
    if data == "[DONE]" {
        return EventKind::Done;
    }
    // Multi-line data, or a first line with odd spacing: the same test.
    if data.starts_with('{') && plain_token_chunk(data.as_bytes()) {
        return EventKind::Data { usage: None };
    }
    match serde_json::from_str::<ChunkView>(data) {
        Ok(c) if c.error.is_some() => EventKind::Error,
        Ok(c) => match (c.choices.as_ref().map(Vec::len), c.usage) {
            (Some(0), Some(u)) => EventKind::UsageOnly(u),
            (_, usage) => EventKind::Data { usage },
        },
        Err(_) => EventKind::Other,
    }
}

/// vLLM's token chunks and its usage chunk, read in one pass, the head
/// checked once. A token chunk is exactly what vLLM streams for a token (or
/// for the role that opens an answer), `data: {"id":…,"object":
/// "chat.completion.chunk","created":…,"model":…,"choices":[{"index":0,
/// "delta":{"content":TEXT},"logprobs":null,"finish_reason":null}]}`
/// (`"token_ids":null` before the `}` as current vLLM writes it,
/// `"role":"assistant",` before the content in the answer's first chunk),
/// so it is data without usage, names no router-only field, goes out as it
/// came and adds TEXT to the answer. The relay needs nothing else from it,
/// and checking the shape costs a fraction of classifying the event,
/// searching it for router fields and parsing its text one after another
/// (~3,100 instructions a token in callgrind). Only the two strings are
/// searched, and only TEXT is parsed. The usage chunk (`…,"choices":[],
/// "usage":{…}}`) is read from where its usage starts. `None` for any other
/// event, which the relay reads the general way.
pub(crate) fn vllm_chunk(event: &[u8]) -> Option<VllmChunk<'_>> {
    let rest = vllm_head(event)?;
    match token_text(rest) {
        Some(text) => Some(VllmChunk::Token(text)),
        None => usage_of(rest).map(VllmChunk::Usage),
    }
}

/// The two events of vLLM's stream that [`vllm_chunk`] reads.
#[derive(Debug, PartialEq)]
pub(crate) enum VllmChunk<'a> {
    /// A token (or the answer's role): its text.
    Token(Cow<'a, str>),
    /// The last chunk: the usage, with no choices.
    Usage(Usage),
}

/// A token chunk's text, from what follows vLLM's head.
fn token_text(rest: &[u8]) -> Option<Cow<'_, str>> {
    const CHOICE_0: &[u8] = b",\"choices\":[{\"index\":0,\"delta\":{";
    const ROLE: &[u8] = b"\"role\":\"assistant\",";
    const CONTENT: &[u8] = b"\"content\":";
    const TAIL: &[u8] = b"},\"logprobs\":null,\"finish_reason\":null";
    // vLLM names the token ids it was not asked for as null.
    const NO_TOKEN_IDS: &[u8] = b",\"token_ids\":null";
    let rest = rest.strip_prefix(CHOICE_0)?;
    let rest = rest.strip_prefix(ROLE).unwrap_or(rest);
    let json = rest.strip_prefix(CONTENT)?;
    let (text, end) = json_string(json)?;
    let rest = json[end..].strip_prefix(TAIL)?;
    let rest = rest.strip_prefix(NO_TOKEN_IDS).unwrap_or(rest);
    (rest == b"}]}").then_some(text)
}

/// The usage of vLLM's last chunk, `…,"choices":[],"usage":{…}}` after
/// its head, read from where the usage starts.
fn usage_of(rest: &[u8]) -> Option<Usage> {
    use serde::Deserialize as _;
    const USAGE: &[u8] = b",\"choices\":[],\"usage\":";
    let json = rest.strip_prefix(USAGE)?;
    let mut de = serde_json::Deserializer::from_slice(json.strip_suffix(b"}")?);
    let usage = Usage::deserialize(&mut de).ok()?;
    de.end().ok()?;
    Some(usage)
}

/// Whether the event is `data: [DONE]`, as vLLM ends every stream.
pub(crate) fn is_done(event: &[u8]) -> bool {
    event == b"data: [DONE]\n\n"
}

/// What follows the fields vLLM writes before a chunk's `choices`, in the
/// event's single data line: `{"id":…,"object":"chat.completion.chunk",
/// "created":…,"model":…` — none of them a field the relay acts on.
fn vllm_head(event: &[u8]) -> Option<&[u8]> {
    const OBJECT: &[u8] = b",\"object\":\"chat.completion.chunk\",\"created\":";
    const MODEL: &[u8] = b",\"model\":";
    let data = single_data_line(event)?;
    let rest = plain_string(data.strip_prefix(b"{\"id\":")?)?;
    let rest = rest.strip_prefix(OBJECT)?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    plain_string(rest[digits..].strip_prefix(MODEL)?)
}

/// What follows a JSON string without escapes at the start of `s`; `None`
/// where `s` starts with anything else (ids and model names have none).
fn plain_string(s: &[u8]) -> Option<&[u8]> {
    let body = s.strip_prefix(b"\"")?;
    let close = memchr::memchr2(b'"', b'\\', body)?;
    (body[close] == b'"').then(|| &body[close + 1..])
}

/// The JSON string at the start of `json`, unescaped (borrowed where it has
/// no escapes: serde's `Cow` would always copy), and where it ends.
pub(crate) fn json_string(json: &[u8]) -> Option<(Cow<'_, str>, usize)> {
    let mut borrowed = serde_json::Deserializer::from_slice(json).into_iter::<&str>();
    if let Some(Ok(t)) = borrowed.next() {
        return Some((Cow::Borrowed(t), borrowed.byte_offset()));
    }
    let mut owned = serde_json::Deserializer::from_slice(json).into_iter::<String>();
    let t = owned.next()?.ok()?;
    Some((Cow::Owned(t), owned.byte_offset()))
}

/// What the relay does with one event.
pub enum Pass {
    Keep,
    Drop,
    /// Send these bytes (a whole event) instead.
    Replace(Bytes),
}

/// An event whose data is a JSON object with router-only fields, rewritten
/// without them; `None` for every other event (sent as it came).
pub fn without_router_fields(event: &[u8]) -> Option<Bytes> {
    let data = single_data_line(event)?;
    let clean = crate::body::answer_without_router_fields(data)?;
    Some(Bytes::from(format!("data: {clean}\n\n")))
}

/// Accumulates bytes and yields complete events (each with its blank-line terminator).
#[derive(Default)]
pub struct EventSplitter {
    buf: BytesMut,
    /// No event boundary ends before this offset of `buf` (already searched),
    /// so an event arriving in many chunks is not searched from its start each time.
    searched: usize,
}

/// End (exclusive) of the first blank line at or after `from`: "\n\n" or "\r\n\r\n".
/// One pass over the line feeds, so a buffer of many events costs its length once.
fn find_boundary(b: &[u8], from: usize) -> Option<usize> {
    let from = from.min(b.len());
    memchr::memchr_iter(b'\n', &b[from..])
        .map(|i| i + from)
        .find_map(|i| match b.get(i + 1) {
            Some(b'\n') => Some(i + 2),
            Some(b'\r') if i > 0 && b[i - 1] == b'\r' && b.get(i + 2) == Some(&b'\n') => {
                Some(i + 3)
            }
            _ => None,
        })
}

impl EventSplitter {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Where the next complete event ends, searching from `at`.
    fn boundary_from(&mut self, at: usize) -> Option<usize> {
        let found = find_boundary(&self.buf, self.searched.max(at));
        if found.is_none() {
            // A boundary straddling the end needs at most 3 earlier bytes.
            self.searched = self.buf.len().saturating_sub(3);
        }
        found
    }

    /// The next complete event, if the buffer holds one.
    pub fn next_event(&mut self) -> Option<Bytes> {
        let end = self.boundary_from(0)?;
        self.searched = 0;
        Some(self.buf.split_to(end).freeze())
    }

    /// The first complete event, left in the buffer.
    pub fn peek_event(&mut self) -> Option<&[u8]> {
        let end = self.boundary_from(0)?;
        Some(&self.buf[..end])
    }

    /// All complete events in the buffer, each kept, dropped or replaced as
    /// `pass` says, as one buffer. When every event is kept (a stream's usual
    /// chunk) the bytes are handed on without a copy. `None` when nothing is to
    /// be sent.
    pub fn take_events(&mut self, mut pass: impl FnMut(&[u8]) -> Pass) -> Option<Bytes> {
        let mut end = 0;
        let mut changed: Vec<(usize, usize, Option<Bytes>)> = Vec::new();
        while let Some(next) = self.boundary_from(end) {
            match pass(&self.buf[end..next]) {
                Pass::Keep => {}
                Pass::Drop => changed.push((end, next, None)),
                Pass::Replace(b) => changed.push((end, next, Some(b))),
            }
            end = next;
        }
        if end == 0 {
            return None;
        }
        self.searched = self.searched.saturating_sub(end);
        let all = self.buf.split_to(end).freeze();
        if changed.is_empty() {
            return Some(all);
        }
        let mut out = BytesMut::with_capacity(end);
        let mut at = 0;
        for (a, b, with) in changed {
            out.extend_from_slice(&all[at..a]);
            if let Some(with) = with {
                out.extend_from_slice(&with);
            }
            at = b;
        }
        out.extend_from_slice(&all[at..]);
        (!out.is_empty()).then(|| out.freeze())
    }

    /// Whatever is left when the stream ends (an unterminated last event).
    pub fn take_rest(&mut self) -> Option<Bytes> {
        self.searched = 0;
        (!self.buf.is_empty()).then(|| self.buf.split().freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ppd_core::identity::ContentHasher;

    #[test]
    fn events_split_across_chunks_are_reassembled() {
        let mut s = EventSplitter::default();
        s.push(b"data: {\"choices\":[{\"delta\":{}}]}\n");
        assert!(s.next_event().is_none());
        s.push(b"\ndata: [DO");
        let e = s.next_event().unwrap();
        assert_eq!(&e[..], b"data: {\"choices\":[{\"delta\":{}}]}\n\n");
        s.push(b"NE]\n\n");
        assert_eq!(classify(&s.next_event().unwrap()), EventKind::Done);
        assert!(s.take_rest().is_none());
    }

    #[test]
    fn usage_only_chunk_is_recognised() {
        let e = b"data: {\"id\":\"x\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":5,\"total_tokens\":17}}\n\n";
        assert_eq!(
            classify(e),
            EventKind::UsageOnly(Usage {
                prompt_tokens: 12,
                completion_tokens: 5
            })
        );
        let e = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n";
        assert_eq!(classify(e), EventKind::Data { usage: None });
        assert_eq!(
            classify(b"data: {\"error\":{\"message\":\"x\"}}\n\n"),
            EventKind::Error
        );
        assert_eq!(classify(b": keep-alive\n\n"), EventKind::Other);
        let token = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
        assert_eq!(classify(token), EventKind::Data { usage: None });
        assert_eq!(classify(b"data: not json\n\n"), EventKind::Other);
    }

    #[test]
    fn crlf_boundaries_work() {
        let mut s = EventSplitter::default();
        s.push(b"data: [DONE]\r\n\r\nrest");
        assert_eq!(classify(&s.next_event().unwrap()), EventKind::Done);
        assert_eq!(&s.take_rest().unwrap()[..], b"rest");
    }

    #[test]
    fn take_events_hands_whole_events_on_and_cuts_only_the_dropped_one() {
        let mut s = EventSplitter::default();
        s.push(b"data: {\"choices\":[1]}\n\ndata: {\"choices\":[],\"usage\":{}}\n\ndata: [DO");
        let out = s
            .take_events(|ev| {
                if ev.starts_with(b"data: {\"choices\":[]") {
                    Pass::Drop
                } else {
                    Pass::Keep
                }
            })
            .unwrap();
        assert_eq!(&out[..], b"data: {\"choices\":[1]}\n\n");
        assert!(s.take_events(|_| Pass::Keep).is_none());
        s.push(b"NE]\n");
        assert!(s.take_events(|_| Pass::Keep).is_none());
        s.push(b"\n");
        assert_eq!(
            &s.take_events(|_| Pass::Keep).unwrap()[..],
            b"data: [DONE]\n\n"
        );
        s.push(b"data: x\n\n");
        assert!(s.take_events(|_| Pass::Drop).is_none());
        assert!(s.take_rest().is_none());
    }

    #[test]
    fn router_only_fields_are_cut_out_of_stream_chunks() {
        let mut s = EventSplitter::default();
        s.push(b"data: {\"choices\":[1],\"kv_transfer_params\":{\"remote_host\":\"h\"}}\n\ndata: {\"choices\":[2]}\n\n");
        let out = s
            .take_events(|ev| without_router_fields(ev).map_or(Pass::Keep, Pass::Replace))
            .unwrap();
        assert_eq!(
            &out[..],
            b"data: {\"choices\":[1]}\n\ndata: {\"choices\":[2]}\n\n"
        );
    }

    fn token_chunk(event: &[u8]) -> Option<Cow<'_, str>> {
        match vllm_chunk(event)? {
            VllmChunk::Token(t) => Some(t),
            VllmChunk::Usage(_) => None,
        }
    }

    fn usage_chunk(event: &[u8]) -> Option<Usage> {
        match vllm_chunk(event)? {
            VllmChunk::Usage(u) => Some(u),
            VllmChunk::Token(_) => None,
        }
    }

    fn vllm_event(delta: &str, tail: &str) -> Vec<u8> {
        format!(
            "data: {{\"id\":\"chatcmpl-7f3a\",\"object\":\"chat.completion.chunk\",\"created\":1765100000,\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"choices\":[{{\"index\":0,\"delta\":{{{delta}}},\"logprobs\":null,\"finish_reason\":{tail}}}]}}\n\n"
        )
        .into_bytes()
    }

    #[test]
    fn a_vllm_token_chunk_is_read_in_one_pass() {
        let plain = vllm_event(r#""content":" the""#, "null");
        assert_eq!(token_chunk(&plain).as_deref(), Some(" the"));
        let with_ids = vllm_event(r#""content":"a \"b\" \u00e9""#, r#"null,"token_ids":null"#);
        assert_eq!(token_chunk(&with_ids).as_deref(), Some("a \"b\" é"));
        let role = vllm_event(r#""role":"assistant","content":"""#, "null");
        assert_eq!(token_chunk(&role).as_deref(), Some(""));
    }

    #[test]
    fn every_other_event_goes_the_general_way() {
        for ev in [
            vllm_event(r#""content":"x""#, r#""stop""#),
            vllm_event(r#""content":"x""#, r#"null,"token_ids":[5]"#),
            vllm_event(r#""content":"x","reasoning":"y""#, "null"),
            vllm_event(r#""content":"x""#, "null").replace_str(
                "}]}",
                r#"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#,
            ),
            vllm_event(r#""content":"x""#, "null")
                .replace_str("}]}", r#"}],"kv_transfer_params":{"remote_host":"h"}}"#),
            vllm_event(r#""content":"x""#, "null").replace_str(r#""index":0"#, r#""index":1"#),
            vllm_event(r#""content":"x""#, "null").replace_str("Llama", r#"Ll\"ama"#),
            vllm_event(r#""content":"x""#, "null").replace_str("\n\n", "\r\n\r\n"),
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n".to_vec(),
            b"data: {\"error\":{\"message\":\"x\"}}\n\n".to_vec(),
            b"data: [DONE]\n\n".to_vec(),
            b": keep-alive\n\n".to_vec(),
        ] {
            assert_eq!(token_chunk(&ev), None, "{}", String::from_utf8_lossy(&ev));
        }
    }

    #[test]
    fn vllm_s_usage_chunk_and_end_are_read_without_a_parse_of_the_rest() {
        let usage = b"data: {\"id\":\"chatcmpl-7f3a\",\"object\":\"chat.completion.chunk\",\"created\":1765100000,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"total_tokens\":17,\"completion_tokens\":5}}\n\n";
        let expect = Usage {
            prompt_tokens: 12,
            completion_tokens: 5,
        };
        assert_eq!(usage_chunk(usage), Some(expect));
        assert_eq!(classify(usage), EventKind::UsageOnly(expect));
        // Anything after the usage (a router-only field) is left to the general way.
        let more = String::from_utf8_lossy(usage).replace("}}\n", "},\"kv_transfer_params\":{}}\n");
        assert_eq!(usage_chunk(more.as_bytes()), None);
        assert_eq!(usage_chunk(&vllm_event(r#""content":"x""#, "null")), None);
        assert!(is_done(b"data: [DONE]\n\n"));
        assert_eq!(classify(b"data: [DONE]\n\n"), EventKind::Done);
        assert!(!is_done(b"data: [DONE]\r\n\r\n"));
    }

    trait ReplaceStr {
        fn replace_str(self, from: &str, to: &str) -> Vec<u8>;
    }
    impl ReplaceStr for Vec<u8> {
        fn replace_str(self, from: &str, to: &str) -> Vec<u8> {
            String::from_utf8(self)
                .unwrap()
                .replacen(from, to, 1)
                .into_bytes()
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// Whatever the one-pass read takes, the general reading would
        /// have treated alike: data without usage, no router field, the
        /// same text added to the answer.
        #[test]
        fn the_one_pass_read_agrees_with_the_general_one(
            text in "(?s).{0,12}",
            role in proptest::bool::ANY,
            finish in proptest::sample::select(vec!["null", r#""stop""#, r#"null,"token_ids":null"#, r#"null,"usage":null"#]),
            extra in proptest::sample::select(vec!["", r#","usage":{"prompt_tokens":2,"completion_tokens":3}"#, r#","kv_transfer_params":{"a":1}"#, r#","error":{"message":"m"}"#]),
        ) {
            let content = serde_json::to_string(&text).unwrap();
            let delta = if role {
                format!(r#""role":"assistant","content":{content}"#)
            } else {
                format!(r#""content":{content}"#)
            };
            let ev = vllm_event(&delta, finish).replace_str("}]}", &format!("}}]{extra}}}"));
            let plain = extra.is_empty() && (finish == "null" || finish.contains("token_ids"));
            let read = token_chunk(&ev);
            proptest::prop_assert_eq!(read.is_some(), plain);
            if let Some(t) = read {
                proptest::prop_assert_eq!(t.as_ref(), text.as_str());
                proptest::prop_assert_eq!(classify(&ev), EventKind::Data { usage: None });
                proptest::prop_assert!(without_router_fields(&ev).is_none());
                let (mut general, mut fast) = (ContentHasher::new(), ContentHasher::new());
                crate::answer::feed_event(&ev, &mut general);
                fast.update(&t);
                proptest::prop_assert_eq!(general.digest(), fast.digest());
            }
        }
    }

    /// The splitter and classifier before they were tuned, as references.
    fn boundary_reference(b: &[u8]) -> Option<usize> {
        let lf = b.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
        let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
        match (lf, crlf) {
            (Some(a), Some(c)) => Some(a.min(c)),
            (a, c) => a.or(c),
        }
    }

    fn classify_reference(event: &[u8]) -> EventKind {
        let Ok(text) = std::str::from_utf8(event) else {
            return EventKind::Other;
        };
        let mut data = String::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("data:") {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(rest.strip_prefix(' ').unwrap_or(rest));
            }
        }
        let data = data.trim();
        if data.is_empty() {
            return EventKind::Other;
        }
        if data == "[DONE]" {
            return EventKind::Done;
        }
        if data.starts_with('{')
            && data.contains("\"choices\"")
            && !data.contains("\"usage\"")
            && !data.contains("\"error\"")
        {
            return EventKind::Data { usage: None };
        }
        match serde_json::from_str::<ChunkView>(data) {
            Ok(c) if c.error.is_some() => EventKind::Error,
            Ok(c) => match (c.choices.as_ref().map(Vec::len), c.usage) {
                (Some(0), Some(u)) => EventKind::UsageOnly(u),
                (_, usage) => EventKind::Data { usage },
            },
            Err(_) => EventKind::Other,
        }
    }

    fn piece() -> impl proptest::strategy::Strategy<Value = &'static str> {
        proptest::sample::select(vec![
            "data:",
            "data: ",
            " ",
            "\n",
            "\r",
            "\r\n",
            "\n\n",
            "{",
            "}",
            "[",
            "]",
            ",",
            ":",
            "\"choices\"",
            "\"usage\"",
            "\"error\"",
            "\"x\"",
            "1",
            "null",
            "{\"prompt_tokens\":3,\"completion_tokens\":2}",
            "[DONE]",
            "é",
            "event: e",
        ])
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        #[test]
        fn splitting_and_classifying_match_the_references(
            parts in proptest::collection::vec(piece(), 0..24),
            cut in 0usize..200,
        ) {
            let all: Vec<u8> = parts.concat().into_bytes();
            // The same events, whether the bytes come in one chunk or two.
            let mut expect = Vec::new();
            let mut rest: &[u8] = &all;
            while let Some(end) = boundary_reference(rest) {
                expect.push(rest[..end].to_vec());
                rest = &rest[end..];
            }
            let mut s = EventSplitter::default();
            let cut = cut.min(all.len());
            s.push(&all[..cut]);
            let mut got = Vec::new();
            while let Some(e) = s.next_event() {
                got.push(e.to_vec());
            }
            s.push(&all[cut..]);
            if let Some(b) = s.take_events(|_| Pass::Keep) {
                let mut b: &[u8] = &b;
                while let Some(end) = boundary_reference(b) {
                    got.push(b[..end].to_vec());
                    b = &b[end..];
                }
            }
            proptest::prop_assert_eq!(&got, &expect);
            proptest::prop_assert_eq!(s.take_rest().map(|b| b.to_vec()).unwrap_or_default(), rest.to_vec());
            for e in &expect {
                proptest::prop_assert_eq!(classify(e), classify_reference(e));
            }
            proptest::prop_assert_eq!(classify(&all), classify_reference(&all));

        }
    }
}
