#!/usr/bin/env bash
# Criterion benches of the core hot path, and the RSS of 1,000,000 live sessions.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo bench -p ppd-core --bench hot_path -- --warm-up-time 1 --measurement-time 4
cargo run -q --release -p ppd-core --example session_rss -- 1000000
cargo run -q --release -p ppd-core --example residency_rss -- 1000000
