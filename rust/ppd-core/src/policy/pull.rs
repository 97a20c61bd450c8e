//! Every Turn 2+ request through P reading the conversation's KV back from its D: the third path as a static rule, for tests and comparisons.

use super::{Context, Policy, PolicyKind};
use crate::route::{Path, Reason};

pub struct PullPolicy;

impl Policy for PullPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Pull
    }
    fn choose(&self, _: &Context) -> (Path, Reason) {
        (Path::Pull, Reason::Forced)
    }
}
