//! Runs the simulator over (a subset of) the paper's grid and writes one CSV row per point,
//! with sweep.csv's column names, for calibration and the fidelity report.
//!
//! ppd-sim-grid [--profile NAME|PATH] [--set step.overhead_ms=7.5 ...] [--configs 4R,2P_2pD]
//!              [--workloads small_tiny,...] [--qps 0.5,1] [--threads 2] [--seed 0] [--out FILE]

use std::io::Write;
use std::time::Instant;

use ppd_core::catalog::{paper_configs, paper_workload_names, PAPER_QPS};
use ppd_model::load_profile;
use ppd_model::sim::{run_grid, SimConfig};

fn fail(msg: &str) -> ! {
    eprintln!("ppd-sim-grid: {msg}");
    std::process::exit(2)
}

fn set_path(v: &mut toml::Value, path: &str, raw: &str) -> Result<(), String> {
    let mut cur = v;
    let parts: Vec<&str> = path.split('.').collect();
    for (i, p) in parts.iter().enumerate() {
        let table = cur
            .as_table_mut()
            .ok_or_else(|| format!("{path}: {p} is not a table"))?;
        if i + 1 == parts.len() {
            let old = table
                .get(*p)
                .ok_or_else(|| format!("{path}: no such field"))?;
            let new = match old {
                toml::Value::Integer(_) => {
                    toml::Value::Integer(raw.parse().map_err(|e| format!("{path}: {e}"))?)
                }
                toml::Value::Float(_) => {
                    toml::Value::Float(raw.parse().map_err(|e| format!("{path}: {e}"))?)
                }
                toml::Value::Boolean(_) => {
                    toml::Value::Boolean(raw.parse().map_err(|e| format!("{path}: {e}"))?)
                }
                _ => toml::Value::String(raw.to_owned()),
            };
            table.insert((*p).to_owned(), new);
            return Ok(());
        }
        cur = table
            .get_mut(*p)
            .ok_or_else(|| format!("{path}: no table {p}"))?;
    }
    Err(format!("{path}: empty path"))
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut profile_name = "default".to_owned();
    let mut sets: Vec<(String, String)> = vec![];
    let mut configs: Vec<String> = paper_configs().iter().map(|c| c.0.to_owned()).collect();
    let mut workloads = paper_workload_names();
    let mut qps: Vec<f64> = PAPER_QPS.to_vec();
    let mut threads = 2usize;
    let mut seed = 0u64;
    let mut out: Option<String> = None;
    while let Some(a) = args.next() {
        let mut val = || {
            args.next()
                .unwrap_or_else(|| fail(&format!("{a} needs a value")))
        };
        match a.as_str() {
            "--profile" => profile_name = val(),
            "--set" => {
                let kv = val();
                let (k, v) = kv
                    .split_once('=')
                    .unwrap_or_else(|| fail("--set wants key=value"));
                sets.push((k.to_owned(), v.to_owned()));
            }
            "--configs" => configs = val().split(',').map(str::to_owned).collect(),
            "--workloads" => workloads = val().split(',').map(str::to_owned).collect(),
            "--qps" => {
                qps = val()
                    .split(',')
                    .map(|q| {
                        q.parse()
                            .unwrap_or_else(|_| fail(&format!("bad qps {q:?}")))
                    })
                    .collect()
            }
            "--threads" => threads = val().parse().unwrap_or_else(|_| fail("bad --threads")),
            "--seed" => seed = val().parse().unwrap_or_else(|_| fail("bad --seed")),
            "--out" => out = Some(val()),
            "-h" | "--help" => {
                println!("see the module doc at the top of ppd-sim-grid.rs");
                return;
            }
            other => fail(&format!("unknown argument {other:?}")),
        }
    }
    let mut profile = load_profile(&profile_name).unwrap_or_else(|e| fail(&e.to_string()));
    if !sets.is_empty() {
        let mut v = toml::Value::try_from(&profile).unwrap_or_else(|e| fail(&e.to_string()));
        for (k, x) in &sets {
            set_path(&mut v, k, x).unwrap_or_else(|e| fail(&e));
        }
        profile = v
            .try_into()
            .unwrap_or_else(|e: toml::de::Error| fail(&e.to_string()));
        profile.validate().unwrap_or_else(|e| fail(&e.to_string()));
    }
    let policy_of = |c: &str| {
        if c.contains('P') && (c.contains('D')) {
            "local"
        } else {
            "replica"
        }
    };
    let mut points = vec![];
    for c in &configs {
        for w in &workloads {
            for &q in &qps {
                let mut p = SimConfig::new(c, policy_of(c), w, q);
                p.seed = seed;
                points.push(p);
            }
        }
    }
    let start = Instant::now();
    let results = run_grid(&points, &profile, None, threads);
    let wall = start.elapsed().as_secs_f64();
    let mut text = String::from(
        "config,t1_context,t2_workload,qps,turn1_count,turn1_avg_ttft_ms,turn1_p50_ttft_ms,turn1_p99_ttft_ms,turn1_avg_tpot_ms,\
turn2_count,turn2_avg_ttft_ms,turn2_p50_ttft_ms,turn2_p99_ttft_ms,turn2_avg_tpot_ms,turn2_p50_tpot_ms,turn2_avg_e2e_ms,\
requests_per_sec,tokens_per_sec,success_rate_pct,local_share,error\n",
    );
    for (p, r) in points.iter().zip(&results) {
        let (ctx, t2) = p.workload.split_once('_').unwrap_or(("", ""));
        match r {
            Ok(r) => text.push_str(&format!(
                "{},{},{},{},{},{:.3},{:.3},{:.3},{:.4},{},{:.3},{:.3},{:.3},{:.4},{:.4},{:.3},{:.4},{:.3},{:.3},{:.4},\n",
                p.deployment, ctx, t2, p.qps, r.turn1.count, r.turn1.avg_ttft_ms, r.turn1.p50_ttft_ms, r.turn1.p99_ttft_ms,
                r.turn1.avg_tpot_ms, r.turn2plus.count, r.turn2plus.avg_ttft_ms, r.turn2plus.p50_ttft_ms,
                r.turn2plus.p99_ttft_ms, r.turn2plus.avg_tpot_ms, r.turn2plus.p50_tpot_ms, r.turn2plus.avg_e2e_ms,
                r.throughput.requests_per_sec, r.throughput.tokens_per_sec, r.success_rate * 100.0, r.local_share
            )),
            Err(e) => text.push_str(&format!(
                "{},{},{},{},,,,,,,,,,,,,,,,,{}\n",
                p.deployment, ctx, t2, p.qps, e.to_string().replace(',', ";")
            )),
        }
    }
    match out {
        Some(path) => std::fs::write(&path, text).unwrap_or_else(|e| fail(&format!("{path}: {e}"))),
        None => {
            let _ = std::io::stdout().write_all(text.as_bytes());
        }
    }
    eprintln!(
        "points={} threads={} wall_s={:.2}",
        points.len(),
        threads,
        wall
    );
}
