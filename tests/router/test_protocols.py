"""What P and D receive on the pd path, byte for byte: NIXL kv_transfer_params, legacy P2pNccl request ids, and `none`."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from ppd_router import Router

from .conftest import free_port

P_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p0",
        "remote_block_ids": [3, 4, 5], "remote_host": "127.0.0.1", "remote_port": 5600,
        "remote_request_id": "abc", "tp_size": 1}


def make_stub(name: str, log: list[dict[str, Any]]):
    class Stub(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(200, b'{"object":"list","data":[{"id":"m","object":"model"}]}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            log.append({"node": name, "body": body, "request_id": self.headers.get("x-request-id")})
            answer: dict[str, Any] = {"id": "x", "object": "chat.completion",
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
            if name == "P" and body.get("kv_transfer_params", {}).get("do_remote_decode"):
                answer["kv_transfer_params"] = P_KV
            self._send(200, json.dumps(answer).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def stubs():
    log: list[dict[str, Any]] = []
    p, p_url = make_stub("P", log)
    d, d_url = make_stub("D", log)
    routers: list[Router] = []

    def router(kv_protocol: str, p_node: str = "", d_node: str = "") -> str:
        r = Router(json.dumps({"prefill": [p_url + p_node], "pd_capable": [d_url + d_node], "policy": "pd",
                               "kv_protocol": kv_protocol, "port": free_port()}))
        routers.append(r)
        return r.start()

    yield router, log
    for r in routers:
        r.stop()
    p.shutdown()
    d.shutdown()


REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "max_completion_tokens": 50,
           "min_tokens": 10, "stream": False, "temperature": 0}


def test_nixl_p_gets_a_prefill_only_request_and_d_gets_ps_params_unchanged(stubs):
    router, log = stubs
    url = router("nixl")
    r = httpx.post(url + "/v1/chat/completions", json=REQUEST, timeout=10)
    assert r.status_code == 200, r.text
    p, d = log
    assert (p["node"], d["node"]) == ("P", "D")
    assert p["body"]["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                               "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert (p["body"]["stream"], p["body"]["max_tokens"], p["body"]["max_completion_tokens"]) == (False, 1, 1)
    assert "min_tokens" not in p["body"] and "stream_options" not in p["body"]
    assert p["body"]["messages"] == REQUEST["messages"]
    assert d["body"] == {**REQUEST, "kv_transfer_params": P_KV}
    assert p["request_id"] == d["request_id"] and p["request_id"]


def test_p2pnccl_encodes_both_zmq_addresses_in_the_request_id(stubs):
    router, log = stubs
    url = router("p2pnccl", ";zmq=127.0.0.1:21001", ";zmq=127.0.0.1:22001")
    r = httpx.post(url + "/v1/chat/completions", json=REQUEST, timeout=10)
    assert r.status_code == 200, r.text
    p, d = log
    assert re.fullmatch(r"___prefill_addr_127\.0\.0\.1:21001___decode_addr_127\.0\.0\.1:22001_[0-9a-f]{32}", p["request_id"])
    assert d["request_id"] == p["request_id"]
    assert p["body"]["max_tokens"] == 1 and "kv_transfer_params" not in p["body"]
    assert d["body"] == REQUEST


def test_p2pnccl_without_zmq_addresses_is_a_clear_503(stubs):
    router, log = stubs
    r = httpx.post(router("p2pnccl") + "/v1/chat/completions", json=REQUEST, timeout=10)
    assert r.status_code == 503
    assert "zmq" in r.json()["error"]["message"]
    assert log == []


def test_kv_protocol_none_sends_the_request_to_d_alone(stubs):
    router, log = stubs
    r = httpx.post(router("none") + "/v1/chat/completions", json=REQUEST, timeout=10)
    assert r.status_code == 200
    assert [e["node"] for e in log] == ["D"]
    assert log[0]["body"] == REQUEST
