//! Runs the simulator over (a subset of) the paper's grid and writes one CSV row per point,
//! with sweep.csv's column names, for calibration and the fidelity report.
//!
//! ppd-sim-grid [--profile NAME|PATH] [--set step.overhead_ms=7.5 ...] [--configs 4R,2P_2pD]
//!              [--workloads small_tiny,...] [--qps 0.5,1] [--threads 2] [--seed 0] [--out FILE]

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use ppd_core::catalog::{paper_configs, paper_workload_names, PAPER_QPS};
use ppd_model::load_profile;
use ppd_model::sim::{run_grid, SimConfig};

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

/// Simulate (a subset of) the paper's grid; one CSV row per point, with sweep.csv's columns.
#[derive(Parser, Debug)]
#[command(name = "ppd-sim-grid")]
struct Args {
    /// Engine profile: a built-in name or a TOML path.
    #[arg(long, default_value = "default")]
    profile: String,
    /// Override one profile field, e.g. step.overhead_ms=7.5 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = key_value)]
    sets: Vec<(String, String)>,
    /// Deployments, comma-separated (default: the paper's 17).
    #[arg(long, value_delimiter = ',')]
    configs: Vec<String>,
    /// Workloads, comma-separated (default: the paper's 18).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Arrival rates, comma-separated (default: the paper's).
    #[arg(long, value_delimiter = ',')]
    qps: Vec<f64>,
    /// Worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write the CSV here instead of standard output.
    #[arg(long)]
    out: Option<String>,
}

fn key_value(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or("wants KEY=VALUE")?;
    Ok((k.to_owned(), v.to_owned()))
}

impl Args {
    /// The grid's axes, each the paper's when not given.
    fn axes(&self) -> (Vec<String>, Vec<String>, Vec<f64>) {
        let or = |given: &Vec<String>, all: Vec<String>| {
            if given.is_empty() {
                all
            } else {
                given.clone()
            }
        };
        let configs = or(
            &self.configs,
            paper_configs().iter().map(|c| c.0.to_owned()).collect(),
        );
        let workloads = or(&self.workloads, paper_workload_names());
        let qps = if self.qps.is_empty() {
            PAPER_QPS.to_vec()
        } else {
            self.qps.clone()
        };
        (configs, workloads, qps)
    }
}

fn profile_of(args: &Args) -> Result<ppd_model::Profile, String> {
    let mut profile = load_profile(&args.profile).map_err(|e| e.to_string())?;
    if !args.sets.is_empty() {
        let mut v = toml::Value::try_from(&profile).map_err(|e| e.to_string())?;
        for (k, x) in &args.sets {
            set_path(&mut v, k, x)?;
        }
        profile = v.try_into().map_err(|e: toml::de::Error| e.to_string())?;
        profile.validate().map_err(|e| e.to_string())?;
    }
    Ok(profile)
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("ppd-sim-grid: {msg}");
            ExitCode::from(2)
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    let profile = profile_of(args)?;
    let (configs, workloads, qps) = args.axes();
    let (threads, seed) = (args.threads, args.seed);
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
    match &args.out {
        Some(path) => std::fs::write(path, text).map_err(|e| format!("{path}: {e}"))?,
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
    Ok(())
}
