//! x ≡ 1, full append-prefill on D: every Turn 2+ request stays on its pD.

use super::{Context, Policy, PolicyKind};
use crate::route::{Path, Reason};

pub struct LocalPolicy;

impl Policy for LocalPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Local
    }
    fn choose(&self, _: &Context) -> (Path, Reason) {
        (Path::Local, Reason::Forced)
    }
}
