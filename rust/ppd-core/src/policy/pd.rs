//! x ≡ 0, traditional PD: every Turn 2+ request goes through P again.

use super::{Context, Policy, PolicyKind};
use crate::route::{Path, Reason};

pub struct PdPolicy;

impl Policy for PdPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Pd
    }
    fn choose(&self, _: &Context) -> (Path, Reason) {
        (Path::Pd, Reason::Forced)
    }
}
