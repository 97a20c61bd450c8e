//! PPD (Equation 1): local iff S = w_ttft·Δttft − w_tpot·Δtpot > 0 in the request's cell.

use super::{Context, Policy, PolicyKind};
use crate::route::{Path, Reason, Weights};

pub struct PpdPolicy;

/// Equation 1, with Δ relative to x = 0 (precomputed per cell at table load).
pub fn score(d_ttft: f64, d_tpot: f64, w: Weights) -> f64 {
    w.w_ttft * d_ttft - w.w_tpot * d_tpot
}

impl Policy for PpdPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Ppd
    }
    fn choose(&self, c: &Context) -> (Path, Reason) {
        if c.scored.score > 0.0 {
            (Path::Local, Reason::ScorePositive)
        } else {
            (Path::Pd, Reason::ScoreNegative)
        }
    }
}
