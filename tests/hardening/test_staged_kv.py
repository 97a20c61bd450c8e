"""Issue 15, defect 8: KV that a P holds for a hand-off to D is freed at once when the hand-off
will not happen — the client left after P answered but before D pulled, or D failed before
pulling — instead of staying pinned for P's whole KV lease (the emulator holds it 480 s)."""

from __future__ import annotations

import json
import socket
import time

from tests.hardening.test_failover import set_faults
from tests.helpers import user
from tests.router.conftest import Node, cluster_factory  # noqa: F401 - the fixture


def held(p: Node) -> float:
    return p.metric("emulator:kv_held_requests")


def wait_for(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def test_a_client_that_leaves_before_d_pulls_does_not_pin_ps_kv(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, policy="pd")
    p, d = c.nodes["P"][0], c.nodes["pD"][0]
    set_faults(d, latency_ms=4000)  # D reads the request but pulls only after 4 s
    host, port = c.url.removeprefix("http://").split(":")
    body = json.dumps({"messages": [user("hello " * 200)], "max_tokens": 8, "stream": True}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert wait_for(lambda: held(p) == 1, 3), "P never staged the KV"
    # The client is gone; D has not pulled (it is still in its 4 s delay).
    left = time.monotonic()
    assert wait_for(lambda: held(p) == 0, 5), "P still holds the KV 5 s after the client left"
    assert time.monotonic() - left < 5
    assert d.served() == 0
    metrics = c.client.get(c.url + "/metrics").text
    assert 'ppd_kv_releases_total{result="sent"} 1' in metrics, metrics


def test_a_d_that_fails_before_pulling_does_not_pin_ps_kv(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 2}, policy="pd", breaker_failures=100)
    p = c.nodes["P"][0]
    bad = c.nodes["pD"][0]
    set_faults(bad, error_rate=1.0)  # answers 500 before pulling
    for i in range(4):
        r = c.chat([user(f"staged {i}")])
        assert r.status_code == 200, r.text
    # Each turn that met the failing D was served by the other (after a fresh prefill), and the
    # KV P had staged for the failing D was released through the other D.
    assert wait_for(lambda: held(p) == 0, 5), f"P still holds {held(p)} requests' KV"
