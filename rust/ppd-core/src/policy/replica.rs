//! Replica serving: every request, Turn 1 included, to an R node.

use super::{Policy, PolicyKind};
use crate::route::{DecisionInput, Path, Reason, Scored, Weights};

pub struct ReplicaPolicy;

impl Policy for ReplicaPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Replica
    }
    fn choose(&self, _: &DecisionInput, _: &Scored, _: Weights) -> (Path, Reason) {
        (Path::Replica, Reason::ReplicaPolicy)
    }
    fn replica_only(&self) -> bool {
        true
    }
}
