//! vLLM's NixlConnector: P holds the KV (`do_remote_decode`) and answers where it is; D pulls it with those `kv_transfer_params`.

use std::borrow::Cow;

use super::{HandoffError, KvConnector};
use crate::body::Edit;
use crate::registry::Node;

pub(super) struct Nixl;

/// What P's body carries so that P keeps the prompt's blocks for a remote decode.
const HOLD_FOR_DECODE: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

impl KvConnector for Nixl {
    fn prefills(&self) -> bool {
        true
    }

    fn request_id(&self, _p: &Node, _d: &Node) -> Result<String, &'static str> {
        Ok(format!("ppd-{}", uuid::Uuid::new_v4().simple()))
    }

    fn prefill_edit(&self) -> Option<Edit<'static>> {
        Some(Edit::Set(
            "kv_transfer_params",
            Cow::Borrowed(HOLD_FOR_DECODE),
        ))
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
