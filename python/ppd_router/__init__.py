"""ppd-router: per-request PD / local routing for multi-turn LLM serving (the PPD paper).

The decision engine, session table and lookup grid live in the Rust core
(``ppd_router._core``); this package re-exports them and adds the CLI.
"""

from ppd_router._core import (
    PATHS,
    REASONS,
    BadRequest,
    ConfigError,
    DecisionEngine,
    PpdError,
    QpsEstimator,
    Route,
    Router,
    SessionTable,
    Table,
    TableError,
    TokenCounter,
    __version__,
    count_tokens,
    identify,
    validate_router_config,
)

__all__ = [
    "PATHS",
    "REASONS",
    "BadRequest",
    "ConfigError",
    "DecisionEngine",
    "PpdError",
    "QpsEstimator",
    "Route",
    "Router",
    "SessionTable",
    "Table",
    "TableError",
    "TokenCounter",
    "__version__",
    "count_tokens",
    "identify",
    "validate_router_config",
]
