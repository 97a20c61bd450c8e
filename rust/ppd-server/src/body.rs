//! Rewrites the top level of a JSON request body without parsing what lies below it.
//!
//! The pd path must change a few top-level fields (stream, max_tokens,
//! kv_transfer_params, …) of bodies that may carry long histories; only the
//! top-level keys are read, every value is copied through as raw text.

use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

struct TopLevel<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de> serde::Deserialize<'de> for TopLevel<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TopLevel<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut out: Vec<(Cow<'de, str>, &'de RawValue)> = Vec::new();
                while let Some((k, v)) = m.next_entry::<Cow<'de, str>, &'de RawValue>()? {
                    // A repeated key keeps its first position and its last value, as JSON parsers do.
                    match out.iter_mut().find(|(ok, _)| *ok == k) {
                        Some(slot) => slot.1 = v,
                        None => out.push((k, v)),
                    }
                }
                Ok(TopLevel(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// Top-level fields only the router may set: they steer a node's KV connector
/// (vLLM's NIXL `kv_transfer_params` makes a node hold, send or fetch KV from a
/// host of the sender's choosing). Removed from every client body and from
/// every answer the client sees.
pub const ROUTER_ONLY_FIELDS: [&str; 1] = ["kv_transfer_params"];

/// The edits that drop the router-only fields a client body carries.
pub fn drop_router_fields(
    view: &ppd_core::request::RequestView<'_>,
) -> impl Iterator<Item = Edit<'static>> {
    view.kv_transfer_params
        .0
        .then_some(Edit::Remove(ROUTER_ONLY_FIELDS[0]))
        .into_iter()
}

/// A node's JSON answer without the router-only fields, or `None` when it has
/// none at the top level (or is not a JSON object) and goes out unchanged.
pub fn answer_without_router_fields(json: &[u8]) -> Option<String> {
    use std::sync::LazyLock;
    static NEEDLE: LazyLock<memchr::memmem::Finder<'static>> =
        LazyLock::new(|| memchr::memmem::Finder::new(b"\"kv_transfer_params\""));
    NEEDLE.find(json)?;
    let text = std::str::from_utf8(json).ok()?;
    let TopLevel(fields) = serde_json::from_str::<TopLevel<'_>>(text).ok()?;
    if !fields
        .iter()
        .any(|(k, _)| ROUTER_ONLY_FIELDS.contains(&k.as_ref()))
    {
        return None;
    }
    let edits: Vec<Edit<'_>> = ROUTER_ONLY_FIELDS.iter().map(|k| Edit::Remove(k)).collect();
    rewrite(text, &edits).ok()
}

/// One change to the top level: set a key to raw JSON, or remove it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Edit<'a> {
    Set(&'a str, Cow<'a, str>),
    Remove(&'a str),
}

/// Applies the edits in order; set keys keep their position when present and
/// are appended otherwise. Fails only on a body that is not a JSON object.
pub fn rewrite(body: &str, edits: &[Edit<'_>]) -> Result<String, serde_json::Error> {
    let TopLevel(mut fields) = serde_json::from_str::<TopLevel<'_>>(body)?;
    let mut owned: Vec<(Cow<'_, str>, Cow<'_, str>)> = fields
        .drain(..)
        .map(|(k, v)| (k, Cow::Borrowed(v.get())))
        .collect();
    for e in edits {
        match e {
            Edit::Set(k, v) => match owned.iter_mut().find(|(ok, _)| ok == k) {
                Some(slot) => slot.1 = v.clone(),
                None => owned.push((Cow::Borrowed(*k), v.clone())),
            },
            Edit::Remove(k) => owned.retain(|(ok, _)| ok != k),
        }
    }
    let mut out = String::with_capacity(body.len() + 256);
    out.push('{');
    for (i, (k, v)) in owned.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&serde_json::to_string(k.as_ref())?);
        out.push(':');
        out.push_str(v);
    }
    out.push('}');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    #[test]
    fn sets_replace_in_place_and_append_new_keys() {
        let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"a\"b"}]}"#;
        let out = rewrite(
            body,
            &[
                Edit::Set("stream", "false".into()),
                Edit::Set("max_tokens", "1".into()),
            ],
        )
        .unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            v,
            json!({"model":"m","stream":false,"messages":[{"role":"user","content":"a\"b"}],"max_tokens":1})
        );
        assert!(out.starts_with(r#"{"model":"m","stream":false,"#));
    }

    #[test]
    fn removes_keys_and_keeps_nested_values_verbatim() {
        let body = r#"{"a": {"x": [1, 2.50, "é"]}, "stream_options": {"include_usage": false}, "b": null}"#;
        let out = rewrite(body, &[Edit::Remove("stream_options")]).unwrap();
        assert_eq!(out, r#"{"a":{"x": [1, 2.50, "é"]},"b":null}"#);
    }

    #[test]
    fn duplicate_keys_collapse_to_the_last_value() {
        let out = rewrite(r#"{"k":1,"j":2,"k":3}"#, &[]).unwrap();
        assert_eq!(out, r#"{"k":3,"j":2}"#);
    }

    #[test]
    fn answers_lose_the_router_only_fields_and_nothing_else() {
        let answer = br#"{"id":"x","choices":[{"text":"kv_transfer_params"}],"kv_transfer_params":{"remote_host":"10.0.0.9","remote_port":5600}}"#;
        let out = answer_without_router_fields(answer).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            v,
            json!({"id":"x","choices":[{"text":"kv_transfer_params"}]})
        );
        // Mentioned only inside a value: unchanged, no rewrite.
        assert!(answer_without_router_fields(
            br#"{"choices":[{"text":"\"kv_transfer_params\""}]}"#
        )
        .is_none());
        assert!(answer_without_router_fields(br#"{"id":"x"}"#).is_none());
        assert!(answer_without_router_fields(b"not json \"kv_transfer_params\"").is_none());
    }

    #[test]
    fn non_objects_are_errors() {
        assert!(rewrite("[1,2]", &[]).is_err());
        assert!(rewrite("{", &[]).is_err());
        assert!(rewrite("", &[]).is_err());
    }
}
