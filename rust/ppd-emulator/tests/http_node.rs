//! The HTTP node against vLLM's documented OpenAI and NIXL formats, on loopback.

use ppd_emulator::{parse_layout, start_cluster, Cluster, NodeConfig, Role};
use serde_json::{json, Value};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

async fn cluster(layout: &str, seed: u64) -> Cluster {
    let mut base = NodeConfig::new(Role::R);
    base.seed = seed;
    // Fast steps keep the tests short; behaviour, not timing, is under test.
    base.profile.step.overhead_ms = 0.5;
    base.profile.api.request_overhead_ms = 0.0;
    base.profile.link.latency_ms = 1.0;
    start_cluster(&parse_layout(layout).unwrap(), &base)
        .await
        .unwrap()
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(20))
        .build()
        .unwrap()
}

async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = client().post(url).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn post_sse(url: &str, body: &Value) -> (u16, String, Vec<String>) {
    let r = client().post(url).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    let ctype = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let text = r.text().await.unwrap();
    let events = text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .expect("every SSE event is a data line")
                .to_owned()
        })
        .collect();
    (status, ctype, events)
}

/// A greedy chat body (`temperature: 0`: the same text for the same prompt).
fn chat(messages: Value, max_tokens: u32) -> Value {
    json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
}

/// The router's token estimate for a chat prompt (ppd-core's template constants).
fn estimate(messages: &[(&str, &str)]) -> u64 {
    1 + messages
        .iter()
        .map(|(_, c)| 4 + ppd_core::tokens::word_rule_count(c) as u64)
        .sum::<u64>()
        + 3
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_json_has_vllms_shape_and_exact_token_counts() {
    let c = cluster("1R", 1).await;
    let url = format!("{}/v1/chat/completions", c.nodes[0].url);
    let msgs = [
        ("system", "You are terse."),
        ("user", "Hello, how are caches used here?"),
    ];
    let body = chat(
        json!(msgs
            .iter()
            .map(|(r, t)| json!({"role": r, "content": t}))
            .collect::<Vec<_>>()),
        12,
    );
    let (status, v) = post(&url, &body).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL);
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let ch = &v["choices"][0];
    assert_eq!(ch["index"], 0);
    assert_eq!(ch["message"]["role"], "assistant");
    assert_eq!(ch["finish_reason"], "length");
    let content = ch["message"]["content"].as_str().unwrap();
    assert_eq!(ppd_core::tokens::word_rule_count(content), 12);
    assert!(
        !content.contains("  ") && !content.starts_with(' '),
        "single-space joined words: {content:?}"
    );
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"].as_u64().unwrap(), estimate(&msgs));
    assert_eq!(u["completion_tokens"], 12);
    assert_eq!(u["total_tokens"].as_u64().unwrap(), estimate(&msgs) + 12);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(v["kv_transfer_params"].is_null());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_sends_role_then_tokens_then_finish_usage_and_done() {
    let c = cluster("1R", 2).await;
    let url = format!("{}/v1/chat/completions", c.nodes[0].url);
    let mut body = chat(json!([{"role": "user", "content": "stream please"}]), 7);
    let (_, plain) = post(&url, &body).await;
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, ctype, events) = post_sse(&url, &body).await;
    assert_eq!(status, 200);
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    for ch in &chunks {
        assert_eq!(ch["object"], "chat.completion.chunk");
        assert_eq!(ch["id"], chunks[0]["id"]);
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"]
                .get(0)
                .and_then(|x| x["delta"]["content"].as_str())
                .map(str::to_owned)
        })
        .collect();
    // Same prompt and seed: the stream carries exactly the non-streamed text.
    assert_eq!(
        text,
        plain["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let fin: Vec<&Value> = chunks
        .iter()
        .filter(|c| {
            c["choices"]
                .get(0)
                .is_some_and(|x| !x["finish_reason"].is_null())
        })
        .collect();
    assert_eq!(fin.len(), 1);
    assert_eq!(fin[0]["choices"][0]["finish_reason"], "length");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 7);
    // Without include_usage no chunk carries usage.
    body["stream_options"] = json!({"include_usage": false});
    let (_, _, events) = post_sse(&url, &body).await;
    assert!(events.iter().all(|e| !e.contains("\"usage\"")));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_models_health_and_metrics_follow_vllm() {
    let c = cluster("1R", 3).await;
    let base = &c.nodes[0].url;
    let (s, v) = post(
        &format!("{base}/v1/completions"),
        &json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(
        ppd_core::tokens::word_rule_count(v["choices"][0]["text"].as_str().unwrap()),
        5
    );
    assert_eq!(v["usage"]["prompt_tokens"], 1 + 4);
    let (_, _, ev) = post_sse(
        &format!("{base}/v1/completions"),
        &json!({"model": MODEL, "prompt": "x y", "max_tokens": 3, "stream": true}),
    )
    .await;
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let first: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(first["object"], "text_completion");
    assert!(first["choices"][0]["text"].is_string());
    // Without max_tokens the answer ends naturally with `stop`.
    let (_, v) = post(
        &format!("{base}/v1/completions"),
        &json!({"prompt": "no limit"}),
    )
    .await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let m: Value = client()
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(m["data"][0]["owned_by"], "vllm");
    assert_eq!(
        client()
            .get(format!("{base}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let text = client()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:prefix_cache_queries_total{",
        "vllm:prefix_cache_hits_total{",
        "vllm:external_prefix_cache_hits_total{",
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:inter_token_latency_seconds_count{",
    ] {
        assert!(text.contains(name), "missing {name}");
    }
    let ttft_count = text
        .lines()
        .find(|l| l.starts_with("vllm:time_to_first_token_seconds_count"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|x| x.parse::<f64>().ok())
        .unwrap();
    assert_eq!(ttft_count, 3.0);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_vllm_like_errors() {
    let c = cluster("1R", 4).await;
    let url = format!("{}/v1/chat/completions", c.nodes[0].url);
    let raw = client()
        .post(&url)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 400);
    let v: Value = raw.json().await.unwrap();
    // vLLM's request model (pydantic) refuses it, with its own error type.
    assert_eq!(v["error"]["type"], "Bad Request");
    assert_eq!(v["error"]["code"], 400);
    let cases = [
        (json!({"messages": []}), 400),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
            400,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}),
            400,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "n": 0}),
            400,
        ),
        (json!({"messages": [{"role": "user", "content": 5}]}), 400),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "stream": "maybe"}),
            400,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}),
            400,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "kv_transfer_params": {"do_remote_prefill": true}}),
            400,
        ),
        (json!({"prompt": "x"}), 400),
        (
            json!({"model": "other-model", "messages": [{"role": "user", "content": "x"}]}),
            404,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 200_000}),
            400,
        ),
    ];
    for (body, want) in cases {
        let (s, v) = post(&url, &body).await;
        assert_eq!(s, want, "{body} -> {v}");
        assert_eq!(v["error"]["code"], want, "{v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    let (_, v) = post(
        &url,
        &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 200_000}),
    )
    .await;
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length"));
    let (s, _) = post(&format!("{}/v1/nothing", c.nodes[0].url), &json!({})).await;
    assert_eq!(s, 404);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_turn_hits_the_prefix_cache_on_the_same_node() {
    let c = cluster("1R", 5).await;
    let url = format!("{}/v1/chat/completions", c.nodes[0].url);
    let q1 = "Explain prefix caching in a few words, please, with an example.";
    let (_, v1) = post(&url, &chat(json!([{"role": "user", "content": q1}]), 40)).await;
    let a1 = v1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let p1 = v1["usage"]["prompt_tokens"].as_u64().unwrap();
    let msgs = json!([{"role": "user", "content": q1}, {"role": "assistant", "content": a1}, {"role": "user", "content": "And then?"}]);
    let (_, v2) = post(&url, &chat(msgs, 5)).await;
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Turn 1's prompt and answer, to the last full 16-token block whose KV exists.
    let expect = (p1 + 40 - 1) / 16 * 16;
    assert_eq!(cached, expect, "turn 2 reuses turn 1's KV");
    let metrics = client()
        .get(format!("{}/metrics", c.nodes[0].url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let hits = metrics
        .lines()
        .find(|l| l.starts_with("vllm:prefix_cache_hits_total"))
        .unwrap();
    assert!(hits.ends_with(&format!(" {expect}")), "{hits}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_exchange_moves_kv_from_p_to_d_end_to_end() {
    let c = cluster("1P1D", 6).await;
    let (p, d) = (&c.nodes[0].url, &c.nodes[1].url);
    let long = "word ".repeat(300);
    let original = chat(json!([{"role": "user", "content": long}]), 20);
    let mut to_p = original.clone();
    to_p["max_tokens"] = json!(1);
    to_p["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let (s, pv) = post(&format!("{p}/v1/chat/completions"), &to_p).await;
    assert_eq!(s, 200, "{pv}");
    let kv = &pv["kv_transfer_params"];
    assert_eq!(kv["do_remote_prefill"], true);
    assert_eq!(kv["do_remote_decode"], false);
    assert_eq!(kv["remote_host"], "127.0.0.1");
    assert_eq!(
        kv["remote_port"].as_u64().unwrap(),
        c.nodes[0].addr.port() as u64
    );
    assert!(kv["remote_engine_id"]
        .as_str()
        .unwrap()
        .starts_with("emu-P"));
    assert_eq!(kv["remote_request_id"], pv["id"]);
    assert_eq!(kv["tp_size"], 1);
    let prompt = pv["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        kv["remote_block_ids"].as_array().unwrap().len() as u64,
        prompt.div_ceil(16)
    );
    let held = |m: &str| {
        m.lines()
            .find(|l| l.starts_with("emulator:kv_held_requests"))
            .unwrap()
            .ends_with(" 1")
    };
    let pm = client()
        .get(format!("{p}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(held(&pm), "P holds the KV until it is pulled");

    let mut to_d = original.clone();
    to_d["kv_transfer_params"] = kv.clone();
    let (s, dv) = post(&format!("{d}/v1/chat/completions"), &to_d).await;
    assert_eq!(s, 200, "{dv}");
    assert_eq!(dv["usage"]["completion_tokens"], 20);
    assert_eq!(
        dv["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        prompt - 1,
        "all but the last prompt token came from P"
    );
    let dm = client()
        .get(format!("{d}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(dm
        .lines()
        .any(|l| l.starts_with("vllm:external_prefix_cache_hits_total")
            && l.ends_with(&format!(" {}", prompt - 1))));
    assert!(dm
        .lines()
        .any(|l| l.starts_with("emulator:kv_transfer_bytes_total")
            && l.ends_with(&format!(" {}", (prompt - 1) * 131_072))));
    let pm = client()
        .get(format!("{p}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!held(&pm), "the pull released P's blocks");

    // Replaying the same params: nothing left at P, so D recomputes (vLLM's recompute policy).
    let mut again = to_d.clone();
    again["messages"][0]["content"] = json!(format!("{long} more"));
    let (s, rv) = post(&format!("{d}/v1/chat/completions"), &again).await;
    assert_eq!(s, 200);
    assert!(
        rv["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= (prompt - 1) / 16 * 16,
        "D's prefix cache kept the pulled KV"
    );
    let dm = client()
        .get(format!("{d}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(dm
        .lines()
        .any(|l| l.starts_with("emulator:kv_pull_failures_total") && l.ends_with(" 1")));
    c.shutdown().await;
}

async fn metric(url: &str, name: &str) -> f64 {
    let text = client()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bidirectional_p_reads_ds_conversation_kv_and_prefills_only_the_new_turn() {
    let mut base = NodeConfig::new(Role::R);
    base.seed = 8;
    base.profile.step.overhead_ms = 0.5;
    base.profile.api.request_overhead_ms = 0.0;
    base.profile.link.latency_ms = 1.0;
    base.bidirectional = ppd_emulator::Bidirectional::from_extra_config(
        r#"{"bidirectional_kv_xfer": true, "decoder_kv_blocks_ttl": 30}"#,
    )
    .unwrap();
    let c = start_cluster(&parse_layout("1P1pD").unwrap(), &base)
        .await
        .unwrap();
    let (p, d) = (&c.nodes[0].url, &c.nodes[1].url);
    // Turn 1 on D, with (empty) transfer params so that D pins its blocks.
    let turn1 = json!([{"role": "user", "content": "word ".repeat(300)}]);
    let mut to_d = chat(turn1.clone(), 20);
    to_d["kv_transfer_params"] = json!({"do_remote_decode": false, "do_remote_prefill": false});
    let (s, dv) = post(&format!("{d}/v1/chat/completions"), &to_d).await;
    assert_eq!(s, 200, "{dv}");
    let handle = dv["kv_transfer_params"].clone();
    assert_eq!(handle["do_remote_decode"], true, "{handle}");
    assert_eq!(handle["do_remote_prefill"], false);
    let prompt1 = dv["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        handle["remote_num_tokens"].as_u64().unwrap(),
        prompt1 + 20 - 1
    );
    assert!(handle["remote_blocks_expiry_time"].as_f64().unwrap() > 0.0);
    assert_eq!(
        metric(d, "emulator:kv_held_requests").await,
        1.0,
        "D pins turn 1"
    );
    // Without params a request is not pinned, and its answer names nothing.
    let (_, plain) = post(
        &format!("{d}/v1/chat/completions"),
        &chat(json!([{"role": "user", "content": "other"}]), 4),
    )
    .await;
    assert!(plain["kv_transfer_params"].is_null(), "{plain}");

    // Turn 2's prefill on P reads the conversation's KV back from D.
    let answer = dv["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let turn2 = json!([{"role": "user", "content": "word ".repeat(300)},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and then what happened after all of that"}]);
    let mut to_p = chat(turn2.clone(), 1);
    let mut kv = handle.clone();
    kv["do_remote_decode"] = json!(true);
    kv["do_remote_prefill"] = json!(false);
    to_p["kv_transfer_params"] = kv;
    let computed_before = metric(p, "vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\",source=\"local_compute\"}").await;
    let (s, pv) = post(&format!("{p}/v1/chat/completions"), &to_p).await;
    assert_eq!(s, 200, "{pv}");
    let prompt2 = pv["usage"]["prompt_tokens"].as_u64().unwrap();
    let pulled = pv["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(pulled, prompt1 + 20 - 1, "P pulled all D computed");
    let computed = metric(p, "vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\",source=\"local_compute\"}").await - computed_before;
    assert_eq!(
        computed as u64,
        prompt2 - pulled,
        "P computed only the new tokens"
    );
    assert_eq!(
        metric(p, "vllm:external_prefix_cache_hits_total").await as u64,
        pulled
    );
    assert_eq!(
        metric(d, "emulator:kv_held_requests").await,
        0.0,
        "the read released D's pin"
    );
    // The handle is single-use: a second read finds nothing at D (P's own
    // prefix cache serves the prompt now).
    let (s, _) = post(&format!("{p}/v1/chat/completions"), &to_p).await;
    assert_eq!(s, 200);
    assert_eq!(
        metric(p, "vllm:external_prefix_cache_hits_total").await as u64,
        pulled
    );
    assert_eq!(metric(p, "emulator:kv_pull_failures_total").await, 1.0);

    // D decodes turn 2 from P's prefill, pulling only what its cache lacks.
    let mut to_d2 = chat(turn2, 8);
    to_d2["kv_transfer_params"] = pv["kv_transfer_params"].clone();
    let (s, d2) = post(&format!("{d}/v1/chat/completions"), &to_d2).await;
    assert_eq!(s, 200, "{d2}");
    assert_eq!(
        d2["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        prompt2 - 1
    );
    assert_eq!(
        d2["kv_transfer_params"]["do_remote_decode"], true,
        "turn 2 pinned too"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_like_vllm_varies_the_text_unless_greedy_or_seeded() {
    let c = cluster("1R", 3).await;
    let url = format!("{}/v1/chat/completions", c.nodes[0].url);
    let text = |v: &Value| {
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let mut body = chat(json!([{"role": "user", "content": "Hello"}]), 12);
    body.as_object_mut().unwrap().remove("temperature"); // vLLM's default: 1.0
    let mut seen = std::collections::HashSet::new();
    for _ in 0..4 {
        let (s, v) = post(&url, &body).await;
        assert_eq!(s, 200, "{v}");
        seen.insert(text(&v));
    }
    assert!(
        seen.len() > 1,
        "sampled answers to one prompt all alike: {seen:?}"
    );
    for fixed in [
        json!({"temperature": 0}),
        json!({"temperature": 0.8, "seed": 7}),
    ] {
        let mut b = body.clone();
        b.as_object_mut()
            .unwrap()
            .extend(fixed.as_object().unwrap().clone());
        let (_, first) = post(&url, &b).await;
        let (_, again) = post(&url, &b).await;
        assert_eq!(text(&first), text(&again), "{fixed}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_fixes_generated_text_across_nodes() {
    let a = cluster("2R", 9).await;
    let b = cluster("1R", 9).await;
    let body = chat(json!([{"role": "user", "content": "same question"}]), 15);
    let text = |v: Value| {
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let (_, x) = post(&format!("{}/v1/chat/completions", a.nodes[0].url), &body).await;
    let (_, y) = post(&format!("{}/v1/chat/completions", b.nodes[0].url), &body).await;
    let (_, z) = post(&format!("{}/v1/chat/completions", a.nodes[1].url), &body).await;
    assert_eq!(text(x.clone()), text(y), "same seed, same text");
    assert_ne!(text(x), text(z), "node 1 of a cluster gets seed + 1");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_faults_error_hang_and_crash() {
    let c = cluster("1R", 10).await;
    let base = c.nodes[0].url.clone();
    let url = format!("{base}/v1/chat/completions");
    let body = chat(json!([{"role": "user", "content": "x"}]), 2);
    let (s, _) = post(&format!("{base}/admin/faults"), &json!({"error_rate": 1.0})).await;
    assert_eq!(s, 200);
    let (s, v) = post(&url, &body).await;
    assert_eq!((s, v["error"]["code"].as_u64()), (500, Some(500)));
    let (s, _) = post(&format!("{base}/admin/faults"), &json!({"error_rate": 2.0})).await;
    assert_eq!(s, 400, "out-of-range faults are refused");
    post(&format!("{base}/admin/faults"), &json!({"hang": true})).await;
    let quick = reqwest::Client::builder()
        .timeout(std::time::Duration::from_millis(300))
        .build()
        .unwrap();
    assert!(quick
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap_err()
        .is_timeout());
    post(&format!("{base}/admin/faults"), &json!({"latency_ms": 0.0})).await;
    let (s, _) = post(&url, &body).await;
    assert_eq!(s, 200, "clearing faults restores service");
    post(&format!("{base}/admin/faults"), &json!({"crash": true})).await;
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let r = client().get(format!("{base}/health")).send().await;
    assert!(
        r.is_err() || r.unwrap().status() != 200,
        "a crashed node is not healthy"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoding_node_publishes_its_stored_blocks_as_vllm_kv_events() {
    use zeromq::{Socket, SocketRecv};
    let c = cluster("1R", 7).await;
    let endpoint = c.nodes[0].kv_events.clone().expect("R publishes KV events");
    // The router's side: SUB binds, the node's PUB connects (vLLM's non-wildcard endpoint).
    let mut sub = zeromq::SubSocket::new();
    sub.bind(&endpoint).await.unwrap();
    sub.subscribe("").await.unwrap();
    let url = format!("{}/v1/chat/completions", c.nodes[0].url);
    let history = json!([{"role": "user", "content": "one two three four five six seven eight nine ten ".repeat(8)}]);
    // The node retries its connection every 500 ms; ask until a batch arrives.
    let mut stored = Vec::new();
    for _ in 0..20 {
        let (status, _) = post(&url, &chat(history.clone(), 4)).await;
        assert_eq!(status, 200);
        if let Ok(Ok(msg)) =
            tokio::time::timeout(std::time::Duration::from_millis(300), sub.recv()).await
        {
            let frames: Vec<&[u8]> = msg.iter().map(|f| f.as_ref()).collect();
            let batch = ppd_core::kv_events::decode_message(&frames).unwrap();
            stored.extend(batch.events);
            break;
        }
    }
    assert!(
        stored
            .iter()
            .any(|e| matches!(e, ppd_core::residency::KvEvent::Stored { .. })),
        "no BlockStored reached the subscriber: {stored:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_times_n_answers_one_choice_per_prompt_and_sample_whole_and_streamed() {
    let c = cluster("1R", 6).await;
    let url = format!("{}/v1/completions", c.nodes[0].url);
    let body = json!({"model": MODEL, "prompt": ["one two", "three"], "n": 2, "max_tokens": 3, "logprobs": 1});
    let (s, v) = post(&url, &body).await;
    assert_eq!(s, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    let idx: Vec<u64> = choices
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(idx, [0, 1, 2, 3]);
    for ch in choices {
        let lp = &ch["logprobs"];
        let tokens: Vec<&str> = lp["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(tokens.concat(), ch["text"].as_str().unwrap());
        assert!(lp["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x.as_f64().unwrap() <= 0.0));
    }
    assert_eq!(v["usage"]["completion_tokens"], 12);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (s, _, events) = post_sse(&url, &streamed).await;
    assert_eq!(s, 200);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut finishes = [0; 4];
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        for ch in v["choices"].as_array().unwrap() {
            if !ch["finish_reason"].is_null() {
                finishes[ch["index"].as_u64().unwrap() as usize] += 1;
            }
        }
    }
    assert_eq!(finishes, [1, 1, 1, 1]);
    c.shutdown().await;
}
