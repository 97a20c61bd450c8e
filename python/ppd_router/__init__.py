"""ppd-router: per-request PD / local routing for multi-turn LLM serving (the PPD paper).

The decision engine, session table and lookup grid live in the Rust core
(``ppd_router._core``); this package re-exports them and adds the CLI.
Every exception the package raises derives from :class:`PpdError`
(see :mod:`ppd_router.errors`).
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
from ppd_router.errors import (
    DatasetNotFoundError,
    FileError,
    InvalidArgument,
    LaunchError,
    MissingDependencyError,
    ModelDirExistsError,
    RecoveryError,
    RegistrationError,
    ReportError,
    RunError,
    TargetError,
    TokenizerError,
    UnknownNodeError,
    WorkloadError,
)

__all__ = [
    "PATHS",
    "REASONS",
    "BadRequest",
    "ConfigError",
    "DatasetNotFoundError",
    "DecisionEngine",
    "FileError",
    "InvalidArgument",
    "LaunchError",
    "MissingDependencyError",
    "ModelDirExistsError",
    "PpdError",
    "QpsEstimator",
    "RecoveryError",
    "RegistrationError",
    "ReportError",
    "Route",
    "Router",
    "RunError",
    "SessionTable",
    "Table",
    "TableError",
    "TargetError",
    "TokenCounter",
    "TokenizerError",
    "UnknownNodeError",
    "WorkloadError",
    "__version__",
    "count_tokens",
    "identify",
    "validate_router_config",
]
