"""A router with no live node, and raw-socket HTTP helpers, for the transport's own behaviour."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest

from ppd_router import Router
from tests.helpers import free_port

# Nothing listens here: health checks fail at once, and the router still answers
# everything that does not need a node (/v1/models, /metrics, the admin API, refusals).
DEAD_NODE = "http://127.0.0.1:9"


@dataclass
class Served:
    router: Router
    url: str
    port: int


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    """Starts embedded routers with the given settings; stops them after the test."""
    made: list[Router] = []

    def start(**settings: Any) -> Served:
        port = settings.pop("port", None) or free_port()
        cfg = {"replica": [DEAD_NODE], "policy": "replica", "port": port, "health_interval": 60, **settings}
        router = Router(json.dumps(cfg))
        made.append(router)
        url = router.start()
        return Served(router, url, port)

    yield start
    # A socket a failed test left open must not hold up a stop.
    while OPEN:
        OPEN.pop().close()
    for r in made:
        r.stop()


# Sockets made by `connect`, closed after each test that uses `serve`.
OPEN: list[socket.socket] = []


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    OPEN.append(s)
    return s


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    raw_head: bytes = b""
    extra: bytes = field(default=b"")

    def json(self) -> Any:
        return json.loads(self.body)

    def error_code(self) -> Optional[str]:
        return self.json()["error"]["code"]


def read_answer(sock: socket.socket, timeout: float = 10.0) -> Answer:
    """One HTTP/1.1 answer from the socket (Content-Length bodies, or up to EOF); raises on EOF before a head."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before an answer head; got {data!r}")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return Answer(status, headers, rest[:n], head, rest[n:])
    while True:  # no length: the body ends with the connection
        chunk = sock.recv(65536)
        if not chunk:
            return Answer(status, headers, rest, head)
        rest += chunk


def closed_within(sock: socket.socket, timeout: float) -> bool:
    """True when the router closes the connection (EOF or reset) within `timeout` s; earlier bytes are skipped."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except (ConnectionResetError, BrokenPipeError):
            return True


def assert_openai_error(a: Answer, status: int, code: Optional[str] = None) -> dict[str, Any]:
    assert a.status == status, (a.status, a.raw_head, a.body)
    assert a.headers.get("content-type", "").startswith("application/json"), (a.raw_head, a.body)
    err = a.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err
