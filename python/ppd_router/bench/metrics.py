"""Per-request measurements and their aggregation into the bench/simulate JSON object.

Definitions (all latencies in milliseconds in the output):

* TTFT: request sent -> first chunk carrying non-empty ``delta.content``.
* E2E: request sent -> end of stream.
* TPOT: ``(e2e - ttft) / (completion_tokens - 1)``, per request; undefined for
  requests with fewer than two completion tokens (they are left out of TPOT).
* Percentiles: linear interpolation between closest ranks, numpy's default
  (``method="linear"``): for sorted ``x`` of length n, ``h = (n-1)·p/100`` and
  ``P = x[⌊h⌋] + (h-⌊h⌋)·(x[⌊h⌋+1]-x[⌊h⌋])``. One value is its own percentile;
  no value gives None.
* ``count`` of a turn class = its successful requests. Success rate = successful
  / planned requests, where the turns a conversation never sent because an
  earlier turn failed count as failed (reason ``not_sent``), as the paper's
  sweep does (``total_requests`` = conversations × turns).
* requests/s = successful requests / run duration; tokens/s = completion
  tokens of successful requests / run duration (the sweep's definitions).
* local share = Turn 2+ responses whose ``x-ppd-path`` is ``local`` / Turn 2+
  responses that carried the header; None when none did (no router in front).
* SLO attainment (with SLOs) = requests that succeeded with TTFT and (where
  defined) TPOT within their objectives / requests sent, as the simulator counts
  it: turns never sent are left out of both, failed requests miss.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ppd_router.errors import ConfigError

# Column names of shared/data/ppd-h100/sweep.csv, in order.
SWEEP_COLUMNS: tuple[str, ...] = (
    "config",
    "t1_context",
    "t2_workload",
    "qps",
    "turn1_count",
    "turn1_avg_ttft_ms",
    "turn1_p50_ttft_ms",
    "turn1_p99_ttft_ms",
    "turn1_avg_tpot_ms",
    "turn1_p50_tpot_ms",
    "turn1_p99_tpot_ms",
    "turn1_avg_e2e_ms",
    "turn1_p99_e2e_ms",
    "turn2_count",
    "turn2_avg_ttft_ms",
    "turn2_p50_ttft_ms",
    "turn2_p99_ttft_ms",
    "turn2_avg_tpot_ms",
    "turn2_p50_tpot_ms",
    "turn2_p99_tpot_ms",
    "turn2_avg_e2e_ms",
    "turn2_p99_e2e_ms",
    "requests_per_sec",
    "tokens_per_sec",
    "success_rate_pct",
    "total_requests",
    "failed_requests",
    "duration_sec",
    "error",
)
# Keys every turn object must have (bench --out and simulate --json alike).
TURN_KEYS: tuple[str, ...] = (
    "count",
    "avg_ttft_ms",
    "p50_ttft_ms",
    "p99_ttft_ms",
    "avg_tpot_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "avg_e2e_ms",
    "p99_e2e_ms",
)
NOT_SENT = "not_sent"


@dataclass
class RequestRecord:
    """What the client measured for one request (times in seconds)."""

    conversation: int
    turn: int  # 1-based
    start: float = 0.0  # since the run started
    ok: bool = False
    reason: Optional[str] = None  # failure reason; None when ok
    status: Optional[int] = None
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    prompt_tokens: Optional[int] = None
    completion_tokens: int = 0
    path: Optional[str] = None  # x-ppd-path response header
    usage_reported: bool = False

    @property
    def tpot(self) -> Optional[float]:
        return tpot(self.e2e, self.ttft, self.completion_tokens)


def tpot(e2e: Optional[float], ttft: Optional[float], completion_tokens: int) -> Optional[float]:
    """Time per output token after the first; None when undefined."""
    if e2e is None or ttft is None or completion_tokens < 2:
        return None
    return (e2e - ttft) / (completion_tokens - 1)


def percentile(values: Sequence[float], p: float) -> Optional[float]:
    """The ``p``-th percentile (0..100) by linear interpolation (numpy's default)."""
    if not 0.0 <= p <= 100.0:
        raise ConfigError(f"percentile must be in [0, 100], got {p}")
    if not values:
        return None
    xs = sorted(values)
    h = (len(xs) - 1) * p / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def mean(values: Sequence[float]) -> Optional[float]:
    return math.fsum(values) / len(values) if values else None


def _ms(x: Optional[float]) -> Optional[float]:
    return None if x is None else x * 1000.0


def turn_stats(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """Latency statistics of one turn class; keys of :data:`TURN_KEYS` plus extras."""
    recs = list(records)
    ok = [r for r in recs if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    tp = [t for t in (r.tpot for r in ok) if t is not None]
    failures = Counter(r.reason or "unknown" for r in recs if not r.ok)
    return {
        "count": len(ok),
        "avg_ttft_ms": _ms(mean(ttft)),
        "p50_ttft_ms": _ms(percentile(ttft, 50)),
        "p90_ttft_ms": _ms(percentile(ttft, 90)),
        "p99_ttft_ms": _ms(percentile(ttft, 99)),
        "avg_tpot_ms": _ms(mean(tp)),
        "p50_tpot_ms": _ms(percentile(tp, 50)),
        "p99_tpot_ms": _ms(percentile(tp, 99)),
        "avg_e2e_ms": _ms(mean(e2e)),
        "p50_e2e_ms": _ms(percentile(e2e, 50)),
        "p99_e2e_ms": _ms(percentile(e2e, 99)),
        "requests": len(recs),
        "failed": len(recs) - len(ok),
        "success_rate": len(ok) / len(recs) if recs else None,
        "failures": dict(sorted(failures.items())),
        "completion_tokens": sum(r.completion_tokens for r in ok),
    }


def local_share(records: Iterable[RequestRecord]) -> tuple[Optional[float], dict[str, int]]:
    """Share of Turn 2+ responses routed ``local``, and the count of each path seen."""
    paths = Counter(r.path for r in records if r.turn >= 2 and r.path is not None)
    total = sum(paths.values())
    return (paths["local"] / total if total else None), dict(sorted(paths.items()))


def slo_attainment(records: Iterable[RequestRecord], ttft_ms: float, tpot_ms: float) -> Optional[float]:
    """Share of the requests sent that met both objectives; None when none was sent."""
    sent = [r for r in records if r.reason != NOT_SENT]
    if not sent:
        return None
    met = 0
    for r in sent:
        if not r.ok or r.ttft is None or r.ttft * 1000.0 > ttft_ms:
            continue
        t = r.tpot
        met += t is None or t * 1000.0 <= tpot_ms
    return met / len(sent)


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """The JSON object of a run: ``turn1``, ``turn2plus``, ``throughput``, ``success_rate``,
    ``local_share`` (the shared keys), plus ``overall``, ``failures`` and ``paths``."""
    if duration_s <= 0:
        raise ConfigError("duration must be positive")
    overall = turn_stats(records)
    share, paths = local_share(records)
    return {
        "turn1": turn_stats(r for r in records if r.turn == 1),
        "turn2plus": turn_stats(r for r in records if r.turn >= 2),
        "overall": overall,
        "throughput": {
            "requests_per_sec": overall["count"] / duration_s,
            "tokens_per_sec": overall["completion_tokens"] / duration_s,
        },
        "success_rate": overall["success_rate"],
        "local_share": share,
        "paths": paths,
        "failures": overall["failures"],
        "total_requests": overall["requests"],
        "failed_requests": overall["failed"],
        "duration_sec": duration_s,
    }


def error_string(failures: dict[str, int]) -> str:
    """Failures by reason in one CSV cell, most frequent first: ``timeout:3;http_500:1``."""
    return ";".join(f"{k}:{v}" for k, v in sorted(failures.items(), key=lambda kv: (-kv[1], kv[0])))


def csv_row(summary: dict[str, Any], *, config: str, t1_context: str, t2_workload: str, qps: float) -> dict[str, Any]:
    """One sweep.csv row. Undefined statistics are written as 0, as the sweep does."""
    row: dict[str, Any] = {"config": config, "t1_context": t1_context, "t2_workload": t2_workload, "qps": qps}
    for prefix, key in (("turn1", "turn1"), ("turn2", "turn2plus")):
        for k in TURN_KEYS:
            v = summary[key][k]
            row[f"{prefix}_{k}"] = 0 if v is None else v
    sr = summary["success_rate"]
    row.update(
        {
            "requests_per_sec": summary["throughput"]["requests_per_sec"],
            "tokens_per_sec": summary["throughput"]["tokens_per_sec"],
            "success_rate_pct": 0.0 if sr is None else 100.0 * sr,
            "total_requests": summary["total_requests"],
            "failed_requests": summary["failed_requests"],
            "duration_sec": summary["duration_sec"],
            "error": error_string(summary["failures"]),
        }
    )
    assert tuple(row) == SWEEP_COLUMNS
    return row
