//! The parts of an OpenAI-style request body that routing reads, parsed without copying the rest.

use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;

use crate::error::Error;

/// A `/v1/chat/completions` or `/v1/completions` body, as far as routing needs it.
/// Message contents stay raw JSON until counted, so unread fields cost nothing.
#[derive(Debug, Deserialize)]
pub struct RequestView<'a> {
    #[serde(borrow, default)]
    pub model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub messages: Option<Vec<MessageView<'a>>>,
    #[serde(borrow, default)]
    pub prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub conversation_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub session_id: Option<Cow<'a, str>>,
    /// OpenAI's end-user id: names the conversation only where the operator
    /// allows it (an end user may hold several conversations at once).
    #[serde(borrow, default)]
    pub user: Option<Cow<'a, str>>,
    /// As written; [`parse_request`] admits only whole numbers ≥ 1.
    #[serde(default)]
    pub max_tokens: Option<serde_json::Number>,
    #[serde(default)]
    pub max_completion_tokens: Option<serde_json::Number>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptionsView>,
    /// Whether the client sent `kv_transfer_params`, a field only the router
    /// may set (it steers a node's KV connector); null counts as sent.
    #[serde(default)]
    pub kv_transfer_params: Present,
}

/// Whether a field was in the body at all, whatever its value.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Present(pub bool);

impl<'de> Deserialize<'de> for Present {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(d).map(|_| Present(true))
    }
}

#[derive(Debug, Deserialize)]
pub struct StreamOptionsView {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

impl RequestView<'_> {
    /// The output limit the client set: `max_completion_tokens`, else `max_tokens`.
    pub fn output_limit(&self) -> Option<u64> {
        self.max_completion_tokens
            .as_ref()
            .or(self.max_tokens.as_ref())
            .and_then(serde_json::Number::as_u64)
    }

    pub fn is_stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }
    /// Whether the client itself asked for the final usage chunk of a stream.
    pub fn wants_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

#[derive(Debug, Deserialize)]
pub struct MessageView<'a> {
    #[serde(borrow)]
    pub role: Cow<'a, str>,
    #[serde(borrow, default)]
    pub content: Option<&'a RawValue>,
}

#[derive(Debug, Deserialize)]
struct ContentPart<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

/// The text of a message's content: a string, or the `text` parts of a list
/// (joined by newlines); `null` and non-text parts contribute nothing.
#[derive(Debug, PartialEq, Eq)]
pub enum ContentText<'a> {
    Empty,
    One(Cow<'a, str>),
    Parts(Vec<Cow<'a, str>>),
}

impl<'a> ContentText<'a> {
    pub fn parse(raw: Option<&'a RawValue>) -> Result<Self, Error> {
        let Some(raw) = raw else {
            return Ok(ContentText::Empty);
        };
        let s = raw.get().trim_start();
        match s.as_bytes().first() {
            Some(b'"') => {
                let text: Cow<'a, str> = serde_json::from_str(raw.get())
                    .map_err(|e| Error::BadRequest(format!("message content: {e}")))?;
                Ok(ContentText::One(text))
            }
            Some(b'[') => {
                let parts: Vec<ContentPart<'a>> = serde_json::from_str(raw.get())
                    .map_err(|e| Error::BadRequest(format!("message content parts: {e}")))?;
                let texts = parts
                    .into_iter()
                    .filter(|p| p.kind.as_deref().is_none_or(|k| k == "text"))
                    .filter_map(|p| p.text)
                    .collect();
                Ok(ContentText::Parts(texts))
            }
            Some(b'n') if s == "null" => Ok(ContentText::Empty),
            _ => Err(Error::BadRequest(
                "message content must be a string, a list of parts or null".into(),
            )),
        }
    }

    /// Tokens of the content under a counter (parts counted one by one).
    pub fn count(&self, counter: &dyn crate::tokens::TokenCounter) -> u32 {
        match self {
            ContentText::Empty => 0,
            ContentText::One(t) => counter.count(t),
            ContentText::Parts(ps) => ps
                .iter()
                .fold(0u32, |acc, p| acc.saturating_add(counter.count(p))),
        }
    }

    /// The whole text, parts joined by `\n` (what the conversation hash reads).
    pub fn joined(&self) -> Cow<'_, str> {
        match self {
            ContentText::Empty => Cow::Borrowed(""),
            ContentText::One(t) => Cow::Borrowed(t.as_ref()),
            ContentText::Parts(ps) if ps.len() == 1 => Cow::Borrowed(ps[0].as_ref()),
            ContentText::Parts(ps) => {
                Cow::Owned(ps.iter().map(|p| p.as_ref()).collect::<Vec<_>>().join("\n"))
            }
        }
    }
}

/// The `prompt` of `/v1/completions`: a string, a list of strings (the first is
/// routed), or token ids (a list of integers, or a list of such lists).
#[derive(Debug, PartialEq, Eq)]
pub enum PromptText<'a> {
    Text(Cow<'a, str>),
    TokenIds(Vec<u32>),
}

impl<'a> PromptText<'a> {
    pub fn parse(raw: &'a RawValue) -> Result<Self, Error> {
        let bad = |e: serde_json::Error| Error::BadRequest(format!("prompt: {e}"));
        let s = raw.get().trim_start();
        if s.starts_with('"') {
            return Ok(PromptText::Text(
                serde_json::from_str(raw.get()).map_err(bad)?,
            ));
        }
        if !s.starts_with('[') {
            return Err(Error::BadRequest(
                "prompt must be a string, a list of strings or token ids".into(),
            ));
        }
        let items: Vec<&'a RawValue> = serde_json::from_str(raw.get()).map_err(bad)?;
        let Some(first) = items.first() else {
            return Err(Error::BadRequest("prompt must not be empty".into()));
        };
        let f = first.get().trim_start();
        if f.starts_with('"') {
            Ok(PromptText::Text(
                serde_json::from_str(first.get()).map_err(bad)?,
            ))
        } else if f.starts_with('[') {
            Ok(PromptText::TokenIds(
                serde_json::from_str(first.get()).map_err(bad)?,
            ))
        } else {
            Ok(PromptText::TokenIds(
                serde_json::from_str(raw.get()).map_err(bad)?,
            ))
        }
    }
}

/// Parses a request body; a clear error names what is wrong.
pub fn parse_request(body: &str) -> Result<RequestView<'_>, Error> {
    let view: RequestView<'_> = serde_json::from_str(body)
        .map_err(|e| Error::BadRequest(format!("invalid JSON body: {e}")))?;
    if view.messages.is_none() && view.prompt.is_none() {
        return Err(Error::BadRequest(
            "body has neither `messages` nor `prompt`".into(),
        ));
    }
    for (name, n) in [
        ("max_tokens", &view.max_tokens),
        ("max_completion_tokens", &view.max_completion_tokens),
    ] {
        if let Some(n) = n {
            if n.as_u64().is_none_or(|v| v < 1) {
                return Err(Error::BadRequest(format!(
                    "{name} must be a whole number of at least 1, got {n}"
                )));
            }
        }
    }
    Ok(view)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_and_part_contents_both_parse() {
        let body = r#"{"messages":[{"role":"user","content":"hi there"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]}]}"#;
        let v = parse_request(body).unwrap();
        let msgs = v.messages.unwrap();
        assert_eq!(
            ContentText::parse(msgs[0].content).unwrap().joined(),
            "hi there"
        );
        assert_eq!(
            ContentText::parse(msgs[1].content).unwrap().joined(),
            "a\nb"
        );
    }

    #[test]
    fn escaped_strings_are_decoded() {
        let body = r#"{"messages":[{"role":"user","content":"line\none \"q\""}]}"#;
        let v = parse_request(body).unwrap();
        let msgs = v.messages.unwrap();
        assert_eq!(
            ContentText::parse(msgs[0].content).unwrap().joined(),
            "line\none \"q\""
        );
    }

    #[test]
    fn bad_bodies_are_rejected_with_reasons() {
        assert!(parse_request("not json").is_err());
        assert!(parse_request("{}").is_err());
        for (body, said) in [
            (
                r#"{"messages":[],"max_tokens":-3}"#,
                "max_tokens must be a whole number of at least 1, got -3",
            ),
            (
                r#"{"messages":[],"max_tokens":0}"#,
                "max_tokens must be a whole number of at least 1, got 0",
            ),
            (
                r#"{"prompt":"x","max_completion_tokens":2.5}"#,
                "max_completion_tokens must be a whole number of at least 1, got 2.5",
            ),
        ] {
            let e = parse_request(body).unwrap_err().to_string();
            // A plain message: no serde position ("at line 1 column …").
            assert_eq!(e, format!("bad request: {said}"));
        }
        let v =
            parse_request(r#"{"prompt":"x","max_tokens":7,"max_completion_tokens":9}"#).unwrap();
        assert_eq!(v.output_limit(), Some(9));
        let v = parse_request(r#"{"messages":[{"role":"user","content":7}]}"#).unwrap();
        assert!(ContentText::parse(v.messages.unwrap()[0].content).is_err());
    }

    #[test]
    fn a_router_only_field_is_seen_whatever_its_value() {
        for body in [
            r#"{"prompt":"x","kv_transfer_params":{"do_remote_prefill":true}}"#,
            r#"{"prompt":"x","kv_transfer_params":null}"#,
        ] {
            assert!(parse_request(body).unwrap().kv_transfer_params.0, "{body}");
        }
        let v = parse_request(r#"{"prompt":"kv_transfer_params"}"#).unwrap();
        assert!(!v.kv_transfer_params.0);
    }

    #[test]
    fn prompt_forms_parse() {
        let v = parse_request(r#"{"prompt":"hello"}"#).unwrap();
        assert_eq!(
            PromptText::parse(v.prompt.unwrap()).unwrap(),
            PromptText::Text("hello".into())
        );
        let v = parse_request(r#"{"prompt":["a","b"]}"#).unwrap();
        assert_eq!(
            PromptText::parse(v.prompt.unwrap()).unwrap(),
            PromptText::Text("a".into())
        );
        let v = parse_request(r#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(
            PromptText::parse(v.prompt.unwrap()).unwrap(),
            PromptText::TokenIds(vec![1, 2, 3])
        );
        let v = parse_request(r#"{"prompt":[[4,5]]}"#).unwrap();
        assert_eq!(
            PromptText::parse(v.prompt.unwrap()).unwrap(),
            PromptText::TokenIds(vec![4, 5])
        );
        let v = parse_request(r#"{"prompt":[]}"#).unwrap();
        assert!(PromptText::parse(v.prompt.unwrap()).is_err());
    }
}
