//! ppd-server: the router's HTTP service over P, D/pD and R pools.
//!
//! A request flows down the layers once: [`ingress`] (HTTP, body limits,
//! OpenAI errors) → [`identify`] (conversation, features) → [`route`] (path,
//! P, D, vetoes) → [`orchestrate`] (through the [`connector`] of the KV
//! protocol) → [`upstream`] and [`relay`] (node calls, the relayed answer) →
//! [`bookkeeping`] (session update, metrics). Side planes: [`registry`],
//! [`admin`], [`metrics`]. Under them, the transport: `listener` (accept
//! loop, connection cap, graceful stop) and `connection` (hyper per
//! connection: timeouts, refusals as OpenAI errors, lingering close).
//! Emulated nodes are started by the caller; this crate never links the
//! emulator.

// The request path returns `Result<_, Response>`: a refusal is the answer to
// send, built once on the way out; boxing it would only add an allocation.
#![allow(clippy::result_large_err)]

pub mod admin;
mod admission;
mod answer;
mod auth;
pub mod body;
mod bookkeeping;
mod client;
pub mod config;
mod connection;
mod connector;
pub mod error;
mod fleet_rate;
mod head;
mod identify;
mod ingress;
mod intake;
pub mod kv_subscriber;
mod listener;
pub mod load;
pub mod logging;
pub mod membership;
pub mod metrics;
mod orchestrate;
mod pin;
mod pull;
pub mod registry;
mod relay;
mod replicas;
mod route;
pub mod server;
mod shared;
pub mod sse;
pub mod state;
mod trail;
mod upstream;

pub use config::{RouterConfig, Settings};
pub use identify::SESSION_HEADER;
pub use server::{run, serve_blocking, shutdown_signal, RouterHandle};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{0}")]
    Config(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}
