//! x ≡ 1, full append-prefill on D: every Turn 2+ request stays on its pD.

use super::{Policy, PolicyKind};
use crate::route::{DecisionInput, Path, Reason, Scored, Weights};

pub struct LocalPolicy;

impl Policy for LocalPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Local
    }
    fn choose(&self, _: &DecisionInput, _: &Scored, _: Weights) -> (Path, Reason) {
        (Path::Local, Reason::Forced)
    }
}
