//! Measures the resident memory of a node's block index holding N cached blocks (default 1,000,000).
//!
//! `cargo run --release -p ppd-core --example residency_rss -- 1000000`

use ppd_core::residency::{BlockIndex, KvEvent};

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    const BS: u64 = 16;
    const PER_PROMPT: u64 = 128;
    let before = rss_kib();
    let mut index = BlockIndex::default();
    let mut stored = 0;
    let mut prompt = 0u64;
    while stored < n {
        // One prompt's blocks per event, as vLLM publishes them.
        let blocks = PER_PROMPT.min(n - stored);
        let hashes: Vec<u64> = (0..blocks).map(|b| (prompt << 24) | (b + 1)).collect();
        let tokens: Vec<u64> = (0..blocks * BS).map(|t| (prompt << 24) | t).collect();
        index.apply(&KvEvent::Stored {
            hashes,
            parent: None,
            tokens,
            block_size: BS as u32,
        });
        stored += blocks;
        prompt += 1;
    }
    let after = rss_kib();
    println!(
        "blocks={} held={} rss_before_kib={} rss_after_kib={} delta_mib={:.1} bytes_per_block={:.0} (BYTES_PER_BLOCK estimate {})",
        n,
        index.len(),
        before,
        after,
        (after - before) as f64 / 1024.0,
        (after - before) as f64 * 1024.0 / n.max(1) as f64,
        BlockIndex::BYTES_PER_BLOCK
    );
}
