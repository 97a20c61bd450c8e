//! Open-loop load generator for streamed OpenAI chat requests; prints one JSON summary.
//!
//! Arrivals are Poisson at `--rate` per second for `--duration` seconds (so at most
//! rate × duration requests), scheduled by a dedicated OS thread with ~µs sleeps (not
//! tokio's 1 ms timer), so arrival times are not phase-locked to any millisecond tick.
//! TTFT is measured per request from the moment the request is handed to the HTTP client
//! (`t0`, on the runtime thread) to the first response body chunk carrying `data:`.
//!
//! Modes:
//! - `--target URL`: POST the body to URL (a node or a router) and read the SSE stream.
//! - `--client-pd --prefill URL --decode URL`: do vLLM's NIXL exchange in the client
//!   (P gets `kv_transfer_params.do_remote_decode`, `max_tokens: 1`, no stream; P's
//!   `kv_transfer_params` go to D with the original body), i.e. a router with zero cost.
//!
//! Bounded: every request has `--timeout`; at most `--max-inflight` are open at once
//! (arrivals beyond it are counted as `dropped`, not sent); the run ends at most
//! `timeout + 2 s` after the last arrival.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Open-loop load generator for streamed OpenAI chat requests; prints one JSON summary.
#[derive(Clone, Debug, Parser)]
#[command(name = "ppd-loadgen")]
struct Args {
    /// POST the body to this URL (a node or a router) and read the SSE stream.
    #[arg(long, required_unless_present = "client_pd")]
    target: Option<String>,
    /// Do vLLM's NIXL exchange in the client (a router with zero cost): needs --prefill and --decode.
    #[arg(long, requires_all = ["prefill", "decode"], conflicts_with = "target")]
    client_pd: bool,
    /// The P node of --client-pd.
    #[arg(long)]
    prefill: Option<String>,
    /// The D node of --client-pd.
    #[arg(long)]
    decode: Option<String>,
    /// Poisson arrivals per second (0, 100000].
    #[arg(long, default_value_t = 100.0, value_parser = positive_up_to::<100_000>)]
    rate: f64,
    /// Seconds of arrivals (0, 600].
    #[arg(long, default_value_t = 5.0, value_parser = positive_up_to::<600>)]
    duration: f64,
    /// The request body (JSON) of every request.
    #[arg(long)]
    body: String,
    /// A body sent once per session before the run (the sessions' first turn).
    #[arg(long)]
    prime_body: Option<String>,
    /// Rotate over this many x-session-id values (0: none).
    #[arg(long, default_value_t = 0)]
    sessions: u64,
    #[arg(long, default_value = "bench-")]
    session_prefix: String,
    /// Per-request limit in seconds (0, 120].
    #[arg(long, default_value_t = 5.0, value_parser = positive_up_to::<120>)]
    timeout: f64,
    /// Requests open at once at most; arrivals beyond it are counted as dropped.
    #[arg(long, default_value_t = 4096)]
    max_inflight: u64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Requests sent (and not measured) before the run.
    #[arg(long, default_value_t = 200)]
    warmup: u64,
    /// A fresh x-session-id per request (a new conversation each time).
    #[arg(long)]
    unique_sessions: bool,
}

/// A number in (0, MAX]; written as a range check so that NaN is refused too.
fn positive_up_to<const MAX: u32>(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (f64::MIN_POSITIVE..=f64::from(MAX)).contains(&v) {
        Ok(v)
    } else {
        Err(format!("must be in (0, {MAX}]"))
    }
}

/// splitmix64: the arrival process only needs a seeded uniform source.
struct Rng(u64);
impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

#[derive(Default)]
struct Sample {
    ok: bool,
    status: u16,
    ttft_us: f64,
    total_us: f64,
    lag_us: f64,
    path: Option<String>,
    err: Option<&'static str>,
    end: Option<Instant>,
}

struct Shared {
    client: HttpClient,
    args: Args,
    body: Bytes,
    /// client-pd: the P body, built once (a zero-cost router).
    p_body: Bytes,
    /// client-pd: the original body as JSON, to which P's kv_transfer_params are added.
    body_json: Value,
    inflight: AtomicU64,
}

/// `x-session-id` of request `i`: one of `--sessions` ids in turn, or a fresh id per
/// request with `--unique-sessions` (a new conversation each time), or none.
fn session_id(a: &Args, i: u64) -> Option<String> {
    if a.unique_sessions {
        return Some(format!("{}{}-{}", a.session_prefix, a.seed, i));
    }
    (a.sessions > 0).then(|| format!("{}{}", a.session_prefix, i % a.sessions))
}

fn post(uri: &str, body: Bytes, session: Option<&str>) -> Request<Full<Bytes>> {
    let mut b = Request::post(uri).header("content-type", "application/json");
    if let Some(s) = session {
        b = b.header("x-session-id", s);
    }
    b.body(Full::new(body)).expect("request")
}

/// Sends one streamed request and reads the whole SSE answer; TTFT is from `t0`.
async fn stream_one(
    sh: &Shared,
    uri: &str,
    body: Bytes,
    session: Option<&str>,
    t0: Instant,
    s: &mut Sample,
) {
    let resp = match sh.client.request(post(uri, body, session)).await {
        Ok(r) => r,
        Err(_) => {
            s.err = Some("connect_or_send");
            return;
        }
    };
    s.status = resp.status().as_u16();
    s.path = resp
        .headers()
        .get("x-ppd-path")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let status_ok = resp.status().is_success();
    let mut body = resp.into_body();
    let mut first = None;
    let mut tail: Vec<u8> = Vec::new();
    let mut done = false;
    loop {
        match body.frame().await {
            Some(Ok(f)) => {
                if let Some(d) = f.data_ref() {
                    if d.is_empty() {
                        continue;
                    }
                    if first.is_none() {
                        first = Some(Instant::now());
                    }
                    tail.extend_from_slice(d);
                    if tail.windows(6).any(|w| w == b"[DONE]") {
                        done = true;
                    }
                    if tail.len() > 8 {
                        tail.drain(..tail.len() - 8);
                    }
                }
            }
            Some(Err(_)) => {
                s.err = Some("body_error");
                return;
            }
            None => break,
        }
    }
    let end = Instant::now();
    s.end = Some(end);
    s.total_us = (end - t0).as_secs_f64() * 1e6;
    if let Some(f) = first {
        s.ttft_us = (f - t0).as_secs_f64() * 1e6;
    }
    if !status_ok {
        s.err = Some("http_status");
    } else if !done || first.is_none() {
        s.err = Some("no_done");
    } else {
        s.ok = true;
    }
}

/// The NIXL exchange done by the client: P (non-streamed, max_tokens 1) then D (streamed).
async fn client_pd_one(sh: &Shared, session: Option<&str>, t0: Instant, s: &mut Sample) {
    let p_uri = format!(
        "{}/v1/chat/completions",
        sh.args.prefill.as_deref().unwrap_or_default()
    );
    let resp = match sh
        .client
        .request(post(&p_uri, sh.p_body.clone(), session))
        .await
    {
        Ok(r) => r,
        Err(_) => {
            s.err = Some("p_connect_or_send");
            return;
        }
    };
    if !resp.status().is_success() {
        s.status = resp.status().as_u16();
        s.err = Some("p_http_status");
        return;
    }
    let bytes = match resp.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            s.err = Some("p_body_error");
            return;
        }
    };
    let kv = match serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|mut v| v.get_mut("kv_transfer_params").map(Value::take))
    {
        Some(kv) => kv,
        None => {
            s.err = Some("p_no_kv_transfer_params");
            return;
        }
    };
    let mut d = sh.body_json.clone();
    d["kv_transfer_params"] = kv;
    let d_body = Bytes::from(serde_json::to_vec(&d).expect("json"));
    let d_uri = format!(
        "{}/v1/chat/completions",
        sh.args.decode.as_deref().unwrap_or_default()
    );
    stream_one(sh, &d_uri, d_body, session, t0, s).await;
}

async fn one(sh: Arc<Shared>, i: u64, scheduled: Instant) -> Sample {
    let session = session_id(&sh.args, i);
    let mut s = Sample::default();
    let t0 = Instant::now();
    s.lag_us = (t0 - scheduled).as_secs_f64() * 1e6;
    let limit = Duration::from_secs_f64(sh.args.timeout);
    let fut = async {
        if sh.args.client_pd {
            client_pd_one(&sh, session.as_deref(), t0, &mut s).await;
        } else {
            let uri = format!(
                "{}/v1/chat/completions",
                sh.args.target.as_deref().unwrap_or_default()
            );
            stream_one(&sh, &uri, sh.body.clone(), session.as_deref(), t0, &mut s).await;
        }
    };
    if tokio::time::timeout(limit, fut).await.is_err() {
        s = Sample {
            err: Some("timeout"),
            lag_us: s.lag_us,
            ..Sample::default()
        };
    }
    s
}

fn pct(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let r = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (r.floor() as usize, r.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (r - lo as f64)
}

fn summary(v: &mut [f64]) -> Value {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let mean = if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    };
    json!({
        "n": v.len(), "mean": mean, "p50": pct(v, 0.5), "p90": pct(v, 0.9),
        "p99": pct(v, 0.99), "p999": pct(v, 0.999), "max": v.last().copied().unwrap_or(f64::NAN)
    })
}

fn cpu_seconds() -> f64 {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn main() {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()
        .expect("runtime");
    let read = |p: &str| std::fs::read(p).unwrap_or_else(|e| panic!("{p}: {e}"));
    let body = Bytes::from(read(&args.body));
    let body_json: Value = serde_json::from_slice(&body).expect("--body is not JSON");
    let mut p = body_json.clone();
    if let Some(o) = p.as_object_mut() {
        o.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null}),
        );
        o.insert("stream".into(), Value::Bool(false));
        o.insert("max_tokens".into(), json!(1));
        if o.contains_key("max_completion_tokens") {
            o.insert("max_completion_tokens".into(), json!(1));
        }
        o.remove("stream_options");
        o.remove("min_tokens");
    }
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(4096)
        .build(conn);
    let sh = Arc::new(Shared {
        client,
        args: args.clone(),
        body,
        p_body: Bytes::from(serde_json::to_vec(&p).expect("json")),
        body_json,
        inflight: AtomicU64::new(0),
    });

    // Priming: one Turn-1 request per session id (sequential in 16 lanes), so that the
    // measured requests find their sessions; and warm-up requests to open connections.
    rt.block_on(async {
        if let Some(pb) = &args.prime_body {
            let pb = Bytes::from(read(pb));
            let uri = format!(
                "{}/v1/chat/completions",
                args.target.as_deref().unwrap_or_default()
            );
            let mut lanes = Vec::new();
            for lane in 0..16u64 {
                let (sh, pb, uri) = (Arc::clone(&sh), pb.clone(), uri.clone());
                lanes.push(tokio::spawn(async move {
                    let mut bad = 0u64;
                    let mut i = lane;
                    while i < sh.args.sessions {
                        let mut s = Sample::default();
                        let sid = session_id(&sh.args, i);
                        let f = stream_one(
                            &sh,
                            &uri,
                            pb.clone(),
                            sid.as_deref(),
                            Instant::now(),
                            &mut s,
                        );
                        if tokio::time::timeout(Duration::from_secs(10), f)
                            .await
                            .is_err()
                            || !s.ok
                        {
                            bad += 1;
                        }
                        i += 16;
                    }
                    bad
                }));
            }
            let mut bad = 0;
            for l in lanes {
                bad += l.await.unwrap_or(1);
            }
            if bad > 0 {
                eprintln!(
                    "priming: {bad} of {} session requests failed",
                    args.sessions
                );
            }
        }
        for w in 0..args.warmup {
            let sh2 = Arc::clone(&sh);
            let _ = one(sh2, (1u64 << 40) + w, Instant::now()).await;
        }
    });

    let n_planned = (args.rate * args.duration).round() as u64;
    let results: Arc<Mutex<Vec<Sample>>> =
        Arc::new(Mutex::new(Vec::with_capacity(n_planned as usize)));
    let dropped = Arc::new(AtomicU64::new(0));
    let handle = rt.handle().clone();
    let cpu0 = cpu_seconds();
    let start = Instant::now() + Duration::from_millis(20);
    let mut rng = Rng(args.seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0x1234_5678);

    // The dispatcher: an OS thread with fine-grained sleeps.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1u64, 0, 0, 0) };
    let mut t = 0.0f64;
    let mut sent = 0u64;
    let mut max_lag = 0.0f64;
    let mut last_arrival = start;
    for i in 0..n_planned {
        t += -rng.next_f64().ln() / args.rate;
        if t > args.duration {
            break;
        }
        let at = start + Duration::from_secs_f64(t);
        let now = Instant::now();
        if at > now {
            std::thread::sleep(at - now);
        } else {
            max_lag = max_lag.max((now - at).as_secs_f64());
        }
        last_arrival = at;
        if sh.inflight.load(Ordering::Relaxed) >= args.max_inflight {
            dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        sent += 1;
        sh.inflight.fetch_add(1, Ordering::Relaxed);
        let (sh2, res) = (Arc::clone(&sh), Arc::clone(&results));
        handle.spawn(async move {
            let s = one(Arc::clone(&sh2), i, at).await;
            sh2.inflight.fetch_sub(1, Ordering::Relaxed);
            res.lock().unwrap().push(s);
        });
    }
    let dispatch_end = Instant::now();
    // Wait for the stragglers, bounded.
    let deadline = dispatch_end + Duration::from_secs_f64(args.timeout + 2.0);
    while sh.inflight.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let cpu = cpu_seconds() - cpu0;
    let wall = (Instant::now() - start).as_secs_f64();
    let res = std::mem::take(&mut *results.lock().unwrap());
    let unfinished = sh.inflight.load(Ordering::Relaxed);

    let mut ttft: Vec<f64> = res.iter().filter(|s| s.ok).map(|s| s.ttft_us).collect();
    let mut total: Vec<f64> = res.iter().filter(|s| s.ok).map(|s| s.total_us).collect();
    let mut lag: Vec<f64> = res.iter().map(|s| s.lag_us).collect();
    let ok = ttft.len() as u64;
    let last_end = res.iter().filter_map(|s| s.end).max().unwrap_or(start);
    let span = (last_end.max(last_arrival) - start).as_secs_f64().max(1e-9);
    let mut errors = serde_json::Map::new();
    let mut paths = serde_json::Map::new();
    for s in &res {
        if let Some(e) = s.err {
            let c = errors.entry(e).or_insert(json!(0));
            *c = json!(c.as_u64().unwrap_or(0) + 1);
        }
        if let Some(p) = &s.path {
            let c = paths.entry(p.clone()).or_insert(json!(0));
            *c = json!(c.as_u64().unwrap_or(0) + 1);
        }
    }
    let arrivals = sent + dropped.load(Ordering::Relaxed);
    let out = json!({
        "mode": if args.client_pd { "client-pd".to_string() } else { args.target.clone().unwrap_or_default() },
        "offered_rate": args.rate,
        "duration_s": args.duration,
        "arrivals": arrivals,
        "sent": sent,
        "dropped_inflight_cap": dropped.load(Ordering::Relaxed),
        "unfinished": unfinished,
        "ok": ok,
        "success": if arrivals > 0 { ok as f64 / arrivals as f64 } else { 0.0 },
        "achieved_rate": ok as f64 / span,
        "errors": errors,
        "paths": paths,
        "ttft_us": summary(&mut ttft),
        "total_us": summary(&mut total),
        "dispatch_lag_us": summary(&mut lag),
        "dispatcher_max_late_s": max_lag,
        "client_cpu_s": cpu,
        "client_cpu_share_of_one_core": cpu / wall,
        "wall_s": wall,
    });
    println!("{out}");
    rt.shutdown_timeout(Duration::from_secs(1));
}
