"""``ppd-router build-table``: Phase 1 of the paper's Algorithm 1 against live endpoints.

For each grid cell (context class × Turn-2 workload type × QPS level) it runs
the cell's synthetic two-turn workload through the x = 0 endpoint (PD: every
turn through P) and the x = 1 endpoint (local append-prefill on pD), records
the Turn-2 mean TTFT, mean TPOT and sample count of each, and writes a
``ppd-table/1`` file. Every finished measurement is appended to a JSON-lines
log first, so an interrupted build resumes where it stopped and the table is
rewritten (and validated by the Rust loader) after each completed cell.

Context classes map to the synthetic Turn-1 sizes: ``small`` = Turn 1 128/128
(Turn-2 context 256 + n_in), ``large`` = 1024/1024 (2048 + n_in); no synthetic
workload reaches the ``huge`` class (> 4096), whose lookups fall back to
``large`` as in the shipped H100 tables.

``--backend simulate`` runs the same grid in the virtual-time simulator
(``ppd-router simulate``): x = 0 is the deployment under policy ``pd``, x = 1
under policy ``local``, so a deployment with P and pD nodes is needed. The whole
default grid (2 × 9 × 10 cells × 2 paths) takes seconds; the log and resuming
work as for the live backend.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import orjson

from ppd_router import Table, _core
from ppd_router.bench.client import BenchConfig, chat_url, run
from ppd_router.bench.workloads import T2_SETTINGS, SyntheticWorkload
from ppd_router.errors import TargetError

CONTEXT_TO_T1 = {"small": "small", "large": "large"}
DEFAULT_QPS = tuple(_core.PAPER_QPS)
CONTEXT_BINS = list(_core.PAPER_CONTEXT_BINS)

Key = tuple[str, str, float, int]  # (context, workload, qps, x)


def grid(contexts: list[str], workloads: list[str], qps: list[float]) -> list[Key]:
    """Every (context, workload, qps, x) measurement of the build, in run order."""
    return [(c, w, float(q), x) for c in contexts for w in workloads for q in qps for x in (0, 1)]


def cell_measurement(summary: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A run's Turn-2+ (mean TTFT, mean TPOT, successes), or None if it has none."""
    t2 = summary["turn2plus"]
    if not t2["count"] or t2["avg_ttft_ms"] is None or t2["avg_tpot_ms"] is None:
        return None
    if not (t2["avg_ttft_ms"] > 0 and t2["avg_tpot_ms"] > 0):
        return None
    return {"ttft_ms": t2["avg_ttft_ms"], "tpot_ms": t2["avg_tpot_ms"], "n": t2["count"]}


def load_log(path: Path) -> dict[Key, Optional[dict[str, Any]]]:
    """Measurements already taken (a torn last line from an interruption is ignored)."""
    done: dict[Key, Optional[dict[str, Any]]] = {}
    if not path.exists():
        return done
    for line in path.read_bytes().splitlines():
        try:
            e = orjson.loads(line)
            done[(e["context"], e["workload"], float(e["qps"]), int(e["x"]))] = e["measurement"]
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return done


def table_doc(
    measured: dict[Key, Optional[dict[str, Any]]],
    workloads: list[str],
    qps: list[float],
    meta: dict[str, Any],
) -> tuple[dict[str, Any], list[str]]:
    """The ppd-table/1 document of all cells measured on both paths, and the skipped ones."""
    cells, skipped = [], []
    axis_w, axis_q = set(workloads), set(qps)
    points = sorted({k[:3] for k in measured if k[1] in axis_w and k[2] in axis_q})
    for ctx, wl, q in points:
        if (ctx, wl, q, 0) not in measured or (ctx, wl, q, 1) not in measured:
            continue  # the other path is still to be measured
        m0, m1 = measured[(ctx, wl, q, 0)], measured[(ctx, wl, q, 1)]
        if m0 is None or m1 is None:
            skipped.append(f"{ctx}/{wl}/qps={q:g}")
            continue
        cells.append({"context": ctx, "workload": wl, "qps": q, "x0": m0, "x1": m1})
    doc = {
        "schema": "ppd-table/1",
        "model": meta.get("model") or "",
        "hardware": meta.get("hardware") or "",
        "deployment": meta.get("deployment") or "",
        "source": meta.get("source") or "measured",
        "created": meta.get("created") or "",
        "default_n_out": 128,
        "provenance": {
            "builder": f"ppd-router build-table --backend {meta.get('backend', 'live')}",
            "skipped_points": skipped,
            **{
                k: v
                for k, v in meta.items()
                if k not in ("model", "hardware", "deployment", "created", "source", "backend")
            },
        },
        "axes": {
            "context_bins": CONTEXT_BINS,
            "workloads": [{"name": w, "n_in": T2_SETTINGS[w][0], "n_out": T2_SETTINGS[w][1]} for w in workloads],
            "qps": sorted(qps),
        },
        "cells": cells,
    }
    return doc, skipped


def _csv_list(kind: Callable[[str], Any], allowed: Optional[set[str]] = None) -> Any:
    def parse(s: str) -> list[Any]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        if allowed is not None:
            bad = [x for x in items if x not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(sorted(allowed))}")
        try:
            out = [kind(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a list of numbers: {s!r}") from None
        if kind is float and any(not v > 0 for v in out):
            raise argparse.ArgumentTypeError("QPS levels must be positive")
        return out

    parse.__name__ = "list"
    return parse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "build-table",
        help="measure a ppd-table/1 lookup table (Algorithm 1, Phase 1)",
        description="Run each grid cell's workload at x=0 and x=1 and write the measured "
        "Turn-2 TTFT/TPOT per cell as a ppd-table/1 file; resumable.",
    )
    p.add_argument(
        "--backend",
        choices=["live", "simulate"],
        default="live",
        help="live: real HTTP endpoints --x0/--x1 (default); simulate: the virtual-time "
        "simulator on --deployment (policy pd for x=0, local for x=1)",
    )
    p.add_argument(
        "--x0", metavar="URL", help="live: endpoint serving Turn 2+ through P (e.g. a router with policy pd)"
    )
    p.add_argument(
        "--x1", metavar="URL", help="live: endpoint serving Turn 2+ locally (e.g. a router with policy local)"
    )
    p.add_argument(
        "--profile", default=None, help="simulate: engine profile name or TOML path (default: built-in H100)"
    )
    p.add_argument("--out", type=Path, required=True, help="ppd-table/1 file to write")
    p.add_argument("--log", type=Path, default=None, help="measurement log for resuming (default OUT.runs.jsonl)")
    p.add_argument(
        "--contexts",
        type=_csv_list(str, set(CONTEXT_TO_T1)),
        default=list(CONTEXT_TO_T1),
        help="context classes (default small,large)",
    )
    p.add_argument(
        "--workloads",
        type=_csv_list(str, set(T2_SETTINGS)),
        default=list(T2_SETTINGS),
        help="Turn-2 workload types (default: all nine)",
    )
    p.add_argument(
        "--qps", type=_csv_list(float), default=list(DEFAULT_QPS), help="QPS levels (default the paper's ten)"
    )
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per run")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument(
        "--deployment",
        default="",
        help="e.g. 2P2pD (descriptive for live; the simulated layout for simulate, which needs P and pD nodes)",
    )
    p.add_argument("--hardware", default="", help="descriptive")
    p.add_argument("--quiet", action="store_true", help="no per-run line on stderr")
    p.set_defaults(func=run_command)


def _fail(msg: str) -> int:
    print(f"ppd-router build-table: error: {msg}", file=sys.stderr)
    return 2


def _simulated_layout(deployment: str) -> str:
    """Checks that the layout can serve both paths; returns an error message or ''."""
    from ppd_router import _core

    if not deployment:
        return "--backend simulate needs --deployment (e.g. 2P2pD)"
    try:
        roles = _core.parse_layout(deployment)
    except ValueError as e:
        return str(e)
    if "P" not in roles or "pD" not in roles or "D" in roles or "R" in roles:
        return (
            f"--deployment {deployment}: the simulated build needs P and pD nodes only "
            "(x=0 is its pd path, x=1 its local path), e.g. 2P2pD"
        )
    return ""


def _measure_simulated(args: argparse.Namespace, ctx: str, wl: str, q: float, x: int) -> dict[str, Any]:
    """One simulated run, as a summary with the keys the live path reads."""
    from ppd_router.simulate import simulate_point

    r = simulate_point(
        deployment=args.deployment,
        policy="pd" if x == 0 else "local",
        workload=f"{CONTEXT_TO_T1[ctx]}_{wl}",
        qps=q,
        duration=args.duration,
        seed=args.seed,
        timeout=args.timeout,
        profile=args.profile,
    )
    fails = r["failed_requests"]
    return {**r, "failures": {"timeout": fails} if fails else {}}


def run_command(args: argparse.Namespace) -> int:
    simulated = args.backend == "simulate"
    if simulated:
        if args.x0 or args.x1:
            return _fail("--x0/--x1 are for --backend live")
        if msg := _simulated_layout(args.deployment):
            return _fail(msg)
        urls = {0: f"simulate:{args.deployment}:pd", 1: f"simulate:{args.deployment}:local"}
    else:
        if not args.x0 or not args.x1:
            return _fail("--backend live needs --x0 URL and --x1 URL")
        try:
            urls = {0: chat_url(args.x0), 1: chat_url(args.x1)}
        except TargetError as e:
            return _fail(str(e))
    if not args.duration > 0 or not args.timeout > 0:
        print("ppd-router build-table: error: --duration and --timeout must be positive", file=sys.stderr)
        return 2
    log = args.log or args.out.with_name(args.out.name + ".runs.jsonl")
    measured = load_log(log)
    todo = [k for k in grid(args.contexts, args.workloads, args.qps) if k not in measured]
    meta = {
        "model": args.model,
        "hardware": args.hardware,
        "deployment": args.deployment,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "x0_target": urls[0],
        "x1_target": urls[1],
        "duration_s": args.duration,
        "timeout_s": args.timeout,
        "seed": args.seed,
        "backend": args.backend,
        "source": "simulated" if simulated else "measured",
    }
    if simulated:
        meta["profile"] = args.profile or "default"
    if not args.quiet:
        print(f"build-table: {len(todo)} runs to do, {len(measured)} already in {log}", file=sys.stderr)
    for i, (ctx, wl, q, x) in enumerate(todo, 1):
        try:
            if simulated:
                summary = _measure_simulated(args, ctx, wl, q, x)
            else:
                workload = SyntheticWorkload(CONTEXT_TO_T1[ctx], wl, turns=2, seed=args.seed)
                cfg = BenchConfig(
                    target=urls[x],
                    workload=workload,
                    qps=q,
                    duration=args.duration,
                    timeout=args.timeout,
                    seed=args.seed,
                    model=args.model,
                )
                summary = run(cfg).summary
        except TargetError as e:
            return _fail(str(e))
        m = cell_measurement(summary)
        entry = {
            "context": ctx,
            "workload": wl,
            "qps": q,
            "x": x,
            "measurement": m,
            "success_rate": summary["success_rate"],
            "failures": summary["failures"],
        }
        with open(log, "ab") as f:  # append first: the log is what resuming trusts
            f.write(orjson.dumps(entry) + b"\n")
        measured[(ctx, wl, q, x)] = m
        if not args.quiet:
            shown = (
                ("no conversation arrived: raise --duration" if not summary["total_requests"] else "no Turn-2 success")
                if m is None
                else f"TTFT {m['ttft_ms']:.1f} ms TPOT {m['tpot_ms']:.2f} ms n={m['n']}"
            )
            print(f"[{i}/{len(todo)}] {ctx}/{wl} qps={q:g} x={x}: {shown}", file=sys.stderr)
        if all((ctx, wl, q, other) in measured for other in (0, 1)):
            _write_table(args.out, measured, args.workloads, args.qps, meta)
    doc = _write_table(args.out, measured, args.workloads, args.qps, meta)
    if doc is None:
        print("ppd-router build-table: error: no cell has Turn-2 measurements on both paths", file=sys.stderr)
        return 1
    if not args.quiet:
        print(
            f"{args.out}: {len(doc['cells'])} cells, {len(doc['provenance']['skipped_points'])} skipped",
            file=sys.stderr,
        )
    return 0


def _write_table(
    out: Path,
    measured: dict[Key, Optional[dict[str, Any]]],
    workloads: list[str],
    qps: list[float],
    meta: dict[str, Any],
) -> Optional[dict[str, Any]]:
    doc, _ = table_doc(measured, workloads, qps, meta)
    if not doc["cells"]:
        return None  # a ppd-table/1 file needs at least one cell
    text = orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()
    Table.from_json(text, str(out))  # the router's own validation, before replacing the file
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(out)
    return doc
