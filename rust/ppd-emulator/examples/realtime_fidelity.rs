//! Does the emulator keep real time under load? N nodes × S concurrent SSE streams each,
//! in this process; compares each request's client-observed first-token→last-token wall
//! time with the engine model's time for the same interval (from `/admin/timings`).
//!
//! cargo run --release -p ppd-emulator --example realtime_fidelity -- [nodes] [streams] [requests] [max_tokens]

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use ppd_emulator::{parse_layout, start_cluster, NodeConfig, Role};
use serde_json::{json, Value};

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p / 100.0).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let nodes = arg(1, 4);
    let streams = arg(2, 256);
    let requests = arg(3, 2);
    let max_tokens = arg(4, 128);
    let base = NodeConfig::new(Role::R);
    let layout = format!("{nodes}R");
    let cluster = start_cluster(&parse_layout(&layout).expect("layout"), &base)
        .await
        .expect("cluster");
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(streams * 2)
        .timeout(Duration::from_secs(600))
        .build()
        .expect("client");
    let started = Instant::now();
    let mut tasks = vec![];
    for (n, node) in cluster.nodes.iter().enumerate() {
        for s in 0..streams {
            let url = format!("{}/v1/chat/completions", node.url);
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let mut out = vec![];
                for r in 0..requests {
                    let content =
                        format!("stream {n} {s} request {r} ") + &"context word ".repeat(50);
                    let body = json!({"messages": [{"role": "user", "content": content}],
                        "max_tokens": max_tokens, "stream": true});
                    let resp = client.post(&url).json(&body).send().await.expect("send");
                    let mut bytes = resp.bytes_stream();
                    let mut first: Option<Instant> = None;
                    let mut id = String::new();
                    let mut last = Instant::now();
                    while let Some(chunk) = bytes.next().await {
                        let chunk = chunk.expect("chunk");
                        let now = Instant::now();
                        let text = String::from_utf8_lossy(&chunk);
                        if first.is_none() && text.contains("\"content\"") {
                            first = Some(now);
                            if let Some(i) = text.find("\"id\":\"") {
                                id = text[i + 6..].split('"').next().unwrap_or("").to_owned();
                            }
                        }
                        last = now;
                    }
                    if let Some(f) = first {
                        out.push((id, last.duration_since(f).as_secs_f64() * 1000.0));
                    }
                }
                out
            }));
        }
    }
    let mut wall: Vec<(String, f64)> = vec![];
    for t in tasks {
        wall.extend(t.await.expect("task"));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let mut model = std::collections::HashMap::new();
    let mut lag_mean = vec![];
    let mut lag_max: f64 = 0.0;
    for node in &cluster.nodes {
        let v: Value = client
            .get(format!("{}/admin/timings", node.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        for r in v["requests"].as_array().unwrap() {
            let d = r["model_finish_ms"].as_f64().unwrap()
                - r["model_first_token_ms"].as_f64().unwrap();
            model.insert(r["id"].as_str().unwrap().to_owned(), d);
        }
        let m = client
            .get(format!("{}/metrics", node.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for l in m.lines() {
            let val = || {
                l.rsplit(' ')
                    .next()
                    .and_then(|x| x.parse::<f64>().ok())
                    .unwrap_or(f64::NAN)
            };
            if l.starts_with("emulator:event_lag_mean_seconds") {
                lag_mean.push(val() * 1000.0);
            }
            if l.starts_with("emulator:event_lag_max_seconds") {
                lag_max = lag_max.max(val() * 1000.0);
            }
        }
    }
    let mut dev: Vec<f64> = vec![];
    let mut ratios: Vec<f64> = vec![];
    for (id, w) in &wall {
        if let Some(&m) = model.get(id) {
            if m > 0.0 {
                ratios.push(w / m);
                dev.push((w / m - 1.0).abs() * 100.0);
            }
        }
    }
    dev.sort_by(f64::total_cmp);
    ratios.sort_by(f64::total_cmp);
    println!(
        "nodes={nodes} streams/node={streams} requests/stream={requests} max_tokens={max_tokens} \
         matched={} of {} requests, run {elapsed:.1}s",
        dev.len(),
        wall.len()
    );
    println!(
        "wall/model duration ratio: median {:.4}, p1 {:.4}, p99 {:.4}; |deviation| median {:.2} %, p99 {:.2} %, max {:.2} %",
        pct(&ratios, 50.0),
        pct(&ratios, 1.0),
        pct(&ratios, 99.0),
        pct(&dev, 50.0),
        pct(&dev, 99.0),
        dev.last().copied().unwrap_or(f64::NAN)
    );
    println!(
        "event lag behind model time: mean per node {:?} ms, max {:.1} ms",
        lag_mean
            .iter()
            .map(|x| (x * 100.0).round() / 100.0)
            .collect::<Vec<_>>(),
        lag_max
    );
    cluster.shutdown().await;
}
