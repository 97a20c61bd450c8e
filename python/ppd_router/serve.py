"""``ppd-router serve``: the router, from a TOML file and flags that share one schema."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

import orjson

from ppd_router._core import Router, validate_router_config

# flag -> (config key, type, help); list-valued flags take one or more URLs.
_LISTS = {
    "prefill": "prefill (P) node URLs",
    "decode": "decode-only (D) node URLs: never serve a turn locally (vllm-router's --decode is any decoding node)",
    "pd_capable": "prefill-capable decode (pD) node URLs",
    "replica": "replica (R) node URLs",
}
_SCALARS: dict[str, tuple[type, str]] = {
    "emulated": (str, "start an emulated cluster of this layout in-process, e.g. 2P2pD, 1P_1D_2pD, 4R"),
    "emulator_profile": (
        str,
        "emulator profile (with --emulated): h100-llama3.1-8b (default, as measured with P2pNccl), "
        "h100-llama3.1-8b-nixl, h200-llama3.1-8b (device-measured steps), or a TOML path",
    ),
    "policy": (str, "ppd | pd | local | fraction:X | replica (default ppd)"),
    "table": (str, "lookup table path or builtin:h100-1P3pD|h100-2P2pD|h100-3P1pD (default: by P:D ratio)"),
    "w_ttft": (float, "weight of the TTFT gain in Equation 1 (default 1)"),
    "w_tpot": (float, "weight of the TPOT loss in Equation 1 (default 1)"),
    "engine_profile": (
        str,
        "engine profile ppd-live's cost model predicts with: built-in name or TOML path (default: the "
        "emulator's profile with --emulated, else h100-llama3.1-8b); observed latencies correct it per node",
    ),
    "slo_ttft_ms": (float, "ppd-live SLO mode: TTFT objective in ms (with --slo-tpot-ms)"),
    "slo_tpot_ms": (float, "ppd-live SLO mode: TPOT objective in ms (with --slo-ttft-ms)"),
    "kv_protocol": (str, "nixl | p2pnccl | none (default nixl)"),
    "host": (str, "address to listen on (default 127.0.0.1)"),
    "port": (int, "port to listen on (default 8000)"),
    "admin_token": (
        str,
        "bearer token of the admin API (disabled without a token); visible on the command line, so prefer "
        "--admin-token-file or the PPD_ADMIN_TOKEN environment variable",
    ),
    "admin_token_file": (str, "file holding the admin bearer token (one trailing newline stripped)"),
    "api_key": (
        str,
        "bearer token clients must send on /v1/* (401 otherwise; /health and /metrics stay open); never passed "
        "on to the nodes; prefer --api-key-file or the PPD_API_KEY environment variable",
    ),
    "api_key_file": (str, "file holding --api-key (one trailing newline stripped)"),
    "upstream_api_key": (
        str,
        "bearer token sent to every node on every call (the nodes' vLLM --api-key); without it and without "
        "--api-key a client's Authorization is passed on; prefer --upstream-api-key-file or PPD_UPSTREAM_API_KEY",
    ),
    "upstream_api_key_file": (str, "file holding --upstream-api-key (one trailing newline stripped)"),
    "upstream_ca_file": (str, "PEM CA certificates trusted for https:// nodes, besides the public web roots"),
    "admin_port": (int, "serve /admin/* and /metrics on this port only (the main port answers them 404)"),
    "admin_host": (str, "address of the admin listener (default: --host; needs --admin-port)"),
    "session_ttl": (float, "session idle TTL in seconds (default 3600)"),
    "session_capacity": (int, "live sessions kept at most (default 1000000)"),
    "session_max_bytes": (int, "memory the session table may take, ids included, in bytes (default 256 MiB)"),
    "request_timeout": (float, "whole-request limit in seconds (default 600)"),
    "prefill_timeout": (float, "limit for P's prefill in seconds (default 120)"),
    "connect_timeout": (float, "upstream connect limit in seconds (default 5)"),
    "stream_idle_timeout": (float, "longest silence inside a stream in seconds (default 60)"),
    "max_body_bytes": (int, "largest request body (default 16 MiB)"),
    "health_interval": (float, "seconds between health checks (default 5)"),
    "heartbeat_timeout": (float, "seconds without heartbeat before a registered node goes (default 30)"),
    "breaker_failures": (int, "consecutive failures that open a node's breaker (default 3)"),
    "breaker_open": (float, "seconds a breaker stays open (default 10)"),
    "overload_inflight": (int, "in-flight requests at which local is vetoed on a pD (0 = off)"),
    "overload_waiting": (int, "requests a pD reports waiting at which local is vetoed (0 = off, the default)"),
    "overload_kv_usage": (float, "KV-cache usage (0..1) a pD reports at which local is vetoed (0 = off; default 0.95)"),
    "decoder_kv_blocks_ttl": (float, "seconds a bidirectional D pins a turn's blocks (vLLM's default 480)"),
    "load_interval": (float, "seconds between scrapes of node /metrics for load and restarts (0 = off; default 1)"),
    "qps_window": (float, "QPS estimator window in seconds (default 10)"),
    "replica_share": (float, "hybrid R + P/D: share of new conversations for replicas"),
    "kv_bytes_per_token": (int, "KV bytes per token for the KV-moved metrics (default 131072)"),
    "tokenizer": (str, "tokenizer.json for exact token counts (default: word rule)"),
    "prompt_renderer": (
        str,
        "auto (the tokenizer's chat template when --tokenizer is set), word-rule (emulated nodes) or none: "
        "how requests become token ids matched against the nodes' KV events",
    ),
    "state": (
        str,
        "share admin changes (weights, policy, nodes, table) and conversation rates with the other replicas of "
        "this router through Redis at redis://HOST[:PORT][/DB], or rediss:// over TLS (default: PPD_STATE, else "
        "nothing is shared); a password in the URL is better given through PPD_STATE than on the command line",
    ),
    "state_ca_file": (
        str,
        "PEM file of the CA certificates a rediss:// --state store's certificate must chain to, instead of the "
        "public web roots",
    ),
    "state_prefix": (
        str,
        "namespace of this router's keys and channel in --state, so clusters can share one Redis (default ppd)",
    ),
    "worker_threads": (int, "router I/O threads (default 0 = one per core)"),
    "runtime": (str, "thread-per-core (default: a request stays on its thread) or work-stealing"),
    "placement": (
        str,
        "least-loaded (default: one router) or rendezvous (one of several replicas: new conversations by "
        "rendezvous hashing with bounded loads, later turns adopted where the nodes' KV events show them)",
    ),
    "log": (
        str,
        "log filter in tracing's EnvFilter syntax, e.g. info or warn,ppd_router::request=info "
        "(default: RUST_LOG, else warn); info logs one line per request",
    ),
    "log_format": (str, "text (default) or json: one JSON object per log line, on stderr"),
    "otlp_traces_endpoint": (
        str,
        "export request spans (identity, decision, prefill, kv_handoff, decode_first_token) over OTLP/HTTP JSON "
        "to this collector URL, e.g. http://127.0.0.1:4318/v1/traces (off by default)",
    ),
    "max_inflight_per_node": (int, "requests each node may have in flight (0 = no limit; default 256)"),
    "max_inflight_tokens_per_node": (int, "prompt tokens each node may have in flight (0 = no limit, the default)"),
    "queue_size": (int, "requests that may wait for room on their node; beyond: 503 (default 1024)"),
    "queue_timeout": (float, "longest wait for room on a node in seconds; past it: 503 (default 30)"),
    "rate_limit": (int, "requests per second the router takes; beyond: 429 (0 = no limit, the default)"),
    "rate_limit_burst": (int, "requests allowed in a burst above the rate (0 = the rate)"),
    "first_token_timeout": (
        float,
        "longest wait for a streamed answer's first token in seconds; past it the node counts as failed "
        "and the request is retried once elsewhere (default 60)",
    ),
    "header_read_timeout": (float, "seconds a connection has to send a complete request head (default 10)"),
    "body_read_timeout": (float, "seconds a request body has to arrive, else 408 (default 30)"),
    "keep_alive_timeout": (float, "seconds an idle kept-alive connection stays open (default 75)"),
    "max_connections": (int, "open client connections at most; beyond it 503 + Retry-After (default 4096)"),
    "route_headers": (
        str,
        "which x-ppd-* headers answers carry: all (path, reason, session; default), path (x-ppd-path only) or none",
    ),
}
# On/off settings: the flag turns them on (the file may too).
_SWITCHES = {
    "expose_node_header": "send each answer's node address in x-ppd-node (internal; off by default)",
    "bidirectional_kv_xfer": "the nodes run vLLM's NIXL connector with bidirectional_kv_xfer (launch sets it): "
    "the pull path, where P reads a conversation's KV back from its D and prefills only the new tokens",
    "session_from_user": "let the body's `user` field name the conversation when no id header or field does (off)",
}


def flag_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags, by TOML key; they override the file's (``--config``), which Rust reads."""
    keys = [*_LISTS, *_SCALARS, *_SWITCHES]
    return {key: value for key in keys if (value := getattr(args, key, None)) is not None}


def build_router(args: argparse.Namespace, extra: Optional[dict[str, Any]] = None) -> Router:
    """The router of ``--config`` and the flags (plus ``extra`` settings), validated once in Rust."""
    return Router(orjson.dumps({**flag_settings(args), **(extra or {})}).decode(), config_path=args.config)


def settings_of(args: argparse.Namespace, extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Every setting as the router would run with it (defaults filled in), or ConfigError."""
    text = validate_router_config(
        orjson.dumps({**flag_settings(args), **(extra or {})}).decode(), config_path=args.config
    )
    settings: dict[str, Any] = orjson.loads(text)
    return settings


def _serve(args: argparse.Namespace) -> int:
    if args.print_config:
        sys.stdout.write(orjson.dumps(settings_of(args)).decode() + "\n")
        return 0
    router = build_router(args)
    discovery = None
    if args.discovery:
        from ppd_router.discovery import Discovery

        url = router.start()
        discovery = Discovery(router, args.discovery)
        discovery.start()
        print(f"ppd-router listening on {url}; discovery on {args.discovery}", file=sys.stderr)
        try:
            discovery.wait()
        finally:
            discovery.stop()
            router.stop()
        return 0
    router.serve()
    return 0


# vllm-router's and SMG's spellings of the same settings (README: "Flags of vllm-router and SMG").
# Their --decode names every decoding node; here it is a decode-only D, and --pd-capable names the
# decoding nodes that may also append-prefill (local turns).
_COMPAT_ALIASES: dict[str, tuple[str, ...]] = {
    "replica": ("--worker-urls",),
    "request_timeout": ("--request-timeout-secs",),
    "max_body_bytes": ("--max-payload-size",),
    "health_interval": ("--health-check-interval-secs",),
}

# Settings that choose the nodes; `launch` starts its own nodes and fills these in.
_NODE_SETTINGS = ("emulated", "emulator_profile")


def add_settings_flags(p: argparse.ArgumentParser, node_lists: bool = True) -> None:
    """The router's settings as flags (--config plus one flag per TOML key)."""
    p.add_argument("--config", metavar="FILE.toml", help="settings file; flags override it")
    if node_lists:
        for key, help_text in _LISTS.items():
            # extend: `--prefill A --prefill B` and `--prefill A B` both give [A, B], as in vllm-router and SMG.
            flags = ["--" + key.replace("_", "-"), *_COMPAT_ALIASES.get(key, ())]
            p.add_argument(*flags, dest=key, action="extend", nargs="+", metavar="URL", default=None, help=help_text)
        p.add_argument(
            "--pd-disaggregation",
            action="store_true",
            help="accepted for vllm-router / SMG command lines; has no effect (the nodes given choose the paths)",
        )
    for key, (typ, help_text) in _SCALARS.items():
        if node_lists or key not in _NODE_SETTINGS:
            flags = ["--" + key.replace("_", "-"), *_COMPAT_ALIASES.get(key, ())]
            p.add_argument(*flags, dest=key, type=typ, default=None, help=help_text)
    for key, help_text in _SWITCHES.items():
        p.add_argument("--" + key.replace("_", "-"), action="store_const", const=True, default=None, help=help_text)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the router (OpenAI-compatible endpoint over P / D / pD / R nodes)")
    add_settings_flags(p)
    p.add_argument(
        "--discovery",
        metavar="tcp://HOST:PORT",
        default=None,
        help="also accept node registrations over ZMQ (vLLM P2pNccl format) on this address",
    )
    p.add_argument("--print-config", action="store_true", help="print the validated settings as JSON and exit")
    p.set_defaults(func=_serve)


def main(argv: Optional[list[str]] = None) -> int:  # pragma: no cover - thin wrapper
    from ppd_router.cli import main as cli_main

    return cli_main(["serve", *(argv or [])])
