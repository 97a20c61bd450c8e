"""Does the live emulated cluster rank the routing policies as the simulator does? (issue 17's proof)

`decision_sim.py` ranks the policies in the simulator only. This script runs a
subset of its points over real HTTP -- `ppd-router serve --emulated LAYOUT`
(the emulator runs in real time) driven by `ppd-router bench` -- and the same
points through the simulator with the same build, then compares the two
orderings of the policies per point and metric.

Points: 2P_2pD and 1P_3pD x wildchat-like and sharegpt x QPS 2, 8, 16; 10 s of
Poisson arrivals, 30 s client timeout, seed 0, one fresh router per run (the
simulator starts every point from empty nodes too). Arms: the policies of
`decision_sim.py` with weights (1, 1), plus ppd-live in its SLO mode with the
tight SLO (`ppd-live-slo`). Every live run also measures SLO attainment under
the tight SLO (`bench --slo-ttft-ms/--slo-tpot-ms`), as the simulator does
for every policy in decision_sim's `tight` setting.

    python bench/scripts/decision_live.py live --out bench/results/decision/live.jsonl
    python bench/scripts/decision_live.py sim --out bench/results/decision/live-sim.jsonl
    python bench/scripts/decision_live.py sim --client bench --out bench/results/decision/live-sim-bench-client.jsonl
    python bench/scripts/decision_live.py compare bench/results/decision/live.jsonl \\
        bench/results/decision/live-sim-bench-client.jsonl > bench/results/decision/live-summary.md

`live` is resumable: runs already in --out are skipped. The runs of a point
go one after another (arms rotated from point to point), so that a change in
the machine's load falls on all arms of a point alike; `/proc/loadavg` is
recorded before and after each run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import signal
import socket
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The sibling scripts' settings and helpers (the path line above makes them importable).
from decision_sim import LAYOUTS, SLOS
from reproduce_live import bench_point, router

TIGHT = SLOS["tight"]
LIVE_LAYOUTS = {"2P_2pD": "2P2pD", "1P_3pD": "1P3pD"}  # decision_sim's name -> --emulated
WORKLOADS = ("wildchat-like", "sharegpt")
# Low, mid, high (decision.md's sweep): at 2 the nodes are near idle and only the
# paths' own costs separate the policies; at 8 the tight-SLO attainment spreads
# most (0.39-0.74 on 1P_3pD); at 16 local's TPOT penalty is largest (5-7 %);
# past 16 the simulator's figures barely move.
QPS = (8.0, 16.0, 2.0)  # run order: the points that separate the policies first
DURATION = 10.0
TIMEOUT = 30.0

# label -> (policy, serve flags, simulate_point keywords); in priority order.
ARMS: dict[str, tuple[str, list[str], dict[str, Any]]] = {
    "pd": ("pd", [], {}),
    "local": ("local", [], {}),
    "ppd-live": ("ppd-live", ["--w-ttft", "1", "--w-tpot", "1"], {"w_ttft": 1.0, "w_tpot": 1.0}),
    "dynamo-isl": ("dynamo-isl", [], {}),
    "llmd-threshold": ("llmd-threshold", [], {}),
    "ppd-live-slo": (
        "ppd-live",
        ["--slo-ttft-ms", f"{TIGHT['ttft_ms']:g}", "--slo-tpot-ms", f"{TIGHT['tpot_ms']:g}"],
        {"slo": TIGHT},
    ),
    "fraction:0.5": ("fraction:0.5", [], {}),
    "dynamo-load": ("dynamo-load", [], {}),
    "ppd": ("ppd", ["--w-ttft", "1", "--w-tpot", "1"], {}),
}
DEFAULT_ARMS = "pd,local,ppd-live,dynamo-isl,llmd-threshold,ppd-live-slo"
# ppd-live with weights routes differently once it has SLOs: its simulated run has none,
# so the simulator has no SLO attainment for it (the live run measures one anyway).
NO_SIM_SLO = {"ppd-live"}

# Near-ties, stated before the first live run: two policies whose values differ by
# less than this are not ordered (relative for latencies, absolute for shares).
TOL = {
    "ttft": ("rel", 0.05),
    "ttft_p50": ("rel", 0.05),
    "tpot": ("rel", 0.02),
    "slo": ("abs", 0.02),
    "success": ("abs", 0.01),
}
# A run whose bench client's event loop woke this late (p99) was starved of CPU: its
# latencies are the machine's as much as the cluster's. Chosen after the first QPS-16 runs
# (loop lag p99 70-280 ms there; 8 ms at 600 streams on a quiet machine, bench-client.md).
CONTENDED_LAG_MS = 50.0
METRICS = {  # name -> (label, lower is better)
    "ttft": ("Turn-2+ mean TTFT", True),
    # Not asked for; the median shows what the mean's CPU-contention outliers do.
    "ttft_p50": ("Turn-2+ median TTFT", True),
    "tpot": ("Turn-2+ mean TPOT", True),
    "slo": ("SLO attainment (tight)", False),
    "success": ("success rate", False),
}


def points() -> list[tuple[str, str, float]]:
    return [(d, wl, q) for q in QPS for d in LIVE_LAYOUTS for wl in WORKLOADS]


def max_context() -> int:
    """The simulator cuts conversations at the profile's context length; the bench is told the same."""
    from ppd_router.simulate import max_model_len

    return max_model_len(None)


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _done(path: Path) -> set[tuple[str, str, float, str]]:
    done = set()
    if path.exists():
        for line in path.read_text().splitlines():
            m = json.loads(line)["meta"]
            done.add((m["deployment"], m["workload"], float(m["qps"]), m["arm"]))
    return done


def _rotated(arms: list[str], k: int) -> list[str]:
    k %= len(arms)
    return arms[k:] + arms[:k]


def live(out: Path, arms: list[str], duration: float, deadline: Optional[float]) -> None:
    """Each point's arms one after another, one fresh router per run; JSON lines appended to ``out``."""
    done = _done(out)
    cut = str(max_context())
    out.parent.mkdir(parents=True, exist_ok=True)
    t_all = time.time()
    for k, (dep, wl, q) in enumerate(points()):
        for arm in _rotated(arms, k):
            if (dep, wl, q, arm) in done:
                continue
            if deadline is not None and time.time() > deadline:
                print("deadline reached; rerun to resume", file=sys.stderr)
                return
            policy, flags, _ = ARMS[arm]
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            # The router's request timeout is the client's, as the simulator has it: ppd-live's
            # deadline term counts from it (left at its 600 s default, the term sees no deadline).
            cmd = ["ppd-router", "serve", "--emulated", LIVE_LAYOUTS[dep], "--policy", policy,
                   "--port", str(port), "--request-timeout", f"{TIMEOUT:g}", *flags]
            if policy == "ppd":
                cmd += ["--table", LAYOUTS[dep]]
            extra = ["--max-context", cut, "--config", dep, "--policy-label", arm,
                     "--slo-ttft-ms", f"{TIGHT['ttft_ms']:g}", "--slo-tpot-ms", f"{TIGHT['tpot_ms']:g}"]
            load0 = loadavg()
            with router(cmd, url):
                r, wall, err = bench_point(url, wl, q, duration, extra)
            if r is None:
                print(f"{dep} {wl} qps={q:g} {arm}: bench failed: {err}", file=sys.stderr)
                continue
            r["meta"].update({
                "arm": arm, "policy": policy, "serve_flags": flags, "qps": q, "backend": "live-emulated",
                "wall_s": round(wall, 1), "loadavg_before": load0, "loadavg_after": loadavg(),
                "session_started": datetime.fromtimestamp(t_all, timezone.utc).isoformat(timespec="seconds"),
                "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            })
            with out.open("a") as f:
                f.write(json.dumps(r) + "\n")
            t2 = r["turn2plus"]
            print(f"{dep} {wl} qps={q:g} {arm}: wall {wall:.0f} s, load {r['meta']['loadavg_after'][0]:.1f}, "
                  f"T2 TTFT {t2['avg_ttft_ms'] or 0:.0f} ms, TPOT {t2['avg_tpot_ms'] or 0:.2f} ms, "
                  f"SLO {r['slo_attainment']:.3f}, paths {r['paths']}", flush=True)
    print(f"live: {time.time() - t_all:.0f} s", file=sys.stderr)


# The built-in profile's [harness] and proxy costs describe the paper's measured client and
# Python proxy, not `ppd-router bench` and ppd-router: that client kept at most 52
# conversations in flight (later arrivals queue, inside their Turn-1 TTFT), its re-rendered
# history missed the cache for the previous answer, and its proxy added a hop of ~12 ms
# (+12 ms more on the local path). The emulator models none of these (it adds only the
# engine's own request overhead). `--client bench` simulates with them set to what the live
# run has: no cap, answers hit, no proxy cost (ppd-router's own is well under 1 ms,
# bench/results/overhead.md).
BENCH_CLIENT = {
    "max_conversations": "0",
    "answer_prefix_hit": "true",
    "router_hop_ms": "0.0",
    "local_path_extra_ms": "0.0",
}
PROFILE_TOML = Path("tables/engine-h100-llama3.1-8b.toml")  # the emulator's default profile


def bench_client_profile(dest: Path) -> Path:
    """The built-in profile with :data:`BENCH_CLIENT`'s settings, written to ``dest``."""
    text = PROFILE_TOML.read_text()
    for key, value in {"name": '"h100-llama3.1-8b-bench-client"', **BENCH_CLIENT}.items():
        text, n = re.subn(rf"^{key}\s*=.*$", f"{key} = {value}", text, flags=re.M)
        assert n == 1, f"{PROFILE_TOML}: {key} found {n} times"
    dest.write_text(text)
    return dest


def sim(out: Path, arms: list[str], duration: float, client: str) -> None:
    """The same points through ``simulate_point``, one JSON line per run."""
    from ppd_router.bench.workloads import ConversationFilter, load_workload
    from ppd_router.simulate import simulate_point

    flt = ConversationFilter(max_context=max_context())
    loaded = {wl: load_workload(wl, flt=flt) for wl in WORKLOADS}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, out.open("w") as f:
        profile = str(bench_client_profile(Path(tmp) / "profile.toml")) if client == "bench" else None
        for (dep, wl, q), arm in itertools.product(points(), arms):
            policy, _, kw = ARMS[arm]
            kw = dict(kw)
            if arm not in NO_SIM_SLO:
                kw.setdefault("slo", TIGHT)  # only ppd-live routes by it; the others are measured by it
            if policy == "ppd":
                kw["table"] = LAYOUTS[dep]
            r = simulate_point(deployment=dep, policy=policy, workload=wl, qps=q, duration=duration,
                               timeout=TIMEOUT, seed=0, loaded=loaded[wl], profile=profile, **kw)
            r["meta"].update({"arm": arm, "client": client})
            if client == "bench":
                r["meta"]["profile_overrides"] = BENCH_CLIENT
            f.write(json.dumps(r) + "\n")


# --- comparison ---------------------------------------------------------------------------


def metric(r: dict[str, Any], name: str) -> Optional[float]:
    """A run's value of a metric, the same definition live and simulated.

    Success counts the requests sent, as the simulator does: a live run's turns that
    were never sent (an earlier turn of their conversation failed) are left out.
    """
    if name == "ttft":
        return r["turn2plus"]["avg_ttft_ms"]
    if name == "ttft_p50":
        return r["turn2plus"]["p50_ttft_ms"]
    if name == "tpot":
        return r["turn2plus"]["avg_tpot_ms"]
    if name == "slo":
        if r["meta"]["backend"] == "simulate" and r["meta"]["arm"] in NO_SIM_SLO:
            return None
        return r.get("slo_attainment")
    ov = r.get("overall")
    if ov is None:  # simulated
        return r["success_rate"]
    sent = ov["requests"] - ov["failures"].get("not_sent", 0)
    return ov["count"] / sent if sent else None


def _cmp(a: float, b: float, name: str) -> int:
    """-1 when a is better, 1 when b is, 0 for a near-tie."""
    kind, tol = TOL[name]
    gap = tol * min(abs(a), abs(b)) if kind == "rel" else tol
    if abs(a - b) <= gap:
        return 0
    lower_better = METRICS[name][1]
    return -1 if (a < b) == lower_better else 1


def kendall_tau_b(xs: list[float], ys: list[float]) -> Optional[float]:
    """Kendall's tau-b of two paired value lists, without tolerance (None when undefined)."""
    conc = disc = tx = ty = 0
    for i, j in itertools.combinations(range(len(xs)), 2):
        dx, dy = xs[i] - xs[j], ys[i] - ys[j]
        if dx == 0 and dy == 0:
            continue
        if dx == 0:
            tx += 1
        elif dy == 0:
            ty += 1
        elif (dx > 0) == (dy > 0):
            conc += 1
        else:
            disc += 1
    den = ((conc + disc + tx) * (conc + disc + ty)) ** 0.5
    return (conc - disc) / den if den else None


def order(vals: dict[str, float], name: str) -> str:
    """Policies best first; ``≈`` joins a policy to the previous one when within tolerance of it."""
    ps = sorted(vals, key=lambda p: vals[p], reverse=not METRICS[name][1])
    out = ps[0]
    for a, b in itertools.pairwise(ps):
        out += (" ≈ " if _cmp(vals[a], vals[b], name) == 0 else " > ") + b
    return out


def compare_point(lv: dict[str, float], sv: dict[str, float], name: str) -> dict[str, Any]:
    """Pairwise agreement (near-ties on either side count as agreement), best-policy agreement, tau-b."""
    arms = sorted(set(lv) & set(sv))
    pairs = agree = sim_ordered = same = tied = 0
    flips = []
    for a, b in itertools.combinations(arms, 2):
        s, l_ = _cmp(sv[a], sv[b], name), _cmp(lv[a], lv[b], name)
        pairs += 1
        if s != 0:  # what the simulator orders: does live order it the same way, tie it, or reverse it?
            sim_ordered += 1
            same += s == l_
            tied += l_ == 0
        if s * l_ >= 0:
            agree += 1
        else:
            flips.append(f"{a}/{b}")

    def best(v: dict[str, float]) -> str:
        return min(arms, key=lambda p: v[p]) if METRICS[name][1] else max(arms, key=lambda p: v[p])

    def near(v: dict[str, float], p: str) -> bool:
        return _cmp(v[p], v[best(v)], name) == 0

    # The same best: one side's winner is within tolerance of the best on the other side.
    best_same = near(lv, best(sv)) or near(sv, best(lv))

    def label(v: dict[str, float]) -> str:
        return "all ≈" if all(near(v, p) for p in arms) else best(v)

    return {
        "arms": len(arms), "pairs": pairs, "agree": agree, "sim_ordered": sim_ordered, "same": same, "tied": tied,
        "flips": flips, "best_agrees": best_same, "sim_best": label(sv), "live_best": label(lv),
        "tau": kendall_tau_b([lv[a] for a in arms], [sv[a] for a in arms]),
        "sim_order": order({a: sv[a] for a in arms}, name), "live_order": order({a: lv[a] for a in arms}, name),
    }


def _load(path: Path) -> dict[tuple[str, str, float], dict[str, dict[str, Any]]]:
    by: dict[tuple[str, str, float], dict[str, dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        m = r["meta"]
        by.setdefault((m["deployment"], m["workload"], float(m["qps"])), {})[m["arm"]] = r  # last wins
    return by


def _values(runs: dict[str, dict[str, Any]], name: str) -> dict[str, float]:
    return {a: v for a, r in runs.items() if (v := metric(r, name)) is not None}


def _fmt(v: Optional[float], name: str) -> str:
    if v is None:
        return "–"
    return f"{v:.0f}" if name.startswith("ttft") else f"{v:.2f}" if name == "tpot" else f"{v:.3f}"


def _share(r: dict[str, Any]) -> str:
    """Turn-2+ local and pull shares."""
    if r["meta"]["backend"] == "simulate":
        return f"{r['local_share']:.2f}, {r.get('pull_share', 0.0):.2f}"
    paths = r.get("paths") or {}
    n = sum(paths.values())
    return f"{paths.get('local', 0) / n:.2f}, {paths.get('pull', 0) / n:.2f}" if n else "–"


def _agreement(per: dict[str, list[tuple[tuple[str, str, float], dict[str, Any]]]],
               keys: set[tuple[str, str, float]]) -> list[str]:
    """The agreement table over ``keys``."""
    out = [
        "| metric | points | same best (near-ties) | pairs agreeing (near-ties count) "
        "| pairs the simulator orders: live same / tied / reversed | mean Kendall tau-b (no tolerance) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for n, rows in per.items():
        c = [r for k, r in rows if k in keys]
        if not c:
            continue
        taus = [r["tau"] for r in c if r["tau"] is not None]
        tau = f"{sum(taus) / len(taus):.2f} ({len(taus)} points)" if taus else "–"
        pairs, agree = sum(r["pairs"] for r in c), sum(r["agree"] for r in c)
        so, same, tied = (sum(r[k] for r in c) for k in ("sim_ordered", "same", "tied"))
        best = sum(r["best_agrees"] for r in c)
        share = f"{100 * agree / max(1, pairs):.0f} %"
        out.append(f"| {METRICS[n][0]} | {len(c)} | {best}/{len(c)} | {agree}/{pairs} ({share}) "
                   f"| {so}: {same} / {tied} / {so - same - tied} | {tau} |")
    return out


def compare(live_path: Path, sim_path: Path) -> str:
    lv_all, sv_all = _load(live_path), _load(sim_path)
    keys = [k for k in sorted(lv_all, key=lambda k: (k[0], k[1], k[2])) if k in sv_all]
    loads = [x for runs in lv_all.values() for r in runs.values()
             for x in (r["meta"]["loadavg_before"][0], r["meta"]["loadavg_after"][0])]
    walls = [r["meta"]["wall_s"] for runs in lv_all.values() for r in runs.values()]
    out = [
        f"Live runs: {sum(len(v) for v in lv_all.values())} at {len(lv_all)} points, "
        f"{sum(walls) / 60:.0f} min of bench wall time; 1-min load average {min(loads):.1f}–{max(loads):.1f} "
        f"(median {sorted(loads)[len(loads) // 2]:.1f}) before/after the runs.",
        "",
        "Near-ties (not ordered): " + ", ".join(
            f"{METRICS[n][0]} {100 * t:g} %" if k == "rel" else f"{METRICS[n][0]} {t:g}"
            for n, (k, t) in TOL.items()) + ".",
        "",
    ]
    per: dict[str, list[tuple[tuple[str, str, float], dict[str, Any]]]] = {n: [] for n in METRICS}
    for k in keys:
        for n in METRICS:
            lv, sv = _values(lv_all[k], n), _values(sv_all[k], n)
            if len(set(lv) & set(sv)) >= 2:
                per[n].append((k, compare_point(lv, sv, n)))
    lag = {k: max(r["client"]["loop_lag_p99_ms"] or 0.0 for r in lv_all[k].values()) for k in keys}
    calm = {k for k in keys if lag[k] <= CONTENDED_LAG_MS}
    out += ["## Agreement per metric, all points", "", *_agreement(per, set(keys)), "",
            f"## Agreement per metric, the points where every live run's client loop lag p99 was ≤ "
            f"{CONTENDED_LAG_MS:g} ms", "",
            f"{len(calm)} of {len(keys)} points: " + ", ".join(f"{k[0]} {k[1]} {k[2]:g}" for k in keys if k in calm)
            + ".", "", *_agreement(per, calm)]
    out += ["", "## Per point: best policy simulator / live (✓ the same within tolerance), pairs agreeing", "",
            "| point | " + " | ".join(METRICS[n][0] for n in METRICS) + " |", "|---|" + "---|" * len(METRICS)]
    for k in keys:
        cells = []
        for n in METRICS:
            r = next((r for kk, r in per[n] if kk == k), None)
            mark = "✓" if r is not None and r["best_agrees"] else "✗"
            cells.append("–" if r is None else f"{r['sim_best']} / {r['live_best']} {mark}, {r['agree']}/{r['pairs']}")
        out.append(f"| {k[0]} {k[1]} {k[2]:g} | " + " | ".join(cells) + " |")
    out += ["", "## Orders per point (best first; `≈` within tolerance)", "",
            "| point | metric | simulator | live | pairs agreeing | flipped pairs |", "|---|---|---|---|---:|---|"]
    for n, rows in per.items():
        for (dep, wl, q), r in rows:
            out.append(f"| {dep} {wl} {q:g} | {n} | {r['sim_order']} | {r['live_order']} | {r['agree']}/{r['pairs']} "
                       f"| {', '.join(r['flips']) or '–'} |")
    out += ["", "## Values, live / simulator", "",
            "| point | arm | T2+ TTFT ms | T2+ TTFT p50 ms | T2+ TPOT ms | SLO attainment | success "
            "| T2+ local, pull share | load before → after | client loop lag p99 ms | wall s |",
            "|---|---|---|---|---|---|---|---|---|---:|---:|"]
    for k in keys:
        for arm in ARMS:
            lr, sr = lv_all[k].get(arm), sv_all[k].get(arm)
            if lr is None or sr is None:
                continue
            cells = [f"{_fmt(metric(lr, n), n)} / {_fmt(metric(sr, n), n)}" for n in METRICS]
            lb, la = lr["meta"]["loadavg_before"][0], lr["meta"]["loadavg_after"][0]
            out.append(f"| {k[0]} {k[1]} {k[2]:g} | {arm} | " + " | ".join(cells)
                       + f" | {_share(lr)} / {_share(sr)} | {lb:.1f} → {la:.1f} "
                       f"| {lr['client']['loop_lag_p99_ms']:.0f} | {lr['meta']['wall_s']:.0f} |")
    return "\n".join(out)


def _stop_on_sigterm() -> None:
    """SIGTERM ends the run like Ctrl-C, so the router started last is stopped too."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("live", "sim"):
        p = sub.add_parser(name)
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma list of {', '.join(ARMS)}")
        p.add_argument("--duration", type=float, default=DURATION, help="seconds of arrivals per point")
        if name == "sim":
            p.add_argument("--client", choices=("paper", "bench"), default="paper",
                           help="paper: the built-in profile as decision_sim.py runs it; bench: the live run's client")
        if name == "live":
            p.add_argument("--stop-after", type=float, default=None,
                           help="start no new run after this many minutes (rerun to resume)")
    p = sub.add_parser("compare")
    p.add_argument("live_jsonl", type=Path)
    p.add_argument("sim_jsonl", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "compare":
        print(compare(a.live_jsonl, a.sim_jsonl))
        return 0
    arms = a.arms.split(",")
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}")
    if a.cmd == "sim":
        sim(a.out, arms, a.duration, a.client)
        return 0
    _stop_on_sigterm()
    deadline = None if a.stop_after is None else time.time() + 60 * a.stop_after
    try:
        live(a.out, arms, a.duration, deadline)
    except KeyboardInterrupt:
        print("interrupted; rerun to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
