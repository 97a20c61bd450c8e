//! Routing policies: each decides the path of a Turn 2+ request whose session's D can serve it.
//!
//! The engine settles everything common (Turn 1, unknown session, D gone, D
//! overloaded) before and after a policy runs, so a policy is one small rule.

mod anchors;
pub mod fraction;
mod live;
mod local;
mod pd;
pub mod ppd;
mod pull;
mod replica;

pub use anchors::{DynamoIslPolicy, DynamoLoadPolicy, LlmdThresholdPolicy};
pub use fraction::FractionPolicy;
pub use live::{LivePolicy, Slo};
pub use local::LocalPolicy;
pub use pd::PdPolicy;
pub use ppd::PpdPolicy;
pub use pull::PullPolicy;
pub use replica::ReplicaPolicy;

use crate::cost::Forecast;
use crate::error::Error;
use crate::route::{DecisionInput, Path, Reason, Scored, Weights};

/// What a policy decides on: the request, its table cell, the operator's
/// objective, and — for policies that predict — the cost model's forecast.
pub struct Context<'a> {
    pub input: &'a DecisionInput,
    pub scored: &'a Scored,
    pub weights: Weights,
    pub slo: Option<Slo>,
    pub forecast: Option<&'a Forecast>,
}

pub trait Policy: Send + Sync {
    fn kind(&self) -> PolicyKind;
    /// The path for a Turn 2+ request with a live session on an available D.
    fn choose(&self, c: &Context) -> (Path, Reason);
    /// Whether every turn, Turn 1 included, goes to a replica.
    fn replica_only(&self) -> bool {
        false
    }
}

/// The policies one engine can run, by name: `pd`, `local`, `pull`, `fraction:X`, `replica`,
/// `ppd`, `ppd-live`, and the anchors' rules `dynamo-isl`, `dynamo-load`, `llmd-threshold`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PolicyKind {
    /// x ≡ 0: Turn 2+ always re-enters through P.
    Pd,
    /// x ≡ 1: Turn 2+ always append-prefills on the session's pD.
    Local,
    /// Turn 2+ always through P reading D's KV back (for tests and comparisons).
    Pull,
    /// A reproducible share x of Turn 2+ conversations goes local.
    Fraction(f64),
    /// Every request to a replica.
    Replica,
    /// Equation 1 on the lookup table.
    Ppd,
    /// Equation 1 (or SLO goodput) over the cost model's live predictions of all three paths.
    Live,
    /// NVIDIA Dynamo's `isl_bounding`: skip P for a short uncached prompt.
    DynamoIsl,
    /// NVIDIA Dynamo's prefill-load rule with its decode-busy gate.
    DynamoLoad,
    /// llm-d's prefix-based PD decider: skip P under an uncached-token threshold.
    LlmdThreshold,
}

impl PolicyKind {
    /// Whether the policy predicts with the cost model (`ppd-live`).
    pub fn predicts(self) -> bool {
        self == PolicyKind::Live
    }

    /// Whether the policy reads the nodes' live state (the route step builds
    /// a snapshot only for these).
    pub fn sees_load(self) -> bool {
        matches!(
            self,
            PolicyKind::Live
                | PolicyKind::DynamoIsl
                | PolicyKind::DynamoLoad
                | PolicyKind::LlmdThreshold
        )
    }

    pub fn parse(s: &str) -> Result<PolicyKind, Error> {
        let s = s.trim();
        match s {
            "pd" | "x0" => Ok(PolicyKind::Pd),
            "local" | "x1" => Ok(PolicyKind::Local),
            "pull" => Ok(PolicyKind::Pull),
            "replica" => Ok(PolicyKind::Replica),
            "ppd" => Ok(PolicyKind::Ppd),
            "ppd-live" => Ok(PolicyKind::Live),
            "dynamo-isl" => Ok(PolicyKind::DynamoIsl),
            "dynamo-load" => Ok(PolicyKind::DynamoLoad),
            "llmd-threshold" => Ok(PolicyKind::LlmdThreshold),
            _ => {
                let x = s.strip_prefix("fraction:").ok_or_else(|| {
                    Error::Config(format!(
                        "unknown policy {s:?}; expected pd, local, pull, fraction:X, replica, ppd, ppd-live, dynamo-isl, dynamo-load or llmd-threshold"
                    ))
                })?;
                let x: f64 = x.parse().map_err(|_| {
                    Error::Config(format!("policy {s:?}: fraction must be a number in [0, 1]"))
                })?;
                if !(0.0..=1.0).contains(&x) {
                    return Err(Error::Config(format!(
                        "policy {s:?}: fraction must be in [0, 1]"
                    )));
                }
                Ok(PolicyKind::Fraction(x))
            }
        }
    }

    pub fn build(self) -> Box<dyn Policy> {
        match self {
            PolicyKind::Pd => Box::new(PdPolicy),
            PolicyKind::Local => Box::new(LocalPolicy),
            PolicyKind::Pull => Box::new(PullPolicy),
            PolicyKind::Fraction(x) => Box::new(FractionPolicy::new(x)),
            PolicyKind::Replica => Box::new(ReplicaPolicy),
            PolicyKind::Ppd => Box::new(PpdPolicy),
            PolicyKind::Live => Box::new(LivePolicy),
            PolicyKind::DynamoIsl => Box::new(DynamoIslPolicy::default()),
            PolicyKind::DynamoLoad => Box::new(DynamoLoadPolicy::default()),
            PolicyKind::LlmdThreshold => Box::new(LlmdThresholdPolicy::default()),
        }
    }
}

/// A policy in settings files is its name (`"fraction:0.5"`), checked as [`PolicyKind::parse`] checks it.
impl serde::Serialize for PolicyKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for PolicyKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        PolicyKind::parse(&name).map_err(serde::de::Error::custom)
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicyKind::Pd => write!(f, "pd"),
            PolicyKind::Local => write!(f, "local"),
            PolicyKind::Pull => write!(f, "pull"),
            PolicyKind::Fraction(x) => write!(f, "fraction:{x}"),
            PolicyKind::Replica => write!(f, "replica"),
            PolicyKind::Ppd => write!(f, "ppd"),
            PolicyKind::Live => write!(f, "ppd-live"),
            PolicyKind::DynamoIsl => write!(f, "dynamo-isl"),
            PolicyKind::DynamoLoad => write!(f, "dynamo-load"),
            PolicyKind::LlmdThreshold => write!(f, "llmd-threshold"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_print_back() {
        for s in [
            "pd",
            "local",
            "pull",
            "replica",
            "ppd",
            "ppd-live",
            "dynamo-isl",
            "dynamo-load",
            "llmd-threshold",
            "fraction:0.5",
            "fraction:0",
            "fraction:1",
        ] {
            assert_eq!(PolicyKind::parse(s).unwrap().to_string(), s);
        }
        assert_eq!(PolicyKind::parse("x0").unwrap(), PolicyKind::Pd);
    }

    #[test]
    fn settings_files_hold_the_policy_by_name() {
        let p: PolicyKind = serde_json::from_str("\"fraction:0.25\"").unwrap();
        assert_eq!(p, PolicyKind::Fraction(0.25));
        assert_eq!(serde_json::to_string(&p).unwrap(), "\"fraction:0.25\"");
        let e = serde_json::from_str::<PolicyKind>("\"fast\"")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("unknown policy \"fast\""), "{e}");
    }

    #[test]
    fn bad_names_are_rejected_with_the_reason() {
        assert!(PolicyKind::parse("fast")
            .unwrap_err()
            .to_string()
            .contains("unknown policy"));
        assert!(PolicyKind::parse("fraction:1.5").is_err());
        assert!(PolicyKind::parse("fraction:NaN").is_err());
        assert!(PolicyKind::parse("fraction:").is_err());
    }
}
