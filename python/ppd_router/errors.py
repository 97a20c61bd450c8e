"""Every exception ppd_router raises, under one base: :class:`PpdError`.

``PpdError`` and the classes Rust raises (``ConfigError``, ``TableError``,
``BadRequest``, ``InvalidArgument``, ``RunError``, ``TokenizerError``, ``FileError``)
come from the extension. Every class derives from ``PpdError`` *and* from the
builtin a caller would expect, so ``except PpdError`` catches everything the package
raises while ``except ValueError`` (``RuntimeError``, ``KeyError``, ...) keeps working:

* ``ValueError``: ``ConfigError`` (an invalid setting or name), ``TableError``,
  ``BadRequest``, ``InvalidArgument`` (an argument out of range),
  :class:`WorkloadError`, :class:`TargetError`, :class:`RecoveryError`,
  :class:`ReportError`, :class:`RegistrationError`;
* ``RuntimeError``: ``RunError`` (a router, emulator or cluster failed),
  :class:`LaunchError`, :class:`MissingDependencyError`;
* ``OSError``: ``TokenizerError``, ``FileError``;
* ``KeyError``: :class:`UnknownNodeError`;
* ``FileNotFoundError``: :class:`DatasetNotFoundError`;
* ``FileExistsError``: :class:`ModelDirExistsError`.
"""

from __future__ import annotations

from ppd_router._core import (
    BadRequest,
    ConfigError,
    FileError,
    InvalidArgument,
    PpdError,
    RunError,
    TableError,
    TokenizerError,
)


class WorkloadError(PpdError, ValueError):
    """Unknown workload name, unreadable workload file, or bad workload options."""


class TargetError(PpdError, ValueError):
    """The target URL is unusable or the endpoint cannot be reached at all."""


class RecoveryError(PpdError, ValueError):
    """The input is not a (possibly truncated) JSON array of records."""


class ReportError(PpdError, ValueError):
    """A result file that cannot be read as results."""


class RegistrationError(PpdError, ValueError):
    """A discovery message that is not a valid node registration."""


class LaunchError(PpdError, RuntimeError):
    """A node could not be started; the message names it and carries its log's tail."""


class MissingDependencyError(PpdError, RuntimeError):
    """An optional dependency a command needs is not installed."""


class UnknownNodeError(PpdError, KeyError):
    """No node of that name in the cluster."""


class DatasetNotFoundError(PpdError, FileNotFoundError):
    """A data set a workload needs is not installed and no file was given."""


class ModelDirExistsError(PpdError, FileExistsError):
    """The output directory of ``make-tiny-model`` exists and is not empty."""


__all__ = [
    "BadRequest",
    "ConfigError",
    "DatasetNotFoundError",
    "FileError",
    "InvalidArgument",
    "LaunchError",
    "MissingDependencyError",
    "ModelDirExistsError",
    "PpdError",
    "RecoveryError",
    "RegistrationError",
    "ReportError",
    "RunError",
    "TableError",
    "TargetError",
    "TokenizerError",
    "UnknownNodeError",
    "WorkloadError",
]
