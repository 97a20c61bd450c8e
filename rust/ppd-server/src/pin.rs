//! Asks a bidirectional D to pin a conversation's KV when no whole answer named a pin, so that a turn after a streamed answer can still be pulled.
//!
//! vLLM (0.32) names a D's pin only in a whole answer's `kv_transfer_params`;
//! a streamed answer pins nothing the router can name. So before such a pull
//! the router sends D one more request: the chat up to and including the last
//! answer, left open (`continue_final_message`, no generation prompt), for one
//! token, whole, with the pin's params. Its prompt is a token-exact prefix of
//! the turn's own prompt (both are the same history rendered by D's
//! template), it hits D's prefix cache but for its last token, and its answer
//! names a pin of that prefix, which P then reads back as on any pull.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use serde_json::{Map, Value};

use crate::metrics::ResultLabel;
use crate::pull::Handle;
use crate::registry::Node;
use crate::state::AppState;
use crate::upstream::{self, Endpoint, NodeHeaders};

/// The request fields that shape how D's chat template renders the history,
/// copied so the pin's prompt renders as the turn's own does.
const TEMPLATE_FIELDS: [&str; 7] = [
    "model",
    "tools",
    "tool_choice",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "add_special_tokens",
];

/// The pin request's body for a chat request `text`, or `None` when the chat
/// has no answer before its newest messages (nothing on D to pin).
/// `pin_params` is the connector's `kv_transfer_params` that ask D to pin.
pub(crate) fn ask_body(text: &str, pin_params: &str) -> Option<String> {
    let body: Map<String, Value> = serde_json::from_str(text).ok()?;
    let messages = body.get("messages")?.as_array()?;
    let last_answer = messages
        .iter()
        .rposition(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))?;
    if last_answer + 1 == messages.len() {
        // The request itself continues its last answer: nothing new follows it.
        return None;
    }
    let mut out = Map::new();
    for k in TEMPLATE_FIELDS {
        if let Some(v) = body.get(k) {
            out.insert(k.into(), v.clone());
        }
    }
    out.insert(
        "messages".into(),
        Value::Array(messages[..=last_answer].to_vec()),
    );
    out.insert("continue_final_message".into(), Value::Bool(true));
    out.insert("add_generation_prompt".into(), Value::Bool(false));
    out.insert("max_tokens".into(), 1.into());
    out.insert("temperature".into(), 0.into());
    out.insert("stream".into(), Value::Bool(false));
    out.insert(
        "kv_transfer_params".into(),
        serde_json::from_str(pin_params).ok()?,
    );
    Some(Value::Object(out).to_string())
}

/// Sends `body` to `d` and returns the pin its answer names; counted by
/// outcome. `None` when D did not answer in time, refused, or named no pin.
pub(crate) async fn ask(
    st: &AppState,
    d: &Arc<Node>,
    body: String,
    headers: NodeHeaders<'_>,
) -> Option<Handle> {
    let timeout = Duration::from_secs_f64(st.cfg.prefill_timeout);
    let handle = async {
        let resp = upstream::send(st, Endpoint::Chat, d, Bytes::from(body), headers, timeout)
            .await
            .ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let bytes = upstream::read_all(st, resp).await?;
        let params = crate::answer::whole(&bytes).pin?;
        let expires = crate::pull::pin_expiry(st.now_ms(), st.cfg.decoder_kv_blocks_ttl);
        crate::pull::handle_of(&params, (d.id, d.load.epoch()), expires)
    }
    .await;
    let result = if handle.is_some() { "pinned" } else { "failed" };
    st.metrics
        .pin_requests
        .get_or_create(&ResultLabel { result })
        .inc();
    if handle.is_none() {
        tracing::warn!(node = %d.url, "D named no pin for a pull; the turn prefills all on P");
    }
    handle
}

#[cfg(test)]
mod tests {
    use super::*;

    const PIN: &str = r#"{"do_remote_decode":false,"do_remote_prefill":false}"#;

    fn ask_of(v: Value) -> Option<Value> {
        ask_body(&v.to_string(), PIN).map(|s| serde_json::from_str(&s).unwrap())
    }

    #[test]
    fn the_pin_request_is_the_history_up_to_the_last_answer_left_open() {
        let body = serde_json::json!({
            "model": "m", "stream": true, "max_tokens": 200, "temperature": 0.8,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2"},
            ],
        });
        let ask = ask_of(body).unwrap();
        assert_eq!(ask["messages"].as_array().unwrap().len(), 3);
        assert_eq!(ask["messages"][2]["content"], "a1");
        assert_eq!(
            (
                &ask["continue_final_message"],
                &ask["add_generation_prompt"],
                &ask["stream"],
                &ask["max_tokens"]
            ),
            (
                &Value::Bool(true),
                &Value::Bool(false),
                &Value::Bool(false),
                &Value::from(1)
            )
        );
        assert_eq!(ask["model"], "m");
        assert!(
            ask["tools"].is_array(),
            "what shapes the template goes along"
        );
        assert_eq!(ask["kv_transfer_params"]["do_remote_decode"], false);
        assert_eq!(ask["temperature"], 0);
    }

    #[test]
    fn a_chat_without_an_earlier_answer_has_nothing_to_pin() {
        let first = serde_json::json!({"messages": [{"role": "user", "content": "q"}]});
        assert!(ask_of(first).is_none());
        let continuing = serde_json::json!({"messages": [
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "partial"}]});
        assert!(ask_of(continuing).is_none());
        assert!(ask_body(r#"{"prompt": "text"}"#, PIN).is_none());
        assert!(ask_body("not json", PIN).is_none());
    }
}
