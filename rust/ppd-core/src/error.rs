//! The core's one error type: every fallible function of the routing logic returns it.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("{0}")]
    Table(#[from] crate::table::TableError),
    /// A bad setting or name; the message says which and why.
    #[error("{0}")]
    Config(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}
