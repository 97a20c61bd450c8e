"""Issue 15, defect 1: nothing a client sends may steer a node's KV connector, and no node's internal
KV parameters reach the client; only JSON bodies are taken (no cross-site "simple" POSTs)."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import httpx
import pytest

from tests.helpers import answer_text, assistant, user
from tests.router.conftest import cluster_factory  # noqa: F401 - the fixture



class Trap:
    """A listener on 127.0.0.1 that counts the connections made to it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.hits += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


def hostile_params(trap: Trap) -> dict[str, Any]:
    """What made a pD connect to a host:port of the client's choosing (3 of 3 times on main)."""
    return {"do_remote_prefill": True, "do_remote_decode": True, "remote_host": "127.0.0.1",
            "remote_port": trap.port, "remote_engine_id": "attacker", "remote_request_id": "x",
            "remote_block_ids": [[1, 2, 3]]}


def no_router_fields(resp: httpx.Response) -> None:
    assert resp.status_code == 200, resp.text
    assert "kv_transfer_params" not in resp.json(), resp.text


@pytest.mark.parametrize("stream", [False, True])
def test_client_kv_transfer_params_reach_no_node_on_any_path(cluster_factory, stream: bool) -> None:  # noqa: F811
    trap = Trap()
    try:
        c = cluster_factory({"P": 1, "pD": 1}, policy="local")
        first = [user("tell me about the sea")]
        r1 = c.chat(first)
        no_router_fields(r1)
        turn2 = [*first, assistant(answer_text(r1)), user("and the sky")]
        # Turn 1 (pd), Turn 2 (local), a Turn 2 for a conversation the router does not know (pd):
        # each carries the hostile fields.
        for msgs in (first, turn2, [user("other"), assistant("x"), user("y")]):
            payload = {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": msgs, "max_tokens": 4,
                       "stream": stream, "kv_transfer_params": hostile_params(trap)}
            r = c.client.post(c.url + "/v1/chat/completions", json=payload)
            assert r.status_code == 200, r.text
            assert "kv_transfer_params" not in r.text, r.text
        held = c.nodes["pD"][0].metric("emulator:kv_held_requests")
        assert trap.hits == 0, f"a node connected to the client's host:port {trap.hits} times"
        assert held == 0, f"the pD holds {held} requests' KV for a remote decode the client asked for"
    finally:
        trap.close()


def test_replica_and_no_kv_protocol_paths_strip_them_too(cluster_factory) -> None:  # noqa: F811
    trap = Trap()
    try:
        for layout, cfg in (({"R": 1}, {"policy": "replica"}), ({"pD": 1}, {"policy": "pd", "kv_protocol": "none"})):
            c = cluster_factory(layout, **cfg)
            r = c.chat([user("hi")], kv_transfer_params=hostile_params(trap))
            no_router_fields(r)
            node = next(iter(c.nodes.values()))[0]
            assert node.metric("emulator:kv_held_requests") == 0
        assert trap.hits == 0
    finally:
        trap.close()


def test_answers_never_carry_a_nodes_kv_parameters(cluster_factory) -> None:  # noqa: F811
    # A P's answer carries its engine id, host, port and block ids; the client of a pd turn
    # gets D's answer, which must not carry any either, streamed or not.
    c = cluster_factory({"P": 1, "pD": 1}, policy="pd")
    r = c.chat([user("hello")])
    no_router_fields(r)
    with c.client.stream("POST", c.url + "/v1/chat/completions",
                         json={"messages": [user("hello again")], "max_tokens": 4, "stream": True}) as s:
        body = s.read().decode()
    assert s.status_code == 200
    assert "kv_transfer_params" not in body
    assert body.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_only_json_bodies_are_taken(cluster_factory, content_type: str | None) -> None:  # noqa: F811
    c = cluster_factory({"R": 1}, policy="replica")
    body = json.dumps({"messages": [user("hi")], "max_tokens": 2})
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(c.url + "/v1/chat/completions", content=body, headers=headers, timeout=10)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert c.nodes["R"][0].served() == 0
