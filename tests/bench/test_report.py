"""ppd-router report: Tables 1–3 on hand-made result files whose answers are worked out by hand."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from ppd_router.bench.metrics import SWEEP_COLUMNS
from ppd_router.cli import main
from ppd_router.report import (
    ReportError,
    load_rows,
    mode_of,
    pair_key,
    pair_wins,
    policy_summary,
    table1,
    table2,
    table3,
)


def _csv(path: Path, points: list[tuple], extra: bool = False) -> Path:
    """points: (config, workload, qps, t2_ttft, t2_tpot, tokens_per_sec[, policy])."""
    cols = list(SWEEP_COLUMNS) + (["policy"] if extra else [])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for p in points:
            cfg, wl, q, ttft, tpot, tps = p[:6]
            t1, t2 = wl.split("_", 1)
            row = {c: 1 for c in SWEEP_COLUMNS}
            row.update(config=cfg, t1_context=t1, t2_workload=t2, qps=q, turn2_count=10,
                       turn2_avg_ttft_ms=ttft, turn2_p99_ttft_ms=2 * ttft, turn2_avg_tpot_ms=tpot,
                       tokens_per_sec=tps, success_rate_pct=100, error="")
            if extra:
                row["policy"] = p[6]
            w.writerow(row)
    return path


# Two (workload, QPS) combinations, three configurations each; no ties.
GRID = [
    ("4R", "small_tiny", 2, 50, 12, 900), ("1P_3D", "small_tiny", 2, 120, 8, 1000),
    ("1P_3pD", "small_tiny", 2, 60, 9, 1100),
    ("4R", "small_tiny", 8, 200, 20, 800), ("1P_3D", "small_tiny", 8, 150, 9, 1200),
    ("1P_3pD", "small_tiny", 8, 100, 10, 1150),
]


def test_modes_and_pairs_follow_the_papers_notation():
    assert mode_of("1P_3D", "") == "x=0" and mode_of("1P3pD", "local") == "x=1"
    assert mode_of("1P_1D_2pD", "") == "0<x<1" and mode_of("1P3pD", "pd") == "x=0"
    assert mode_of("4R", "replica") == "Replica" and mode_of("1R_1P_2D", "") == "hybrid"
    assert mode_of("2P2pD", "ppd") == "PPD" and mode_of("2P2pD", "fraction:0.5") == "0<x<1"
    assert pair_key("1P3pD") == pair_key("1P_3D") == pair_key("1P_1D_2pD") == "1P_3D"
    with pytest.raises(ReportError, match="unknown configuration"):
        mode_of("3Q", "")


def test_winner_table_by_hand(tmp_path):
    rows = load_rows(_csv(tmp_path / "g.csv", GRID))
    t2, n = table2(rows)
    assert n == 2
    # TTFT: 4R at QPS 2 (50), 1P_3pD at QPS 8 (100). TPOT: 1P_3D both. Thpt: 1P_3pD, then 1P_3D.
    assert t2["Replica"] == pytest.approx((50.0, 0.0, 0.0, 50.0 / 3))
    assert t2["x=0"] == pytest.approx((0.0, 100.0, 50.0, 50.0))
    assert t2["x=1"] == pytest.approx((50.0, 0.0, 50.0, 100.0 / 3))
    assert t2["0<x<1"] == (0.0, 0.0, 0.0, 0.0)


def test_turn2_ttft_change_by_band(tmp_path):
    t1 = table1(load_rows(_csv(tmp_path / "g.csv", GRID)))
    assert set(t1) == {"1P_3D"}
    assert t1["1P_3D"]["low"] == pytest.approx(-50.0)        # (60 - 120) / 120
    assert t1["1P_3D"]["med"] == pytest.approx(-100 / 3)     # (100 - 150) / 150
    assert t1["1P_3D"]["high"] is None


def _result(dep: str, policy: str, q: float, ttft: float, tpot: float, sr: float) -> dict:
    turn = {"count": 5, "avg_ttft_ms": ttft, "p50_ttft_ms": ttft, "p99_ttft_ms": ttft,
            "avg_tpot_ms": tpot, "p50_tpot_ms": tpot, "p99_tpot_ms": tpot,
            "avg_e2e_ms": 1000.0, "p99_e2e_ms": 1000.0}
    return {"turn1": turn, "turn2plus": turn, "throughput": {"requests_per_sec": 1,
            "tokens_per_sec": 100}, "success_rate": sr, "local_share": 0.5,
            "meta": {"deployment": dep, "policy": policy, "workload": "wildchat-like", "qps": q}}


def test_three_way_wins_from_json_lines(tmp_path):
    pts = [  # QPS 4: PPD best TTFT, x=0 best TPOT; QPS 8: x=1 best TTFT, PPD best TPOT
        _result("2P2pD", "pd", 4, 300, 8.0, 0.90), _result("2P2pD", "local", 4, 90, 9.0, 1.0),
        _result("2P2pD", "ppd", 4, 80, 8.5, 1.0),
        _result("2P2pD", "pd", 8, 400, 9.0, 1.0), _result("2P2pD", "local", 8, 95, 9.5, 1.0),
        _result("2P2pD", "ppd", 8, 99, 8.9, 1.0),
        _result("2P2pD", "ppd", 12, 99, 8.9, 1.0),  # no x=0/x=1 partner: not a test point
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in pts) + "\n")
    t3, n = table3(load_rows(path), "wildchat-like")
    assert n == 2
    assert t3 == {"x=0": (1, 0, 1), "x=1": (0, 1, 2), "PPD": (1, 1, 2)}


def test_report_command_writes_markdown_and_pngs(tmp_path):
    g = _csv(tmp_path / "g.csv", GRID)
    out = tmp_path / "rep"
    assert main(["report", str(g), "--out-dir", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "| 1P_3D | -50.0 % | -33.3 % | – |" in text
    assert "| x=0 | 0.0 % | 100.0 % | 50.0 % | 50.0 % |" in text
    png = (out / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_inputs_are_clear_errors(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert main(["report", str(bad), "--out-dir", str(tmp_path / "o")]) == 2
    assert "not a sweep.csv-style file" in capsys.readouterr().err
    nometa = tmp_path / "r.json"
    r = _result("2P2pD", "pd", 4, 1, 1, 1)
    del r["meta"]
    nometa.write_text(json.dumps(r))
    assert main(["report", str(nometa), "--out-dir", str(tmp_path / "o")]) == 2
    assert "deployment/config, workload and qps" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.csv"), "--out-dir", str(tmp_path / "o")]) == 2


def test_unknown_configuration_label_is_named_in_the_error(tmp_path, capsys):
    path = _csv(tmp_path / "g.csv", [("live", "small_tiny", 2, 50, 12, 900)])
    assert main(["report", str(path), "--out-dir", str(tmp_path / "o"), "--no-plots"]) == 2
    assert "unknown configuration 'live'" in capsys.readouterr().err


def test_policies_side_by_side_with_slo_attainment_and_pairwise_wins(tmp_path):
    slo = {"ttft_ms": 150.0, "tpot_ms": 15.0}

    def res(policy: str, q: float, ttft: float, tpot: float, att: float) -> dict:
        r = _result("3P1pD", policy, q, ttft, tpot, 1.0)
        r["meta"]["slo"] = slo
        r["slo_attainment"] = att
        return r

    pts = [
        res("local", 8, 90, 14.3, 0.50), res("pd", 8, 180, 13.4, 0.42), res("ppd-live", 8, 120, 13.6, 0.80),
        res("local", 16, 96, 15.6, 0.21), res("pd", 16, 183, 14.5, 0.18), res("ppd-live", 16, 130, 14.7, 0.34),
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in pts) + "\n")
    rows = load_rows(path)
    assert {r.mode for r in rows if r.policy == "ppd-live"} == {"other"}
    summary = {p["policy"]: p for p in policy_summary(rows)}
    assert summary["ppd-live"]["slo_attainment"] == pytest.approx(0.57)
    assert summary["pd"]["ttft_ms"] == pytest.approx(181.5)
    wins = pair_wins(rows)
    # points, lower TTFT, lower TPOT, both, higher SLO attainment
    assert wins[("ppd-live", "local")] == (2, 0, 2, 0, 2)
    assert wins[("ppd-live", "pd")] == (2, 2, 0, 0, 2)
    assert wins[("local", "pd")] == (2, 2, 0, 0, 2)
    # ppd-live is no mode of the paper's tables: Table 2 ignores it.
    t2, n = table2(rows)
    assert n == 2 and "other" not in t2
    text = main(["report", str(path), "--out-dir", str(tmp_path / "out"), "--no-plots"])
    assert text == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Policies side by side" in md and "| ppd-live | local | 2 | 0 | 2 | 0 | 2 |" in md
