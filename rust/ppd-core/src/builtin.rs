//! The lookup tables shipped in `tables/`, compiled in, and the one rule that picks the nearest for a deployment.
//!
//! `serve`, `simulate`, `table decide` and the Python API all resolve a table
//! through [`load_table`] and [`nearest_for`], so a deployment gets the same
//! table whichever command asks.

use crate::error::Error;
use crate::layout::Role;
use crate::table::Table;

/// A shipped table and the deployment it was measured on.
#[derive(Debug, Clone, Copy)]
pub struct BuiltinTable {
    /// `h100-2P2pD`; `builtin:h100-2P2pD` names it as a table spec.
    pub name: &'static str,
    /// Prefill nodes of the measured deployment.
    pub prefill: u32,
    /// Decode (pD) nodes of the measured deployment.
    pub decode: u32,
    pub json: &'static str,
}

impl BuiltinTable {
    /// Share of prefill nodes among the nodes that take part in PD.
    fn prefill_share(&self) -> f64 {
        f64::from(self.prefill) / f64::from(self.prefill + self.decode)
    }

    /// The spec that names it: `builtin:NAME`.
    pub fn spec(&self) -> String {
        format!("{BUILTIN_PREFIX}{}", self.name)
    }
}

pub const BUILTIN_PREFIX: &str = "builtin:";

pub const BUILTIN_TABLES: [BuiltinTable; 3] = [
    BuiltinTable {
        name: "h100-1P3pD",
        prefill: 1,
        decode: 3,
        json: include_str!("../../../tables/h100-llama3.1-8b-1P3pD.json"),
    },
    BuiltinTable {
        name: "h100-2P2pD",
        prefill: 2,
        decode: 2,
        json: include_str!("../../../tables/h100-llama3.1-8b-2P2pD.json"),
    },
    BuiltinTable {
        name: "h100-3P1pD",
        prefill: 3,
        decode: 1,
        json: include_str!("../../../tables/h100-llama3.1-8b-3P1pD.json"),
    },
];

/// The built-in table whose share of prefill nodes, P / (P + D + pD), is
/// nearest the deployment's; R nodes do not count. A deployment without D
/// nodes counts as all-prefill. Ties go to the table listed first.
pub fn nearest_for(roles: &[Role]) -> &'static BuiltinTable {
    let p = roles.iter().filter(|r| **r == Role::P).count();
    let d = roles.iter().filter(|r| r.decodes()).count();
    let share = if d == 0 {
        1.0
    } else {
        p as f64 / (p + d) as f64
    };
    let mut best = &BUILTIN_TABLES[0];
    for t in &BUILTIN_TABLES[1..] {
        if (t.prefill_share() - share).abs() < (best.prefill_share() - share).abs() {
            best = t;
        }
    }
    best
}

fn names() -> String {
    BUILTIN_TABLES.map(|t| t.name).join(", ")
}

/// Loads a table spec: `builtin:NAME`, or a path to a `ppd-table/1` JSON file.
pub fn load_table(spec: &str) -> Result<Table, Error> {
    if let Some(name) = spec.strip_prefix(BUILTIN_PREFIX) {
        let t = BUILTIN_TABLES
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| {
                Error::Config(format!("no builtin table {name:?} (have {})", names()))
            })?;
        return Ok(Table::from_json(t.json, spec)?);
    }
    let text = std::fs::read_to_string(spec)
        .map_err(|e| Error::Config(format!("cannot read table {spec}: {e}")))?;
    Ok(Table::from_json(&text, spec)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::parse_layout;

    fn nearest(layout: &str) -> &'static str {
        nearest_for(&parse_layout(layout).unwrap()).name
    }

    #[test]
    fn each_measured_deployment_gets_its_own_table() {
        assert_eq!(nearest("1P3pD"), "h100-1P3pD");
        assert_eq!(nearest("2P2pD"), "h100-2P2pD");
        assert_eq!(nearest("3P1pD"), "h100-3P1pD");
    }

    #[test]
    fn other_deployments_get_the_nearest_prefill_share() {
        // 2 of 3 nodes prefill: 0.67 is nearer 0.75 (3P1pD) than 0.5 (2P2pD).
        assert_eq!(nearest("2P1pD"), "h100-3P1pD");
        // 1 of 3: nearer 0.25.
        assert_eq!(nearest("1P2pD"), "h100-1P3pD");
        // D and pD both decode; R nodes take no part.
        assert_eq!(nearest("1P_1D_2pD"), "h100-1P3pD");
        assert_eq!(nearest("2R_1P_1pD"), "h100-2P2pD");
        assert_eq!(nearest("4P4pD"), "h100-2P2pD");
        // No decode node: all-prefill.
        assert_eq!(nearest("4R"), "h100-3P1pD");
    }

    #[test]
    fn every_builtin_table_loads_and_matches_its_deployment() {
        for t in BUILTIN_TABLES {
            let table = load_table(&t.spec()).unwrap();
            let roles = parse_layout(&table.doc().deployment).unwrap();
            assert_eq!(nearest_for(&roles).name, t.name);
        }
    }

    #[test]
    fn unknown_names_and_missing_files_are_clear_errors() {
        let e = load_table("builtin:h200").unwrap_err().to_string();
        assert!(e.contains("h100-1P3pD, h100-2P2pD, h100-3P1pD"), "{e}");
        let e = load_table("/nonexistent/t.json").unwrap_err().to_string();
        assert!(e.contains("cannot read table /nonexistent/t.json"), "{e}");
    }
}
