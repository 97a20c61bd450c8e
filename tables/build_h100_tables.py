#!/usr/bin/env python3
"""Builds the shipped ppd-table/1 files from the paper's measured H100 sweep.

x=0 comes from the `kP_mD` rows (Turn 2 always through P), x=1 from the
`kP_mpD` rows (Turn 2 local on pD); each cell takes the Turn-2 mean TTFT, mean
TPOT and request count of its (Turn-1 context, Turn-2 workload, QPS) point.

    python tables/build_h100_tables.py [--sweep ../shared/data/ppd-h100/sweep.csv] [--out tables]
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import sys
from pathlib import Path

from ppd_router import _core

HERE = Path(__file__).resolve().parent
DEFAULT_SWEEP = HERE.parent.parent / "shared" / "data" / "ppd-h100" / "sweep.csv"

# Deployment name -> (x=0 config, x=1 config) in the sweep's notation.
DEPLOYMENTS = {
    "1P3pD": ("1P_3D", "1P_3pD"),
    "2P2pD": ("2P_2D", "2P_2pD"),
    "3P1pD": ("3P_1D", "3P_1pD"),
}
# The paper's grid, as the router's core defines it (whole QPS levels written as integers).
WORKLOADS = _core.PAPER_WORKLOADS
QPS = [int(q) if float(q).is_integer() else q for q in _core.PAPER_QPS]
# Turn-1 size -> Turn-2 accumulated context: small is 128+128 = 256 tokens
# (context class small, <= 512); large is 1024+1024 = 2048 (class large).
T1_CONTEXT_CLASS = {"small": "small", "large": "large"}


def measurement(row: dict) -> dict | None:
    """Turn-2 (ttft, tpot, n) of a row, or None when the row has no Turn-2 data."""
    try:
        n = int(float(row["turn2_count"] or 0))
        ttft = float(row["turn2_avg_ttft_ms"])
        tpot = float(row["turn2_avg_tpot_ms"])
    except (KeyError, ValueError):
        return None
    if n < 1 or not (math.isfinite(ttft) and ttft > 0 and math.isfinite(tpot) and tpot > 0):
        return None
    return {"ttft_ms": ttft, "tpot_ms": tpot, "n": n}


def load_rows(path: Path) -> dict:
    rows = {}
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            rows[(r["config"], r["t1_context"], r["t2_workload"], float(r["qps"]))] = r
    return rows


def build(deployment: str, rows: dict, sweep: Path, sha: str) -> tuple[dict, list[str]]:
    x0_cfg, x1_cfg = DEPLOYMENTS[deployment]
    cells, skipped = [], []
    for t1, ctx in T1_CONTEXT_CLASS.items():
        for name, _, _ in WORKLOADS:
            for q in QPS:
                r0 = rows.get((x0_cfg, t1, name, float(q)))
                r1 = rows.get((x1_cfg, t1, name, float(q)))
                m0 = measurement(r0) if r0 else None
                m1 = measurement(r1) if r1 else None
                if m0 is None or m1 is None:
                    skipped.append(f"{t1}/{name}/qps={q}")
                    continue
                cells.append({"context": ctx, "workload": name, "qps": q, "x0": m0, "x1": m1})
    doc = {
        "schema": "ppd-table/1",
        "model": "Llama-3.1-8B",
        "hardware": "H100-80GB",
        "deployment": deployment,
        "source": "measured",
        "created": "paper prototype sweep (freelulul/vllm-ppd, ppd/results/comprehensive)",
        "default_n_out": 128,
        "provenance": {
            "sweep": sweep.name,
            "sweep_sha256": sha,
            "x0_config": x0_cfg,
            "x1_config": x1_cfg,
            "columns": ["turn2_avg_ttft_ms", "turn2_avg_tpot_ms", "turn2_count"],
            "context_mapping": {"small": "t1_context=small (128+128 tokens)", "large": "t1_context=large (1024+1024 tokens)"},
            "missing": "no huge-context (>4096) points were measured; those cells fall back to large",
            "skipped_points": skipped,
            "builder": "tables/build_h100_tables.py",
        },
        "axes": {
            "context_bins": _core.PAPER_CONTEXT_BINS,
            "workloads": [{"name": n, "n_in": i, "n_out": o} for n, i, o in WORKLOADS],
            "qps": QPS,
        },
        "cells": cells,
    }
    return doc, skipped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--sweep", type=Path, default=DEFAULT_SWEEP)
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    if not args.sweep.exists():
        print(f"sweep file not found: {args.sweep}", file=sys.stderr)
        return 2
    sha = hashlib.sha256(args.sweep.read_bytes()).hexdigest()
    rows = load_rows(args.sweep)
    for dep in DEPLOYMENTS:
        doc, skipped = build(dep, rows, args.sweep, sha)
        out = args.out / f"h100-llama3.1-8b-{dep}.json"
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"{out}: {len(doc['cells'])} cells, {len(skipped)} points skipped")
    try:  # validate with the real loader when the package is built
        from ppd_router import Table

        for dep in DEPLOYMENTS:
            Table.load(args.out / f"h100-llama3.1-8b-{dep}.json")
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
