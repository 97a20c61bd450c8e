"""The shipped H100 tables agree with the measured sweep, and the engine with Equation 1 on them."""

from __future__ import annotations

import csv
import math

import pytest

from ppd_router import DecisionEngine, Table

from ..conftest import TABLES

DEPLOYMENTS = {"1P3pD": ("1P_3D", "1P_3pD"), "2P2pD": ("2P_2D", "2P_2pD"), "3P1pD": ("3P_1D", "3P_1pD")}
WORKLOADS = {
    "tiny": (16, 32), "short_gen": (32, 256), "long_gen": (32, 512), "very_long_gen": (64, 1024),
    "small_bal": (64, 64), "mid_bal": (128, 128), "mid_paste": (256, 64), "big_paste": (512, 64),
    "huge_paste": (1024, 32),
}
# Turn-2 accumulated context of each Turn-1 size: 128+128 and 1024+1024 tokens.
T1_CTX = {"small": 256, "large": 2048}


def sweep_rows(path):
    with open(path, newline="") as f:
        return {(r["config"], r["t1_context"], r["t2_workload"], float(r["qps"])): r for r in csv.DictReader(f)}


@pytest.mark.parametrize("deployment", sorted(DEPLOYMENTS))
def test_shipped_table_loads_and_names_its_deployment(deployment):
    t = Table.load(TABLES / f"h100-llama3.1-8b-{deployment}.json")
    assert t.deployment == deployment
    assert t.source == "measured"
    assert t.context_classes == ["small", "large", "huge"]
    assert len(t) > 100


def test_engine_sign_matches_equation_1_recomputed_from_the_csv_for_every_2p2pd_cell(sweep_csv):
    rows = sweep_rows(sweep_csv)
    table = Table.load(TABLES / "h100-llama3.1-8b-2P2pD.json")
    engine = DecisionEngine(table, "ppd", 1.0, 1.0)
    checked = 0
    for t1, n_ctx in T1_CTX.items():
        for name, (n_in, n_out) in WORKLOADS.items():
            for q in table.qps_levels:
                r0 = rows[("2P_2D", t1, name, q)]
                r1 = rows[("2P_2pD", t1, name, q)]
                t0, p0 = float(r0["turn2_avg_ttft_ms"]), float(r0["turn2_avg_tpot_ms"])
                tt1, p1 = float(r1["turn2_avg_ttft_ms"]), float(r1["turn2_avg_tpot_ms"])
                s = (t0 - tt1) / t0 - (p1 - p0) / p0
                route = engine.decide(2, n_in, n_out, n_ctx, q)
                assert route.cell["distance"] == 0.0
                assert (route.cell["context"], route.cell["workload"], route.cell["qps"]) == (
                    "small" if t1 == "small" else "large", name, q)
                assert math.isclose(route.score, s, rel_tol=1e-9, abs_tol=1e-12)
                assert route.path == ("local" if s > 0 else "pd"), (t1, name, q, s)
                checked += 1
    assert checked == 180


def test_huge_context_falls_back_to_large_at_distance_one():
    table = Table.load(TABLES / "h100-llama3.1-8b-2P2pD.json")
    cell = table.lookup(20_000, 512, 64, 4.0)
    assert cell["requested"]["context"] == "huge"
    assert cell["context"] == "large"
    assert cell["distance"] == pytest.approx(1.0)
