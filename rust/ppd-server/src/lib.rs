//! ppd-server: the router's HTTP service over P, D/pD and R pools.
//!
//! Layers run top to bottom once per request ([`proxy`]): ingress, identity,
//! policy (ppd-core), orchestration (NIXL / P2pNccl / none), upstream relay,
//! bookkeeping. Side planes: [`registry`], [`admin`], [`metrics`].

pub mod admin;
pub mod body;
pub mod config;
pub mod metrics;
pub mod proxy;
pub mod registry;
pub mod server;
pub mod sse;
pub mod state;

pub use config::RouterConfig;
pub use server::{run, serve_blocking, RouterHandle};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{0}")]
    Config(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}
