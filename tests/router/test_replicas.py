"""Issue 19: router replicas that agree on placement without talking — 3 `ppd-router serve` processes
with `--placement rendezvous` in front of 1 P + 3 pD emulated nodes (separate processes publishing KV
events) and a Redis of the test's own for their admin changes (`--state`), every turn sent to a random
replica: later turns land where their KV is (checked against the node's own `cached_tokens`), a weight
change through one replica holds on all three within 1 s, a killed replica loses only its in-flight
requests, and a fourth pD added through one replica moves no existing conversation while taking about a
quarter of new ones."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Optional

import httpx
import pytest

from tests.helpers import answer_text, assistant, free_port, metric_sum, user
from tests.router.conftest import Node, kill_all, start_healthy, start_node
from tests.router.test_shared_state import Redis, needs_redis

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BLOCK = 16  # the emulator's KV block size in tokens, as vLLM's default


@dataclass
class Replica:
    port: int
    proc: subprocess.Popen
    url: str = ""

    def __post_init__(self) -> None:
        self.url = f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, self.url + path, headers={"authorization": "Bearer secret"}, timeout=10, **kw)


def start_replica(node_flags: list[str], *extra: str) -> Replica:
    port = free_port()
    cmd = [
        sys.executable, "-m", "ppd_router.cli", "serve", "--port", str(port), *node_flags,
        "--placement", "rendezvous", "--policy", "local", "--prompt-renderer", "word-rule",
        "--expose-node-header", "--load-interval", "0.2", "--health-interval", "0.5",
        "--admin-token", "secret", *extra,
    ]  # fmt: skip
    return Replica(port, start_healthy(cmd, port, stderr=subprocess.DEVNULL))


@dataclass
class Fleet:
    nodes: dict[str, list[Node]]
    endpoints: dict[str, str]
    replicas: list[Replica] = field(default_factory=list)

    def spec(self, n: Node) -> str:
        # The node's publisher binds; every replica connects to it (ZMQ PUB/SUB fans out).
        return f"{n.url};kv_events_from={self.endpoints[n.url]}"

    def node_flags(self) -> list[str]:
        flags = [f"--prefill={p.url}" for p in self.nodes["P"]]
        return flags + [f"--pd-capable={self.spec(d)}" for d in self.nodes["pD"]]

    def add_pd(self) -> Node:
        ep = f"tcp://127.0.0.1:{free_port()}"
        node = start_node("D", "--kv-events-endpoint", ep, "--kv-events-bind")
        self.nodes["pD"].append(node)
        self.endpoints[node.url] = ep
        return node

    def stop(self) -> None:
        for r in self.replicas:
            r.kill()
        kill_all(self.nodes)


@pytest.fixture
def fleet() -> Any:
    f = Fleet({"P": [], "pD": []}, {})
    with tempfile.TemporaryDirectory() as workdir:
        redis = Redis(workdir)
        try:
            f.nodes["P"].append(start_node("P"))
            for _ in range(3):
                f.add_pd()
            flags = [*f.node_flags(), "--state", redis.url]
            f.replicas = [start_replica(flags) for _ in range(3)]
            yield f
        finally:
            f.stop()
            redis.kill()


@dataclass
class Turn:
    conv: int
    turn: int
    replica: int
    status: int = 0
    path: str = ""
    node: str = ""
    prompt_tokens: int = 0
    cached: int = 0
    error: str = ""


class Conversation:
    """One client's conversation: each turn to a replica the caller picks, the history grown by answers."""

    def __init__(self, i: int, named: bool) -> None:
        self.i = i
        self.headers = {"x-session-id": f"replica-conv-{i}"} if named else {}
        # Openings of a few hundred tokens: several KV blocks, distinct per conversation.
        self.history = [user(f"conversation {i} opens with its own question about replicas " * 6)]
        self.turns: list[Turn] = []

    def send(self, client: httpx.Client, replica: Replica, index: int) -> Turn:
        t = Turn(self.i, len(self.turns) + 1, index)
        body = {"model": MODEL, "messages": self.history, "max_tokens": 12, "temperature": 0}
        try:
            r = client.post(replica.url + "/v1/chat/completions", json=body, headers=self.headers)
        except httpx.HTTPError as e:
            t.error = type(e).__name__
            self.turns.append(t)
            return t
        t.status = r.status_code
        if r.status_code == 200:
            t.path, t.node = r.headers["x-ppd-path"], r.headers["x-ppd-node"]
            usage = r.json()["usage"]
            t.prompt_tokens = usage["prompt_tokens"]
            t.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            self.history = [*self.history, assistant(answer_text(r)), user(f"turn {t.turn + 1} of {self.i}: go on")]
        else:
            t.error = r.text[:200]
        self.turns.append(t)
        return t


def where_its_kv_was(turns: list[Turn]) -> tuple[int, int]:
    """(Turn 2+ requests, those served local on the node of the previous turn with at least that turn's
    prompt cached there, block-aligned — the node's own report)."""
    later = ok = 0
    for prev, t in pairwise(turns):
        if prev.status != 200:
            continue
        later += 1
        held = prev.prompt_tokens // BLOCK * BLOCK
        if t.status == 200 and t.path in ("local", "pull") and t.node == prev.node and t.cached >= held:
            ok += 1
    return later, ok


def run(convs: list[Conversation], replicas: list[Optional[Replica]], turns: int, seed: int) -> None:
    """Each conversation's turns in order, each to a random live replica; conversations in parallel."""
    rng = random.Random(seed)
    picks = {c.i: [rng.randrange(len(replicas)) for _ in range(turns)] for c in convs}
    local = threading.local()

    def one(c: Conversation) -> None:
        client = getattr(local, "client", None) or httpx.Client(timeout=30)
        local.client = client
        for k in range(turns):
            index = picks[c.i][k]
            replica = replicas[index]
            while replica is None:  # a replica gone: the load balancer's next one
                index = (index + 1) % len(replicas)
                replica = replicas[index]
            c.send(client, replica, index)

    with ThreadPoolExecutor(max_workers=12) as pool:
        list(pool.map(one, convs))


def eventually(what: Any, within: float) -> float:
    """Seconds until ``what()`` held, polled; fails past ``within``."""
    start = time.monotonic()
    while not what():
        assert time.monotonic() - start < within, f"not within {within} s"
        time.sleep(0.02)
    return time.monotonic() - start


@needs_redis
def test_every_later_turn_finds_its_kv_through_any_replica(fleet: Fleet) -> None:
    convs = [Conversation(i, named=i % 2 == 0) for i in range(200)]
    run(convs, list(fleet.replicas), turns=4, seed=19)
    turns = [t for c in convs for t in c.turns]
    failed = [t for t in turns if t.status != 200]
    assert not failed, failed[:5]
    later, ok = 0, 0
    for c in convs:
        n, k = where_its_kv_was(c.turns)
        later, ok = later + n, ok + k
    assert later == 600
    missed = [
        (p.turn, t.replica, t.path, t.node == p.node, t.cached, p.prompt_tokens, p.replica)
        for c in convs
        for p, t in pairwise(c.turns)
        if (t.path, t.node) != ("local", p.node) or t.cached < p.prompt_tokens // BLOCK * BLOCK
    ]
    assert ok / later >= 0.99, f"{ok} of {later} Turn 2+ requests found their KV; missed: {missed[:12]}"
    # Every replica served later turns it never saw the start of: adopted, mostly by residency.
    adopted = [metric_sum(httpx.get(r.url + "/metrics").text, "ppd_sessions_adopted") for r in fleet.replicas]
    assert all(a > 0 for a in adopted), adopted
    # Placement spread the conversations: no pD took more than half of them.
    firsts = [c.turns[0].node for c in convs]
    assert max(firsts.count(d.url) for d in fleet.nodes["pD"]) <= 100, {u: firsts.count(u) for u in set(firsts)}


@needs_redis
def test_a_weight_change_through_one_replica_holds_on_all_three_within_a_second(fleet: Fleet) -> None:
    a, *others = fleet.replicas
    put = a.admin("PUT", "/admin/weights", json={"w_ttft": 1, "w_tpot": 3})
    assert put.status_code == 200, put.text

    def everywhere() -> bool:
        return all(r.admin("GET", "/admin/weights").json() == {"w_ttft": 1.0, "w_tpot": 3.0} for r in others)

    eventually(everywhere, 1.0)


@needs_redis
def test_a_killed_replica_loses_only_its_in_flight_requests(fleet: Fleet) -> None:
    convs = [Conversation(i, named=False) for i in range(60)]
    replicas: list[Optional[Replica]] = list(fleet.replicas)
    run(convs, replicas, turns=2, seed=7)
    victim = fleet.replicas[2]
    killer = threading.Timer(0.3, victim.kill)
    killer.start()
    try:
        run(convs, replicas, turns=2, seed=8)
    finally:
        killer.join()
    assert victim.proc.poll() is not None
    turns = [t for c in convs for t in c.turns]
    lost = [t for t in turns if t.status != 200]
    # Only requests sent to the killed replica failed, each as a transport error the client sees.
    assert all(t.replica == 2 and t.error for t in lost), [(t.replica, t.status, t.error) for t in lost[:5]]
    # The others go on: the conversations whose turn was lost continue through a live replica, on their node.
    survivors: list[Optional[Replica]] = [fleet.replicas[0], fleet.replicas[1], None]
    run(convs, survivors, turns=1, seed=9)
    last = [c.turns[-1] for c in convs]
    assert all(t.status == 200 and t.path == "local" for t in last), [(t.status, t.path, t.error) for t in last[:5]]
    for c in convs:
        answered = [t for t in c.turns if t.status == 200]
        assert len({t.node for t in answered}) == 1, [(t.turn, t.node) for t in c.turns]


@needs_redis
def test_a_fourth_pd_moves_no_conversation_and_takes_about_a_quarter_of_new_ones(fleet: Fleet) -> None:
    old = [Conversation(i, named=False) for i in range(40)]
    run(old, list(fleet.replicas), turns=1, seed=1)
    new_pd = fleet.add_pd()
    # Added through one replica; the shared state brings it to the others.
    resp = fleet.replicas[0].admin("POST", "/admin/nodes", json={"url": fleet.spec(new_pd), "role": "pD"})
    assert resp.status_code in (200, 201), resp.text

    def listed_everywhere() -> bool:
        return all(
            any(
                n["url"] == new_pd.url and n["state"] == "healthy"
                for n in r.admin("GET", "/admin/nodes").json()["nodes"]
            )
            for r in fleet.replicas
        )

    eventually(listed_everywhere, 5.0)
    run(old, list(fleet.replicas), turns=2, seed=2)
    for c in old:
        assert {t.node for t in c.turns} == {c.turns[0].node}, [(t.turn, t.node, t.path) for t in c.turns]
    fresh = [Conversation(1000 + i, named=i % 2 == 0) for i in range(160)]
    run(fresh, list(fleet.replicas), turns=1, seed=3)
    share = sum(c.turns[0].node == new_pd.url for c in fresh) / len(fresh)
    assert 0.12 <= share <= 0.4, share
