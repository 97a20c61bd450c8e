//! Every Turn 2+ request through P reading the conversation's KV back from its D: the third path as a static rule, for tests and comparisons.

use super::{Policy, PolicyKind};
use crate::route::{DecisionInput, Path, Reason, Scored, Weights};

pub struct PullPolicy;

impl Policy for PullPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Pull
    }
    fn choose(&self, _: &DecisionInput, _: &Scored, _: Weights) -> (Path, Reason) {
        (Path::Pull, Reason::Forced)
    }
}
