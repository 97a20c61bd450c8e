//! Rewrites the top level of a JSON request body without parsing what lies below it.
//!
//! The pd path must change a few top-level fields (stream, max_tokens,
//! kv_transfer_params, …) of bodies that may carry long histories; only the
//! top-level keys are read, every value is copied through as raw text.

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

/// A top-level key, borrowed from the body unless it holds escapes (serde's
/// own `Cow<str>` always copies: one allocation per key).
struct Key<'a>(Cow<'a, str>);

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Borrowed(s)))
            }
            fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Owned(s.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

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
                while let Some((Key(k), v)) = m.next_entry::<Key<'de>, &'de RawValue>()? {
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
/// are appended otherwise. When the edits only add keys, the client's bytes
/// are kept as sent (whitespace included) and the keys go before the closing
/// brace. Fails only on a body that is not a JSON object.
pub fn rewrite(body: &str, edits: &[Edit<'_>]) -> Result<String, serde_json::Error> {
    match appended(body, edits)? {
        Some(out) => Ok(out),
        None => rewritten_whole(body, edits),
    }
}

/// The rewrite of every top-level entry: keys written anew, values copied.
fn rewritten_whole(body: &str, edits: &[Edit<'_>]) -> Result<String, serde_json::Error> {
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
        push_key(&mut out, k)?;
        out.push(':');
        out.push_str(v);
    }
    out.push('}');
    Ok(out)
}

/// The body with the edits spliced in before its closing brace, when every
/// edit sets a key the body lacks (and none is set twice) and the body has
/// no repeated key: what the full rewrite would write, less the
/// re-serialisation of every entry the client sent (a stream's added
/// `stream_options`, on every request of the local path). `None` when the
/// full rewrite must run.
fn appended(body: &str, edits: &[Edit<'_>]) -> Result<Option<String>, serde_json::Error> {
    let sets_once = edits.iter().enumerate().all(|(i, e)| match e {
        Edit::Set(k, _) => !edits[..i].iter().any(|p| set_key(p) == Some(*k)),
        Edit::Remove(_) => false,
    });
    if !sets_once {
        return Ok(None);
    }
    let mut de = serde_json::Deserializer::from_str(body);
    let scan = KeyScan(edits).deserialize(&mut de)?;
    de.end()?;
    let Some(empty) = scan else {
        return Ok(None);
    };
    // A parsed object ends at its last byte that is not JSON whitespace.
    let close = body.trim_end_matches([' ', '\t', '\n', '\r']).len() - 1;
    let mut out = String::with_capacity(body.len() + 64);
    out.push_str(&body[..close]);
    for (i, e) in edits.iter().enumerate() {
        if let Edit::Set(k, v) = e {
            if i > 0 || !empty {
                out.push(',');
            }
            push_key(&mut out, k)?;
            out.push(':');
            out.push_str(v);
        }
    }
    out.push_str(&body[close..]);
    Ok(Some(out))
}

/// The key an edit sets, if it sets one.
fn set_key<'a>(e: &Edit<'a>) -> Option<&'a str> {
    match *e {
        Edit::Set(k, _) => Some(k),
        Edit::Remove(_) => None,
    }
}

/// Reads a body's top-level keys, values unread: `Some(whether the object
/// is empty)` when none of the given keys is there and no key repeats, else
/// `None` (a repeated key collapses in the full rewrite; splicing would keep
/// both).
struct KeyScan<'e>(&'e [Edit<'e>]);

impl<'de> DeserializeSeed<'de> for KeyScan<'_> {
    type Value = Option<bool>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for KeyScan<'_> {
    type Value = Option<bool>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
        // One allocation for the usual body's handful of keys.
        let mut seen: Vec<Cow<'de, str>> = Vec::with_capacity(8);
        let mut clash = false;
        while let Some(Key(k)) = m.next_key::<Key<'de>>()? {
            m.next_value::<IgnoredAny>()?;
            if clash {
                continue;
            }
            clash = seen.contains(&k) || self.0.iter().any(|e| set_key(e) == Some(k.as_ref()));
            seen.push(k);
        }
        Ok((!clash).then_some(seen.is_empty()))
    }
}

/// `k` as a JSON string, as `serde_json::to_string` writes it, without its
/// allocation when nothing needs escaping (the usual key).
fn push_key(out: &mut String, k: &str) -> Result<(), serde_json::Error> {
    if k.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20) {
        out.push_str(&serde_json::to_string(k)?);
    } else {
        out.push('"');
        out.push_str(k);
        out.push('"');
    }
    Ok(())
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
        let add = [Edit::Set("k", "1".into())];
        assert!(rewrite("[1,2]", &add).is_err());
        assert!(rewrite(r#"{"a":1} x"#, &add).is_err());
        assert!(rewrite(r#"{"a":1,}"#, &add).is_err());
        assert!(rewrite("", &add).is_err());
    }

    const USAGE: &str = r#"{"include_usage":true}"#;

    #[test]
    fn added_keys_go_before_the_closing_brace_of_the_clients_bytes() {
        let body =
            r#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true}"#;
        let out = rewrite(body, &[Edit::Set("stream_options", USAGE.into())]).unwrap();
        assert_eq!(
            out,
            r#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true,"stream_options":{"include_usage":true}}"#
        );
        let two = rewrite(
            body,
            &[Edit::Set("a", "1".into()), Edit::Set("b", "2".into())],
        )
        .unwrap();
        assert!(two.ends_with(r#""stream": true,"a":1,"b":2}"#), "{two}");
    }

    #[test]
    fn an_empty_object_gets_no_leading_comma() {
        let add = [Edit::Set("k", "1".into()), Edit::Set("j", "2".into())];
        assert_eq!(rewrite("{}", &add).unwrap(), r#"{"k":1,"j":2}"#);
        assert_eq!(rewrite(" { \n} ", &add).unwrap(), " { \n\"k\":1,\"j\":2} ");
    }

    #[test]
    fn whitespace_after_the_closing_brace_is_kept() {
        let out = rewrite("{\"a\":1}\r\n\t ", &[Edit::Set("k", "2".into())]).unwrap();
        assert_eq!(out, "{\"a\":1,\"k\":2}\r\n\t ");
    }

    #[test]
    fn a_key_the_body_has_is_replaced_in_place_even_when_escaped() {
        let body = r#"{"strea\u006d":true,"n":1}"#;
        let out = rewrite(body, &[Edit::Set("stream", "false".into())]).unwrap();
        assert_eq!(out, r#"{"stream":false,"n":1}"#);
    }

    #[test]
    fn repeated_keys_in_the_body_collapse_even_when_only_adding() {
        let out = rewrite(r#"{"k":1,"j":2,"k":3}"#, &[Edit::Set("x", "0".into())]).unwrap();
        assert_eq!(out, r#"{"k":3,"j":2,"x":0}"#);
    }

    #[test]
    fn a_key_set_twice_appears_once_with_the_last_value() {
        let edits = [Edit::Set("k", "1".into()), Edit::Set("k", "2".into())];
        assert_eq!(rewrite(r#"{"a":0}"#, &edits).unwrap(), r#"{"a":0,"k":2}"#);
    }

    #[test]
    fn added_keys_that_need_escapes_are_escaped() {
        let out = rewrite("{}", &[Edit::Set("a\"b\\c\n", "1".into())]).unwrap();
        assert_eq!(out, r#"{"a\"b\\c\n":1}"#);
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v, json!({"a\"b\\c\n": 1}));
    }

    proptest::proptest! {
        /// Splicing and the whole rewrite say the same thing, key for key and
        /// in the same order: the spliced body, itself rewritten whole, is the
        /// whole rewrite of the original.
        #[test]
        fn splicing_says_what_the_whole_rewrite_says(
            entries in proptest::collection::vec(("[a-d]", 0u8..9, "[ \n]{0,2}"), 0..5),
            adds in proptest::collection::vec(("[a-f]", 0u8..9), 0..3),
            tail in "[ \t\r\n]{0,2}",
        ) {
            let inner: Vec<String> = entries
                .iter()
                .map(|(k, v, ws)| format!("{ws}\"{k}\"{ws}:{ws}{v}{ws}"))
                .collect();
            let body = format!("{{{}}}{tail}", inner.join(","));
            let edits: Vec<Edit<'_>> = adds
                .iter()
                .map(|(k, v)| Edit::Set(k.as_str(), v.to_string().into()))
                .collect();
            let out = rewrite(&body, &edits).unwrap();
            proptest::prop_assert_eq!(
                rewritten_whole(&out, &[]).unwrap(),
                rewritten_whole(&body, &edits).unwrap()
            );
        }
    }
}
