"""The decision engine through the Python API: policies, reasons, live weights, bad input."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppd_router import REASONS, DecisionEngine, Table

WORKLOADS = [("tiny", 16, 32), ("big_paste", 512, 64)]


def make_table(cells) -> Table:
    doc = {
        "schema": "ppd-table/1",
        "deployment": "test",
        "axes": {
            "context_bins": [512, 4096],
            "workloads": [{"name": n, "n_in": i, "n_out": o} for n, i, o in WORKLOADS],
            "qps": [1, 4, 16],
        },
        "cells": cells,
    }
    return Table.from_json(json.dumps(doc), "test.json")


def cell(ctx, wl, qps, t0, p0, t1, p1):
    return {"context": ctx, "workload": wl, "qps": qps,
            "x0": {"ttft_ms": t0, "tpot_ms": p0, "n": 5}, "x1": {"ttft_ms": t1, "tpot_ms": p1, "n": 5}}


@pytest.fixture
def table() -> Table:
    # big_paste at qps 16: local gains 10% TTFT but loses 30% TPOT -> pd at (1, 1).
    return make_table([
        cell("small", "tiny", 1, 100, 10, 40, 10.5),
        cell("large", "big_paste", 16, 200, 10, 180, 13),
    ])


def test_turn_one_takes_pd(table):
    r = DecisionEngine(table, "ppd").decide(1, 100, 100, 0, 1.0)
    assert (r.path, r.reason, r.score, r.cell) == ("pd", "turn1", None, None)


def test_score_sign_decides_turn_two(table):
    e = DecisionEngine(table, "ppd", 1.0, 1.0)
    r = e.decide(2, 16, 32, 100, 1.0)
    assert (r.path, r.reason) == ("local", "score_positive")
    assert r.score == pytest.approx(0.6 - 0.05)
    r = e.decide(2, 512, 64, 2000, 16.0)
    assert (r.path, r.reason) == ("pd", "score_negative")
    assert r.score == pytest.approx(0.1 - 0.3)


def test_weights_put_flips_the_next_decision(table):
    e = DecisionEngine(table, "ppd", 1.0, 1.0)
    assert e.decide(2, 512, 64, 2000, 16.0).path == "pd"
    e.set_weights(5.0, 1.0)
    assert e.weights == (5.0, 1.0)
    assert e.decide(2, 512, 64, 2000, 16.0).path == "local"


def test_vetoes_and_their_reasons(table):
    e = DecisionEngine(table, "local")
    assert e.decide(2, 16, 32, 100, 1.0, has_session=False).reason == "no_session"
    assert e.decide(2, 16, 32, 100, 1.0, d_available=False).reason == "d_unavailable"
    r = e.decide(2, 16, 32, 100, 1.0, d_overloaded=True)
    assert (r.path, r.reason) == ("pd", "d_overloaded")
    assert e.decide(2, 16, 32, 100, 1.0).reason == "forced"
    assert set(REASONS) >= {"turn1", "score_positive", "score_negative", "no_session", "d_unavailable", "forced"}


def test_replica_policy_routes_everything_to_replicas(table):
    e = DecisionEngine(table, "replica")
    assert [e.decide(t, 10, 10, 10, 1.0).path for t in (1, 2, 3)] == ["replica"] * 3


def test_missing_cell_reports_its_fallback_distance(table):
    r = DecisionEngine(table, "ppd").decide(2, 16, 32, 100, 4.0)
    assert r.cell["requested"] == {"context": "small", "workload": "tiny", "qps": 4.0}
    assert r.cell["qps"] == 1.0
    assert r.cell["distance"] > 0


def test_fraction_policy_share_and_stickiness(table):
    e = DecisionEngine(table, "fraction:0.3")
    paths = [e.decide(2, 16, 32, 100, 1.0, conversation_id=f"c{i}").path for i in range(5000)]
    share = paths.count("local") / len(paths)
    assert abs(share - 0.3) < 0.03
    again = [e.decide(4, 16, 32, 100, 1.0, conversation_id=f"c{i}").path for i in range(5000)]
    assert again == paths


@pytest.mark.parametrize("kwargs", [
    {"turn": -1}, {"n_in": -5}, {"n_out": 2**40}, {"qps": float("nan")}, {"qps": -1.0}, {"turn": 0},
])
def test_bad_numbers_raise_value_error(table, kwargs):
    args = {"turn": 2, "n_in": 10, "n_out": 10, "n_ctx": 10, "qps": 1.0} | kwargs
    with pytest.raises(ValueError):
        DecisionEngine(table).decide(**args)


@pytest.mark.parametrize("policy", ["fast", "fraction:2", "fraction:x", ""])
def test_bad_policy_names_raise(table, policy):
    with pytest.raises(ValueError, match="policy"):
        DecisionEngine(table, policy)


@pytest.mark.parametrize("w", [(float("nan"), 1.0), (1.0, -1.0), (float("inf"), 1.0)])
def test_bad_weights_raise(table, w):
    with pytest.raises(ValueError):
        DecisionEngine(table, "ppd", *w)
    e = DecisionEngine(table)
    with pytest.raises(ValueError):
        e.set_weights(*w)
    assert e.weights == (1.0, 1.0)


@settings(max_examples=300, deadline=None)
@given(
    turn=st.integers(1, 50),
    n_in=st.integers(0, 2**32 - 1),
    n_out=st.integers(0, 2**32 - 1),
    n_ctx=st.integers(0, 2**32 - 1),
    qps=st.floats(0, 1e6, allow_nan=False),
    w=st.tuples(st.floats(0, 1e3), st.floats(0, 1e3)),
)
def test_decide_is_total_and_consistent_with_its_score(turn, n_in, n_out, n_ctx, qps, w):
    tbl = make_table([cell("small", "tiny", 1, 100, 10, 40, 10.5), cell("large", "big_paste", 16, 200, 10, 180, 13)])
    r = DecisionEngine(tbl, "ppd", *w).decide(turn, n_in, n_out, n_ctx, qps)
    assert r.path in ("pd", "local")
    if turn == 1:
        assert r.reason == "turn1"
    else:
        assert (r.path == "local") == (r.score > 0)
        expect = w[0] * r.cell["d_ttft"] - w[1] * r.cell["d_tpot"]
        assert r.score == pytest.approx(expect, rel=1e-9, abs=1e-12)


def live_view(running: int, p_queued: int = 0) -> str:
    return json.dumps(
        {
            "d": {"node": 1, "running": running, "decode_ctx_tokens": running * 2000},
            "p": {"node": 2, "queued_prefill_tokens": p_queued, "waiting": 1 if p_queued else 0},
            "d_cached": 2000,
            "mean_out_tokens": 200,
        }
    )


def test_ppd_live_answers_with_its_forecast_and_flips_with_the_load(table):
    engine = DecisionEngine(table, "ppd-live", 1.0, 3.0)
    idle = engine.decide(2, 512, 64, 2000, 4.0, live=live_view(0))
    assert (idle.path, idle.reason) == ("local", "cost_model")
    f = idle.forecast
    assert f is not None and set(f) == {"pd", "local", "pull"}
    assert f["local"]["ttft_ms"] < f["pd"]["ttft_ms"]
    assert f["local"]["tpot_burden"] == 0.0
    busy = engine.decide(2, 512, 64, 2000, 4.0, live=live_view(200))
    assert (busy.path, busy.reason) == ("pd", "cost_model")
    assert busy.forecast["local"]["corunners"] == 200
    assert busy.forecast["local"]["tpot_burden"] > busy.forecast["pd"]["tpot_burden"]
    # With D's pin named, the pull path computes only the new tokens on P.
    pulled = engine.decide(2, 512, 64, 2000, 4.0, live=live_view(200), pull_ready=True)
    assert (pulled.path, pulled.reason) == ("pull", "cost_model")
    assert "forecast" in pulled.to_dict()


def test_ppd_live_without_a_live_view_falls_back_to_the_table(table):
    engine = DecisionEngine(table, "ppd-live")
    r = engine.decide(2, 16, 32, 100, 1.0)
    assert r.forecast is None
    assert r.reason in ("score_positive", "score_negative")


def test_ppd_live_settings_are_checked(table):
    with pytest.raises(ValueError, match="slo_ttft_ms"):
        DecisionEngine(table, "ppd-live", slo_ttft_ms=100.0)
    with pytest.raises(ValueError, match="live"):
        DecisionEngine(table, "ppd-live").decide(2, 16, 32, 100, 1.0, live='{"d": {"runing": 3}}')
    with pytest.raises(ValueError, match="profile"):
        DecisionEngine(table, "ppd-live", profile="/nonexistent.toml")
