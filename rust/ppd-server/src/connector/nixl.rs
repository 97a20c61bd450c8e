//! vLLM's NixlConnector: P holds the KV (`do_remote_decode`) and answers where it is; D pulls it with those `kv_transfer_params`.

use std::borrow::Cow;

use super::{HandoffError, KvConnector};
use crate::body::Edit;
use crate::registry::Node;

pub(super) struct Nixl;

/// A model name no node serves, for [`Nixl::release_body`].
pub(crate) const RELEASE_MODEL: &str = "ppd-router/release-staged-kv";

/// What P's body carries so that P keeps the prompt's blocks for a remote decode.
const HOLD_FOR_DECODE: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// What a local turn's body carries so that a bidirectional D pins what it
/// computes: any non-empty params make vLLM's `request_finished` keep the
/// blocks on a D (neither flag asks for a transfer now).
const PIN_ON_DECODE: &str = r#"{"do_remote_decode":false,"do_remote_prefill":false}"#;

/// `{client_id}-{8 hex digits}`, fresh per call.
fn attempt_id(client_id: &str) -> String {
    let suffix = uuid::Uuid::new_v4().as_u64_pair().1 as u32;
    format!("{client_id}-{suffix:08x}")
}

impl KvConnector for Nixl {
    fn prefills(&self) -> bool {
        true
    }

    /// The client's id with a suffix fresh for each attempt: P and D get
    /// the same id (as vLLM's own disaggregation proxy sends), and a retried
    /// prefill that lands on the same P never reuses the id of KV it may
    /// still hold for the failed attempt.
    fn request_id(&self, _p: &Node, _d: &Node, client_id: &str) -> Result<String, &'static str> {
        Ok(attempt_id(client_id))
    }

    fn prefill_edit(&self) -> Option<Edit<'static>> {
        Some(Edit::Set(
            "kv_transfer_params",
            Cow::Borrowed(HOLD_FOR_DECODE),
        ))
    }

    /// D's pin as vLLM's pull scheduler reads it (`do_remote_decode` with
    /// D's `remote_block_ids`): P holds its own prefill for D as well.
    fn pull_edit(&self, prefill_params: &str) -> Option<Edit<'static>> {
        Some(Edit::Set(
            "kv_transfer_params",
            Cow::Owned(prefill_params.to_owned()),
        ))
    }

    fn pin_edit(&self) -> Option<Edit<'static>> {
        Some(Edit::Set(
            "kv_transfer_params",
            Cow::Borrowed(PIN_ON_DECODE),
        ))
    }

    /// A request D refuses after reading it (a model it does not serve) while
    /// carrying P's `kv_transfer_params`: vLLM's rejection cleanup
    /// (`notify_kv_transfer_request_rejected`) then notifies P, which frees the
    /// blocks at once instead of holding them for its whole KV lease.
    fn release_body(&self, handoff: &Edit<'_>) -> Option<String> {
        match handoff {
            Edit::Set("kv_transfer_params", kv) => Some(format!(
                r#"{{"model":"{RELEASE_MODEL}","prompt":[0],"max_tokens":1,"kv_transfer_params":{kv}}}"#
            )),
            _ => None,
        }
    }

    /// P's answered `kv_transfer_params`, passed to D unchanged.
    fn handoff(&self, answer: &[u8]) -> Result<Option<Edit<'static>>, HandoffError> {
        #[derive(serde::Deserialize)]
        struct PrefillAnswer<'a> {
            #[serde(borrow, default)]
            kv_transfer_params: Option<&'a serde_json::value::RawValue>,
        }
        let parsed: PrefillAnswer<'_> =
            serde_json::from_slice(answer).map_err(|e| HandoffError {
                kind: None,
                message: format!("prefill answer is not JSON: {e}"),
            })?;
        match parsed.kv_transfer_params {
            Some(kv) if kv.get() != "null" => Ok(Some(Edit::Set(
                "kv_transfer_params",
                Cow::Owned(kv.get().to_owned()),
            ))),
            _ => Err(HandoffError {
                kind: Some("no_kv_params"),
                message: "prefill answer has no kv_transfer_params (is P a NIXL kv_producer?)"
                    .into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p_answer_params_go_to_d_unchanged() {
        let answer = br#"{"id":"x","kv_transfer_params":{"remote_engine_id":"e1","remote_block_ids":[1,2],"remote_host":"h","remote_port":5}}"#;
        match Nixl.handoff(answer).unwrap() {
            Some(Edit::Set(key, v)) => {
                assert_eq!(key, "kv_transfer_params");
                assert_eq!(
                    v,
                    r#"{"remote_engine_id":"e1","remote_block_ids":[1,2],"remote_host":"h","remote_port":5}"#
                );
            }
            _ => panic!("expected a set"),
        }
    }

    #[test]
    fn each_prefill_attempt_gets_the_clients_id_with_a_fresh_suffix() {
        let a = attempt_id("req-1");
        let b = attempt_id("req-1");
        assert!(
            a.starts_with("req-1-") && a.len() == "req-1-".len() + 8,
            "{a}"
        );
        assert_ne!(a, b);
    }

    #[test]
    fn a_release_carries_the_params_to_a_model_no_node_serves() {
        let handoff = Edit::Set("kv_transfer_params", r#"{"remote_request_id":"r1"}"#.into());
        let body = Nixl.release_body(&handoff).unwrap();
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["model"], RELEASE_MODEL);
        assert_eq!(v["kv_transfer_params"]["remote_request_id"], "r1");
        assert_eq!(v["max_tokens"], 1);
        assert!(Nixl.release_body(&Edit::Remove("x")).is_none());
    }

    #[test]
    fn an_answer_without_params_names_the_misconfiguration() {
        for answer in [&br#"{"id":"x"}"#[..], br#"{"kv_transfer_params":null}"#] {
            let e = Nixl.handoff(answer).unwrap_err();
            assert_eq!(e.kind, Some("no_kv_params"));
        }
        let e = Nixl.handoff(b"<html>").unwrap_err();
        assert_eq!(e.kind, None);
        assert!(e.message.contains("not JSON"));
    }
}
