"""Multi-turn load testing: workloads, an open-loop streaming client and its metrics.

The workload generators (:mod:`.workloads`) return plain data so the simulator
can replay exactly the conversations the live client sends; :mod:`.metrics`
turns per-request measurements into the JSON object shared by ``bench`` and
``simulate``; :mod:`.client` is the asyncio load generator itself.
"""

from ppd_router.bench.workloads import (
    SYNTHETIC_WORKLOADS,
    T1_SETTINGS,
    T2_SETTINGS,
    Conversation,
    Turn,
    load_workload,
    workload_names,
)
from ppd_router.errors import WorkloadError

__all__ = [
    "SYNTHETIC_WORKLOADS",
    "T1_SETTINGS",
    "T2_SETTINGS",
    "Conversation",
    "Turn",
    "WorkloadError",
    "load_workload",
    "workload_names",
]
