#!/usr/bin/env python3
"""Fit the engine profile to the measured H100 sweep and report the emulator's fidelity.

The simulator (``ppd-sim-grid``, the engine model of the emulator in virtual
time) is run over the paper's grid and compared with ``sweep.csv`` row by row.

    python3 bench/calibrate/fit.py eval   [--profile P] [--set k=v ...]
    python3 bench/calibrate/fit.py fit    [--rounds N] [--write tables/engine-h100-llama3.1-8b.toml]
    python3 bench/calibrate/fit.py report [--out bench/results/emulator-fidelity.md]

Only the standard library is used. Errors are median absolute percentage errors
over the rows where the measurement has both turns (``turn*_count > 0``).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT.parent / "shared" / "data" / "ppd-h100" / "sweep.csv"
PROFILE = ROOT / "tables" / "engine-h100-llama3.1-8b.toml"
CORE = ["4R", "1P_3D", "2P_2D", "3P_1D", "1P_3pD", "2P_2pD", "3P_1pD", "1P_1D_2pD", "1P_2D_1pD", "2P_1D_1pD"]
REGRESSION_QPS = [1.0, 4.0]
PAIRS = [("1P_3D", "1P_3pD"), ("2P_2D", "2P_2pD"), ("3P_1D", "3P_1pD")]
METRICS = [("turn2_avg_ttft_ms", "T2 TTFT"), ("turn2_avg_tpot_ms", "T2 TPOT"), ("turn1_avg_ttft_ms", "T1 TTFT")]
# The fitted parameters and their search bounds.
PARAMS = {
    "step.overhead_ms": (3.0, 12.0),
    "step.per_token_ms": (0.01, 0.12),
    "step.per_seq_ms": (0.0, 0.3),
    "step.prefill_token_ms": (0.0, 0.08),
    "step.attn_ms_per_mpair": (0.0, 20.0),
    "step.decode_ctx_ms_per_ktoken": (0.0, 0.5),
    "link.latency_ms": (0.0, 120.0),
    "link.push_ms": (0.0, 80.0),
    "api.request_overhead_ms": (0.0, 40.0),
    "api.router_hop_ms": (0.0, 40.0),
    "api.local_path_extra_ms": (0.0, 60.0),
    "harness.max_conversations": (8, 256),
}


def sim_binary() -> str:
    env = os.environ.get("PPD_SIM_GRID")
    if env:
        return env
    target = os.environ.get("CARGO_TARGET_DIR", str(ROOT / "target"))
    exe = Path(target) / "release" / "ppd-sim-grid"
    if not exe.exists():
        subprocess.run(["cargo", "build", "--release", "-p", "ppd-emulator", "--bin", "ppd-sim-grid"], cwd=ROOT, check=True)
    return str(exe)


def key(r: dict) -> tuple:
    return (r["config"], r["t1_context"], r["t2_workload"], float(r["qps"]))


def load_measured(path: Path = SWEEP) -> dict:
    with open(path, newline="") as f:
        return {key(r): r for r in csv.DictReader(f)}


def run_sim(profile: str, sets: dict, configs=None, qps=None, threads: int = 2) -> tuple[dict, float]:
    cmd = [sim_binary(), "--profile", profile, "--threads", str(threads)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    if configs:
        cmd += ["--configs", ",".join(configs)]
    if qps:
        cmd += ["--qps", ",".join(str(q) for q in qps)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = float(re.search(r"wall_s=([0-9.]+)", p.stderr).group(1))
    return {key(r): r for r in csv.DictReader(io.StringIO(p.stdout))}, wall


def num(r: dict, k: str) -> float | None:
    try:
        v = float(r.get(k) or "nan")
    except ValueError:
        return None
    return v if v == v and v > 0 else None


def usable(m: dict) -> bool:
    return (num(m, "turn1_count") or 0) > 0 and (num(m, "turn2_count") or 0) > 0


def errors(measured: dict, sim: dict, configs) -> dict:
    """{config: {metric: median abs % error}} over usable rows."""
    out = {}
    for c in configs:
        per = {}
        for mk, _ in METRICS:
            errs = []
            for k, m in measured.items():
                if k[0] != c or k not in sim or not usable(m):
                    continue
                a, b = num(m, mk), num(sim[k], mk)
                if a is None or b is None:
                    continue
                errs.append(abs(b - a) / a * 100.0)
            per[mk] = statistics.median(errs) if errs else float("nan")
            per[mk + "_n"] = len(errs)
        out[c] = per
    return out


def winner(r0: dict, r1: dict) -> int | None:
    """x=1 wins when Equation 1's S = Δttft − Δtpot > 0 (balanced weights)."""
    t0, t1 = num(r0, "turn2_avg_ttft_ms"), num(r1, "turn2_avg_ttft_ms")
    p0, p1 = num(r0, "turn2_avg_tpot_ms"), num(r1, "turn2_avg_tpot_ms")
    if None in (t0, t1, p0, p1):
        return None
    s = (t0 - t1) / t0 - (p1 - p0) / p0
    return 1 if s > 0 else 0


def same_winner(measured: dict, sim: dict) -> tuple[int, int]:
    agree = total = 0
    for x0, x1 in PAIRS:
        for k, m0 in measured.items():
            if k[0] != x0:
                continue
            k1 = (x1,) + k[1:]
            m1 = measured.get(k1)
            if m1 is None or not usable(m0) or not usable(m1) or k not in sim or k1 not in sim:
                continue
            wm, ws = winner(m0, m1), winner(sim[k], sim[k1])
            if wm is None or ws is None:
                continue
            total += 1
            agree += wm == ws
    return agree, total


def objective(errs: dict) -> float:
    vals = [e[mk] for e in errs.values() for mk, _ in METRICS if e[mk] == e[mk]]
    return statistics.mean(vals) if vals else float("inf")


def read_profile_values(path: Path) -> dict:
    """The fitted parameters' current values, read from the TOML (tomllib is 3.11+)."""
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        tomllib = None
    text = path.read_text()
    if tomllib:
        doc = tomllib.loads(text)
        out = {}
        for k in PARAMS:
            sec, name = k.split(".")
            out[k] = doc[sec][name]
        return out
    raise SystemExit("Python 3.11+ (tomllib) is needed to read the profile")


def write_profile(path: Path, values: dict) -> None:
    """Rewrites the fitted values in place, keeping the file's comments and layout."""
    text = path.read_text()
    section = None
    lines = []
    for line in text.splitlines():
        m = re.match(r"\[(\w+)\]", line.strip())
        if m:
            section = m.group(1)
        kv = re.match(r"(\s*)(\w+)(\s*=\s*)([^#\s]+)(.*)", line)
        if kv and section and f"{section}.{kv.group(2)}" in values:
            v = values[f"{section}.{kv.group(2)}"]
            v = str(int(v)) if isinstance(v, int) else f"{v:.6g}" if "." in f"{v:.6g}" or "e" in f"{v:.6g}" else f"{v:.6g}.0"
            line = f"{kv.group(1)}{kv.group(2)}{kv.group(3)}{v}{kv.group(5)}"
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")


def fit(args) -> None:
    measured = load_measured()
    values = read_profile_values(Path(args.profile))
    fit_qps = None if args.qps == "all" else [float(q) for q in args.qps.split(",")]

    def score(vals: dict) -> float:
        sim, _ = run_sim(args.profile, vals, CORE, fit_qps)
        e = errors(measured, sim, CORE)
        agree, total = same_winner(measured, sim)
        # Fidelity of the decision matters too: count each disagreeing cell as 10 % error.
        return objective(e) + 10.0 * (1 - agree / max(total, 1))

    best = score(values)
    print(f"start objective {best:.2f}", flush=True)
    step = {k: 0.3 for k in PARAMS}
    t0 = time.time()
    for rnd in range(args.rounds):
        for k, (lo, hi) in PARAMS.items():
            for direction in (1, -1):
                cur = values[k]
                span = max(abs(cur), (hi - lo) * 0.05)
                cand = min(hi, max(lo, cur + direction * step[k] * span))
                if isinstance(cur, int):
                    cand = int(round(cand))
                if cand == cur:
                    continue
                trial = dict(values, **{k: cand})
                s = score(trial)
                if s < best:
                    best, values = s, trial
                    print(f"round {rnd} {k}={cand:.5g} objective {best:.2f} ({time.time() - t0:.0f}s)", flush=True)
                    break
            else:
                step[k] *= 0.5
    print(json.dumps(values, indent=1))
    if args.write:
        write_profile(Path(args.write), values)
        print(f"wrote {args.write}")


def evaluate(args) -> tuple[dict, dict, tuple[int, int], float]:
    measured = load_measured()
    sets = dict(s.split("=", 1) for s in args.set)
    sim, wall = run_sim(args.profile, sets)
    return measured, sim, same_winner(measured, sim), wall


def table(measured: dict, sim: dict, configs) -> str:
    errs = errors(measured, sim, configs)
    lines = ["| configuration | rows | T2 TTFT | T2 TPOT | T1 TTFT |", "|---|---:|---:|---:|---:|"]
    for c in configs:
        e = errs[c]
        lines.append(
            f"| {c} | {e['turn2_avg_ttft_ms_n']} | "
            + " | ".join(f"{e[mk]:.1f} %" for mk, _ in METRICS)
            + " |"
        )
    return "\n".join(lines)


def report(args) -> None:
    measured, sim, (agree, total), wall = evaluate(args)
    hybrids = sorted({k[0] for k in measured} - set(CORE))
    errs = errors(measured, sim, CORE)
    core_ok = {c: all(errs[c][mk] <= 15.0 for mk, _ in METRICS) for c in CORE}
    summary = {
        "profile": args.profile,
        "core_median_abs_pct_error": {c: {mk: round(errs[c][mk], 2) for mk, _ in METRICS} for c in CORE},
        "same_winner": {"agree": agree, "cells": total, "share": round(agree / max(total, 1), 4)},
        "core_within_15pct": sum(core_ok.values()),
    }
    # The subset the Rust regression test (rust/ppd-model/tests/calibration.rs) re-simulates.
    reg_sim, _ = run_sim(args.profile, dict(s.split("=", 1) for s in args.set), CORE, REGRESSION_QPS)
    reg = errors(measured, reg_sim, CORE)
    ra, rt = same_winner(measured, reg_sim)
    summary["regression"] = {
        "qps": REGRESSION_QPS,
        "median_abs_pct_error": {c: {mk: round(reg[c][mk], 3) for mk, _ in METRICS} for c in CORE},
        "same_winner": {"agree": ra, "cells": rt},
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    if args.out:
        Path(args.out).write_text(
            render_md(measured, sim, CORE, hybrids, agree, total, wall, core_ok, args)
        )
        print(f"wrote {args.out}")


def render_md(measured, sim, core, hybrids, agree, total, wall, core_ok, args) -> str:
    return f"""# Emulator fidelity against the measured H100 sweep

Measured: `../shared/data/ppd-h100/sweep.csv` (paper prototype, vLLM + P2pNccl, 4 × H100, Llama-3.1-8B).
Emulated: the engine model of `ppd-emulator` in virtual time (`ppd-core::sim`), profile
`tables/engine-h100-llama3.1-8b.toml`, same 17 configurations × 18 workloads × 10 QPS levels,
10 s of Poisson two-turn conversations per point, 30 s timeout, seed 0.

Produced by:

    cargo build --release -p ppd-model --bin ppd-sim-grid
    python3 bench/calibrate/fit.py report --out bench/results/emulator-fidelity.md --json bench/results/emulator-fidelity.json

(whole grid simulated in {wall:.1f} s on this 2-core machine for this report).

Error = median over a configuration's rows of |simulated − measured| / measured, for the
per-point averages; rows where the measurement lost a turn entirely (`turn*_count = 0`) are skipped.

## Core configurations (target ≤ 15 %)

{table(measured, sim, core)}

Configurations meeting the target on all three metrics: {sum(core_ok.values())} of {len(core)}
({", ".join(c for c, ok in core_ok.items() if ok) or "none"}).

## Same winner between x = 0 and x = 1 (target ≥ 80 %)

For each (workload, QPS) cell of the pairs 1P_3D/1P_3pD, 2P_2D/2P_2pD, 3P_1D/3P_1pD, the winner is
x = 1 when Equation 1 with balanced weights, S = Δttft − Δtpot on Turn-2 averages, is positive.
Emulator and measurement agree in **{agree} of {total} cells ({100 * agree / max(total, 1):.1f} %)**.

## Hybrid configurations (no target)

{table(measured, sim, hybrids)}

## Notes

{NOTES}
"""


NOTES = """- The measured Turn-1 TTFT grows to tens of seconds at high QPS even on 4R. That is the
  paper's load client, not the GPUs: it keeps a bounded number of conversations in flight,
  so later arrivals wait. The simulator models it as `harness.max_conversations` (fitted);
  TTFT counts from the scheduled arrival, the 30 s timeout from the actual send.
- The measured x = 0 rows used P2pNccl, which resends the whole prompt's KV every turn;
  the profile sets `link.full_prompt_transfer = true` to match. The emulator's NIXL path with
  `full_prompt_transfer = false` pulls only what D lacks, as current vLLM does.
- P2pNccl's P pushes each finished prefill's KV layer by layer, and its forward ends with
  `wait_for_sent` (the send queue must be empty), so the step that finishes a prefill for D
  is longer by the send: `link.push_ms` (fitted, 30 ms) per such request. It is paid on P,
  so a single P saturates under load (1P_3D's simulated Turn-2 TTFT grows to 0.14–1.7 s for
  the small-context workloads at QPS ≥ 10, as measured); `link.latency_ms` keeps what is
  left of the per-transfer overhead. The emulator's engine pays it too (it is an engine
  cost, not a simulator one). NVLink bandwidth itself is not identifiable from this data
  (a 2 k-token KV is ~2 ms at 150 GB/s).
- The client's re-rendered history misses the cache for the previous answer only
  (`harness.answer_prefix_hit = false`): Turn 2 recomputes the Turn-1 answer over the cached
  Turn-1 prompt. (Before 2026-12-03 the simulator also missed the Turn-1 prompt, i.e. Turn 2
  recomputed everything; fixing that moved the fitted step costs: `per_token_ms` 0.023 →
  0.034, `attn_ms_per_mpair` 1.07 → 0.82.)
- Single short runs per point: several measured points are noisy outliers (e.g. Turn-2
  TTFT at QPS 0.5 based on 1–5 conversations), which bounds what any model can match.

### Where it misses, honestly

- **Turn-2 TTFT misses the 15 % target on 3 of 10 core configurations**: 1P_3D (15.4 %) and
  the partial 1P_1D_2pD (19.9 %) / 1P_2D_1pD (16.0 %); 3P_1pD (14.9 %) and 4R (13.3 %) are
  close. The signed error by QPS shows why: at QPS 0.5–4 these are up to 20 % high, at
  QPS ≥ 10 28–63 % low (signed medians per QPS level). The measured single P saturates
  earlier than the model's, and its queueing grows with the prompt size (1P_3D
  small_huge_paste at QPS 8: 1,848 ms measured, 242 ms simulated; the large-context
  workloads saturate at QPS 8 measured but are held below saturation in the model by the
  client's conversation bound); a per-token push cost, tried for that, made the low-load
  rows worse. The pD-only 1P_3pD and 3P_1pD are also 18–72 % low at QPS ≥ 12,
  where Turn 2 never touches the link; the model has no cause for that (the measured PPD
  proxy is one suspect).
- A cause found for the pD rows' Turn-2 tail (2026-12-05), modelled but off: the measured
  proxy (`comprehensive_proxy.py` in the paper's repository) keys a conversation by the
  prompt's first `User:`…`Assistant:` span, else its first 200 characters, and the client
  renders each turn's new input as `User:`, `Question:` or `<|user|>` at random, so 2/9 of
  Turn 2s (Turn 1 not `User:`, Turn 2 `User:`) got a new key and went through P as a new
  conversation's Turn 1, even on pD. `harness.new_conversation_share = 0.222` reproduces the
  measured Turn-2 TTFT p99/p50 of 1P_3pD/2P_2pD/3P_1pD at QPS 1–8 (2.2–3.3 measured,
  2.4–2.8 simulated, ~1.0 without it), but its averages at QPS ≤ 4 come out 20–50 % high
  and a 2-round refit (`fit --rounds 2 --qps all`) with it met the target on 5 of 10
  (1P_3D 17.4 %, 1P_3pD 17.6 %, 3P_1pD 16.4 %, 1P_1D_2pD 20.9 %, 1P_2D_1pD 15.1 % T2 TTFT):
  the fitted local-path constants had absorbed that tail, and the short low-QPS runs
  (5–20 conversations) hold too few rekeyed turns to pin it. The profile keeps it at 0.
  The proxy also picks P and D by Python's `hash()` (random per process), not round robin.
- Tried and not kept: a FIFO sending thread per P that does not block P's steps
  (8 of 10 at best, but vLLM's P2pNccl does block the forward on its sends), a per-request
  receive cost in D's step (worse), a per-token push cost (worse).
- Turn-2 TPOT (≤ 5.2 %) and Turn-1 TTFT (≤ 13.0 %) are within the target for all core
  configurations.
- The x = 0 / x = 1 winner agrees in ~98 % of cells, well above the 80 % target: the
  decision the router takes from this model matches the measured one.
- The fit is a coordinate search over the core configurations (all QPS levels) of a
  mean-of-medians objective plus a penalty per disagreeing winner cell; it is a local
  optimum, not a global one. The last pass, from the previous fit's values (QPS 1/4/8/16
  passes before it), was:

      python3 bench/calibrate/fit.py fit --rounds 3 --qps all --write tables/engine-h100-llama3.1-8b.toml

- `aiconfigurator-core` (NVIDIA's measured kernel tables) was not used as a second source.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("eval", "report"):
        p = sub.add_parser(name)
        p.add_argument("--profile", default=str(PROFILE))
        p.add_argument("--set", action="append", default=[], help="override a profile field, e.g. step.overhead_ms=7")
        p.add_argument("--out")
        p.add_argument("--json")
    f = sub.add_parser("fit")
    f.add_argument("--rounds", type=int, default=3)
    f.add_argument("--profile", default=str(PROFILE))
    f.add_argument("--write")
    f.add_argument("--qps", default="1,4,8,16", help="QPS levels to fit on, or 'all' for the report's grid")
    args = ap.parse_args()
    if not SWEEP.exists():
        sys.exit(f"measured data not found at {SWEEP}")
    if args.cmd == "fit":
        fit(args)
    elif args.cmd == "report":
        report(args)
    else:
        measured, sim, (agree, total), wall = evaluate(args)
        print(table(measured, sim, CORE))
        print(f"same winner {agree}/{total}; grid wall {wall:.1f}s")


if __name__ == "__main__":
    main()
