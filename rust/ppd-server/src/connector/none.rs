//! No KV transfer (`--kv-protocol none`): the pd path is D alone, computing the whole prompt.

use super::{HandoffError, KvConnector};
use crate::body::Edit;
use crate::registry::Node;

pub(super) struct NoTransfer;

impl KvConnector for NoTransfer {
    fn prefills(&self) -> bool {
        false
    }

    fn request_id(&self, _p: &Node, _d: &Node, _client_id: &str) -> Result<String, &'static str> {
        Err("no KV protocol: the pd path has no prefill node")
    }

    fn prefill_edit(&self) -> Option<Edit<'static>> {
        None
    }

    fn handoff(&self, _answer: &[u8]) -> Result<Option<Edit<'static>>, HandoffError> {
        Ok(None)
    }
}
