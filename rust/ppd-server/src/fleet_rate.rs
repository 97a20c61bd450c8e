//! The conversation arrival rate of the whole fleet of router replicas, so that the decision's QPS axis sees the load every replica sends to the nodes, not this replica's share of it.
//!
//! Each replica with `state` reports its own rate to the store once a second
//! (on the state link's liveness tick, replicas.rs) and reads back everyone's.
//! Layout under the prefix `P`: the hash `P:rate` (replica id → conversations
//! per second) and the sorted set `P:rate:seen` (replica id → the store's
//! clock, ms, at its last report). One Lua script stores this replica's rate,
//! forgets the replicas not heard from within [`FORGET_AFTER`] (stopped, or
//! cut off from the store) and returns the rest, so only the store's clock
//! decides who is gone and the replicas' clocks need not agree. A replica
//! that loses the store keeps the others' last sum (its view of the fleet
//! ages with its admin view, and `/health` says the link is down).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// How long a replica that stopped reporting still counts (five missed
/// reports: a slow store round trip does not drop a live replica).
pub(crate) const FORGET_AFTER: Duration = Duration::from_secs(5);

/// Stores ARGV[2] as replica ARGV[1]'s rate, forgets replicas silent for
/// ARGV[3] ms, returns the hash (field, value, field, value, …). KEYS: the
/// rate hash, the last-seen set.
pub(crate) const REPORT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[3]))
for _, r in ipairs(gone) do
  redis.call('HDEL', KEYS[1], r)
  redis.call('ZREM', KEYS[2], r)
end
return redis.call('HGETALL', KEYS[1])
"#;

/// The other replicas' rates as last read: lock-free for the request path.
#[derive(Default)]
pub(crate) struct FleetRate {
    others_bits: AtomicU64,
    others: AtomicU32,
}

impl FleetRate {
    /// Σ of the other replicas' conversation rates, per second.
    pub(crate) fn others_rate(&self) -> f64 {
        f64::from_bits(self.others_bits.load(Ordering::Relaxed))
    }

    /// How many other replicas reported within [`FORGET_AFTER`].
    pub(crate) fn others(&self) -> u32 {
        self.others.load(Ordering::Relaxed)
    }

    fn set(&self, (rate, n): (f64, u32)) {
        self.others_bits.store(rate.to_bits(), Ordering::Relaxed);
        self.others.store(n, Ordering::Relaxed);
    }
}

/// Σ and count of the rates in the script's answer that are not `me`'s. A
/// rate that is not a finite non-negative number (a foreign writer) counts
/// as a replica with no load rather than poisoning the sum.
pub(crate) fn others_in(answer: &[String], me: &str) -> (f64, u32) {
    answer
        .chunks_exact(2)
        .filter(|kv| kv[0] != me)
        .map(|kv| {
            kv[1]
                .parse::<f64>()
                .ok()
                .filter(|r| r.is_finite() && *r >= 0.0)
                .unwrap_or(0.0)
        })
        .fold((0.0, 0), |(sum, n), r| (sum + r, n + 1))
}

/// Reports `own` as replica `me`'s rate and takes in the others'. `keys`
/// are the store's rate hash and its last-seen hash (shared.rs names them).
pub(crate) async fn report(
    conn: &mut redis::aio::MultiplexedConnection,
    script: &redis::Script,
    (rate, rate_seen): (&str, &str),
    me: &str,
    own: f64,
    fleet: &FleetRate,
) -> Result<(), String> {
    let answer: Vec<String> = script
        .key(rate)
        .key(rate_seen)
        .arg(me)
        .arg(format!("{own:.6}"))
        .arg(FORGET_AFTER.as_millis() as u64)
        .invoke_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    fleet.set(others_in(&answer, me));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(pairs: &[(&str, &str)]) -> Vec<String> {
        pairs
            .iter()
            .flat_map(|(k, v)| [k.to_string(), v.to_string()])
            .collect()
    }

    #[test]
    fn the_others_rates_are_summed_without_this_replicas_own() {
        let a = answer(&[("me", "4.0"), ("b", "2.5"), ("c", "1.5")]);
        assert_eq!(others_in(&a, "me"), (4.0, 2));
    }

    #[test]
    fn a_replica_alone_sees_no_others() {
        assert_eq!(others_in(&answer(&[("me", "3")]), "me"), (0.0, 0));
        assert_eq!(others_in(&[], "me"), (0.0, 0));
    }

    #[test]
    fn a_rate_that_is_not_a_number_counts_as_an_idle_replica() {
        let a = answer(&[("b", "x"), ("c", "-1"), ("d", "inf"), ("e", "2")]);
        assert_eq!(others_in(&a, "me"), (2.0, 4));
    }

    #[test]
    fn an_odd_trailing_field_is_ignored() {
        let mut a = answer(&[("b", "1")]);
        a.push("dangling".into());
        assert_eq!(others_in(&a, "me"), (1.0, 1));
    }

    #[test]
    fn what_was_read_last_is_what_the_request_path_sees() {
        let f = FleetRate::default();
        assert_eq!((f.others_rate(), f.others()), (0.0, 0));
        f.set((7.25, 3));
        assert_eq!((f.others_rate(), f.others()), (7.25, 3));
    }
}
