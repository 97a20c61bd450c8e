"""build-table --backend simulate: a ppd-table/1 file the Rust loader accepts, whose cells are
the simulator's own x=0 (pd) and x=1 (local) numbers and whose decisions follow their signs."""

from __future__ import annotations

import contextlib
import io

import orjson
from ppd_router import DecisionEngine, Table
from ppd_router.bench.workloads import T2_SETTINGS
from ppd_router.cli import main
from ppd_router.simulate import simulate_point

ARGS = ["--contexts", "small,large", "--workloads", "tiny,huge_paste", "--duration", "4",
        "--seed", "2", "--deployment", "1P3pD"]


def _build(out, qps, *extra):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["build-table", "--backend", "simulate", "--out", str(out), "--qps", qps,
                   *ARGS, *extra])
    return rc, err.getvalue()


def test_cells_are_the_simulators_numbers_and_decisions_follow_their_sign(tmp_path):
    out = tmp_path / "t.json"
    rc, _ = _build(out, "2,16")
    assert rc == 0
    table = Table.load(out)  # the router's own loader and validation
    assert len(table) == 8 and table.deployment == "1P3pD"
    doc = orjson.loads(out.read_bytes())
    assert doc["source"] == "simulated" and "simulate" in doc["provenance"]["builder"]
    engine = DecisionEngine(table, "ppd", 1.0, 1.0)
    for cell in doc["cells"]:
        t1 = "small" if cell["context"] == "small" else "large"
        sim = {x: simulate_point(deployment="1P3pD", policy=pol, workload=f"{t1}_{cell['workload']}",
                                 qps=cell["qps"], duration=4.0, seed=2)["turn2plus"]
               for x, pol in ((0, "pd"), (1, "local"))}
        for x in (0, 1):
            assert cell[f"x{x}"]["ttft_ms"] == sim[x]["avg_ttft_ms"]
            assert cell[f"x{x}"]["tpot_ms"] == sim[x]["avg_tpot_ms"]
            assert cell[f"x{x}"]["n"] == sim[x]["count"]
        s = ((sim[0]["avg_ttft_ms"] - sim[1]["avg_ttft_ms"]) / sim[0]["avg_ttft_ms"]
             - (sim[1]["avg_tpot_ms"] - sim[0]["avg_tpot_ms"]) / sim[0]["avg_tpot_ms"])
        n_in, n_out = T2_SETTINGS[cell["workload"]]
        ctx = 256 if cell["context"] == "small" else 2048
        route = engine.decide(2, n_in, n_out, ctx, cell["qps"], has_session=True)
        assert route.path == ("local" if s > 0 else "pd"), (cell, s)


def test_resumes_and_refuses_bad_layouts(tmp_path):
    out = tmp_path / "t.json"
    assert _build(out, "4")[0] == 0
    rc, err = _build(out, "4,8")
    assert rc == 0 and "8 runs to do, 8 already" in err
    assert len(Table.load(out)) == 8
    rc, err = _build(tmp_path / "u.json", "4", "--deployment", "2P2D")
    assert rc == 2 and "needs P and pD nodes" in err
    rc, err = _build(tmp_path / "u.json", "4", "--x0", "http://127.0.0.1:9")
    assert rc == 2 and "--backend live" in err
