//! Deployments in the paper's notation, shared with the simulator (ppd-core), plus the emulator role of each node.

pub use ppd_core::sim::layout::LayoutRole;

use crate::{Error, Role};

/// Parses `2P2pD`, `2P_2pD`, `1P_1D_2pD`, `4R`, `1R_1P_2D`, … into node roles, in order.
pub fn parse_layout(s: &str) -> Result<Vec<LayoutRole>, Error> {
    ppd_core::sim::layout::parse_layout(s).map_err(|e| match e {
        ppd_core::Error::Config(m) => Error::Config(m),
        other => Error::Config(other.to_string()),
    })
}

/// The emulator role that serves a layout node (a pD is a D node; every node takes plain requests).
pub fn node_role(r: LayoutRole) -> Role {
    match r {
        LayoutRole::P => Role::P,
        LayoutRole::D | LayoutRole::PD => Role::D,
        LayoutRole::R => Role::R,
    }
}
