"""``ppd-router simulate`` and the simulator binding: output shape, policies, determinism, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ppd_router import _core

TURN_KEYS = {"count", "avg_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "avg_tpot_ms", "p50_tpot_ms",
             "p99_tpot_ms", "avg_e2e_ms", "p99_e2e_ms"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from ppd_router.cli import main; sys.exit(main())", *args],
                          capture_output=True, text=True, timeout=120)


def test_json_output_has_the_measured_files_names():
    r = cli("simulate", "--deployment", "2P2pD", "--policy", "ppd", "--workload", "large_big_paste",
            "--qps", "8", "--duration", "10", "--json")
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert {"turn1", "turn2plus", "throughput", "success_rate", "local_share"} <= set(v)
    assert TURN_KEYS <= set(v["turn1"]) and TURN_KEYS <= set(v["turn2plus"])
    assert set(v["throughput"]) == {"requests_per_sec", "tokens_per_sec"}
    assert v["turn1"]["count"] > 40 and v["turn2plus"]["count"] > 40
    assert 0.0 <= v["local_share"] <= 1.0
    assert v["table"] == "builtin:h100-2P2pD"


def test_text_output_names_the_papers_metrics():
    r = cli("simulate", "--deployment", "1P_3D", "--policy", "pd", "--workload", "small_tiny", "--qps", "2")
    assert r.returncode == 0, r.stderr
    for word in ("turn 1", "turn 2+", "TTFT", "TPOT", "E2E", "req/s", "tok/s", "success", "local"):
        assert word in r.stdout


def point(**kw) -> dict:
    cfg = {"deployment": "2P2pD", "policy": "local", "workload": "small_mid_bal", "qps": 4.0} | kw
    return json.loads(_core.simulate(json.dumps(cfg)))


def test_policies_set_the_local_share():
    assert point(policy="pd")["local_share"] == 0.0
    assert point(policy="local")["local_share"] == 1.0
    half = point(policy="fraction:0.5", qps=16.0)["local_share"]
    assert 0.2 < half < 0.8
    assert point(deployment="4R", policy="replica")["local_share"] == 0.0


def test_the_seed_makes_runs_reproducible():
    assert point(seed=3) == point(seed=3)
    assert point(seed=3) != point(seed=4)


def test_bad_points_are_errors_with_reasons():
    with pytest.raises(ValueError, match="workload"):
        point(workload="medium_tiny")
    with pytest.raises(ValueError, match="qps"):
        point(qps=-1.0)
    with pytest.raises(ValueError, match="unknown field"):
        _core.simulate(json.dumps({"deployment": "2P2pD", "policy": "local", "workload": "small_tiny", "qps": 1, "bogus": 1}))
    r = cli("simulate", "--deployment", "2X", "--workload", "small_tiny", "--qps", "1")
    assert r.returncode == 2 and "layout" in r.stderr


def test_catalog_lists_the_papers_grid():
    workloads, configs, qps = _core.simulator_catalog()
    assert len(workloads) == 18 and len(configs) == 17 and len(qps) == 10


def test_routers_and_view_delay_reach_the_simulator_from_the_command_line():
    r = cli("simulate", "--deployment", "2P6pD", "--policy", "local", "--workload", "small_mid_bal",
            "--qps", "20", "--duration", "5", "--routers", "3", "--view-delay", "0", "--json")
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert (v["meta"]["routers"], v["meta"]["view_delay_s"]) == (3, 0.0)
    assert v["turn2_on_own_d"] == 1.0 and v["placements_over_bound"] == 0.0
    text = cli("simulate", "--deployment", "2P6pD", "--policy", "local", "--workload", "small_mid_bal",
               "--qps", "20", "--duration", "5", "--routers", "3")
    assert text.returncode == 0, text.stderr
    assert "placement (3 routers, view 1 s old)" in text.stdout


@pytest.mark.parametrize("flag", [("--routers", "0"), ("--view-delay", "-1"), ("--view-delay", "nan")])
def test_bad_router_flags_are_usage_errors(flag):
    r = cli("simulate", "--deployment", "2P2pD", "--workload", "small_tiny", "--qps", "1", *flag)
    assert r.returncode == 2 and flag[0] in r.stderr
