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
