//! ppd-core: the pure logic of ppd-router — no I/O, no clock, no async.
//!
//! Data flows down once: [`request`] parses what routing needs, [`identity`]
//! names the conversation and derives its features, [`engine`] applies a
//! [`policy`] to the [`table`] on the [`grid`], and [`session`] remembers the
//! outcome for the next turn.

pub mod emu;
pub mod engine;
pub mod grid;
pub mod identity;
pub mod policy;
pub mod qps;
pub mod request;
pub mod session;
pub mod sim;
pub mod table;
pub mod tokens;

pub use engine::{DecisionEngine, DecisionInput, Path, Reason, Route, Scored, Weights};
pub use policy::PolicyKind;
pub use table::{Table, TableError};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("{0}")]
    Table(#[from] TableError),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}
