//! Where a request goes: the paths of the decision, named once for the route types and the cost model that prices them.

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// P prefills the whole prompt, its KV moves to D, D decodes (x = 0).
    Pd,
    /// The session's pD append-prefills only the new tokens (x = 1).
    Local,
    /// A replica prefills and decodes.
    Replica,
    /// P reads the conversation's KV back from the session's D (vLLM NIXL
    /// bidirectional transfer), prefills only the new tokens, and D decodes.
    Pull,
}

impl Path {
    pub const ALL: [Path; 4] = [Path::Pd, Path::Local, Path::Replica, Path::Pull];
    pub fn as_str(self) -> &'static str {
        match self {
            Path::Pd => "pd",
            Path::Local => "local",
            Path::Replica => "replica",
            Path::Pull => "pull",
        }
    }
}
