"""``ppd-router table``: inspect a lookup table and ask the engine for single decisions."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

import orjson

from ppd_router import DecisionEngine, Table


def _engine(args: argparse.Namespace) -> tuple[Table, DecisionEngine]:
    table = Table.load(args.path)
    live_settings = {
        k: getattr(args, k) for k in ("profile", "slo_ttft_ms", "slo_tpot_ms") if getattr(args, k, None) is not None
    }
    return table, DecisionEngine(table, args.policy, args.w_ttft, args.w_tpot, **live_settings)


def _show(args: argparse.Namespace) -> int:
    table, engine = _engine(args)
    out = sys.stdout
    print(
        f"{table.name}: deployment={table.deployment or '?'} model={table.model or '?'} "
        f"hardware={table.hardware or '?'} source={table.source or '?'} cells={len(table)}",
        file=out,
    )
    print(
        f"policy={engine.policy} w_ttft={engine.weights[0]:g} w_tpot={engine.weights[1]:g}; "
        "entry = path (L local, P pd) and score S; '~' marks a cell filled from its "
        "nearest populated neighbour",
        file=out,
    )
    qps = table.qps_levels
    width = 9
    local = total = 0
    for ci, ctx in enumerate(table.context_classes):
        n_ctx = table.representative_context(ci)
        print(f"\ncontext {ctx} (n_ctx ~ {n_ctx})", file=out)
        print(f"{'workload':<15}" + "".join(f"{q:>{width}g}" for q in qps), file=out)
        for name, n_in, n_out in table.workloads:
            row = [f"{name:<15}"]
            for q in qps:
                route = engine.decide(2, n_in, n_out, n_ctx, q)
                cell: Mapping[str, Any] = route.cell or {}
                mark = "~" if cell.get("distance", 0.0) > 0 else ""
                tag = {"local": "L", "pd": "P", "replica": "R", "pull": "U"}[route.path]
                score = f"{route.score:+.2f}" if route.score is not None else "-"
                row.append(f"{mark + tag + score:>{width}}")
                local += route.path == "local"
                total += 1
            print("".join(row), file=out)
    print(f"\nlocal in {local} of {total} grid points", file=out)
    return 0


def _decide(args: argparse.Namespace) -> int:
    _, engine = _engine(args)
    route = engine.decide(
        args.turn,
        args.n_in,
        args.n_out,
        args.ctx,
        args.qps,
        conversation_id=args.conversation_id,
        pull_ready=args.pull_ready,
        live=args.live,
    )
    sys.stdout.write(orjson.dumps(route.to_dict()).decode() + "\n")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("table", help="inspect a lookup table, or decide one request")
    tsub = p.add_subparsers(dest="table_command", metavar="ACTION", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("path", help="ppd-table/1 JSON file")
        q.add_argument("--w-ttft", type=float, default=1.0, help="weight of TTFT gain (default 1)")
        q.add_argument("--w-tpot", type=float, default=1.0, help="weight of TPOT loss (default 1)")
        q.add_argument(
            "--policy",
            default="ppd",
            help="ppd | ppd-live | pd | local | pull | fraction:X | replica | dynamo-isl | dynamo-load "
            "| llmd-threshold",
        )

    show = tsub.add_parser("show", help="print the grid with each cell's decision")
    common(show)
    show.set_defaults(func=_show)

    dec = tsub.add_parser("decide", help="print the route of one request as JSON")
    common(dec)
    dec.add_argument("--turn", type=int, required=True)
    dec.add_argument("--n-in", type=int, required=True)
    dec.add_argument("--n-out", type=int, required=True)
    dec.add_argument("--ctx", type=int, required=True)
    dec.add_argument("--qps", type=float, required=True)
    dec.add_argument("--conversation-id", default=None, help="for the fraction policy's hash")
    dec.add_argument(
        "--live",
        default=None,
        metavar="JSON",
        help='the nodes as ppd-live and the anchors see them, e.g. \'{"d": {"running": 120, '
        '"decode_ctx_tokens": 240000}, "p": {"queued_prefill_tokens": 4000, "waiting": 2}, '
        '"d_cached": 2000, "mean_out_tokens": 200}\'; the answer then carries the forecast',
    )
    dec.add_argument("--pull-ready", action="store_true", help="D pins the conversation's KV: pull is feasible")
    dec.add_argument("--profile", default=None, help="engine profile of the cost model (default h100-llama3.1-8b)")
    dec.add_argument("--slo-ttft-ms", type=float, default=None, help="ppd-live SLO mode: TTFT objective")
    dec.add_argument("--slo-tpot-ms", type=float, default=None, help="ppd-live SLO mode: TPOT objective")
    dec.set_defaults(func=_decide)
