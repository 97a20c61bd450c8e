//! Replica serving: every request, Turn 1 included, to an R node.

use super::{Context, Policy, PolicyKind};
use crate::route::{Path, Reason};

pub struct ReplicaPolicy;

impl Policy for ReplicaPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Replica
    }
    fn choose(&self, _: &Context) -> (Path, Reason) {
        (Path::Replica, Reason::ReplicaPolicy)
    }
    fn replica_only(&self) -> bool {
        true
    }
}
