//! Node roles and deployments in the paper's notation (`2P2pD`, `2P_2pD`, `1P_1D_2pD`, `4R`, `1R_1P_2D`), defined once for the router, the emulator, the simulator and the launcher.

use serde::Serialize;

use crate::error::Error;

/// What a node does in a deployment. `D` always receives KV from P (x = 0);
/// `pD` may also append-prefill Turn 2+ locally (x = 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Role {
    /// Prefill only.
    P,
    /// Decode only: always receives KV from P (x ≡ 0).
    D,
    /// Prefill-capable decode: may append-prefill Turn 2+ locally.
    #[serde(rename = "pD")]
    PD,
    /// Replica: prefill and decode on one engine.
    R,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::P, Role::D, Role::PD, Role::R];

    /// A role by its layout letter or its long name (`prefill`, `decode`, `pd_capable`, `replica`).
    pub fn parse(s: &str) -> Result<Role, Error> {
        match s.trim() {
            "P" | "p" | "prefill" => Ok(Role::P),
            "D" | "d" | "decode" => Ok(Role::D),
            "pD" | "PD" | "pd" | "pd_capable" => Ok(Role::PD),
            "R" | "r" | "replica" => Ok(Role::R),
            other => Err(Error::Config(format!(
                "unknown role {other:?}; expected P, D, pD or R"
            ))),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Role::P => "P",
            Role::D => "D",
            Role::PD => "pD",
            Role::R => "R",
        }
    }
    /// Whether it takes Turn 2+ append-prefills locally.
    pub fn local_capable(self) -> bool {
        self == Role::PD
    }
    /// Whether it decodes KV that a P produced (a D or a pD).
    pub fn decodes(self) -> bool {
        matches!(self, Role::D | Role::PD)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The most nodes a live deployment takes (the router, the emulator and the
/// launcher start or track a process or connection per node).
pub const MAX_LIVE_NODES: usize = 256;
/// The most nodes of one role in one group of a live layout.
pub const MAX_LIVE_GROUP: usize = 64;
/// The most nodes a simulated deployment takes: a virtual node costs only
/// memory (its KV pool's bookkeeping, ~1.4 MB), so clusters of thousands fit.
pub const MAX_SIM_NODES: usize = 4096;

/// Parses a live deployment's layout into its node roles, in the order written.
pub fn parse_layout(s: &str) -> Result<Vec<Role>, Error> {
    parse_layout_within(s, MAX_LIVE_GROUP, MAX_LIVE_NODES)
}

/// Parses a simulated deployment's layout (the same notation, up to
/// [`MAX_SIM_NODES`] nodes, e.g. `250P750pD`).
pub fn parse_sim_layout(s: &str) -> Result<Vec<Role>, Error> {
    parse_layout_within(s, MAX_SIM_NODES, MAX_SIM_NODES)
}

fn parse_layout_within(s: &str, max_group: usize, max_nodes: usize) -> Result<Vec<Role>, Error> {
    let bad = |why: &str| {
        Error::Config(format!(
            "layout {s:?}: {why}; expected e.g. 2P2pD, 1P_1D_2pD, 4R, 1R_1P_2D"
        ))
    };
    let b = s.trim().as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    while i < b.len() {
        if b[i] == b'_' {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let count: usize = if i == start {
            1
        } else {
            std::str::from_utf8(&b[start..i])
                .ok()
                .and_then(|t| t.parse().ok())
                .ok_or_else(|| bad("bad count"))?
        };
        let role = match (b.get(i), b.get(i + 1)) {
            (Some(b'p'), Some(b'D')) => {
                i += 2;
                Role::PD
            }
            (Some(b'P'), _) => {
                i += 1;
                Role::P
            }
            (Some(b'D'), _) => {
                i += 1;
                Role::D
            }
            (Some(b'R'), _) => {
                i += 1;
                Role::R
            }
            _ => return Err(bad("expected P, D, pD or R after a count")),
        };
        if count == 0 || count > max_group {
            return Err(bad(&format!("each count must be 1–{max_group}")));
        }
        out.extend(std::iter::repeat_n(role, count));
    }
    if out.is_empty() {
        return Err(bad("no nodes"));
    }
    if out.len() > max_nodes {
        return Err(bad(&format!("more than {max_nodes} nodes")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Role::*;

    #[test]
    fn paper_notations_parse() {
        assert_eq!(parse_layout("2P2pD").unwrap(), vec![P, P, PD, PD]);
        assert_eq!(parse_layout("2P_2pD").unwrap(), vec![P, P, PD, PD]);
        assert_eq!(parse_layout("1P_1D_2pD").unwrap(), vec![P, D, PD, PD]);
        assert_eq!(parse_layout("4R").unwrap(), vec![R, R, R, R]);
        assert_eq!(parse_layout("1R_1P_2D").unwrap(), vec![R, P, D, D]);
        assert_eq!(parse_layout("P_D").unwrap(), vec![P, D]);
    }

    #[test]
    fn a_simulated_cluster_takes_thousands_of_nodes_a_live_one_does_not() {
        let big = parse_sim_layout("250P750pD").unwrap();
        assert_eq!(big.len(), 1000);
        assert_eq!(big.iter().filter(|r| **r == PD).count(), 750);
        assert!(parse_layout("250P750pD").is_err());
        let too_many = parse_sim_layout("4000P97pD").unwrap_err().to_string();
        assert!(too_many.contains("more than 4096 nodes"), "{too_many}");
    }

    #[test]
    fn bad_layouts_are_refused_with_the_input_named() {
        for s in ["", "2X", "0P", "2P_", "_", "3", "1000R"] {
            let e = parse_layout(s);
            if s == "2P_" {
                assert!(e.is_ok());
                continue;
            }
            let msg = e.unwrap_err().to_string();
            assert!(msg.contains("layout"), "{s}: {msg}");
        }
    }
}

#[cfg(test)]
mod role_tests {
    use super::*;

    #[test]
    fn every_role_parses_back_from_its_name() {
        for r in Role::ALL {
            assert_eq!(Role::parse(r.as_str()).unwrap(), r);
        }
        assert_eq!(Role::parse("pd_capable").unwrap(), Role::PD);
        assert!(Role::parse("X")
            .unwrap_err()
            .to_string()
            .contains("expected P, D, pD or R"));
    }

    #[test]
    fn only_d_and_pd_decode_and_only_pd_runs_local() {
        assert_eq!(Role::ALL.map(Role::decodes), [false, true, true, false]);
        assert_eq!(
            Role::ALL.map(Role::local_capable),
            [false, false, true, false]
        );
    }
}
