"""ZMQ discovery: vLLM P2pNccl registrations add nodes, heartbeats keep them, silence removes them;
nodes added with POST /admin/nodes stay until deleted."""

from __future__ import annotations

import json
import time

import httpx
import msgpack
import pytest
import zmq

from ppd_router import Router
from ppd_router.discovery import Discovery, RegistrationError, parse_registration

from .conftest import free_port


def test_p2pnccl_messages_parse_with_the_role_extension():
    reg = parse_registration(msgpack.packb({"type": "P", "http_address": "10.0.0.1:8100", "zmq_address": "10.0.0.1:21001"}))
    assert reg == {"url": "http://10.0.0.1:8100", "role": "P", "zmq_address": "10.0.0.1:21001", "deregister": False}
    assert parse_registration(msgpack.packb({"type": "D", "role": "pD", "http_address": "h:1"}))["role"] == "pD"
    for bad in [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"type": "X", "http_address": "h:1"}), msgpack.packb({"type": "P"})]:
        with pytest.raises(RegistrationError):
            parse_registration(bad)


def nodes(router: Router) -> dict[str, str]:
    return {n["url"]: n["role"] for n in json.loads(router.nodes_json())["nodes"]}


def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_registration_heartbeat_expiry_and_deregistration():
    router = Router(json.dumps({"port": free_port(), "heartbeat_timeout": 0.6, "health_interval": 0.2}))
    router.start()
    disc = Discovery(router, "tcp://127.0.0.1:0")
    disc.start()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(disc.endpoint)
    try:
        sock.send(msgpack.packb({"type": "P", "http_address": "127.0.0.1:9", "zmq_address": "127.0.0.1:21001"}))
        sock.send(msgpack.packb({"type": "D", "role": "pD", "http_address": "127.0.0.1:10"}))
        sock.send(b"garbage")
        assert wait_for(lambda: nodes(router) == {"http://127.0.0.1:9": "P", "http://127.0.0.1:10": "pD"})
        assert wait_for(lambda: disc.rejected == 1)
        # Keep the pD alive with heartbeats; the P falls silent and is removed.
        for _ in range(12):
            sock.send(msgpack.packb({"type": "D", "role": "pD", "http_address": "127.0.0.1:10"}))
            time.sleep(0.1)
        assert wait_for(lambda: nodes(router) == {"http://127.0.0.1:10": "pD"})
        sock.send(msgpack.packb({"type": "D", "role": "pD", "http_address": "127.0.0.1:10", "op": "deregister"}))
        assert wait_for(lambda: nodes(router) == {})
    finally:
        sock.close(0)
        disc.stop()
        router.stop()


def test_admin_added_nodes_outlive_the_heartbeat_timeout_while_zmq_ones_expire():
    router = Router(json.dumps({"port": free_port(), "heartbeat_timeout": 0.6, "health_interval": 0.2,
                                "admin_token": "secret"}))
    url = router.start()
    disc = Discovery(router, "tcp://127.0.0.1:0")
    disc.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(disc.endpoint)
    auth = {"authorization": "Bearer secret"}
    try:
        r = httpx.post(url + "/admin/nodes", json={"url": "http://127.0.0.1:11", "role": "pD"}, headers=auth)
        assert r.status_code == 201, r.text
        sock.send(msgpack.packb({"type": "P", "http_address": "127.0.0.1:12", "zmq_address": "127.0.0.1:21002"}))
        assert wait_for(lambda: "http://127.0.0.1:12" in nodes(router))
        # The ZMQ node falls silent and goes (several heartbeat timeouts); the admin node stays.
        assert wait_for(lambda: "http://127.0.0.1:12" not in nodes(router), timeout=10)
        time.sleep(1.0)  # more than a heartbeat timeout after the ZMQ node went
        assert nodes(router) == {"http://127.0.0.1:11": "pD"}
        listed = httpx.get(url + "/admin/nodes", headers=auth).json()["nodes"]
        assert [n["source"] for n in listed] == ["admin"]
        # ... until deleted.
        r = httpx.delete(url + "/admin/nodes", params={"url": "http://127.0.0.1:11"}, headers=auth)
        assert r.status_code == 200, r.text
        assert nodes(router) == {}
    finally:
        sock.close(0)
        disc.stop()
        router.stop()
