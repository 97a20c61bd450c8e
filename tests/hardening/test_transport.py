"""Client connections: header-read, body-read and keep-alive timeouts, the connection cap, graceful stop.

Every bound below only proves "does not hang": a timeout of 1 s must act within 10 s.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from ppd_router import ConfigError, Router
from tests.helpers import free_port

from .conftest import OPEN, assert_openai_error, closed_within, connect, read_answer

RUNTIMES = ["thread-per-core", "work-stealing"]

MODELS = b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_connection_without_a_complete_head_is_closed_after_header_read_timeout(serve, runtime):
    r = serve(header_read_timeout=1, runtime=runtime, worker_threads=2)
    silent = connect(r.port)
    partial = connect(r.port)
    partial.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: appl")
    # Nothing came: closed without a word.
    assert closed_within(silent, 10)
    # Part of a head came: a 408 in OpenAI form, then closed.
    assert_openai_error(read_answer(partial), 408, "header_timeout")
    assert closed_within(partial, 10)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_body_shorter_than_its_content_length_gets_a_408_and_the_connection_closes(serve, runtime):
    r = serve(body_read_timeout=1, admin_token="secret", runtime=runtime)
    for head in (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n",
        b"PUT /admin/weights HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer secret\r\nContent-Length: 100\r\n\r\n",
    ):
        s = connect(r.port)
        s.sendall(head + b'{"messages"')
        assert_openai_error(read_answer(s), 408, "body_timeout")
        assert closed_within(s, 10)


def test_an_idle_kept_alive_connection_is_closed_after_keep_alive_timeout(serve):
    r = serve(keep_alive_timeout=1)
    s = connect(r.port)
    s.sendall(MODELS)
    assert read_answer(s).status == 200
    assert closed_within(s, 10)


def test_the_keep_alive_wait_is_not_the_header_read_timeout(serve):
    # A kept-alive connection may idle longer than a head may take to arrive.
    r = serve(header_read_timeout=1, keep_alive_timeout=60)
    s = connect(r.port)
    s.sendall(MODELS)
    assert read_answer(s).status == 200
    time.sleep(3)
    s.sendall(MODELS)
    assert read_answer(s).status == 200
    s.close()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_connections_beyond_max_connections_get_a_503_with_retry_after_then_close(serve, runtime):
    r = serve(max_connections=3, runtime=runtime, worker_threads=2)
    held = []
    for _ in range(3):  # each answered once: each is surely open and counted
        s = connect(r.port)
        s.sendall(MODELS)
        assert read_answer(s).status == 200
        held.append(s)
    extra = connect(r.port)
    extra.sendall(MODELS)
    a = read_answer(extra)
    assert_openai_error(a, 503, "too_many_connections")
    assert a.headers["retry-after"] == "1"
    assert closed_within(extra, 10)
    # A place freed is a place taken again.
    held.pop().close()
    deadline = time.monotonic() + 10
    while True:
        s = connect(r.port)
        s.sendall(MODELS)
        a = read_answer(s)
        s.close()
        if a.status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert a.status == 200
    for s in held:
        s.close()


def test_the_new_settings_are_checked_and_named(serve):
    for key, value in [
        ("max_connections", 0),
        ("header_read_timeout", 0),
        ("body_read_timeout", -1),
        ("keep_alive_timeout", -0.5),
    ]:
        with pytest.raises(ConfigError, match=f"{key}`: must be"):
            Router(json.dumps({"replica": ["http://127.0.0.1:9"], key: value}))


class SlowStream(BaseHTTPRequestHandler):
    """A vLLM-shaped stream of 8 events, one every 0.2 s."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        body = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(8):
            ev = f'data: {{"choices":[{{"index":0,"delta":{{"content":"t{i}"}}}}]}}\n\n'.encode()
            self.wfile.write(f"{len(ev):x}\r\n".encode() + ev + b"\r\n")
            self.wfile.flush()
            time.sleep(0.2)
        done = b"data: [DONE]\n\n"
        self.wfile.write(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_stop_lets_an_open_stream_finish_and_closes_idle_connections(runtime):
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), SlowStream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    node = f"http://127.0.0.1:{upstream.server_address[1]}"
    router = Router(json.dumps({"replica": [node], "policy": "replica", "port": free_port(), "runtime": runtime}))
    url = router.start()
    try:
        idle = connect(int(url.rsplit(":", 1)[1]))
        idle.sendall(MODELS)
        assert read_answer(idle).status == 200
        got: list[bytes] = []
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=20) as resp:
            assert resp.status_code == 200
            chunks = resp.iter_bytes()
            got.append(next(chunks))
            stopper = threading.Thread(target=router.stop)
            stopper.start()
            got.extend(chunks)
        stopper.join(20)
        assert not stopper.is_alive()
        text = b"".join(got)
        assert text.count(b"data: ") == 9 and text.rstrip().endswith(b"data: [DONE]"), text
        assert closed_within(idle, 1)  # already closed by the stop
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/v1/models", timeout=2)
    finally:
        while OPEN:
            OPEN.pop().close()
        router.stop()
        upstream.shutdown()
