"""Markdown table: each live emulated-cluster point beside the simulator's same point.

    python bench/scripts/live_vs_sim.py bench/results/reproduction/live.jsonl bench/results/reproduction/sim-modes.csv [WORKLOAD]

With WORKLOAD (e.g. sharegpt, large_big_paste) only that workload's live points are listed.
"""

from __future__ import annotations

import csv
import json
import sys


def main(live_path: str, sim_path: str, workload: str = "") -> int:
    live: dict[tuple, dict] = {}
    for line in open(live_path):
        r = json.loads(line)
        m = r["meta"]
        live[(m["deployment"], m["policy"], m["workload"], float(m["qps"]))] = r  # last wins
    sim = {(r["config"], r["policy"],  # synthetic names are t1_context + "_" + t2_workload
            f"{r['t1_context']}_{r['t2_workload']}" if r["t1_context"] else r["t2_workload"],
            float(r["qps"])): r
           for r in csv.DictReader(open(sim_path))}
    print("| config | policy | QPS | T1 TTFT live / sim | T2+ TTFT live / sim | T2+ TPOT live / sim "
          "| E2E live / sim (s) | success live / sim | local live / sim | wall (s) |")
    print("|---|---|---:|---|---|---|---|---|---|---:|")
    for key, r in live.items():
        if workload and key[2] != workload:
            continue
        s = sim.get(key)
        t1, t2, ov = r["turn1"], r["turn2plus"], r["overall"]

        def pair(a: float, b: str, fmt: str) -> str:
            return f"{a:{fmt}} / {float(b):{fmt}}" if s is not None else f"{a:{fmt}} / –"

        e2e_sim = "0"
        if s is not None:
            n1, n2 = float(s["turn1_count"]), float(s["turn2_count"])
            e2e_sim = str((float(s["turn1_avg_e2e_ms"]) * n1 + float(s["turn2_avg_e2e_ms"]) * n2)
                          / max(1.0, n1 + n2) / 1000)
        local = "–" if r["local_share"] is None else f"{r['local_share']:.2f}"
        print(f"| {key[0]} | {key[1]} | {key[3]:g} "
              f"| {pair(t1['avg_ttft_ms'], s and s['turn1_avg_ttft_ms'], '.0f')} "
              f"| {pair(t2['avg_ttft_ms'], s and s['turn2_avg_ttft_ms'], '.0f')} "
              f"| {pair(t2['avg_tpot_ms'], s and s['turn2_avg_tpot_ms'], '.2f')} "
              f"| {pair(ov['avg_e2e_ms'] / 1000, e2e_sim, '.2f')} "
              f"| {100 * r['success_rate']:.0f} / {float(s['success_rate_pct']) if s else 0:.0f} % "
              f"| {local} / "
              f"{float(s['local_share']) if s else 0:.2f} | {r['meta']['wall_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
