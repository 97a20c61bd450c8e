"""``ppd-router simulate``: one point of the paper's grid in virtual time (engine model + the router's policy)."""

from __future__ import annotations

import argparse
import json


def _fmt_turn(name: str, t: dict) -> str:
    return (
        f"{name:<9} n={t['count']:<5} TTFT avg {t['avg_ttft_ms']:8.1f}  p50 {t['p50_ttft_ms']:8.1f}  p99 {t['p99_ttft_ms']:8.1f} ms | "
        f"TPOT avg {t['avg_tpot_ms']:6.2f}  p50 {t['p50_tpot_ms']:6.2f}  p99 {t['p99_tpot_ms']:6.2f} ms | "
        f"E2E avg {t['avg_e2e_ms']:8.1f}  p99 {t['p99_e2e_ms']:8.1f} ms"
    )


def result(args: argparse.Namespace) -> dict:
    from ppd_router import _core

    cfg = {
        "deployment": args.deployment,
        "policy": args.policy,
        "workload": args.workload,
        "qps": args.qps,
        "duration_s": args.duration,
        "seed": args.seed,
        "timeout_s": args.timeout,
        "turns": args.turns,
        "w_ttft": args.w_ttft,
        "w_tpot": args.w_tpot,
    }
    return json.loads(_core.simulate(json.dumps(cfg), args.profile, args.table))


def _run(args: argparse.Namespace) -> int:
    r = result(args)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{args.deployment} policy={args.policy} workload={args.workload} qps={args.qps} "
          f"duration={args.duration}s seed={args.seed}" + (f" table={r['table']}" if r.get("table") else ""))
    print(_fmt_turn("turn 1", r["turn1"]))
    print(_fmt_turn("turn 2+", r["turn2plus"]))
    tp = r["throughput"]
    print(f"throughput {tp['requests_per_sec']:.2f} req/s, {tp['tokens_per_sec']:.0f} tok/s | "
          f"success {100 * r['success_rate']:.1f} % (timeout {args.timeout:g} s) | "
          f"turn 2+ local {100 * r['local_share']:.1f} %")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a deployment under a policy and workload in virtual time",
        description="Runs the emulator's engine model on every node in virtual time, routed by the "
        "router's own policy code, with the paper's two-turn Poisson workloads.",
    )
    p.add_argument("--deployment", required=True, help="e.g. 2P2pD, 1P_3D, 1P_1D_2pD, 1R_1P_2D, 4R")
    p.add_argument("--policy", default="ppd", help="ppd | pd | local | fraction:X | replica (default ppd)")
    p.add_argument("--table", help="lookup table path or builtin:h100-1P3pD|h100-2P2pD|h100-3P1pD "
                   "(ppd default: the built-in one nearest the P:D ratio)")
    p.add_argument("--workload", required=True, help="small_tiny … large_huge_paste (the paper's 18)")
    p.add_argument("--qps", type=float, required=True, help="conversation arrival rate")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="request timeout for the success rate (default 30 s)")
    p.add_argument("--turns", type=int, default=2, help="turns per conversation (default 2)")
    p.add_argument("--w-ttft", type=float, default=1.0)
    p.add_argument("--w-tpot", type=float, default=1.0)
    p.add_argument("--profile", help="engine profile name or TOML path (default: built-in H100 profile)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run)
