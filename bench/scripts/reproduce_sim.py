"""Simulator side of the reproduction: three sweeps written as sweep.csv-style CSVs.

* ``grid``: the paper's 17 configurations × 18 synthetic workloads × 10 QPS levels,
  each configuration under the policy that realises it (role-defined x, replica
  for 4R) — the same points as ``shared/data/ppd-h100/sweep.csv``.
* ``modes``: 1P_3pD, 2P_2pD, 3P_1pD under x=0 (pd), x=1 (local) and PPD (ppd, weights
  1,1, the shipped tables) plus 4R (replica), QPS 1–20, the 18 synthetic workloads,
  ShareGPT and wildchat-like.
* ``wtpot``: 1P_3pD, prefill-heavy workloads, QPS 8 and 16, PPD with w_tpot swept,
  plus the pd and local extremes (paper Figure 6).

Extra columns after sweep.csv's: policy, local_share, w_ttft, w_tpot, backend.

    python bench/scripts/reproduce_sim.py --out-dir bench/results/reproduction
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ppd_router import _core
from ppd_router.bench.metrics import SWEEP_COLUMNS, TURN_KEYS
from ppd_router.bench.workloads import SYNTHETIC_WORKLOADS, ConversationFilter, load_workload
from ppd_router.simulate import max_model_len, simulate_point

EXTRA = ("policy", "local_share", "w_ttft", "w_tpot", "backend")
LAYOUTS = {"1P_3pD": "tables/h100-llama3.1-8b-1P3pD.json",
           "2P_2pD": "tables/h100-llama3.1-8b-2P2pD.json",
           "3P_1pD": "tables/h100-llama3.1-8b-3P1pD.json"}
QPS_1_20 = (1, 2, 4, 6, 8, 10, 12, 16, 20)


def row(r: dict[str, Any]) -> dict[str, Any]:
    m = r["meta"]
    wl = m["workload"]
    t1, t2 = wl.split("_", 1) if wl in SYNTHETIC_WORKLOADS else ("", wl)
    out: dict[str, Any] = {"config": m["deployment"], "t1_context": t1, "t2_workload": t2,
                           "qps": m["qps"]}
    for prefix, key in (("turn1", "turn1"), ("turn2", "turn2plus")):
        for k in TURN_KEYS:
            out[f"{prefix}_{k}"] = r[key][k]
    fails = r["failed_requests"]
    out.update({"requests_per_sec": r["throughput"]["requests_per_sec"],
                "tokens_per_sec": r["throughput"]["tokens_per_sec"],
                "success_rate_pct": 100.0 * r["success_rate"],
                "total_requests": r["total_requests"], "failed_requests": fails,
                "duration_sec": r["duration_s"], "error": f"timeout:{fails}" if fails else "",
                "policy": m["policy"], "local_share": r["local_share"], "w_ttft": m["w_ttft"],
                "w_tpot": m["w_tpot"], "backend": "simulate"})
    return out


def run(points: list[dict[str, Any]], path: Path, threads: int) -> float:
    loaded = {}
    for p in points:  # load each recorded workload once; the sweep reuses it
        w = p["workload"]
        if w not in SYNTHETIC_WORKLOADS and w not in loaded:
            loaded[w] = load_workload(w, seed=0, flt=ConversationFilter(
                max_context=max_model_len(None)))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:  # the Rust simulator releases the GIL
        results = list(ex.map(lambda p: simulate_point(loaded=loaded.get(p["workload"]), **p),
                              points))
    wall = time.perf_counter() - t0
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(SWEEP_COLUMNS) + list(EXTRA))
        w.writeheader()
        for r in results:
            w.writerow(row(r))
    print(f"{path}: {len(points)} points in {wall:.1f} s", flush=True)
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="grid,modes,wtpot")
    a = ap.parse_args()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    workloads, configs, paper_qps = _core.simulator_catalog()
    sweeps: dict[str, list[dict[str, Any]]] = {}
    sweeps["grid"] = [
        {"deployment": c, "policy": "replica" if c == "4R" else "local", "workload": w, "qps": q}
        for c in configs for w in workloads for q in paper_qps]
    modes = [(d, pol, LAYOUTS[d] if pol == "ppd" else None)
             for d in LAYOUTS for pol in ("pd", "local", "ppd")] + [("4R", "replica", None)]
    sweeps["modes"] = [
        {"deployment": d, "policy": pol, "table": t, "workload": w, "qps": float(q)}
        for d, pol, t in modes for w in list(workloads) + ["sharegpt", "wildchat-like"]
        for q in QPS_1_20]
    heavy = [f"{c}_{t}" for c in ("small", "large") for t in ("mid_paste", "big_paste", "huge_paste")]
    wt = [("pd", 1.0), ("local", 1.0)] + [("ppd", w) for w in (0.5, 1, 3, 6, 12, 20, 30, 50)]
    sweeps["wtpot"] = [
        {"deployment": "1P_3pD", "policy": pol, "w_tpot": float(w), "workload": wl,
         "qps": float(q), "table": LAYOUTS["1P_3pD"] if pol == "ppd" else None}
        for pol, w in wt for wl in heavy + ["sharegpt", "wildchat-like"] for q in (8, 16)]
    for name in a.only.split(","):
        run(sweeps[name], a.out_dir / f"sim-{name}.csv", a.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
