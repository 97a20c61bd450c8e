//! The paper's experiment grid, defined once: context classes, the nine Turn-2 workload types, the QPS levels, the 18 synthetic two-turn workloads and the 17 deployments.
//!
//! The lookup grid, the table builder, the simulator and the Python harness
//! all read these values from here (Python through `ppd_router._core`).

use crate::error::Error;
use crate::grid::WorkloadType;

/// The paper's context bins: small ≤ 512 < large ≤ 4096 < huge.
pub const PAPER_CONTEXT_BINS: [u32; 2] = [512, 4096];
pub const PAPER_CONTEXT_NAMES: [&str; 3] = ["small", "large", "huge"];
/// The paper's QPS levels (Section 4.2).
pub const PAPER_QPS: [f64; 10] = [0.5, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0];

/// The paper's nine Turn-2 workload types (Section 4.2) as (name, n_in, n_out).
pub const PAPER_WORKLOADS: [(&str, u32, u32); 9] = [
    ("tiny", 16, 32),
    ("short_gen", 32, 256),
    ("long_gen", 32, 512),
    ("very_long_gen", 64, 1024),
    ("small_bal", 64, 64),
    ("mid_bal", 128, 128),
    ("mid_paste", 256, 64),
    ("big_paste", 512, 64),
    ("huge_paste", 1024, 32),
];

/// [`PAPER_WORKLOADS`] as table axis entries.
pub fn paper_workloads() -> Vec<WorkloadType> {
    PAPER_WORKLOADS
        .into_iter()
        .map(|(name, n_in, n_out)| WorkloadType {
            name: name.to_owned(),
            n_in,
            n_out,
        })
        .collect()
}

/// Turn-1 contexts of the synthetic workloads as (name, input tokens, output tokens).
pub const T1_CONTEXTS: [(&str, u32, u32); 2] = [("small", 128, 128), ("large", 1024, 1024)];

/// A synthetic two-turn workload: a Turn-1 context and a Turn-2 type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    /// Turn 1 (input, output) tokens.
    pub t1: (u32, u32),
    /// Turn 2+ (new input, output) tokens.
    pub t2: (u32, u32),
}

impl Workload {
    /// `small_tiny` … `large_huge_paste`.
    pub fn by_name(name: &str) -> Result<Workload, Error> {
        let bad = || {
            Error::Config(format!(
                "unknown workload {name:?}; expected <small|large>_<{}>",
                PAPER_WORKLOADS.map(|w| w.0).join("|")
            ))
        };
        let (ctx, t2) = name.split_once('_').ok_or_else(bad)?;
        let t1 = T1_CONTEXTS.iter().find(|c| c.0 == ctx).ok_or_else(bad)?;
        let w = PAPER_WORKLOADS.iter().find(|w| w.0 == t2).ok_or_else(bad)?;
        Ok(Workload {
            t1: (t1.1, t1.2),
            t2: (w.1, w.2),
        })
    }
}

/// The 18 names, small first, in the table's Turn-2 order.
pub fn paper_workload_names() -> Vec<String> {
    T1_CONTEXTS
        .iter()
        .flat_map(|c| {
            PAPER_WORKLOADS
                .iter()
                .map(move |w| format!("{}_{}", c.0, w.0))
        })
        .collect()
}

/// The paper's 17 configurations with the policy that realises each:
/// `local` (D nodes stay x = 0 by role, pD nodes append-prefill) or `replica` for 4R.
pub fn paper_configs() -> Vec<(&'static str, &'static str)> {
    [
        "1P_1D_2pD",
        "1P_2D_1pD",
        "1P_3D",
        "1P_3pD",
        "1R_1P_1D_1pD",
        "1R_1P_2D",
        "1R_1P_2pD",
        "1R_2P_1D",
        "1R_2P_1pD",
        "2P_1D_1pD",
        "2P_2D",
        "2P_2pD",
        "2R_1P_1D",
        "2R_1P_1pD",
        "3P_1D",
        "3P_1pD",
        "4R",
    ]
    .into_iter()
    .map(|c| (c, if c == "4R" { "replica" } else { "local" }))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_synthetic_names_cover_every_context_and_type() {
        let names = paper_workload_names();
        assert_eq!(names.len(), 18);
        assert_eq!(names[0], "small_tiny");
        assert_eq!(names[17], "large_huge_paste");
        for n in &names {
            assert!(Workload::by_name(n).is_ok(), "{n}");
        }
        let w = Workload::by_name("large_big_paste").unwrap();
        assert_eq!((w.t1, w.t2), ((1024, 1024), (512, 64)));
    }

    #[test]
    fn unknown_names_are_refused_with_the_expected_form() {
        for bad in ["", "small", "huge_tiny", "small_enormous"] {
            let e = Workload::by_name(bad).unwrap_err().to_string();
            assert!(e.contains("expected <small|large>_<tiny|"), "{bad}: {e}");
        }
    }

    #[test]
    fn every_paper_configuration_parses_as_a_layout() {
        let configs = paper_configs();
        assert_eq!(configs.len(), 17);
        for (c, policy) in configs {
            let roles = crate::layout::parse_layout(c).unwrap();
            assert_eq!(roles.len(), 4, "{c}");
            assert_eq!(policy == "replica", c == "4R");
        }
    }
}
