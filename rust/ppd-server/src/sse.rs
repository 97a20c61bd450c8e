//! Splits an SSE byte stream into whole events, so the relay can read usage and drop the chunk it asked for.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;

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

pub fn classify(event: &[u8]) -> EventKind {
    let text = match std::str::from_utf8(event) {
        Ok(t) => t,
        Err(_) => return EventKind::Other,
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
    // Token chunks are most of a stream: one without "usage" or "error" in it
    // needs no JSON parse to be known as data.
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

/// Accumulates bytes and yields complete events (each with its blank-line terminator).
#[derive(Default)]
pub struct EventSplitter {
    buf: BytesMut,
}

fn find_boundary(b: &[u8]) -> Option<usize> {
    // Events end at a blank line: "\n\n" or "\r\n\r\n".
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

impl EventSplitter {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete event, if the buffer holds one.
    pub fn next_event(&mut self) -> Option<Bytes> {
        let end = find_boundary(&self.buf)?;
        Some(self.buf.split_to(end).freeze())
    }

    /// Whatever is left when the stream ends (an unterminated last event).
    pub fn take_rest(&mut self) -> Option<Bytes> {
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
}
