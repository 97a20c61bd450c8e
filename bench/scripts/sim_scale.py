"""The simulator at scale and with router replicas (issue 19's proof, in ``bench/results/simulator.md``).

``scale``: a 1,000-node cluster (250P750pD) at 10,000 conversations a second for
60 s of virtual time, through ``ppd-router simulate`` with 8 router replicas,
timed wall-clock with the load average beside each run. ``spread``: routers
1 / 3 / 8 × view delays 0 / 1 / 5 s on a 100-node cluster at the same load per
node, the placement spread and the Turn 2+ figures of each. ``decide``: ``ppd-live`` on
12P4pD (the paper's 3P1pD times 4) with wildchat-like conversations at 12 a second (open
loop: the most this cluster answers within the 30 s timeout, and a load where ppd-live moves a
third of the turns off the pDs through pull, with clients taking whole answers so that the
router can pull), routers 1 / 3 / 8 × the same view delays: what deciding on the nodes' state
as the last refresh read it costs.

Both use the built-in H100 profile as a NIXL deployment (``h100-llama3.1-8b-nixl``:
P2pNccl's per-request push inside P's step would make 250 P nodes the bottleneck)
with the paper client's cap of 52 conversations in flight lifted: an open-loop
10,000 QPS has no such client. The profile is written to a temporary TOML.

    python bench/scripts/sim_scale.py scale --runs 3 --out bench/results/simulator-scale.jsonl
    python bench/scripts/sim_scale.py spread --out bench/results/simulator-spread.jsonl
    python bench/scripts/sim_scale.py decide --out bench/results/simulator-decide.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BASE_PROFILE = ROOT / "tables" / "engine-h100-llama3.1-8b.toml"
# The NIXL variant (ppd_core::profiles::NIXL_PROFILE_NAME) without the client cap.
PROFILE_EDITS = {"full_prompt_transfer": "false", "push_ms": "0.0", "pull": "true", "max_conversations": "0"}
SCALE = {"deployment": "250P750pD", "qps": 10_000, "duration": 60, "routers": 8, "view_delay": 1}
SPREAD = {"deployment": "25P75pD", "qps": 1_000, "duration": 30}
WORKLOAD = "small_mid_bal"
# Whole answers: the clients let the router pull (decision.md), the path replicas must agree on.
DECIDE = {
    "deployment": "12P4pD",
    "qps": 12,
    "duration": 20,
    "policy": "ppd-live",
    "workload": "wildchat-like",
    "whole_answers": True,
}
# The paper's x = 1 on every pD: the lookup tables' QPS axis (0.5-20 on 4 nodes)
# says nothing about a 1,000-node cluster's rate.
POLICY = "local"


def profile_toml(directory: Path) -> Path:
    """The base profile with PROFILE_EDITS applied, each key replaced exactly once."""
    text = BASE_PROFILE.read_text()
    for key, value in PROFILE_EDITS.items():
        text, n = re.subn(rf"(?m)^{key} = [^#\n]*", f"{key} = {value} ", text)
        if n != 1:
            sys.exit(f"{BASE_PROFILE}: expected one {key!r} line, found {n}")
    path = directory / "h100-nixl-open-loop.toml"
    path.write_text(text)
    return path


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def command(
    profile: Path,
    *,
    deployment: str,
    qps: float,
    duration: float,
    routers: int,
    view_delay: float,
    policy: str = POLICY,
    workload: str = WORKLOAD,
    whole_answers: bool = False,
) -> list[str]:
    exe = shutil.which("ppd-router")
    if exe is None:
        sys.exit("ppd-router is not on PATH (pip install . or maturin develop)")
    return [
        exe, "simulate", "--deployment", deployment, "--policy", policy, "--workload", workload,
        "--qps", f"{qps:g}", "--duration", f"{duration:g}", "--routers", str(routers),
        "--view-delay", f"{view_delay:g}", "--profile", str(profile), "--json",
    ] + (["--whole-answers"] if whole_answers else [])  # fmt: skip


def run(cmd: list[str]) -> dict[str, Any]:
    """One simulated point, with its wall time and the load average before and after."""
    before = loadavg()
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    wall = time.perf_counter() - t0
    r = json.loads(out)
    r["bench"] = {"wall_s": wall, "loadavg_before": before, "loadavg_after": loadavg()}
    return r


def scale(profile: Path, runs: int) -> list[dict[str, Any]]:
    cmd = command(profile, **SCALE)
    print("    " + " ".join(cmd).replace(str(profile), "<profile>"))
    print("\n| run | wall (s) | virtual (s) | requests | conversations | success | load avg before / after |")
    print("|---|---:|---:|---:|---:|---:|---|")
    out = []
    for i in range(runs):
        r = run(cmd)
        b = r["bench"]
        print(
            f"| {i + 1} | {b['wall_s']:.1f} | {r['duration_s']:.1f} | {r['total_requests']:,} | "
            f"{r['conversations']:,} | {100 * r['success_rate']:.1f} % | "
            f"{b['loadavg_before']:.2f} / {b['loadavg_after']:.2f} |"
        )
        out.append(r)
    print(f"\nmedian wall: {statistics.median(r['bench']['wall_s'] for r in out):.1f} s")
    return out


def spread(profile: Path) -> list[dict[str, Any]]:
    grid = [(1, 1.0)] + [(n, d) for n in (3, 8) for d in (0.0, 1.0, 5.0)]
    print(f"{SPREAD['deployment']}, {POLICY}, {WORKLOAD}, {SPREAD['qps']} QPS, {SPREAD['duration']} s\n")
    print(
        "| routers | view delay (s) | busiest D / mean | placements over the bound | Turn 2+ on its D | "
        "Turn 2+ KV found | Turn 1 TTFT p50 / p99 (ms) | Turn 2+ TTFT p50 / p99 (ms) | success | wall (s) | load avg |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|")
    out = []
    for routers, delay in grid:
        r = run(command(profile, **SPREAD, routers=routers, view_delay=delay))
        t1, t2, b = r["turn1"], r["turn2plus"], r["bench"]
        shown_delay = "—" if routers == 1 else f"{delay:g}"
        print(
            f"| {routers} | {shown_delay} | {r['placement_max_over_mean']:.3f} | "
            f"{100 * r['placements_over_bound']:.2f} % | {100 * r['turn2_on_own_d']:.1f} % | "
            f"{100 * r['turn2_kv_found']:.1f} % | {t1['p50_ttft_ms']:.1f} / {t1['p99_ttft_ms']:.1f} | "
            f"{t2['p50_ttft_ms']:.1f} / {t2['p99_ttft_ms']:.1f} | {100 * r['success_rate']:.1f} % | "
            f"{b['wall_s']:.1f} | {b['loadavg_before']:.2f} |"
        )
        out.append(r)
    return out


def decide(profile: Path) -> list[dict[str, Any]]:
    grid = [(1, 1.0)] + [(n, d) for n in (3, 8) for d in (0.0, 1.0, 5.0)]
    d = DECIDE
    print(f"{d['deployment']}, {d['policy']}, {d['workload']}, {d['qps']} QPS, {d['duration']} s\n")
    print(
        "| routers | view delay (s) | local / pull share | Turn 2+ TTFT mean / p99 (ms) | Turn 2+ TPOT mean (ms) | "
        "TTFT prediction error | success | wall (s) | load avg |"
    )
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|")
    out = []
    for routers, delay in grid:
        r = run(command(profile, **d, routers=routers, view_delay=delay))
        t2, b = r["turn2plus"], r["bench"]
        shown_delay = "—" if routers == 1 else f"{delay:g}"
        print(
            f"| {routers} | {shown_delay} | {r['local_share']:.2f} / {r['pull_share']:.2f} | "
            f"{t2['avg_ttft_ms']:.1f} / {t2['p99_ttft_ms']:.1f} | {t2['avg_tpot_ms']:.2f} | "
            f"{r['ttft_prediction_error']:.3f} | {100 * r['success_rate']:.1f} % | {b['wall_s']:.1f} | "
            f"{b['loadavg_before']:.2f} |"
        )
        out.append(r)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("scale", "spread", "decide"))
    ap.add_argument("--runs", type=int, default=3, help="scale: timed runs (the figure is their median)")
    ap.add_argument("--out", type=Path, help="append each result as a JSON line here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        profile = profile_toml(Path(tmp))
        if args.what == "scale":
            results = scale(profile, args.runs)
        else:
            results = spread(profile) if args.what == "spread" else decide(profile)
    if args.out:
        with args.out.open("a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
