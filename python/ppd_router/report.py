"""``ppd-router report``: the paper's tables and figures from result files.

Inputs (any mix):

* CSV files with ``shared/data/ppd-h100/sweep.csv``'s columns (``bench --csv``,
  the measured sweep itself, the reproduction scripts' CSVs), optionally with the
  extra columns ``policy``, ``local_share``, ``w_ttft``, ``w_tpot``, ``backend``;
* JSON result objects (``bench --out``, ``simulate --json``), one per file, a JSON
  array of them, or JSON lines. An object names its point in a ``meta`` object
  (or at top level): ``deployment`` (or ``config``), ``workload``, ``qps`` and,
  optionally, ``policy`` and ``w_tpot``.

Every row is classified into a mode from its configuration and policy: ``Replica``
(all R), ``hybrid`` (R with P/D), ``x=0`` (policy pd, or only D decode nodes),
``x=1`` (policy local on pD only), ``0<x<1`` (D and pD mixed, or fraction:X) and
``PPD`` (policy ppd). Configurations pair across modes by their P and decode
counts (``1P_3D`` and ``1P_3pD`` are both the 1P_3D configuration).

Tables (rules, so the numbers can be checked by hand):

* Table 1: for each configuration pair and QPS band (low 0.5–2, med 4–8, high
  12–20, as the paper's columns; 10 falls in none), the mean over (workload, QPS)
  points of 100·(TTFT₂(x=1) − TTFT₂(x=0)) / TTFT₂(x=0), Turn-2 mean TTFT.
* Table 2: for each (workload, QPS) combination, the winner among all rows of
  that combination except PPD: least Turn-2 mean TTFT, least Turn-2 mean TPOT,
  most tokens/s; each mode's share of the combinations; ``Avg`` is the mean of
  the three. Ties credit every tied row's mode.
* Table 3: for each (configuration pair, workload, QPS) with x=0, x=1 and PPD
  all present: who has the least Turn-2 mean TPOT, the least Turn-2 mean TTFT
  (ties credit each), and which have a 100 % success rate.
* Policies side by side (when several policies ran the same points): per
  policy, its points, mean Turn-2 TTFT and TPOT, success rate and — for
  results that carry one (``simulate`` with SLOs) — SLO attainment per SLO;
  and for every pair (A, B), over the points both ran (same configuration,
  workload, QPS, weights and SLO): where A's Turn-2 mean TTFT is below B's,
  its TPOT below B's, both, and its SLO attainment above B's.

Policies beyond the paper's modes (``ppd-live``, ``pull``, the anchors'
``dynamo-isl``, ``dynamo-load``, ``llmd-threshold``) take part in the
side-by-side tables only.

Rows with no successful Turn-2 request take part in no TTFT/TPOT contest.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import orjson

from ppd_router import _core
from ppd_router.bench.metrics import SWEEP_COLUMNS
from ppd_router.errors import ConfigError, ReportError

MODES = ("Replica", "x=0", "0<x<1", "x=1", "PPD", "hybrid")
# Policies that are no mode of the paper: compared side by side only.
OTHER_POLICIES = ("ppd-live", "pull", "dynamo-isl", "dynamo-load", "llmd-threshold")
BANDS: dict[str, tuple[float, float]] = {"low": (0.5, 2.0), "med": (4.0, 8.0), "high": (12.0, 20.0)}
CLASSES: dict[str, tuple[str, ...]] = {
    "decode-heavy": ("tiny", "short_gen", "long_gen", "very_long_gen"),
    "balanced": ("small_bal", "mid_bal"),
    "prefill-heavy": ("mid_paste", "big_paste", "huge_paste"),
}
# The paper's published tables (Tables 1–3), shown beside ours for reference.
PAPER_TABLE1 = {"1P_3D": (-57.8, -65.2, -73.3), "2P_2D": (-47.7, -51.6, -56.2), "3P_1D": (-44.3, -38.1, -24.9)}
PAPER_TABLE2 = {
    "Replica": (63.3, 0.6, 0.0, 21.3),
    "x=0": (0.0, 38.3, 4.4, 14.2),
    "0<x<1": (3.3, 33.3, 27.8, 21.5),
    "x=1": (27.2, 15.6, 38.3, 27.0),
}
PAPER_TABLE3 = {"x=0": (10, 0, 4), "x=1": (5, 13, 27), "PPD": (12, 14, 27)}  # of 27


@dataclass
class Row:
    """One measured or simulated point, reduced to what the tables and plots use."""

    config: str  # paper notation, e.g. 1P_3pD
    policy: str  # "" when the configuration's roles define x (sweep.csv)
    workload: str  # small_tiny, sharegpt, ...
    qps: float
    t2_count: float
    t2_avg_ttft: float
    t2_p99_ttft: float
    t2_avg_tpot: float
    t1_count: float
    t1_avg_e2e: float
    t2_avg_e2e: float
    tokens_per_sec: float
    success_rate: float  # 0..1
    local_share: Optional[float] = None
    w_tpot: float = 1.0
    source: str = ""
    # Share of requests that met both SLOs, and the SLOs as a label ("" without).
    slo_attainment: Optional[float] = None
    slo: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return mode_of(self.config, self.policy)

    @property
    def pair(self) -> str:
        return pair_key(self.config)

    @property
    def t2_type(self) -> str:
        return self.workload.split("_", 1)[1] if self.workload.startswith(("small_", "large_")) else self.workload

    @property
    def avg_e2e(self) -> float:
        """Mean end-to-end latency over all successful requests (both turn classes)."""
        n = self.t1_count + self.t2_count
        return (self.t1_avg_e2e * self.t1_count + self.t2_avg_e2e * self.t2_count) / n if n else math.nan


def _layout(config: str) -> list[str]:
    """The node roles of a configuration, by the core's layout grammar."""
    try:
        return _core.parse_layout(config)
    except ConfigError:
        raise ReportError(f"unknown configuration {config!r}; expected e.g. 1P_3pD, 2P2D, 4R") from None


def roles(config: str) -> dict[str, int]:
    """Node counts of a configuration in the paper's or the CLI's notation (1P_3pD, 1P3pD)."""
    counts = dict.fromkeys(_core.ROLES, 0)
    for r in _layout(config):
        counts[r] += 1
    return counts


def canonical(config: str) -> str:
    """``1P3pD`` → ``1P_3pD``; the order P, D, pD, R is kept as written. A name that is not a
    layout is kept as it is, so the error that classifying it raises names it."""
    try:
        layout = _layout(config)
    except ReportError:
        return config
    return "_".join(f"{len(list(run))}{role}" for role, run in itertools.groupby(layout))


def pair_key(config: str) -> str:
    r = roles(config)
    key = f"{r['P']}P_{r['D'] + r['pD']}D"
    return f"{r['R']}R_{key}" if r["R"] else key


def mode_of(config: str, policy: str) -> str:
    if policy in OTHER_POLICIES:
        return "other"
    r = roles(config)
    decode = r["D"] + r["pD"]
    if policy == "ppd":
        return "PPD"
    if r["R"] and not (r["P"] or decode):
        return "Replica"
    if r["R"]:
        return "hybrid"
    if policy == "pd" or r["pD"] == 0:
        return "x=0"
    if policy.startswith("fraction:"):
        x = float(policy.split(":", 1)[1])
        return "x=0" if x <= 0 else ("x=1" if x >= 1 and r["D"] == 0 else "0<x<1")
    return "x=1" if r["D"] == 0 else "0<x<1"


# --- reading ------------------------------------------------------------------


def _num(v: Any, what: str, path: Path) -> float:
    if v is None or v == "":
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ReportError(f"{path}: {what} is not a number: {v!r}") from None


def _csv_rows(path: Path, source: str) -> list[Row]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in SWEEP_COLUMNS if c != "error" and c not in (reader.fieldnames or [])]
        if missing:
            raise ReportError(f"{path}: not a sweep.csv-style file (missing {', '.join(missing[:4])})")
        out = []
        for i, r in enumerate(reader, 2):
            where = f"line {i}"
            t1 = r["t1_context"]
            wl = f"{t1}_{r['t2_workload']}" if t1 else r["t2_workload"]
            out.append(
                Row(
                    config=canonical(r["config"]),
                    policy=(r.get("policy") or "").strip(),
                    workload=wl,
                    qps=_num(r["qps"], f"{where} qps", path),
                    t2_count=_num(r["turn2_count"], where, path),
                    t2_avg_ttft=_num(r["turn2_avg_ttft_ms"], where, path),
                    t2_p99_ttft=_num(r["turn2_p99_ttft_ms"], where, path),
                    t2_avg_tpot=_num(r["turn2_avg_tpot_ms"], where, path),
                    t1_count=_num(r["turn1_count"], where, path),
                    t1_avg_e2e=_num(r["turn1_avg_e2e_ms"], where, path),
                    t2_avg_e2e=_num(r["turn2_avg_e2e_ms"], where, path),
                    tokens_per_sec=_num(r["tokens_per_sec"], where, path),
                    success_rate=_num(r["success_rate_pct"], where, path) / 100.0,
                    local_share=None if not r.get("local_share") else _num(r["local_share"], where, path),
                    w_tpot=1.0 if not r.get("w_tpot") else _num(r["w_tpot"], where, path),
                    source=source,
                )
            )
    return out


def _json_row(obj: Any, path: Path, source: str) -> Row:
    if not isinstance(obj, dict) or not {"turn1", "turn2plus", "throughput"} <= set(obj):
        raise ReportError(f"{path}: not a bench/simulate result object")
    meta_obj = obj.get("meta")
    meta: dict[str, Any] = meta_obj if isinstance(meta_obj, dict) else obj
    config = meta.get("deployment") or meta.get("config")
    if not config or meta.get("workload") is None or meta.get("qps") is None:
        raise ReportError(f"{path}: result without deployment/config, workload and qps (put them in a 'meta' object)")
    t1, t2 = obj["turn1"], obj["turn2plus"]

    def g(d: dict[str, Any], k: str) -> float:
        return _num(d.get(k), k, path)

    sr = obj.get("success_rate")
    slo = meta.get("slo")
    slo_label = f"TTFT ≤ {slo['ttft_ms']:g} ms, TPOT ≤ {slo['tpot_ms']:g} ms" if isinstance(slo, dict) else ""
    return Row(
        config=canonical(str(config)),
        policy=str(meta.get("policy") or ""),
        workload=str(meta["workload"]),
        qps=_num(meta["qps"], "qps", path),
        t2_count=g(t2, "count"),
        t2_avg_ttft=g(t2, "avg_ttft_ms"),
        t2_p99_ttft=g(t2, "p99_ttft_ms"),
        t2_avg_tpot=g(t2, "avg_tpot_ms"),
        t1_count=g(t1, "count"),
        t1_avg_e2e=g(t1, "avg_e2e_ms"),
        t2_avg_e2e=g(t2, "avg_e2e_ms"),
        tokens_per_sec=g(obj["throughput"], "tokens_per_sec"),
        success_rate=math.nan if sr is None else float(sr),
        local_share=obj.get("local_share"),
        w_tpot=float(meta.get("w_tpot", 1.0)),
        source=source,
        extra={"wall_s": meta.get("wall_s")},
        slo_attainment=obj.get("slo_attainment") if slo_label else None,
        slo=slo_label,
    )


def load_rows(path: Path, source: Optional[str] = None) -> list[Row]:
    """All result rows of one file (CSV by extension ``.csv``, else JSON / JSON lines)."""
    src = source or path.stem
    if path.suffix.lower() == ".csv":
        return _csv_rows(path, src)
    data = path.read_bytes()
    try:
        doc = orjson.loads(data)
        objs = doc if isinstance(doc, list) else [doc]
    except orjson.JSONDecodeError:
        try:
            objs = [orjson.loads(line) for line in data.splitlines() if line.strip()]
        except orjson.JSONDecodeError as e:
            raise ReportError(f"{path}: neither JSON nor JSON lines ({e})") from None
    return [_json_row(o, path, src) for o in objs]


# --- tables -------------------------------------------------------------------


def _ok(v: float) -> bool:
    return not math.isnan(v) and v > 0


def table1(rows: Sequence[Row]) -> dict[str, dict[str, Optional[float]]]:
    """{pair: {band: mean % change of Turn-2 mean TTFT from x=0 to x=1, or None}}."""
    x0 = {(r.pair, r.workload, r.qps): r for r in rows if r.mode == "x=0" and not roles(r.config)["R"]}
    x1 = {(r.pair, r.workload, r.qps): r for r in rows if r.mode == "x=1"}
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for key, a in x0.items():
        b = x1.get(key)
        if b is None or a.t2_count <= 0 or b.t2_count <= 0:
            continue
        if not (_ok(a.t2_avg_ttft) and _ok(b.t2_avg_ttft)):
            continue
        for band, (lo, hi) in BANDS.items():
            if lo <= a.qps <= hi:
                acc[key[0]][band].append(100.0 * (b.t2_avg_ttft - a.t2_avg_ttft) / a.t2_avg_ttft)
    return {
        pair: {band: (sum(v) / len(v) if (v := acc[pair][band]) else None) for band in BANDS} for pair in sorted(acc)
    }


def _winners(cands: Sequence[Row], key: Callable[[Row], float], best: Callable) -> list[Row]:
    vals = [(key(r), r) for r in cands if r.t2_count > 0 and not math.isnan(key(r))]
    if not vals:
        return []
    b = best(v for v, _ in vals)
    return [r for v, r in vals if v == b]


def table2(rows: Sequence[Row]) -> tuple[dict[str, tuple[float, float, float, float]], int]:
    """{mode: (% TTFT wins, % TPOT wins, % throughput wins, average)}, number of combinations."""
    groups: dict[tuple[str, float], list[Row]] = defaultdict(list)
    for r in rows:
        if r.mode not in ("PPD", "other"):
            groups[(r.workload, r.qps)].append(r)
    wins = {m: [0, 0, 0] for m in MODES if m != "PPD"}
    objectives = [(lambda r: r.t2_avg_ttft, min), (lambda r: r.t2_avg_tpot, min), (lambda r: r.tokens_per_sec, max)]
    for cands in groups.values():
        for i, (key, best) in enumerate(objectives):
            for m in {r.mode for r in _winners(cands, key, best)}:
                wins[m][i] += 1
    n = len(groups)
    out = {}
    for m, w in wins.items():
        pct = [100.0 * x / n if n else 0.0 for x in w]
        out[m] = (pct[0], pct[1], pct[2], sum(pct) / 3)
    return out, n


def table3(rows: Sequence[Row], workload: Optional[str] = None) -> tuple[dict[str, tuple[int, int, int]], int]:
    """{mode: (TPOT best, TTFT best, SR = 100 %)} over points with x=0, x=1 and PPD all present."""
    groups: dict[tuple[str, str, float], dict[str, Row]] = defaultdict(dict)
    for r in rows:
        if r.mode in ("x=0", "x=1", "PPD") and (workload is None or r.workload == workload):
            groups[(r.pair, r.workload, r.qps)][r.mode] = r
    counts = {m: [0, 0, 0] for m in ("x=0", "x=1", "PPD")}
    n = 0
    for g in groups.values():
        if len(g) < 3:
            continue
        n += 1
        cands = list(g.values())
        for i, key in ((0, lambda r: r.t2_avg_tpot), (1, lambda r: r.t2_avg_ttft)):
            for r in _winners(cands, key, min):
                counts[r.mode][i] += 1
        for r in cands:
            if r.success_rate >= 1.0 - 1e-9:
                counts[r.mode][2] += 1
    return {m: (c[0], c[1], c[2]) for m, c in counts.items()}, n


def _label(r: Row) -> str:
    return r.policy or r.mode


def policy_summary(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Per policy (and SLO): points, mean Turn-2 TTFT / TPOT, mean success rate, mean SLO attainment."""
    by: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in rows:
        by[(_label(r), r.slo)].append(r)
    out = []
    for (pol, slo), rs in sorted(by.items()):
        ok = [r for r in rs if r.t2_count > 0]
        att = [r.slo_attainment for r in rs if r.slo_attainment is not None]
        out.append(
            {
                "policy": pol,
                "slo": slo,
                "points": len(rs),
                "ttft_ms": sum(r.t2_avg_ttft for r in ok) / len(ok) if ok else math.nan,
                "tpot_ms": sum(r.t2_avg_tpot for r in ok) / len(ok) if ok else math.nan,
                "success": sum(r.success_rate for r in rs) / len(rs),
                "slo_attainment": sum(att) / len(att) if att else None,
            }
        )
    return out


def pair_wins(rows: Sequence[Row]) -> dict[tuple[str, str], tuple[int, int, int, int, int]]:
    """{(A, B): (points both ran, A's TTFT lower, A's TPOT lower, both lower, A's SLO attainment higher)}."""
    points: dict[tuple[str, str, float, float, str], dict[str, Row]] = defaultdict(dict)
    for r in rows:
        points[(r.config, r.workload, r.qps, r.w_tpot, r.slo)][_label(r)] = r
    acc: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for g in points.values():
        for a, b in itertools.permutations(sorted(g), 2):
            ra, rb = g[a], g[b]
            c = acc[(a, b)]
            c[0] += 1
            if ra.t2_count <= 0 or rb.t2_count <= 0:
                continue
            ttft = ra.t2_avg_ttft < rb.t2_avg_ttft
            tpot = ra.t2_avg_tpot < rb.t2_avg_tpot
            c[1] += ttft
            c[2] += tpot
            c[3] += ttft and tpot
            if ra.slo_attainment is not None and rb.slo_attainment is not None:
                c[4] += ra.slo_attainment > rb.slo_attainment
    return {k: (v[0], v[1], v[2], v[3], v[4]) for k, v in sorted(acc.items())}


def md_policies(rows: Sequence[Row]) -> str:
    lines = [
        "| policy | SLO | points | Turn-2 TTFT ms | Turn-2 TPOT ms | success | SLO attainment |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for p in policy_summary(rows):
        att = "–" if p["slo_attainment"] is None else f"{100 * p['slo_attainment']:.1f} %"
        lines.append(
            f"| {p['policy']} | {p['slo'] or '–'} | {p['points']} | {p['ttft_ms']:.1f} | {p['tpot_ms']:.2f} "
            f"| {100 * p['success']:.1f} % | {att} |"
        )
    lines += [
        "",
        "Wins of A over B, over the points both ran: lower Turn-2 TTFT / lower TPOT / both / higher SLO attainment.",
        "",
        "| A | B | points | TTFT | TPOT | both | SLO |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for (a, b), (n, ttft, tpot, both, slo) in pair_wins(rows).items():
        lines.append(f"| {a} | {b} | {n} | {ttft} | {tpot} | {both} | {slo} |")
    return "\n".join(lines)


# --- markdown -----------------------------------------------------------------


def _pct(v: Optional[float]) -> str:
    return "–" if v is None else f"{v:+.1f} %"


def md_table1(t1: dict[str, dict[str, Optional[float]]], paper: bool = True) -> str:
    lines = [
        "| config: x=0 → x=1 | low QPS (0.5–2) | med QPS (4–8) | high QPS (12–20) |"
        + (" paper low / med / high |" if paper else ""),
        "|---|---:|---:|---:|" + ("---|" if paper else ""),
    ]
    for pair, bands in t1.items():
        ref = PAPER_TABLE1.get(pair)
        cells = [_pct(bands[b]) for b in BANDS]
        extra = (" " + " / ".join(f"{v:+.1f} %" for v in ref) + " |" if ref else " – |") if paper else ""
        lines.append(f"| {pair} | " + " | ".join(cells) + " |" + extra)
    return "\n".join(lines)


def md_table2(t2: dict[str, tuple[float, float, float, float]], n: int, paper: bool = True) -> str:
    lines = [
        f"| mode ({n} combinations) | TTFT | TPOT | Thpt | Avg |"
        + (" paper TTFT / TPOT / Thpt / Avg |" if paper else ""),
        "|---|---:|---:|---:|---:|" + ("---|" if paper else ""),
    ]
    for m, v in t2.items():
        ref = PAPER_TABLE2.get(m)
        extra = ((" " + " / ".join(f"{x:.1f} %" for x in ref) + " |") if ref else " – |") if paper else ""
        lines.append(f"| {m} | " + " | ".join(f"{x:.1f} %" for x in v) + " |" + extra)
    return "\n".join(lines)


def md_table3(t3: dict[str, tuple[int, int, int]], n: int, paper: bool = True) -> str:
    lines = [
        "| mode | TPOT best | TTFT best | SR = 100 % |" + (" paper (of 27) |" if paper else ""),
        "|---|---:|---:|---:|" + ("---|" if paper else ""),
    ]
    for m, (a, b, c) in t3.items():
        ref = PAPER_TABLE3[m]
        extra = f" {ref[0]} / {ref[1]} / {ref[2]} |" if paper else ""
        lines.append(f"| {m} | {a}/{n} | {b}/{n} | {c}/{n} |" + extra)
    return "\n".join(lines)


# --- figures ------------------------------------------------------------------

_COLORS = {
    "Replica": "tab:orange",
    "x=0": "tab:orange",
    "hybrid": "0.6",
    "0<x<1": "tab:blue",
    "x=1": "tab:blue",
    "PPD": "tab:green",
}
_MARKERS = {"Replica": "s", "x=0": "o", "hybrid": "x", "0<x<1": "^", "x=1": "D", "PPD": "*"}


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ReportError("plots need matplotlib: pip install 'ppd-router[report]'") from e
    matplotlib.use("Agg")  # files only; no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Pareto frontier for (TPS up, TTFT down): sorted by TPS descending, keep each new TTFT low."""
    best = math.inf
    out = []
    for tps, ttft in sorted(points, key=lambda p: (-p[0], p[1])):
        if ttft < best:
            out.append((tps, ttft))
            best = ttft
    return out


def plot_pareto(rows: Sequence[Row], path: Path, title: str, qps_levels: Sequence[float] = (2, 8, 20)) -> bool:
    """Paper Figure 9: per workload class (columns) and QPS (rows), each configuration's
    mean Turn-2 P99 TTFT vs mean tokens/s over the class's synthetic workloads."""
    plt = _plt()
    fig, axes = plt.subplots(len(qps_levels), len(CLASSES), figsize=(13, 3.4 * len(qps_levels)), squeeze=False)
    any_point = False
    for i, q in enumerate(qps_levels):
        for j, (cls, types) in enumerate(CLASSES.items()):
            ax = axes[i][j]
            acc: dict[tuple[str, str], list[Row]] = defaultdict(list)
            for r in rows:
                if r.qps == q and r.t2_type in types and r.workload != r.t2_type and r.t2_count > 0:
                    acc[(r.config, r.policy)].append(r)
            pts = []
            for (cfg, pol), rs in sorted(acc.items()):
                tps = sum(r.tokens_per_sec for r in rs) / len(rs)
                ttft = sum(r.t2_p99_ttft for r in rs) / len(rs)
                m = rs[0].mode
                label = cfg + (f" {pol}" if pol and pol not in ("local", "replica") else "")
                style = {"edgecolors": "k", "s": 90} if m == "PPD" else {"s": 28}
                ax.scatter(tps, ttft, color=_COLORS[m], marker=_MARKERS[m], zorder=3, **style)
                ax.annotate(label, (tps, ttft), fontsize=6, xytext=(2, 2), textcoords="offset points")
                pts.append((tps, ttft))
                any_point = True
            fr = _frontier(pts)
            if len(fr) > 1:
                ax.plot([p[0] for p in fr], [p[1] for p in fr], "k--", lw=0.8, zorder=2)
            ax.set_title(f"{cls}, QPS={q:g}", fontsize=9)
            ax.set_yscale("log")
            if i == len(qps_levels) - 1:
                ax.set_xlabel("tokens/s")
            if j == 0:
                ax.set_ylabel("Turn-2 P99 TTFT (ms)")
    handles = [plt.Line2D([], [], ls="", marker=_MARKERS[m], color=_COLORS[m], label=m) for m in MODES]
    fig.suptitle(title, y=0.995, fontsize=10)
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.975), ncol=len(MODES), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    if any_point:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return any_point


def plot_latency_vs_qps(rows: Sequence[Row], path: Path, workloads: Sequence[str], title: str) -> bool:
    """Paper Figures 4/11: mean E2E latency vs QPS per configuration pair, one line per
    mode, × where the success rate is below 95 %."""
    plt = _plt()
    pairs = sorted({r.pair for r in rows if r.workload in workloads and r.mode in ("x=0", "x=1", "PPD")})
    if not pairs:
        return False
    fig, axes = plt.subplots(
        len(workloads), len(pairs), figsize=(4.3 * len(pairs), 3.4 * len(workloads)), squeeze=False
    )
    styles = {"x=0": ("tab:blue", "--", "o"), "x=1": ("tab:orange", "-", "^"), "PPD": ("tab:green", "-", "s")}
    for i, wl in enumerate(workloads):
        for j, pair in enumerate(pairs):
            ax = axes[i][j]
            for mode, (col, ls, mk) in styles.items():
                rs = sorted(
                    (r for r in rows if r.workload == wl and r.pair == pair and r.mode == mode and r.w_tpot == 1.0),
                    key=lambda r: r.qps,
                )
                if not rs:
                    continue
                ax.plot(
                    [r.qps for r in rs], [r.avg_e2e / 1000 for r in rs], ls=ls, color=col, marker=mk, ms=4, label=mode
                )
                bad = [r for r in rs if r.success_rate < 0.95]
                ax.scatter(
                    [r.qps for r in bad],
                    [r.avg_e2e / 1000 for r in bad],
                    marker="x",
                    s=70,
                    color="red",
                    zorder=4,
                    label=f"{mode} SR < 95 %" if bad else None,
                )
            ax.set_title(f"{pair}, {wl}", fontsize=9)
            ax.set_xlabel("QPS")
            if j == 0:
                ax.set_ylabel("mean E2E latency (s)")
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def wtpot_points(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Figure 6's operating points: per (QPS, policy, w_tpot) the mean Turn-2 TTFT, TPOT
    and local share over the rows (one configuration, a prefill-heavy slice)."""
    acc: dict[tuple[float, str, float], list[Row]] = defaultdict(list)
    for r in rows:
        if r.t2_count > 0:
            acc[(r.qps, r.policy, r.w_tpot if r.policy == "ppd" else 0.0)].append(r)
    out = []
    for (q, pol, w), rs in sorted(acc.items()):
        shares = [r.local_share for r in rs if r.local_share is not None]
        out.append(
            {
                "qps": q,
                "policy": pol,
                "w_tpot": w if pol == "ppd" else None,
                "ttft_ms": sum(r.t2_avg_ttft for r in rs) / len(rs),
                "tpot_ms": sum(r.t2_avg_tpot for r in rs) / len(rs),
                "local_share": sum(shares) / len(shares) if shares else None,
                "points": len(rs),
            }
        )
    return out


def plot_wtpot(points: list[dict[str, Any]], path: Path, title: str) -> bool:
    plt = _plt()
    qs = sorted({p["qps"] for p in points})
    if not qs:
        return False
    fig, axes = plt.subplots(1, len(qs), figsize=(5.5 * len(qs), 4), squeeze=False)
    for ax, q in zip(axes[0], qs):
        ps = [p for p in points if p["qps"] == q]
        # Points that coincide (e.g. every w_tpot that keeps 100 % local) share one label.
        spots: dict[tuple[float, float], list[dict[str, Any]]] = defaultdict(list)
        for p in ps:
            spots[(round(p["tpot_ms"], 2), round(p["ttft_ms"], 1))].append(p)
        for (x, y), group in spots.items():
            names = [g["policy"] if g["policy"] != "ppd" else f"w_tpot={g['w_tpot']:g}" for g in group]
            share = group[0]["local_share"]
            label = ", ".join(names) + ("" if share is None else f" ({100 * share:.0f} % local)")
            col = {"pd": "tab:blue", "local": "tab:orange"}.get(group[0]["policy"], "tab:green")
            ax.scatter(x, y, color=col, zorder=3)
            ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ppd = sorted((p for p in ps if p["policy"] == "ppd"), key=lambda p: p["w_tpot"])
        ax.plot([p["tpot_ms"] for p in ppd], [p["ttft_ms"] for p in ppd], "g-", lw=0.8)
        ax.set_xlabel("Turn-2+ mean TPOT (ms)")
        ax.set_ylabel("Turn-2+ mean TTFT (ms)")
        ax.set_title(f"QPS {q:g}", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --- command ------------------------------------------------------------------


def build_report(inputs: Sequence[Path], out_dir: Path, paper_sweep: Optional[Path], plots: bool = True) -> str:
    rows: list[Row] = []
    for p in inputs:
        if not p.is_file():
            raise ReportError(f"{p}: no such file")
        rows.extend(load_rows(p))
    if not rows:
        raise ReportError("no result rows in the input files")
    out_dir.mkdir(parents=True, exist_ok=True)
    wtpot_rows = [r for r in rows if r.w_tpot != 1.0 or r.source.endswith("wtpot")]
    main_rows = [r for r in rows if r not in wtpot_rows] if wtpot_rows else rows
    named = sorted({r.workload for r in main_rows if not r.workload.startswith(("small_", "large_"))})
    parts = [f"# ppd-router report\n\nInputs: {', '.join(str(p) for p in inputs)} ({len(rows)} rows).\n"]
    synth = [r for r in main_rows if r.workload.startswith(("small_", "large_"))]
    t1 = table1(synth)
    if t1:
        parts.append("## Table 1: Turn-2 TTFT change from x=0 to x=1 (mean over workloads × QPS in the band)\n")
        parts.append(md_table1(t1) + "\n")
    t2, n2 = table2(synth)
    if n2:
        parts.append("## Table 2: winner distribution per objective (synthetic workloads)\n")
        parts.append(md_table2(t2, n2) + "\n")
    for wl in named:
        t3, n3 = table3(main_rows, wl)
        if n3:
            parts.append(f"## Table 3: per-metric wins, {wl}\n")
            parts.append(md_table3(t3, n3) + "\n")
    if len({_label(r) for r in main_rows}) > 1:
        parts.append("## Policies side by side\n")
        parts.append(md_policies(main_rows) + "\n")
    if paper_sweep is not None:
        prow = load_rows(paper_sweep, "paper-sweep")
        parts.append(f"## The same tables from the measured {paper_sweep.name}\n")
        parts.append(md_table1(table1(prow)) + "\n")
        pt2, pn2 = table2(prow)
        parts.append(md_table2(pt2, pn2) + "\n")
    if plots:
        figs = []
        if plot_pareto(synth, out_dir / "pareto.png", "P99 TTFT vs TPS (ours)"):
            figs.append(("Pareto frontiers, ours (paper Fig. 9)", "pareto.png"))
        if paper_sweep is not None and plot_pareto(
            prow, out_dir / "pareto-paper-sweep.png", f"P99 TTFT vs TPS ({paper_sweep.name})"
        ):
            figs.append(("Pareto frontiers, measured sweep", "pareto-paper-sweep.png"))
        if named and plot_latency_vs_qps(
            main_rows, out_dir / "latency-vs-qps.png", named, "mean E2E latency vs QPS (× = success < 95 %)"
        ):
            figs.append(("Latency vs QPS (paper Figs. 4/11)", "latency-vs-qps.png"))
        if wtpot_rows:
            pts = wtpot_points(wtpot_rows)
            if plot_wtpot(pts, out_dir / "wtpot.png", "w_tpot sweep (paper Fig. 6)"):
                figs.append(("w_tpot sweep (paper Fig. 6)", "wtpot.png"))
            parts.append("## w_tpot sweep (Turn-2+ means over the slice)\n")
            parts.append("| QPS | policy | w_tpot | TTFT ms | TPOT ms | local share |\n|---:|---|---:|---:|---:|---:|")
            for pt in pts:
                w = "" if pt["w_tpot"] is None else f"{pt['w_tpot']:g}"
                share = "–" if pt["local_share"] is None else f"{100 * pt['local_share']:.0f} %"
                parts.append(
                    f"| {pt['qps']:g} | {pt['policy']} | {w} | {pt['ttft_ms']:.1f} | {pt['tpot_ms']:.2f} | {share} |"
                )
            parts.append("")
        parts.append("## Figures\n")
        parts.extend(f"![{t}]({f})\n" for t, f in figs)
    text = "\n".join(parts)
    (out_dir / "report.md").write_text(text)
    return text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="markdown report with the paper's tables and plots from result files",
        description="Reads bench --out / simulate --json JSON (or JSON lines) and sweep.csv-style "
        "CSV files; writes DIR/report.md with Tables 1-3 and PNG plots (Pareto frontiers, "
        "latency vs QPS with failure markers, the w_tpot sweep).",
    )
    p.add_argument("inputs", nargs="+", type=Path, help="result files (.csv, .json, .jsonl)")
    p.add_argument("--out-dir", type=Path, required=True, help="directory for report.md and PNGs")
    p.add_argument(
        "--paper-sweep", type=Path, default=None, help="the measured sweep.csv, to compute the same tables beside ours"
    )
    p.add_argument("--no-plots", action="store_true", help="tables only (no matplotlib needed)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    text = build_report(args.inputs, args.out_dir, args.paper_sweep, plots=not args.no_plots)
    print(f"{args.out_dir / 'report.md'}: {len(text.splitlines())} lines")
    return 0
