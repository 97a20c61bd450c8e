"""simulate with the bench's named workloads (sharegpt, wildchat-like, files): the same
conversations as the bench, handed to the simulator as explicit per-turn token counts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ppd_router.bench.workloads import ConversationFilter, WildChatLikeWorkload, load_workload
from ppd_router.simulate import conversation_list, simulate_point

SHARED_KEYS = {"turn1", "turn2plus", "throughput", "success_rate", "local_share"}
TURN_KEYS = {"count", "avg_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "avg_tpot_ms", "p50_tpot_ms",
             "p99_tpot_ms", "avg_e2e_ms", "p99_e2e_ms"}


def _sharegpt_file(tmp_path):
    recs = []
    for i in range(6):
        turns = 2 + i % 3  # 2, 3, 4 turns
        conv = []
        for k in range(turns):
            conv.append({"from": "human", "value": f"q{i} " + "word " * (5 + 3 * k)})
            conv.append({"from": "gpt", "value": "answer " * (20 + i)})
        recs.append({"id": f"s{i}", "conversations": conv})
    recs.insert(3, {"id": "single", "conversations": recs[0]["conversations"][:2]})  # filtered
    recs.append({"id": "tail", "conversations": recs[0]["conversations"]})
    text = json.dumps(recs, indent=1)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.rindex('"tail"')])  # cut mid-record, as the packaged file is
    return path


def _expected_turns(workload, n: int) -> int:
    return sum(len(c.turns) for c in workload.conversations(n))


def test_sharegpt_file_runs_with_the_recorded_turn_counts(tmp_path):
    path = _sharegpt_file(tmp_path)
    r = simulate_point(deployment="2P2pD", policy="local", workload="sharegpt", qps=2.0,
                       duration=5.0, sharegpt_file=path)
    assert SHARED_KEYS <= set(r) and TURN_KEYS <= set(r["turn1"])
    assert TURN_KEYS <= set(r["turn2plus"])
    wl = load_workload("sharegpt", sharegpt_file=path, flt=ConversationFilter(max_context=16384))
    assert len(wl) == 6  # 8 records, the last cut off, the single-turn one filtered out
    n = r["conversations"]
    assert n > 3
    assert r["success_rate"] == 1.0
    assert r["total_requests"] == _expected_turns(wl, n)
    assert r["turn1"]["count"] == n
    assert r["turn1"]["count"] + r["turn2plus"]["count"] == _expected_turns(wl, n)
    assert r["meta"]["workload_info"]["conversations"] == 6
    assert r["local_share"] == 1.0


def test_wildchat_like_matches_the_generator():
    r = simulate_point(deployment="1P3pD", policy="pd", workload="wildchat-like", qps=1.0,
                       duration=8.0, seed=3)
    n = r["conversations"]
    expected = _expected_turns(WildChatLikeWorkload(seed=3), n)
    assert r["success_rate"] == 1.0 and r["local_share"] == 0.0
    assert r["total_requests"] == expected
    assert r["turn1"]["count"] + r["turn2plus"]["count"] == expected
    assert expected > 2 * n  # multi-turn: ~3.1 turns on average


def test_conversation_list_is_the_bench_conversations():
    wl = WildChatLikeWorkload(seed=1)
    lists = conversation_list(wl, 4)
    assert lists == [[[t.n_in, t.n_out] for t in c.turns] for c in wl.conversations(4)]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ppd_router.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_cli_json_and_errors(tmp_path):
    r = _cli("simulate", "--deployment", "2P2pD", "--policy", "ppd", "--workload", "sharegpt",
             "--sharegpt-file", str(_sharegpt_file(tmp_path)), "--qps", "2", "--duration", "3",
             "--json")
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert SHARED_KEYS <= set(v) and v["meta"]["workload"] == "sharegpt"
    bad = _cli("simulate", "--deployment", "2P2pD", "--workload", "wildchat-like", "--qps", "2",
               "--turns", "3")
    assert bad.returncode == 2 and "--turns applies to the synthetic" in bad.stderr
    nope = _cli("simulate", "--deployment", "2P2pD", "--workload", "nosuch", "--qps", "2")
    assert nope.returncode == 2 and "unknown workload" in nope.stderr


def test_context_beyond_the_engine_is_refused():
    from ppd_router import _core

    cfg = {"deployment": "2P2pD", "policy": "local", "workload": "x", "qps": 1.0,
           "conversations": [[[70000, 10], [70000, 10]]]}
    with pytest.raises(ValueError, match="max_model_len"):
        _core.simulate(json.dumps(cfg))
