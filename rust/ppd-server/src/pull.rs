//! Handles on the KV a bidirectional D pins between turns: what its last whole answer named, so that the next turn's P can read the conversation back (the pull path).
//!
//! vLLM's NIXL connector with `bidirectional_kv_xfer` keeps a finished
//! request's blocks on D for `decoder_kv_blocks_ttl` seconds and names them in
//! the answer's `kv_transfer_params` (`do_remote_decode`, `remote_block_ids`,
//! `remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`,
//! `remote_num_tokens`). The read is positional — P copies D's blocks over the
//! leading blocks of its prompt without comparing tokens — so a handle is only
//! replayed for the same conversation on the same D, once (the read frees the
//! pin), and never from anything a client sent.

use lru::LruCache;
use parking_lot::Mutex;
use serde_json::{Map, Value};

use ppd_core::session::NodeId;

/// The fields of D's answered params that the prefill request replays;
/// `do_remote_decode` / `do_remote_prefill` the router sets itself.
const REPLAYED: [&str; 11] = [
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "tp_size",
    "dcp_size",
    "pp_size",
    "transfer_mode",
];

impl Handle {
    /// Names a pin that still exists on `d` at its current cache epoch.
    fn live_on(&self, (d, epoch): (NodeId, u32), now_ms: u64) -> bool {
        self.d == d && self.epoch == epoch && self.expires_ms > now_ms
    }
}

/// How long before a pin's end the router stops naming it: vLLM's P declines
/// a read within 5 s of it (`_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`).
const PIN_SAFETY_MARGIN_MS: u64 = 5_000;

/// When a pin made at `now_ms` on a D that keeps pins `ttl_s` stops being
/// named (`decoder_kv_blocks_ttl`, less the safety margin).
pub(crate) fn pin_expiry(now_ms: u64, ttl_s: f64) -> u64 {
    now_ms + ((ttl_s * 1000.0) as u64).saturating_sub(PIN_SAFETY_MARGIN_MS)
}

/// What a pin costs the router besides its params' bytes (entry, key, LRU links).
const ENTRY_OVERHEAD_BYTES: usize = 160;

/// One pin on D, as its answer named it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Handle {
    pub d: NodeId,
    /// D's cache epoch when it pinned: a restart since frees every pin.
    pub epoch: u32,
    /// The prefill request's `kv_transfer_params`, ready to send to P.
    pub prefill_params: String,
    /// Tokens D computed and pins (the context P can read).
    pub tokens: u32,
    /// Blocks D pins for it (all KV groups).
    pub blocks: u32,
    pub expires_ms: u64,
}

/// The pins the router knows of: counted, for the memory they hold on D.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Pinned {
    pub handles: u64,
    pub blocks: u64,
    pub tokens: u64,
}

/// D's answered params as a handle, or `None` when they do not name a
/// readable pin (not a bidirectional D's, or fields missing).
pub(crate) fn handle_of(
    params: &Value,
    (d, epoch): (NodeId, u32),
    expires_ms: u64,
) -> Option<Handle> {
    let p = params.as_object()?;
    if p.get("do_remote_decode").and_then(Value::as_bool) != Some(true) {
        return None;
    }
    let text = |k: &str| p.get(k).and_then(Value::as_str).filter(|s| !s.is_empty());
    text("remote_engine_id")?;
    text("remote_request_id")?;
    text("remote_host")?;
    p.get("remote_port").and_then(Value::as_u64)?;
    let blocks = count_ids(p.get("remote_block_ids")?);
    if blocks == 0 {
        return None;
    }
    let tokens = p
        .get("remote_num_tokens")
        .and_then(Value::as_u64)
        .map_or(0, |t| u32::try_from(t).unwrap_or(u32::MAX));
    let mut out = Map::new();
    out.insert("do_remote_decode".into(), Value::Bool(true));
    out.insert("do_remote_prefill".into(), Value::Bool(false));
    for k in REPLAYED {
        if let Some(v) = p.get(k) {
            out.insert(k.into(), v.clone());
        }
    }
    Some(Handle {
        d,
        epoch,
        prefill_params: Value::Object(out).to_string(),
        tokens,
        blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
        expires_ms,
    })
}

/// Block ids in vLLM's `remote_block_ids`: a flat list, or one list per KV
/// cache group.
fn count_ids(v: &Value) -> usize {
    match v {
        Value::Array(items) => items
            .iter()
            .map(|i| if i.is_array() { count_ids(i) } else { 1 })
            .sum(),
        _ => 0,
    }
}

/// The live handles, per conversation: bounded in count and in bytes (the
/// least recently pinned go first), each used once.
pub(crate) struct PullHandles {
    inner: Mutex<Inner>,
    max_bytes: usize,
}

struct Inner {
    map: LruCache<Box<str>, Handle>,
    bytes: usize,
}

fn footprint(conv: &str, h: &Handle) -> usize {
    conv.len() + h.prefill_params.len() + ENTRY_OVERHEAD_BYTES
}

impl PullHandles {
    pub fn new(max_bytes: usize) -> PullHandles {
        PullHandles {
            inner: Mutex::new(Inner {
                map: LruCache::unbounded(),
                bytes: 0,
            }),
            max_bytes,
        }
    }

    /// Records the pin of the conversation's latest turn (replacing any
    /// earlier one: D pinned each turn separately, and the latest covers the
    /// longest context).
    pub fn record(&self, conv: &str, h: Handle) {
        let size = footprint(conv, &h);
        if size > self.max_bytes {
            return;
        }
        let mut g = self.inner.lock();
        if let Some(old) = g.map.pop(conv) {
            g.bytes -= footprint(conv, &old);
        }
        while g.bytes + size > self.max_bytes {
            match g.map.pop_lru() {
                Some((k, old)) => g.bytes -= footprint(&k, &old),
                None => break,
            }
        }
        g.bytes += size;
        g.map.put(conv.into(), h);
    }

    /// Whether a live handle on `d` (at its cache epoch) exists for the conversation.
    pub fn ready(&self, conv: &str, d: (NodeId, u32), now_ms: u64) -> bool {
        self.inner
            .lock()
            .map
            .peek(conv)
            .is_some_and(|h| h.live_on(d, now_ms))
    }

    /// The conversation's handle on `d`, removed: P's read frees D's pin, so
    /// a second read would name freed blocks. An expired or foreign one is
    /// dropped too.
    pub fn take(&self, conv: &str, d: (NodeId, u32), now_ms: u64) -> Option<Handle> {
        let mut g = self.inner.lock();
        let h = g.map.pop(conv)?;
        g.bytes -= footprint(conv, &h);
        h.live_on(d, now_ms).then_some(h)
    }

    /// Pins still live (not read, not expired); expired ones are dropped.
    pub fn pinned(&self, now_ms: u64) -> Pinned {
        let mut g = self.inner.lock();
        let expired: Vec<Box<str>> = g
            .map
            .iter()
            .filter(|(_, h)| h.expires_ms <= now_ms)
            .map(|(k, _)| k.clone())
            .collect();
        for k in expired {
            if let Some(h) = g.map.pop(&k) {
                g.bytes -= footprint(&k, &h);
            }
        }
        g.map.iter().fold(Pinned::default(), |mut p, (_, h)| {
            p.handles += 1;
            p.blocks += u64::from(h.blocks);
            p.tokens += u64::from(h.tokens);
            p
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(i: u32) -> NodeId {
        NodeId::new(i).unwrap()
    }

    fn d_answer() -> Value {
        json!({"do_remote_prefill": false, "do_remote_decode": true,
            "remote_block_ids": [[1, 2, 3], [7]], "remote_engine_id": "e-d",
            "remote_request_id": "chatcmpl-1", "remote_host": "10.0.0.2", "remote_port": 5600,
            "tp_size": 1, "remote_num_tokens": 50, "remote_blocks_expiry_time": 99.5,
            "transfer_mode": "pull", "something_new": 1})
    }

    #[test]
    fn a_ds_answer_becomes_the_prefill_params_p_needs() {
        let h = handle_of(&d_answer(), (node(2), 0), 1000).unwrap();
        let v: Value = serde_json::from_str(&h.prefill_params).unwrap();
        assert_eq!(v["do_remote_decode"], true);
        assert_eq!(v["do_remote_prefill"], false);
        assert_eq!(v["remote_block_ids"], json!([[1, 2, 3], [7]]));
        assert_eq!(v["remote_request_id"], "chatcmpl-1");
        assert!(v.get("something_new").is_none(), "only the replayed fields");
        assert_eq!((h.tokens, h.blocks), (50, 4));
    }

    #[test]
    fn params_that_name_no_readable_pin_are_no_handle() {
        // A P's answer (it holds KV for a D), and incomplete ones.
        let mut p = d_answer();
        p["do_remote_decode"] = json!(false);
        assert!(handle_of(&p, (node(1), 0), 1).is_none());
        for missing in [
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
        ] {
            let mut v = d_answer();
            v.as_object_mut().unwrap().remove(missing);
            assert!(handle_of(&v, (node(1), 0), 1).is_none(), "{missing}");
        }
        let mut v = d_answer();
        v["remote_block_ids"] = json!([[]]);
        assert!(handle_of(&v, (node(1), 0), 1).is_none());
        assert!(handle_of(&json!(null), (node(1), 0), 1).is_none());
    }

    #[test]
    fn a_handle_is_read_once_on_its_own_d_before_it_expires() {
        let t = PullHandles::new(1 << 20);
        t.record("c", handle_of(&d_answer(), (node(2), 0), 1000).unwrap());
        assert!(t.ready("c", (node(2), 0), 999));
        assert!(
            !t.ready("c", (node(3), 0), 999),
            "another D holds none of it"
        );
        assert!(
            !t.ready("c", (node(2), 1), 999),
            "D restarted since it pinned"
        );
        assert!(!t.ready("c", (node(2), 0), 1000), "expired");
        assert!(t.take("c", (node(2), 0), 10).is_some());
        assert!(t.take("c", (node(2), 0), 10).is_none(), "single use");
        t.record("c", handle_of(&d_answer(), (node(2), 0), 1000).unwrap());
        assert!(
            t.take("c", (node(2), 0), 5000).is_none(),
            "expired is never replayed"
        );
        assert_eq!(t.pinned(0), Pinned::default());
    }

    #[test]
    fn pins_are_counted_bounded_and_expire() {
        let h = handle_of(&d_answer(), (node(2), 0), 1000).unwrap();
        let one = footprint("c0", &h);
        let t = PullHandles::new(one * 3);
        for i in 0..5 {
            t.record(&format!("c{i}"), h.clone());
        }
        let p = t.pinned(0);
        assert_eq!((p.handles, p.blocks, p.tokens), (3, 12, 150));
        assert!(!t.ready("c0", (node(2), 0), 0), "the oldest went first");
        assert_eq!(t.pinned(2000).handles, 0, "expired pins are not counted");
    }
}
