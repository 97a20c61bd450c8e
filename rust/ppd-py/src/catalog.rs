//! The shared vocabulary of ppd-core for Python: node roles and layouts, the paper's experiment grid, the shipped tables and the rule that picks one.

use pyo3::prelude::*;

use ppd_core::builtin::{nearest_for, BUILTIN_TABLES};
use ppd_core::catalog;
use ppd_core::layout::{self, Role};

use crate::errors;

/// The roles of a layout, e.g. `parse_layout("1P_1D_2pD") == ["P", "D", "pD", "pD"]`.
#[pyfunction]
fn parse_layout(layout: &str) -> PyResult<Vec<&'static str>> {
    Ok(layout::parse_layout(layout)
        .map_err(errors::from_core)?
        .into_iter()
        .map(Role::as_str)
        .collect())
}

/// The spec (`builtin:NAME`) of the shipped table nearest a layout's share of prefill nodes.
#[pyfunction]
fn nearest_table(layout: &str) -> PyResult<String> {
    let roles = layout::parse_layout(layout).map_err(errors::from_core)?;
    Ok(nearest_for(&roles).spec())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ROLES", Role::ALL.map(Role::as_str).to_vec())?;
    m.add("PAPER_CONTEXT_BINS", catalog::PAPER_CONTEXT_BINS.to_vec())?;
    m.add("PAPER_CONTEXT_NAMES", catalog::PAPER_CONTEXT_NAMES.to_vec())?;
    m.add("PAPER_QPS", catalog::PAPER_QPS.to_vec())?;
    m.add("PAPER_WORKLOADS", catalog::PAPER_WORKLOADS.to_vec())?;
    m.add("T1_CONTEXTS", catalog::T1_CONTEXTS.to_vec())?;
    m.add("SYNTHETIC_WORKLOADS", catalog::paper_workload_names())?;
    m.add("PAPER_CONFIGS", catalog::paper_configs())?;
    m.add(
        "BUILTIN_TABLES",
        BUILTIN_TABLES
            .iter()
            .map(|t| (t.name, t.prefill, t.decode))
            .collect::<Vec<_>>(),
    )?;
    m.add_function(wrap_pyfunction!(parse_layout, m)?)?;
    m.add_function(wrap_pyfunction!(nearest_table, m)?)?;
    Ok(())
}
