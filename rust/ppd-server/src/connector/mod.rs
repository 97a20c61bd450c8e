//! KV connectors: how the pd path hands a prompt's KV from P to D — one implementation per protocol, chosen once at start-up.
//!
//! Orchestration knows the steps (prefill on P, then decode on D); a
//! connector knows the protocol's fields: the request id both nodes get, what
//! P's body must ask for, and what of P's answer D's body must carry.

mod nixl;
mod none;
mod p2pnccl;

use std::borrow::Cow;

use ppd_core::request::RequestView;

use crate::body::{drop_router_fields, rewrite, Edit};
use crate::config::KvProtocol;
use crate::registry::Node;

pub(crate) trait KvConnector: Send + Sync {
    /// Whether the pd path prefills on P before D decodes (`false`: D
    /// computes the whole prompt itself).
    fn prefills(&self) -> bool;

    /// Whether a pd turn moves the prompt's KV from P to D (for the KV-moved metric).
    fn moves_kv(&self) -> bool {
        self.prefills()
    }

    /// The request id both nodes get for one prefill attempt of the
    /// request `client_id` (its checked `X-Request-Id`), or why this pair of
    /// nodes cannot be used.
    fn request_id(&self, p: &Node, d: &Node, client_id: &str) -> Result<String, &'static str>;

    /// The field of P's body that asks P to hold the KV for D, if the protocol has one.
    fn prefill_edit(&self) -> Option<Edit<'static>>;

    /// The field of P's body that also makes P read the conversation's KV
    /// back from D's pin (`prefill_params` of a [`crate::pull::Handle`]), if
    /// the protocol can (NIXL with bidirectional transfer).
    fn pull_edit(&self, _prefill_params: &str) -> Option<Edit<'static>> {
        None
    }

    /// The field of a body computed on D alone (local) that asks a
    /// bidirectional D to pin what it computes for a later pull.
    fn pin_edit(&self) -> Option<Edit<'static>> {
        None
    }

    /// From P's successful answer, the field of D's body that hands D the KV.
    fn handoff(&self, answer: &[u8]) -> Result<Option<Edit<'static>>, HandoffError>;

    /// A `/v1/completions` body that makes a D tell P to free the KV staged
    /// for a hand-off that will not happen (the client left, or D failed
    /// before pulling), if the protocol stages KV on P at all.
    fn release_body(&self, _handoff: &Edit<'_>) -> Option<String> {
        None
    }
}

/// P answered, but not in a way that hands over its KV.
#[derive(Debug)]
pub(crate) struct HandoffError {
    /// The upstream-error kind to count, if the answer shows a misconfigured P.
    pub kind: Option<&'static str>,
    pub message: String,
}

pub(crate) fn build(protocol: KvProtocol) -> Box<dyn KvConnector> {
    match protocol {
        KvProtocol::Nixl => Box::new(nixl::Nixl),
        KvProtocol::P2pNccl => Box::new(p2pnccl::P2pNccl),
        KvProtocol::None => Box::new(none::NoTransfer),
    }
}

/// P's body: the client's request as a one-token, non-streamed prefill, plus
/// the connector's own field (which, with `pull`, also names D's pin to read).
pub(crate) fn prefill_body(
    connector: &dyn KvConnector,
    text: &str,
    view: &RequestView<'_>,
    pull: Option<&str>,
) -> Result<String, serde_json::Error> {
    let mut edits: Vec<Edit<'_>> = drop_router_fields(view).collect();
    edits.extend([
        Edit::Set("stream", Cow::Borrowed("false")),
        Edit::Set("max_tokens", Cow::Borrowed("1")),
        Edit::Remove("stream_options"),
        Edit::Remove("min_tokens"),
    ]);
    if view.max_completion_tokens.is_some() {
        edits.push(Edit::Set("max_completion_tokens", Cow::Borrowed("1")));
    }
    edits.extend(
        pull.and_then(|params| connector.pull_edit(params))
            .or_else(|| connector.prefill_edit()),
    );
    rewrite(text, &edits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ppd_core::request::parse_request;

    fn prefill(protocol: KvProtocol, body: &str) -> serde_json::Value {
        let c = build(protocol);
        let out = prefill_body(c.as_ref(), body, &parse_request(body).unwrap(), None).unwrap();
        serde_json::from_str(&out).unwrap()
    }

    #[test]
    fn p_prefills_one_token_without_streaming() {
        let body = r#"{"stream":true,"stream_options":{"include_usage":true},"min_tokens":4,"max_tokens":50,"max_completion_tokens":50,"messages":[{"role":"user","content":"x"}]}"#;
        for protocol in [KvProtocol::Nixl, KvProtocol::P2pNccl] {
            let v = prefill(protocol, body);
            assert_eq!(v["stream"], false);
            assert_eq!(v["max_tokens"], 1);
            assert_eq!(v["max_completion_tokens"], 1);
            assert!(v.get("stream_options").is_none() && v.get("min_tokens").is_none());
            assert_eq!(v["messages"][0]["content"], "x");
        }
    }

    #[test]
    fn a_clients_kv_transfer_params_never_reach_p() {
        let body = r#"{"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"evil","remote_port":1},"messages":[{"role":"user","content":"x"}]}"#;
        assert!(prefill(KvProtocol::P2pNccl, body)
            .get("kv_transfer_params")
            .is_none());
        let v = prefill(KvProtocol::Nixl, body);
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
        assert!(v["kv_transfer_params"]["remote_host"].is_null());
    }

    #[test]
    fn only_nixl_asks_p_to_hold_the_kv() {
        let body = r#"{"messages":[{"role":"user","content":"x"}]}"#;
        let v = prefill(KvProtocol::Nixl, body);
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], false);
        assert!(v.get("max_completion_tokens").is_none());
        assert!(prefill(KvProtocol::P2pNccl, body)
            .get("kv_transfer_params")
            .is_none());
    }

    #[test]
    fn a_pull_names_ds_pin_only_where_the_protocol_can_read_it() {
        let body = r#"{"kv_transfer_params":{"remote_host":"evil"},"messages":[{"role":"user","content":"x"}]}"#;
        let pin = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_host":"d","remote_block_ids":[1]}"#;
        let with = |protocol| {
            let c = build(protocol);
            let out =
                prefill_body(c.as_ref(), body, &parse_request(body).unwrap(), Some(pin)).unwrap();
            serde_json::from_str::<serde_json::Value>(&out).unwrap()
        };
        let v = with(KvProtocol::Nixl);
        assert_eq!(v["kv_transfer_params"]["remote_host"], "d");
        assert_eq!(
            v["kv_transfer_params"]["remote_block_ids"],
            serde_json::json!([1])
        );
        assert!(with(KvProtocol::P2pNccl)
            .get("kv_transfer_params")
            .is_none());
        let nixl = build(KvProtocol::Nixl);
        assert!(matches!(
            nixl.pin_edit(),
            Some(Edit::Set("kv_transfer_params", _))
        ));
        assert!(build(KvProtocol::None).pin_edit().is_none());
    }

    #[test]
    fn only_none_skips_the_prefill_and_moves_no_kv() {
        for (protocol, moves) in [
            (KvProtocol::Nixl, true),
            (KvProtocol::P2pNccl, true),
            (KvProtocol::None, false),
        ] {
            let c = build(protocol);
            assert_eq!((c.prefills(), c.moves_kv()), (moves, moves));
        }
    }
}
