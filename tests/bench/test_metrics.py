"""Metric math on hand-computed fixtures: percentiles, TPOT, turn classes, throughput, CSV row."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ppd_router.bench.metrics import (
    NOT_SENT,
    SWEEP_COLUMNS,
    TURN_KEYS,
    RequestRecord,
    csv_row,
    error_string,
    local_share,
    mean,
    percentile,
    slo_attainment,
    summarize,
    tpot,
    turn_stats,
)


@pytest.mark.parametrize(
    ("values", "p", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),  # h = 1.5
        ([1.0, 2.0, 3.0, 4.0], 90, 3.7),  # h = 2.7 -> 3 + 0.7 * 1
        ([1.0, 2.0, 3.0, 4.0], 99, 3.97),  # h = 2.97
        ([4.0, 1.0, 3.0, 2.0], 25, 1.75),  # unsorted input; h = 0.75
        ([10.0, 20.0], 0, 10.0),
        ([10.0, 20.0], 100, 20.0),
        ([0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0], 99, 99.0),
        ([5.0], 99, 5.0),
    ],
)
def test_percentile_interpolates_linearly_between_closest_ranks(values, p, expected):
    assert percentile(values, p) == pytest.approx(expected)


def test_percentile_of_nothing_is_none():
    assert percentile([], 50) is None


@pytest.mark.parametrize("p", [-1, 100.5])
def test_percentile_outside_0_100_is_rejected(p):
    with pytest.raises(ValueError):
        percentile([1.0, 2.0], p)


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(st.lists(finite, min_size=2, max_size=60), st.integers(min_value=1, max_value=99))
def test_percentile_matches_statistics_inclusive_quantiles(xs, p):
    # statistics.quantiles(method="inclusive") is the same estimator (numpy "linear").
    cuts = statistics.quantiles(xs, n=100, method="inclusive")
    assert percentile(xs, p) == pytest.approx(cuts[p - 1], rel=1e-9, abs=1e-6)


@given(st.lists(finite, min_size=1, max_size=60), st.floats(0, 100), st.floats(0, 100))
def test_percentile_is_monotone_and_within_range(xs, p, q):
    lo, hi = sorted((p, q))
    a, b = percentile(xs, lo), percentile(xs, hi)
    assert min(xs) - 1e-9 <= a <= b + 1e-9 <= max(xs) + 2e-9


def test_tpot_excludes_the_first_token():
    assert tpot(1.0, 0.1, 10) == pytest.approx(0.1)  # (1.0 - 0.1) / 9
    assert tpot(1.0, 0.1, 1) is None
    assert tpot(None, 0.1, 10) is None


def _ok(conv: int, turn: int, ttft: float, e2e: float, n: int, path: str | None = None):
    return RequestRecord(conv, turn, ok=True, ttft=ttft, e2e=e2e, completion_tokens=n, path=path)


def _fail(conv: int, turn: int, reason: str, path: str | None = None):
    return RequestRecord(conv, turn, reason=reason, path=path)


@pytest.fixture
def records() -> list[RequestRecord]:
    # Turn 1: TTFT 100, 200, 300 ms; Turn 2+: 40, 60 ms, one 500, one not sent.
    return [
        _ok(0, 1, 0.100, 1.100, 11, "pd"),   # TPOT 100 ms
        _ok(1, 1, 0.200, 0.700, 6, "pd"),    # TPOT 100 ms
        _ok(2, 1, 0.300, 0.500, 3, "pd"),    # TPOT 100 ms
        _ok(0, 2, 0.040, 0.240, 5, "local"),  # TPOT 50 ms
        _ok(1, 2, 0.060, 0.060, 1, "pd"),    # one token: no TPOT
        _fail(2, 2, "http_500", "local"),
        _fail(2, 3, NOT_SENT),
    ]


def test_turn_stats_of_turn_one_fixture(records):
    s = turn_stats(r for r in records if r.turn == 1)
    assert set(TURN_KEYS) <= set(s)
    assert s["count"] == 3
    assert s["avg_ttft_ms"] == pytest.approx(200.0)
    assert s["p50_ttft_ms"] == pytest.approx(200.0)
    assert s["p90_ttft_ms"] == pytest.approx(280.0)  # h = 1.8
    assert s["p99_ttft_ms"] == pytest.approx(298.0)  # h = 1.98
    assert s["avg_tpot_ms"] == pytest.approx(100.0)
    assert s["avg_e2e_ms"] == pytest.approx(766.6666667)
    assert s["p99_e2e_ms"] == pytest.approx(700.0 + 0.98 * 400.0)
    assert s["success_rate"] == 1.0 and s["failures"] == {}


def test_turn_stats_counts_failures_by_reason_and_skips_undefined_tpot(records):
    s = turn_stats(r for r in records if r.turn >= 2)
    assert (s["count"], s["requests"], s["failed"]) == (2, 4, 2)
    assert s["failures"] == {"http_500": 1, NOT_SENT: 1}
    assert s["success_rate"] == pytest.approx(0.5)
    assert s["avg_tpot_ms"] == pytest.approx(50.0)  # only the 5-token request has a TPOT
    assert s["avg_ttft_ms"] == pytest.approx(50.0)


def test_turn_stats_of_no_success_has_null_latencies():
    s = turn_stats([_fail(0, 1, "timeout")])
    assert s["count"] == 0 and s["avg_ttft_ms"] is None and s["p99_e2e_ms"] is None
    assert s["success_rate"] == 0.0


def test_local_share_counts_turn2plus_responses_that_carried_the_header(records):
    share, paths = local_share(records)
    assert paths == {"local": 2, "pd": 1}  # Turn 1's "pd" and the unsent turn are not counted
    assert share == pytest.approx(2 / 3)


def test_local_share_without_header_is_none():
    assert local_share([_ok(0, 2, 0.1, 0.2, 3)]) == (None, {})


def test_summarize_throughput_and_success_rate(records):
    s = summarize(records, duration_s=2.0)
    assert s["throughput"]["requests_per_sec"] == pytest.approx(5 / 2.0)
    assert s["throughput"]["tokens_per_sec"] == pytest.approx((11 + 6 + 3 + 5 + 1) / 2.0)
    assert s["success_rate"] == pytest.approx(5 / 7)
    assert s["local_share"] == pytest.approx(2 / 3)
    assert (s["total_requests"], s["failed_requests"]) == (7, 2)
    assert s["turn1"]["count"] == 3 and s["turn2plus"]["count"] == 2


def test_slo_attainment_counts_sent_requests_meeting_both_objectives(records):
    # Sent: 6 (the unsent turn is left out); the 500 misses; TTFT <= 100 ms and TPOT <= 60 ms:
    # conv 0 turn 2 (40 ms, 50 ms) and conv 1 turn 2 (60 ms, one token: no TPOT) only.
    assert slo_attainment(records, ttft_ms=100.0, tpot_ms=60.0) == pytest.approx(2 / 6)
    # A looser TPOT admits the Turn 1s within the TTFT objective: conv 0 turn 1 (100 ms) too.
    assert slo_attainment(records, ttft_ms=100.0, tpot_ms=100.0) == pytest.approx(3 / 6)
    assert slo_attainment([r for r in records if r.turn >= 2], ttft_ms=100.0, tpot_ms=60.0) == pytest.approx(2 / 3)
    assert slo_attainment([_fail(0, 2, NOT_SENT)], ttft_ms=1.0, tpot_ms=1.0) is None


def test_summarize_rejects_non_positive_duration(records):
    with pytest.raises(ValueError):
        summarize(records, 0.0)


def test_mean_is_exact_and_none_when_empty():
    assert mean([0.1] * 10) == pytest.approx(0.1, abs=0)
    assert mean([]) is None


def test_error_string_lists_most_frequent_first():
    assert error_string({"timeout": 1, "http_500": 3, "connection_error": 1}) == \
        "http_500:3;connection_error:1;timeout:1"
    assert error_string({}) == ""


def test_csv_row_uses_sweep_columns_and_percent(records, sweep_csv: Path):
    with open(sweep_csv, newline="") as f:
        header = next(csv.reader(f))
    assert tuple(header) == SWEEP_COLUMNS
    row = csv_row(summarize(records, 2.0), config="1P_3pD", t1_context="small",
                  t2_workload="tiny", qps=4)
    assert list(row) == header
    assert row["success_rate_pct"] == pytest.approx(100 * 5 / 7)
    assert row["turn2_count"] == 2 and row["turn1_p99_ttft_ms"] == pytest.approx(298.0)
    assert row["error"] == "http_500:1;not_sent:1"


def test_csv_row_writes_zero_for_undefined_statistics():
    row = csv_row(summarize([_fail(0, 1, "timeout"), _fail(0, 2, NOT_SENT)], 1.0),
                  config="x", t1_context="", t2_workload="w", qps=1)
    assert row["turn1_avg_ttft_ms"] == 0 and row["turn2_p99_e2e_ms"] == 0
    assert row["success_rate_pct"] == 0.0 and row["failed_requests"] == 2
