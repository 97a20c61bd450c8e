"""``ppd-router emulate``: run vLLM-compatible emulator nodes (P, D/pD, R) on this machine."""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def _run(args: argparse.Namespace) -> int:
    from ppd_router import _core

    if args.layout:
        # Several nodes in this process; print their URLs and wait for a signal.
        cluster = _core.start_emulated_cluster(
            args.layout,
            profile=args.profile,
            kv_link_gbps=args.kv_link_gbps,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_blocks=args.kv_blocks,
            seed=args.seed,
            served_model_name=args.served_model_name,
            kv_connector_extra_config=args.kv_connector_extra_config,
        )
        stop = threading.Event()
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, lambda *_: stop.set())
        try:
            for role, url in zip(cluster.roles, cluster.urls):
                print(f"{role}\t{url}", flush=True)
            while not stop.wait(0.5):
                pass
        finally:
            cluster.shutdown()
        return 0
    print(f"emulator {args.role} node on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    _core.run_emulator(
        args.role,
        args.port,
        host=args.host,
        profile=args.profile,
        kv_link_gbps=args.kv_link_gbps,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_blocks=args.kv_blocks,
        seed=args.seed,
        served_model_name=args.served_model_name,
        fault_latency_ms=args.fault_latency_ms,
        fault_error_rate=args.fault_error_rate,
        fault_hang=args.fault_hang,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_bind=args.kv_events_bind,
        kv_connector_extra_config=args.kv_connector_extra_config,
        api_key=args.api_key,
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "emulate",
        help="run an emulated vLLM node (or --layout for several) calibrated to H100 + Llama-3.1-8B",
        description="A vLLM-compatible engine emulator: OpenAI chat/completions (JSON, SSE), /v1/models, "
        "/health, /metrics with vLLM's names, and the NIXL kv_transfer_params exchange. "
        "Faults can also be set at run time: POST /admin/faults {latency_ms, error_rate, hang, crash}.",
    )
    p.add_argument(
        "--role",
        default="R",
        choices=["P", "D", "pD", "R"],
        help="node role (pD = D; every node serves plain requests)",
    )
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--layout", help="instead of one node, start a deployment in-process, e.g. 2P2pD, 1P_1D_2pD, 4R")
    p.add_argument(
        "--profile",
        help="engine profile: built-in name (h100-llama3.1-8b, as measured with P2pNccl; "
        "h100-llama3.1-8b-nixl; h200-llama3.1-8b, device-measured steps) or TOML path",
    )
    p.add_argument("--kv-link-gbps", type=float, help="KV link bandwidth in GB/s (profile default)")
    p.add_argument("--max-num-seqs", type=int, help="running batch limit (profile default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget per step (profile default 8192)")
    p.add_argument("--kv-blocks", type=int, help="KV pool size in 16-token blocks (profile default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated text (default 0)")
    p.add_argument("--served-model-name", help="model name served (default meta-llama/Llama-3.1-8B-Instruct)")
    p.add_argument("--fault-latency-ms", type=float, default=0.0, help="added latency per request")
    p.add_argument("--fault-error-rate", type=float, default=0.0, help="share of requests answered 500")
    p.add_argument("--fault-hang", action="store_true", help="accept requests and never answer")
    p.add_argument(
        "--kv-events-endpoint",
        help="publish KV events (vLLM's BlockStored/BlockRemoved msgpack over ZMQ) by connecting to tcp://HOST:PORT "
        "(where a router binds); with a wildcard host (tcp://*:PORT) or --kv-events-bind, bind it instead, as vLLM "
        "does, and every router replica connects",
    )
    p.add_argument(
        "--kv-events-bind",
        action="store_true",
        help="bind --kv-events-endpoint (routers connect with kv_events_from=) instead of connecting to it",
    )
    p.add_argument(
        "--kv-connector-extra-config",
        metavar="JSON",
        help="vLLM's NIXL kv_connector_extra_config; bidirectional_kv_xfer, decoder_kv_blocks_ttl and "
        "kv_recompute_threshold are emulated (a D pins turns, a P reads them back: the pull path)",
    )
    p.add_argument(
        "--api-key",
        help="like vLLM's --api-key: requests on /v1/* need Authorization: Bearer KEY (401 otherwise); "
        "/health and /metrics stay open (one node; not with --layout)",
    )
    p.set_defaults(func=_run)
