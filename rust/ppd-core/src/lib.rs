//! ppd-core: the routing logic of ppd-router — no sockets, no clock, no async.
//!
//! Data flows down once: [`request`] parses what routing needs, [`identity`]
//! names the conversation and derives its features, [`decision`] applies a
//! [`policy`] to the [`table`] on the [`grid`] and answers a [`route`], and
//! [`session`] remembers the outcome for the next turn. [`layout`],
//! [`catalog`] and [`builtin`] own the shared vocabulary: node roles and
//! deployments, the paper's experiment grid, the shipped tables;
//! [`profile`] and [`profiles`] the calibrated engine numbers that the
//! engine model runs and the cost model predicts with.

pub mod builtin;
pub mod catalog;
pub mod cost;
pub mod decision;
pub mod error;
pub mod grid;
pub mod identity;
pub mod kv_events;
pub mod layout;
pub mod path;
pub mod placement;
pub mod policy;
pub mod profile;
pub mod profiles;
pub mod prompt;
pub mod qps;
pub mod request;
pub mod residency;
pub mod route;
pub mod session;
pub mod table;
pub mod tokens;

pub use cost::{CostModel, Forecast, LiveView, NodeView, PathCost};
pub use decision::DecisionEngine;
pub use error::Error;
pub use layout::Role;
pub use policy::{PolicyKind, Slo};
pub use route::{DecisionInput, Path, Reason, Residency, Route, Scored, Weights};
pub use table::{Table, TableError};
