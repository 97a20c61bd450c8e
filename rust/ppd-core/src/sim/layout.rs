//! Deployments in the paper's notation: `2P2pD`, `2P_2pD`, `1P_1D_2pD`, `4R`, `1R_1P_2D`.

use crate::Error;

/// A node of a deployment as the router sees it: `D` always receives KV from P
/// (x = 0), `pD` may also append-prefill Turn 2+ locally (x = 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayoutRole {
    P,
    D,
    PD,
    R,
}

impl LayoutRole {
    /// Whether it takes Turn 2+ append-prefills locally.
    pub fn local_capable(self) -> bool {
        self == LayoutRole::PD
    }
    pub fn is_decode(self) -> bool {
        matches!(self, LayoutRole::D | LayoutRole::PD)
    }
    pub fn as_str(self) -> &'static str {
        match self {
            LayoutRole::P => "P",
            LayoutRole::D => "D",
            LayoutRole::PD => "pD",
            LayoutRole::R => "R",
        }
    }
}

/// Parses a layout into its node roles, in the order written.
pub fn parse_layout(s: &str) -> Result<Vec<LayoutRole>, Error> {
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
                LayoutRole::PD
            }
            (Some(b'P'), _) => {
                i += 1;
                LayoutRole::P
            }
            (Some(b'D'), _) => {
                i += 1;
                LayoutRole::D
            }
            (Some(b'R'), _) => {
                i += 1;
                LayoutRole::R
            }
            _ => return Err(bad("expected P, D, pD or R after a count")),
        };
        if count == 0 || count > 64 {
            return Err(bad("each count must be 1–64"));
        }
        out.extend(std::iter::repeat_n(role, count));
    }
    if out.is_empty() {
        return Err(bad("no nodes"));
    }
    if out.len() > 256 {
        return Err(bad("more than 256 nodes"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use LayoutRole::*;

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
