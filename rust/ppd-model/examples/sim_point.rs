//! One simulated point from a `SimConfig` JSON and a profile (name or TOML path), its result as JSON on stdout: the simulator's speed measured without the Python wrapper.
//!
//!     cargo run --release -p ppd-model --example sim_point -- CONFIG.json PROFILE

use std::process::ExitCode;
use std::time::Instant;

use ppd_model::load_profile;
use ppd_model::sim::{simulate, SimConfig};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [config, profile] = args.as_slice() else {
        eprintln!("usage: sim_point CONFIG.json PROFILE");
        return ExitCode::from(2);
    };
    let run = || -> Result<String, String> {
        let text = std::fs::read_to_string(config).map_err(|e| format!("{config}: {e}"))?;
        let cfg: SimConfig = serde_json::from_str(&text).map_err(|e| format!("{config}: {e}"))?;
        let profile = load_profile(profile).map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        let r = simulate(&cfg, &profile, None).map_err(|e| e.to_string())?;
        eprintln!("simulated in {:.2} s", t0.elapsed().as_secs_f64());
        serde_json::to_string(&r).map_err(|e| e.to_string())
    };
    match run() {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sim_point: {e}");
            ExitCode::FAILURE
        }
    }
}
