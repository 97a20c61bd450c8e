//! vLLM's KV-event wire format (ZMQ multipart `[topic, seq, msgpack batch]`), decoded into [`KvEvent`]s and encoded for the emulator.
//!
//! From vLLM 0.32's `vllm/distributed/kv_events.py`: a `KVEventBatch` is a
//! msgspec struct with `array_like=True`, so `[ts, events, data_parallel_rank?]`;
//! each event is a tagged struct (`tag=True`, not array-like), so a map with
//! `"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"` and its fields
//! (defaults omitted). Older vLLM encoded events array-like
//! (`["BlockStored", block_hashes, parent, token_ids, block_size, ...]`); both
//! are read. A block hash is 32 bytes (sha256), or an int with
//! `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`; either becomes 64 bits here (bytes
//! through xxh3), enough to name a block among a node's few million. Events
//! of other KV media (CPU offload, storage) are skipped: only the device cache
//! serves a prefix hit without a load.

use rmpv::Value;

use crate::residency::KvEvent;

/// Why a message could not be read (counted per node, never fatal).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("expected 3 frames (topic, seq, payload), got {0}")]
    Frames(usize),
    #[error("sequence frame is {0} bytes, not 8")]
    Seq(usize),
    #[error("payload is not msgpack: {0}")]
    Msgpack(String),
    #[error("payload is not an event batch: {0}")]
    Shape(&'static str),
}

/// One decoded batch.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Batch {
    pub seq: u64,
    pub events: Vec<KvEvent>,
    /// Events of a type or medium the router does not track.
    pub skipped: u32,
}

/// Decodes one ZMQ message of a vLLM KV-event publisher.
pub fn decode_message(frames: &[&[u8]]) -> Result<Batch, WireError> {
    let [_topic, seq, payload] = frames else {
        return Err(WireError::Frames(frames.len()));
    };
    let seq: [u8; 8] = (*seq).try_into().map_err(|_| WireError::Seq(seq.len()))?;
    let mut batch = decode_batch(payload)?;
    batch.seq = u64::from_be_bytes(seq);
    Ok(batch)
}

/// Decodes a `KVEventBatch` payload.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, WireError> {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).map_err(|e| WireError::Msgpack(e.to_string()))?;
    let Value::Array(items) = v else {
        return Err(WireError::Shape("batch is not an array"));
    };
    let Some(Value::Array(events)) = items.get(1) else {
        return Err(WireError::Shape("batch has no event list"));
    };
    let mut batch = Batch::default();
    for e in events {
        match decode_event(e)? {
            Some(ev) => batch.events.push(ev),
            None => batch.skipped += 1,
        }
    }
    Ok(batch)
}

/// A field of a map- or array-encoded event (`index` counts after the tag).
fn field<'a>(e: &'a Value, name: &str, index: usize) -> Option<&'a Value> {
    match e {
        Value::Map(kv) => kv
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v),
        Value::Array(a) => a.get(index + 1),
        _ => None,
    }
    .filter(|v| !v.is_nil())
}

fn tag(e: &Value) -> Option<&str> {
    match e {
        Value::Map(_) => field(e, "type", usize::MAX)?.as_str(),
        Value::Array(a) => a.first()?.as_str(),
        _ => None,
    }
}

fn block_hash(v: &Value) -> Result<u64, WireError> {
    match v {
        Value::Binary(b) => Ok(xxhash_rust::xxh3::xxh3_64(b)),
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .ok_or(WireError::Shape("block hash out of range")),
        _ => Err(WireError::Shape("block hash is neither bytes nor an int")),
    }
}

fn hashes(e: &Value, index: usize) -> Result<Vec<u64>, WireError> {
    match field(e, "block_hashes", index) {
        Some(Value::Array(a)) => a.iter().map(block_hash).collect(),
        _ => Err(WireError::Shape("event without block_hashes")),
    }
}

/// Whether the event is about the device cache (no medium: older vLLM).
fn on_device(e: &Value, index: usize) -> bool {
    field(e, "medium", index)
        .and_then(Value::as_str)
        .is_none_or(|m| m.eq_ignore_ascii_case("GPU"))
}

fn decode_event(e: &Value) -> Result<Option<KvEvent>, WireError> {
    match tag(e) {
        Some("BlockStored") => {
            // Array order: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium.
            if !on_device(e, 5) {
                return Ok(None);
            }
            let parent = field(e, "parent_block_hash", 1)
                .map(block_hash)
                .transpose()?;
            let tokens = match field(e, "token_ids", 2) {
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|t| t.as_u64().ok_or(WireError::Shape("token id is not an int")))
                    .collect::<Result<Vec<_>, _>>()?,
                _ => return Err(WireError::Shape("BlockStored without token_ids")),
            };
            let block_size = field(e, "block_size", 3)
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .ok_or(WireError::Shape("BlockStored without block_size"))?;
            Ok(Some(KvEvent::Stored {
                hashes: hashes(e, 0)?,
                parent,
                tokens,
                block_size,
            }))
        }
        Some("BlockRemoved") => {
            if !on_device(e, 1) {
                return Ok(None);
            }
            Ok(Some(KvEvent::Removed {
                hashes: hashes(e, 0)?,
            }))
        }
        Some("AllBlocksCleared") => Ok(Some(KvEvent::Cleared)),
        Some(_) => Ok(None),
        None => Err(WireError::Shape("event without a type tag")),
    }
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(
        entries
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    )
}

fn hash_value(h: u64) -> Value {
    Value::from(h)
}

/// Encodes a batch as vLLM 0.32 does (map-encoded events, int block hashes as
/// with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`), for the emulator's publisher.
pub fn encode_batch(ts: f64, events: &[KvEvent]) -> Vec<u8> {
    let events: Vec<Value> = events
        .iter()
        .map(|e| match e {
            KvEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
            } => map(vec![
                ("type", Value::from("BlockStored")),
                (
                    "block_hashes",
                    Value::Array(hashes.iter().copied().map(hash_value).collect()),
                ),
                ("parent_block_hash", parent.map_or(Value::Nil, hash_value)),
                (
                    "token_ids",
                    Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
                ),
                ("block_size", Value::from(*block_size)),
                ("lora_id", Value::Nil),
                ("medium", Value::from("GPU")),
                ("lora_name", Value::Nil),
            ]),
            KvEvent::Removed { hashes } => map(vec![
                ("type", Value::from("BlockRemoved")),
                (
                    "block_hashes",
                    Value::Array(hashes.iter().copied().map(hash_value).collect()),
                ),
                ("medium", Value::from("GPU")),
            ]),
            KvEvent::Cleared => map(vec![("type", Value::from("AllBlocksCleared"))]),
        })
        .collect();
    let batch = Value::Array(vec![Value::F64(ts), Value::Array(events)]);
    let mut out = Vec::with_capacity(64);
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> KvEvent {
        KvEvent::Stored {
            hashes: vec![11, 12],
            parent: Some(10),
            tokens: vec![1, 2, 3, 4],
            block_size: 2,
        }
    }

    #[test]
    fn encoded_batches_decode_to_the_same_events() {
        let events = vec![
            stored(),
            KvEvent::Removed { hashes: vec![11] },
            KvEvent::Cleared,
        ];
        let payload = encode_batch(1.5, &events);
        let seq = 7u64.to_be_bytes();
        let b = decode_message(&[b"kv", &seq, &payload]).unwrap();
        assert_eq!((b.seq, b.events, b.skipped), (7, events, 0));
    }

    #[test]
    fn array_encoded_events_of_older_vllm_are_read_too() {
        let e = Value::Array(vec![
            Value::from("BlockStored"),
            Value::Array(vec![Value::Binary(vec![1; 32])]),
            Value::Nil,
            Value::Array(vec![Value::from(5), Value::from(6)]),
            Value::from(2),
            Value::Nil,
            Value::from("GPU"),
        ]);
        let mut payload = vec![];
        rmpv::encode::write_value(
            &mut payload,
            &Value::Array(vec![Value::F64(0.0), Value::Array(vec![e]), Value::Nil]),
        )
        .unwrap();
        let b = decode_batch(&payload).unwrap();
        assert_eq!(
            b.events,
            vec![KvEvent::Stored {
                hashes: vec![xxhash_rust::xxh3::xxh3_64(&[1; 32])],
                parent: None,
                tokens: vec![5, 6],
                block_size: 2
            }]
        );
    }

    #[test]
    fn unknown_types_and_offload_media_are_skipped_not_errors() {
        let other = map(vec![("type", Value::from("SomethingNew"))]);
        let cpu = map(vec![
            ("type", Value::from("BlockRemoved")),
            ("block_hashes", Value::Array(vec![Value::from(1)])),
            ("medium", Value::from("CPU")),
        ]);
        let mut payload = vec![];
        rmpv::encode::write_value(
            &mut payload,
            &Value::Array(vec![Value::F64(0.0), Value::Array(vec![other, cpu])]),
        )
        .unwrap();
        let b = decode_batch(&payload).unwrap();
        assert_eq!((b.events.len(), b.skipped), (0, 2));
    }

    #[test]
    fn malformed_messages_are_errors_that_say_why() {
        assert_eq!(decode_message(&[b"x"]), Err(WireError::Frames(1)));
        assert_eq!(decode_message(&[b"", b"123", b""]), Err(WireError::Seq(3)));
        assert!(matches!(
            decode_batch(&[0x92, 0x01]),
            Err(WireError::Msgpack(_))
        ));
        let mut not_batch = vec![];
        rmpv::encode::write_value(&mut not_batch, &Value::from(3)).unwrap();
        assert!(matches!(decode_batch(&not_batch), Err(WireError::Shape(_))));
        let no_hashes = map(vec![("type", Value::from("BlockRemoved"))]);
        let mut p = vec![];
        rmpv::encode::write_value(
            &mut p,
            &Value::Array(vec![Value::F64(0.0), Value::Array(vec![no_hashes])]),
        )
        .unwrap();
        assert!(matches!(decode_batch(&p), Err(WireError::Shape(_))));
    }

    #[test]
    fn any_bytes_decode_without_panicking() {
        // A cheap fuzz: every prefix of a valid payload, and byte flips.
        let payload = encode_batch(1.0, &[stored()]);
        for n in 0..payload.len() {
            let _ = decode_batch(&payload[..n]);
            let mut flipped = payload.clone();
            flipped[n] ^= 0xff;
            let _ = decode_batch(&flipped);
        }
    }
}
