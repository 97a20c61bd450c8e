"""The SSE relay: bytes unchanged but for the usage chunk the router asked for; mid-stream failure; the openai client."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from ppd_router import Router

from .conftest import free_port, user

CHUNKS = [
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]}\n\n',
]
USAGE = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}\n\n'
DONE = b"data: [DONE]\n\n"


class Upstream(BaseHTTPRequestHandler):
    """A fixed vLLM-shaped stream, split at awkward places; `cut` ends it early."""

    bodies: list = []
    cut = False
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):
        if self.path == "/health":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")
        else:
            body = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        wants = (body.get("stream_options") or {}).get("include_usage")
        events = CHUNKS + ([USAGE] if wants else []) + [DONE]
        raw = b"".join(events)
        if type(self).cut:
            raw = raw[: len(CHUNKS[0]) + 10]
        # Odd split points: events cross chunk boundaries.
        for i in range(0, len(raw), 37):
            piece = raw[i:i + 37]
            self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            self.wfile.flush()
        if type(self).cut:
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def stub_router():
    Upstream.bodies = []
    Upstream.cut = False
    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    router = Router(json.dumps({"replica": [url], "policy": "replica", "port": free_port()}))
    base = router.start()
    yield base
    router.stop()
    server.shutdown()


def stream(base: str, **extra) -> bytes:
    import httpx

    body = {"messages": [user("hi")], "stream": True, **extra}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return r.read()


def test_the_usage_chunk_the_router_asked_for_is_dropped_and_nothing_else_changes(stub_router):
    got = stream(stub_router)
    assert Upstream.bodies[-1]["stream_options"] == {"include_usage": True}
    assert got == b"".join(CHUNKS) + DONE


def test_a_client_that_asked_for_usage_gets_the_stream_byte_for_byte(stub_router):
    got = stream(stub_router, stream_options={"include_usage": True})
    assert got == b"".join(CHUNKS) + USAGE + DONE


def test_mid_stream_failure_becomes_an_sse_error_event(stub_router):
    Upstream.cut = True
    got = stream(stub_router)
    assert got.startswith(CHUNKS[0])
    last = got.strip().split(b"\n\n")[-1]
    assert last.startswith(b"data: ")
    err = json.loads(last[len(b"data: "):])
    assert err["error"]["type"] == "upstream_error"


def test_the_openai_client_works_unchanged(stub_router):
    client = openai.OpenAI(base_url=stub_router + "/v1", api_key="unused")
    out = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}], stream=True)
    text = "".join((c.choices[0].delta.content or "") for c in out if c.choices)
    assert text == "Hello"
    models = client.models.list()
    assert [m.id for m in models.data] == ["stub"]
