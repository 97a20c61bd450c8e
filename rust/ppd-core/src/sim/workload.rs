//! The paper's 18 synthetic two-turn workloads: Turn-1 context × Turn-2 type.

use crate::Error;

/// Turn-2 types as (name, new input tokens, output tokens), Section 4.2.
pub use crate::grid::PAPER_WORKLOADS as T2_WORKLOADS;

/// Turn-1 contexts as (name, input tokens, output tokens).
pub const T1_CONTEXTS: [(&str, u32, u32); 2] = [("small", 128, 128), ("large", 1024, 1024)];

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
                T2_WORKLOADS.map(|w| w.0).join("|")
            ))
        };
        let (ctx, t2) = name.split_once('_').ok_or_else(bad)?;
        let t1 = T1_CONTEXTS.iter().find(|c| c.0 == ctx).ok_or_else(bad)?;
        let w = T2_WORKLOADS.iter().find(|w| w.0 == t2).ok_or_else(bad)?;
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
        .flat_map(|c| T2_WORKLOADS.iter().map(move |w| format!("{}_{}", c.0, w.0)))
        .collect()
}
