//! A fixed share x of Turn 2+ conversations goes local, chosen by hashing the conversation id.
//!
//! Hashing (not a coin per request) keeps a conversation on one side for all
//! its turns and makes the split reproducible across runs and processes.

use super::{Context, Policy, PolicyKind};
use crate::route::{Path, Reason};

pub struct FractionPolicy {
    x: f64,
}

impl FractionPolicy {
    pub fn new(x: f64) -> Self {
        FractionPolicy { x }
    }
}

/// Maps a 64-bit hash uniformly onto [0, 1).
pub fn unit_interval(hash: u64) -> f64 {
    (hash >> 11) as f64 / (1u64 << 53) as f64
}

impl Policy for FractionPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Fraction(self.x)
    }
    fn choose(&self, c: &Context) -> (Path, Reason) {
        if unit_interval(c.input.conv_hash) < self.x {
            (Path::Local, Reason::FractionLocal)
        } else {
            (Path::Pd, Reason::FractionPd)
        }
    }
}
