"""Emulator nodes as separate processes and a router in front of them, on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import httpx
import pytest

from ppd_router import Router
from tests.helpers import answer_text, assistant, free_port, scrape, user


def wait_healthy(url: str, timeout: float = 30.0, proc: Optional[subprocess.Popen] = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not healthy within {timeout}s")


@dataclass
class Node:
    role: str
    port: int
    proc: subprocess.Popen
    url: str = ""

    def __post_init__(self) -> None:
        self.url = f"http://127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        """Sum of a vLLM metric over its label sets (counters read with or without `_total`)."""
        return scrape(self.url, name)

    def served(self) -> float:
        return self.metric("vllm:request_success")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


def start_healthy(cmd: list[str], port: int, stderr: Any = subprocess.PIPE) -> subprocess.Popen:
    """A ``ppd_router.cli`` process on ``port``, once its /health answers (killed if it never does)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, env=os.environ.copy())
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc=proc)
    except Exception:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        raise
    return proc


def start_node(role: str, *extra: str) -> Node:
    port = free_port()
    cmd = [sys.executable, "-m", "ppd_router.cli", "emulate", "--role", role, "--port", str(port), *extra]
    return Node(role, port, start_healthy(cmd, port))


@dataclass
class Cluster:
    nodes: dict[str, list[Node]]
    router: Router
    url: str
    admin_token: str = "secret"
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=30))

    def chat(self, messages: list[dict[str, str]], headers: Optional[dict[str, str]] = None, **body: Any) -> httpx.Response:
        payload = {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": messages, "max_tokens": 8, "temperature": 0, **body}
        return self.client.post(self.url + "/v1/chat/completions", json=payload, headers=headers or {})

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return self.client.request(method, self.url + path, headers={"authorization": f"Bearer {self.admin_token}"}, **kw)

    def stop(self) -> None:
        self.client.close()
        self.router.stop()
        for ns in self.nodes.values():
            for n in ns:
                n.kill()


def kill_all(nodes: dict[str, list[Node]]) -> None:
    for ns in nodes.values():
        for n in ns:
            n.kill()


def router_over(nodes: dict[str, list[Node]], spec: Callable[[Node], str] = lambda n: n.url, **cfg: Any) -> Cluster:
    """A started router in front of ``nodes`` (by layout kind; ``spec`` names a node in the router's node
    lists), with the tests' defaults and ``cfg`` over them; the nodes are killed if it does not start."""
    keys = {"P": "prefill", "pD": "pd_capable", "D": "decode", "R": "replica"}
    try:
        settings: dict[str, Any] = {keys[k]: [spec(n) for n in v] for k, v in nodes.items()}
        settings.update({"port": free_port(), "admin_token": "secret", "health_interval": 0.5,
                         "expose_node_header": True, **cfg})
        router = Router(json.dumps(settings))
        url = router.start()
    except Exception:
        kill_all(nodes)
        raise
    return Cluster(nodes, router, url)


def start_cluster(layout: dict[str, int], **cfg: Any) -> Cluster:
    """layout: {"P": 1, "pD": 2, "D": 0, "R": 0}; cfg: router settings."""
    roles = {"P": "P", "pD": "D", "D": "D", "R": "R"}
    nodes: dict[str, list[Node]] = {}
    try:
        for kind, n in layout.items():
            nodes[kind] = [start_node(roles[kind]) for _ in range(n)]
    except Exception:
        kill_all(nodes)
        raise
    return router_over(nodes, **cfg)


@pytest.fixture
def cluster_factory() -> Iterator[Any]:
    made: list[Cluster] = []

    def make(layout: dict[str, int], **cfg: Any) -> Cluster:
        c = start_cluster(layout, **cfg)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()
