//! The answer's text as the client will present it in its next turn's history (choice 0's content), hashed as it passes, never buffered.

use serde::Deserialize;
use std::borrow::Cow;

use ppd_core::identity::ContentHasher;

use crate::sse::Usage;

#[derive(Deserialize)]
struct Whole<'a> {
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(borrow, default)]
    choices: Vec<Choice<'a>>,
    /// A bidirectional D's pin (whole answers only), for the next turn's pull.
    #[serde(borrow, default)]
    kv_transfer_params: Option<&'a serde_json::value::RawValue>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: u32,
    #[serde(borrow, default)]
    message: Option<Text<'a>>,
    #[serde(borrow, default)]
    delta: Option<Text<'a>>,
}

#[derive(Deserialize)]
struct Text<'a> {
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
}

/// What a whole (non-streamed) answer tells the bookkeeping.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct WholeAnswer {
    pub usage: Option<Usage>,
    /// The digest of choice 0's `message.content` (`None` when the body is
    /// not an answer the router can read).
    pub digest: Option<u128>,
    /// The node's `kv_transfer_params`, when it sent any.
    pub pin: Option<serde_json::Value>,
}

/// Reads usage and answer of a whole chat answer in one parse.
pub(crate) fn whole(body: &[u8]) -> WholeAnswer {
    let Ok(w) = serde_json::from_slice::<Whole<'_>>(body) else {
        return WholeAnswer::default();
    };
    let digest = w.choices.iter().find(|c| c.index == 0).map(|c| {
        let text = c.message.as_ref().and_then(|m| m.content.as_deref());
        let mut h = ContentHasher::new();
        h.update(text.unwrap_or(""));
        h.digest()
    });
    WholeAnswer {
        usage: w.usage,
        digest,
        pin: w
            .kv_transfer_params
            .and_then(|raw| serde_json::from_str(raw.get()).ok())
            .filter(|v: &serde_json::Value| !v.is_null()),
    }
}

/// Feeds what one stream event adds to choice 0's content.
pub(crate) fn feed_event(event: &[u8], into: &mut ContentHasher) {
    if let Some(text) = token_text(event) {
        into.update(&text);
        return;
    }
    let Some(data) = crate::sse::event_data(event) else {
        return;
    };
    let choices = match choices_of(&data) {
        Some(c) => c,
        None => match serde_json::from_str::<Whole<'_>>(data.trim()) {
            Ok(chunk) => chunk.choices,
            Err(_) => return,
        },
    };
    for c in choices.iter().filter(|c| c.index == 0) {
        if let Some(text) = c.delta.as_ref().and_then(|d| d.content.as_deref()) {
            into.update(text);
        }
    }
}

/// The text of a token chunk as vLLM writes it: one `data:` line whose
/// choices start with choice 0's content delta. Only that JSON string is
/// parsed (by serde_json, escapes and UTF-8 checked), found by the literal
/// prefix: a third of the cost of parsing the choices, at every token of
/// every answer. `None` (the event is parsed) for any other shape.
fn token_text(event: &[u8]) -> Option<Cow<'_, str>> {
    use memchr::memmem::Finder;
    use std::sync::LazyLock;
    static PREFIX: LazyLock<Finder<'static>> =
        LazyLock::new(|| Finder::new(b"\"choices\":[{\"index\":0,\"delta\":{\"content\":"));
    let data = crate::sse::single_data_line(event)?;
    let at = PREFIX.find(data)? + PREFIX.needle().len();
    crate::sse::json_string(&data[at..]).map(|(text, _)| text)
}

/// The `choices` array of a chunk, parsed from where its key is: vLLM
/// writes `id`, `object`, `created` and `model` before it, and skipping
/// them by a search instead of a parse took ~40 % off the relay's cost per
/// token (callgrind). The key cannot be matched inside a string (its quotes
/// would be escaped there) and no field before it holds an object; `None`
/// (parse it all) when the key is not written this way.
fn choices_of(data: &str) -> Option<Vec<Choice<'_>>> {
    use memchr::memmem::Finder;
    use serde::Deserialize as _;
    use std::sync::LazyLock;
    static KEY: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"choices\":"));
    let at = KEY.find(data.as_bytes())? + KEY.needle().len();
    let mut de = serde_json::Deserializer::from_str(&data[at..]);
    Vec::<Choice<'_>>::deserialize(&mut de).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ppd_core::request::ContentText;

    #[test]
    fn a_streamed_answer_and_a_whole_one_give_the_same_digest() {
        let whole_body = br#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"hi \"there\" \u00e9"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#;
        let w = whole(whole_body);
        assert_eq!(
            w.usage,
            Some(Usage {
                prompt_tokens: 3,
                completion_tokens: 4
            })
        );
        let mut h = ContentHasher::new();
        for ev in [
            &b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n"[..],
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi \\\"the\"}}]}\n\n",
            b": keep-alive\n\n",
            b"data: {\"choices\":[{\"index\":1,\"delta\":{\"content\":\"other choice\"}}]}\n\n",
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"re\\\" \\u00e9\"}}]}\n\n",
            b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\n",
            b"data: [DONE]\n\n",
        ] {
            feed_event(ev, &mut h);
        }
        assert_eq!(w.digest, Some(h.digest()));
        assert_eq!(
            w.digest,
            Some(ContentHasher::of(&ContentText::One(
                "hi \"there\" é".into()
            )))
        );
    }

    #[test]
    fn a_multi_line_event_is_read_like_a_single_line_one() {
        let mut a = ContentHasher::new();
        feed_event(
            b"data: {\"choices\":[{\"delta\":\ndata: {\"content\":\"x\"}}]}\n\n",
            &mut a,
        );
        let mut b = ContentHasher::new();
        b.update("x");
        assert_eq!(a.digest(), b.digest());
    }

    #[test]
    fn a_token_chunk_is_read_from_its_content_string_alone() {
        let ev = b"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a \\\"b\\\" \\u00e9\"},\"finish_reason\":null}]}\n\n";
        assert_eq!(token_text(ev).as_deref(), Some("a \"b\" é"));
        let mut fast = ContentHasher::new();
        feed_event(ev, &mut fast);
        let mut full = ContentHasher::new();
        full.update("a \"b\" é");
        assert_eq!(fast.digest(), full.digest());
        // Other shapes are parsed whole: choice 1, a role first, null content.
        for other in [
            &b"data: {\"choices\":[{\"index\":1,\"delta\":{\"content\":\"x\"}}]}\n\n"[..],
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":null}}]}\n\n",
        ] {
            assert_eq!(token_text(other), None, "{}", String::from_utf8_lossy(other));
        }
    }

    #[test]
    fn choices_are_read_wherever_their_key_stands() {
        let digest = |ev: &[u8]| {
            let mut h = ContentHasher::new();
            feed_event(ev, &mut h);
            h.digest()
        };
        let mut x = ContentHasher::new();
        x.update("x");
        for ev in [
            &b"data: {\"id\":\"a\\\"choices\\\":[\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"}}]}\n\n"[..],
            b"data: {\"choices\" : [{\"index\":0,\"delta\":{\"content\":\"x\"}}],\"id\":\"a\"}\n\n",
            b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"},\"index\":0}],\"usage\":null}\n\n",
        ] {
            assert_eq!(digest(ev), x.digest(), "{}", String::from_utf8_lossy(ev));
        }
        // A key the search finds but whose value is no array: the whole parse decides.
        assert_eq!(
            digest(b"data: {\"choices\":5}\n\n"),
            ContentHasher::new().digest()
        );
    }

    #[test]
    fn a_tool_call_answer_without_content_is_the_empty_text() {
        let w = whole(br#"{"choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[]}}]}"#);
        assert_eq!(w.digest, Some(ContentHasher::of(&ContentText::Empty)));
        assert_eq!(whole(b"not json").digest, None);
    }
}
