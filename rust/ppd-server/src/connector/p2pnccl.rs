//! vLLM's legacy P2pNcclConnector (≤ 0.23, the paper's setup): both nodes get the other's ZMQ address in `X-Request-Id`, and P pushes.

use super::{HandoffError, KvConnector};
use crate::body::Edit;
use crate::registry::Node;

pub(super) struct P2pNccl;

impl KvConnector for P2pNccl {
    fn prefills(&self) -> bool {
        true
    }

    /// The protocol's own format (vLLM parses the addresses out of it), so
    /// the client's id is not part of it; the router's log pairs them.
    fn request_id(&self, p: &Node, d: &Node, _client_id: &str) -> Result<String, &'static str> {
        match (&p.zmq, &d.zmq) {
            (Some(pz), Some(dz)) => Ok(format!(
                "___prefill_addr_{pz}___decode_addr_{dz}_{}",
                uuid::Uuid::new_v4().simple()
            )),
            _ => Err("p2pnccl needs a zmq address for both the prefill and the decode node"),
        }
    }

    fn prefill_edit(&self) -> Option<Edit<'static>> {
        None
    }

    /// P pushes to the address in the request id; D's body stays the client's.
    fn handoff(&self, _answer: &[u8]) -> Result<Option<Edit<'static>>, HandoffError> {
        Ok(None)
    }
}
