//! Measures the resident memory of a session table holding N live sessions (default 1,000,000).
//!
//! `cargo run --release -p ppd-core --example session_rss -- 1000000`

use ppd_core::session::{NodeId, SessionConfig, SessionTable};

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let before = rss_kib();
    let table = SessionTable::new(SessionConfig {
        capacity: n.max(1),
        ..SessionConfig::default()
    })
    .expect("valid config");
    let d = NodeId::new(2);
    let p = NodeId::new(1);
    for i in 0..n {
        // Ids shaped like the MD5 hex the router derives from a first message.
        let id = format!(
            "{:032x}",
            (i as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835)
        );
        table.update(&id, i as u64, |s| {
            s.turns = 2;
            s.d = d;
            s.p = p;
            s.record_usage(1500, 300, i as u64);
        });
    }
    let after = rss_kib();
    println!(
        "sessions={} live={} rss_before_kib={} rss_after_kib={} delta_mib={:.1} bytes_per_session={:.0}",
        n,
        table.len(),
        before,
        after,
        (after - before) as f64 / 1024.0,
        (after - before) as f64 * 1024.0 / n.max(1) as f64
    );
}
