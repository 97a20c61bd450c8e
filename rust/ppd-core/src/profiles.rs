//! Engine profiles by name — the built-in calibrated one, its NIXL variant, the measured
//! H200 one — or a TOML file by path.

use crate::error::Error;

use crate::profile::Profile;

/// Name of the built-in profile (fitted to the measured H100 data).
pub const DEFAULT_PROFILE_NAME: &str = "h100-llama3.1-8b";
/// Its TOML text, as committed in `tables/`.
pub const DEFAULT_PROFILE: &str = include_str!("../../../tables/engine-h100-llama3.1-8b.toml");

pub fn default_profile() -> Profile {
    // Compiled in and checked by a unit test: a failure here is a broken build, never input.
    // Falling back to another profile would silently emulate some other machine.
    match parse(DEFAULT_PROFILE, DEFAULT_PROFILE_NAME) {
        Ok(p) => p,
        Err(e) => panic!("the built-in profile does not load: {e}"),
    }
}

fn parse(text: &str, origin: &str) -> Result<Profile, Error> {
    let p: Profile =
        toml::from_str(text).map_err(|e| Error::Config(format!("profile {origin}: {e}")))?;
    p.validate()
        .map_err(|e| Error::Config(format!("profile {origin}: {e}")))?;
    Ok(p)
}

/// The built-in profile as a NIXL deployment would run it: the calibration data came from
/// P2pNccl, which resends the whole prompt's KV and blocks P's step on the send; with NIXL, D
/// pulls only what its prefix cache lacks and P's step does not wait. Step costs are unchanged.
pub const NIXL_PROFILE_NAME: &str = "h100-llama3.1-8b-nixl";

/// Llama-3.1-8B on one H200: step costs measured on the device by `bench/gpu/step_profile.py`
/// (no vLLM), plus an estimated host-side step overhead (its TOML says how it was estimated);
/// the link, API and harness sections are the H100 profile's.
pub const H200_PROFILE_NAME: &str = "h200-llama3.1-8b";
/// Its TOML text, as committed in `tables/`.
pub const H200_PROFILE: &str = include_str!("../../../tables/engine-h200-llama3.1-8b.toml");

/// Loads a profile: the built-in one by name (`h100-llama3.1-8b`,
/// `engine-h100-llama3.1-8b`, `default`), its NIXL variant (`h100-llama3.1-8b-nixl`),
/// the H200 one (`h200-llama3.1-8b`, `engine-h200-llama3.1-8b`), else a TOML file at that path.
pub fn load_profile(name_or_path: &str) -> Result<Profile, Error> {
    match name_or_path.trim() {
        "" | "default" | DEFAULT_PROFILE_NAME | "engine-h100-llama3.1-8b" => {
            parse(DEFAULT_PROFILE, DEFAULT_PROFILE_NAME)
        }
        H200_PROFILE_NAME | "engine-h200-llama3.1-8b" => parse(H200_PROFILE, H200_PROFILE_NAME),
        NIXL_PROFILE_NAME => {
            let mut p = parse(DEFAULT_PROFILE, DEFAULT_PROFILE_NAME)?;
            p.link.full_prompt_transfer = false;
            p.link.push_ms = 0.0;
            p.link.pull = true;
            Ok(p)
        }
        path => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                Error::Config(format!(
                    "profile {path:?}: not a built-in name ({DEFAULT_PROFILE_NAME}, {NIXL_PROFILE_NAME}, {H200_PROFILE_NAME}) and not a readable file: {e}"
                ))
            })?;
            parse(&text, path)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_profile_parses_and_validates() {
        let p = load_profile(DEFAULT_PROFILE_NAME).unwrap();
        assert_eq!(p.kv_bytes_per_token, 131_072);
        assert_eq!(p.block_size, 16);
    }

    #[test]
    fn the_nixl_variant_pulls_only_what_d_lacks_and_keeps_the_step_costs() {
        let base = load_profile(DEFAULT_PROFILE_NAME).unwrap();
        let nixl = load_profile(NIXL_PROFILE_NAME).unwrap();
        assert!(base.link.full_prompt_transfer && base.link.push_ms > 0.0);
        assert!(!nixl.link.full_prompt_transfer);
        assert_eq!(nixl.link.push_ms, 0.0);
        assert!(nixl.link.pull && !base.link.pull);
        assert_eq!(nixl.link.gbps, base.link.gbps);
        assert_eq!(format!("{:?}", nixl.step), format!("{:?}", base.step));
    }

    #[test]
    fn the_h200_profile_loads_by_name_and_validates() {
        let p = load_profile(H200_PROFILE_NAME).unwrap();
        assert_eq!(p.name, H200_PROFILE_NAME);
        assert_eq!(p.kv_bytes_per_token, 131_072);
        assert_eq!(load_profile("engine-h200-llama3.1-8b").unwrap(), p);
    }

    #[test]
    fn the_h200_profile_adds_host_time_to_the_measured_device_overhead() {
        // The measured device-only overhead is 5.5815 ms (../shared/data/h200-step-profile/);
        // the profile must carry vLLM's host work on top of it, and stay below the H100's
        // end-to-end fit (same model, faster memory).
        let h200 = load_profile(H200_PROFILE_NAME).unwrap();
        let h100 = load_profile(DEFAULT_PROFILE_NAME).unwrap();
        assert!(h200.step.overhead_ms > 5.5815);
        assert!(h200.step.overhead_ms < h100.step.overhead_ms);
    }

    #[test]
    fn a_missing_file_is_a_clear_error() {
        let e = load_profile("/nonexistent/profile.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a readable file"), "{e}");
    }

    #[test]
    fn unknown_fields_are_refused() {
        let text = format!("{DEFAULT_PROFILE}\nbogus = 1\n");
        assert!(parse(&text, "x").is_err());
    }
}
