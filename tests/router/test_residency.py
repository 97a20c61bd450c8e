"""Issue 16: exact residency from the nodes' KV events (vLLM's ZMQ + msgpack format, which the emulator
publishes too) — the router's count equals the node's own `cached_tokens`, an evicted prefix vetoes
local, a restarted node's index empties, and a broken publisher is counted, never fatal."""

from __future__ import annotations

import time
from typing import Any, Callable

import httpx
import msgpack
import zmq

from tests.helpers import answer_text, assistant, free_port, user
from tests.router.conftest import Cluster, Node, kill_all, router_over, start_node


def wait_for(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def start(n_pd: int = 2, node_args: tuple[str, ...] = (), **cfg: Any) -> tuple[Cluster, dict[str, str]]:
    """1 P + n_pd pD emulated nodes publishing KV events, and a router subscribed to them."""
    endpoints: dict[str, str] = {}
    nodes: dict[str, list[Node]] = {"P": [], "pD": []}
    try:
        nodes["P"].append(start_node("P"))
        for _ in range(n_pd):
            ep = f"tcp://127.0.0.1:{free_port()}"
            node = start_node("D", "--kv-events-endpoint", ep, *node_args)
            nodes["pD"].append(node)
            endpoints[node.url] = ep
    except Exception:
        kill_all(nodes)
        raise

    def spec(n: Node) -> str:
        return f"{n.url};kv_events={endpoints[n.url]}" if n.url in endpoints else n.url

    settings = {"prompt_renderer": "word-rule", "load_interval": 0.2, **cfg}
    return router_over(nodes, spec, **settings), endpoints


def residency_of(c: Cluster, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = c.admin("POST", "/admin/residency", json={"messages": messages})
    assert r.status_code == 200, r.text
    return {n["url"]: n for n in r.json()["nodes"]}


def node_entry(c: Cluster, url: str) -> dict[str, Any]:
    return next(n for n in c.admin("GET", "/admin/nodes").json()["nodes"] if n["url"] == url)


def cached_tokens(r: httpx.Response) -> int:
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_router_residency_equals_the_nodes_cached_tokens_for_the_next_turn() -> None:
    c, _ = start(policy="local")
    try:
        for i in range(3):
            sid = {"x-session-id": f"exact-{i}"}
            history = [user(f"conversation {i} asks about block hashing in prefix caches " * (3 + 4 * i))]
            r1 = c.chat(history, headers=sid, max_tokens=12)
            assert r1.status_code == 200, r1.text
            holder = r1.headers["x-ppd-node"]
            history += [assistant(answer_text(r1)), user("and what happens next?")]
            # The events of the turn reach the router asynchronously.
            wait_for(lambda: node_entry(c, holder)["residency"]["mode"] == "exact")
            want: list[int] = []

            def settled() -> bool:
                want[:] = [residency_of(c, history)[holder]["cached_tokens"]]
                return want[0] > 0

            wait_for(settled)
            time.sleep(0.3)  # let the last step's events land
            predicted = residency_of(c, history)[holder]["cached_tokens"]
            r2 = c.chat(history, headers=sid, max_tokens=4)
            assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-node"]) == ("local", holder)
            assert cached_tokens(r2) == predicted, (cached_tokens(r2), predicted)
            # The other pD holds none of it.
            others = [u for u, n in residency_of(c, history).items() if u != holder]
            assert all(residency_of(c, history)[u]["cached_tokens"] in (0, None) for u in others)
        counts = node_entry(c, holder)["residency"]["events"]
        assert counts["events"] > 0 and counts["malformed"] == 0
        assert "ppd_residency_mode" in c.client.get(c.url + "/metrics").text
    finally:
        c.stop()


def test_an_evicted_prefix_vetoes_local_as_not_resident() -> None:
    # 48 blocks of 16 tokens: a few other conversations push the first one out.
    c, _ = start(n_pd=1, node_args=("--kv-blocks", "48"), policy="local")
    try:
        sid = {"x-session-id": "evicted"}
        history = [user("the conversation whose cache will be evicted " * 12)]
        r1 = c.chat(history, headers=sid, max_tokens=8)
        assert r1.status_code == 200, r1.text
        history += [assistant(answer_text(r1)), user("still there?")]
        for i in range(6):
            other = c.chat([user(f"another conversation {i} filling the cache " * 40)], max_tokens=8)
            assert other.status_code == 200, other.text
        holder = r1.headers["x-ppd-node"]
        wait_for(lambda: (residency_of(c, history)[holder]["cached_tokens"] or 0) < 32)
        r2 = c.chat(history, headers=sid, max_tokens=4)
        assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"]) == ("pd", "not_resident")
    finally:
        c.stop()


def test_a_broken_publisher_is_counted_and_the_router_keeps_serving() -> None:
    c, endpoints = start(n_pd=1, policy="local")
    ctx = zmq.Context()
    try:
        url, ep = next(iter(endpoints.items()))
        rogue = ctx.socket(zmq.PUB)
        rogue.connect(ep)
        time.sleep(0.5)  # PUB/SUB: the connection must stand before messages count
        bad = [
            [b"kv", (1 << 40).to_bytes(8, "big"), b"\xc1\xc1not msgpack"],
            [b"kv", b"short"],
            [b"kv", (1 << 40 + 1).to_bytes(8, "big"), msgpack.packb([0.0, [{"type": "FutureEvent"}]])],
            [b"kv", (1 << 41).to_bytes(8, "big"), msgpack.packb({"not": "a batch"})],
        ]
        for frames in bad:
            rogue.send_multipart(frames)
        wait_for(lambda: node_entry(c, url)["residency"]["events"]["malformed"] >= 3)
        counts = node_entry(c, url)["residency"]["events"]
        assert counts["skipped"] >= 1, counts
        rogue.close(linger=0)  # the publisher disappears
        r = c.chat([user("still serving?")])
        assert r.status_code == 200, r.text
        assert c.client.get(c.url + "/health").status_code == 200
    finally:
        ctx.term()
        c.stop()


def test_a_node_registered_at_run_time_is_subscribed_and_unsubscribed_with_it() -> None:
    c, _ = start(n_pd=1, policy="local")
    ep = f"tcp://127.0.0.1:{free_port()}"
    late = start_node("D", "--kv-events-endpoint", ep)
    try:
        for attempt in range(2):
            r = c.admin("POST", "/admin/nodes", json={"url": late.url, "role": "pD", "kv_events": ep})
            assert r.status_code == 201, r.text
            # The node's own turns (sent to it directly) reach the router as KV events once its
            # publisher has connected (PUB/SUB drops what it publishes before that).
            sent = [0]

            def subscribed() -> bool:
                sent[0] += 1
                direct = httpx.post(
                    late.url + "/v1/chat/completions",
                    json={"model": "meta-llama/Llama-3.1-8B-Instruct",
                          "messages": [user(f"late node {attempt} {sent[0]} " * 20)], "max_tokens": 4},
                    timeout=10,
                )
                assert direct.status_code == 200, direct.text
                time.sleep(0.2)
                return bool(node_entry(c, late.url)["residency"]["mode"] == "exact")

            wait_for(subscribed)
            assert node_entry(c, late.url)["residency"]["blocks"] > 0
            # Removed, the node's subscriber unbinds its endpoint: registering it again binds anew.
            assert c.admin("DELETE", f"/admin/nodes?url={late.url}").status_code == 200
        bad = c.admin("POST", "/admin/nodes", json={"url": late.url, "role": "pD", "kv_events": "udp://x:1"})
        assert bad.status_code == 400 and "tcp://" in bad.text
    finally:
        late.kill()
        c.stop()
