//! The core's errors: [`Error`], which every fallible function of the routing logic returns, and the table loader's [`TableError`].
//!
//! A leaf module: it imports nothing of the crate, so every module can use it.

use std::fmt;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("{0}")]
    Table(#[from] TableError),
    /// A bad setting or name; the message says which and why.
    #[error("{0}")]
    Config(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

/// A loading error that names the file, the place in it, and the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableError {
    pub file: String,
    pub location: String,
    pub field: String,
    pub message: String,
}

impl fmt::Display for TableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "table {}", self.file)?;
        if !self.location.is_empty() {
            write!(f, ": {}", self.location)?;
        }
        if !self.field.is_empty() {
            write!(f, ": field `{}`", self.field)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for TableError {}
