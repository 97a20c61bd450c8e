//! x ≡ 0, traditional PD: every Turn 2+ request goes through P again.

use super::{Policy, PolicyKind};
use crate::route::{DecisionInput, Path, Reason, Scored, Weights};

pub struct PdPolicy;

impl Policy for PdPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Pd
    }
    fn choose(&self, _: &DecisionInput, _: &Scored, _: Weights) -> (Path, Reason) {
        (Path::Pd, Reason::Forced)
    }
}
