"""ZMQ service discovery: vLLM P2pNccl-style registrations feeding the router's registry.

Nodes send msgpack maps to a ROUTER socket, as vLLM's P2pNccl connector does:
``{"type": "P" | "D", "http_address": "host:port", "zmq_address": "host:port"}``,
repeated as a heartbeat. Extensions: ``"role": "pD" | "R"`` names the PPD role
(a plain ``"D"`` is a decode-only node), ``"op": "deregister"`` removes the
node. The Rust router drops registered nodes whose heartbeats stop
(``heartbeat_timeout``, 30 s by default).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import msgpack
import zmq

from ppd_router._core import Router
from ppd_router.errors import RegistrationError

log = logging.getLogger("ppd_router.discovery")

ROLES = {"P": "P", "D": "D", "pD": "pD", "PD": "pD", "R": "R"}


def parse_registration(payload: bytes) -> dict[str, Any]:
    """The registration in a message, or RegistrationError saying what is wrong."""
    try:
        msg = msgpack.unpackb(payload, raw=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as e:
        raise RegistrationError(f"not msgpack: {e}") from None
    if not isinstance(msg, dict):
        raise RegistrationError("registration must be a map")
    role = ROLES.get(str(msg.get("role") or msg.get("type") or ""))
    if role is None:
        raise RegistrationError(f"unknown node type {msg.get('role') or msg.get('type')!r}")
    http = msg.get("http_address")
    if not isinstance(http, str) or not http:
        raise RegistrationError("missing http_address")
    url = http if http.startswith(("http://", "https://")) else f"http://{http}"
    zmq_addr = msg.get("zmq_address")
    return {
        "url": url,
        "role": role,
        "zmq_address": zmq_addr if isinstance(zmq_addr, str) and zmq_addr else None,
        "deregister": msg.get("op") == "deregister",
    }


class Discovery:
    """A ROUTER socket on a thread of its own, registering nodes with a started router."""

    def __init__(self, router: Router, address: str) -> None:
        self.router = router
        self.address = address
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.accepted = 0
        self.rejected = 0

    @property
    def endpoint(self) -> str:
        return self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def handle(self, payload: bytes) -> None:
        try:
            reg = parse_registration(payload)
        except RegistrationError as e:
            self.rejected += 1
            log.warning("discovery: rejected registration: %s", e)
            return
        if reg["deregister"]:
            self.router.deregister_node(reg["url"])
        elif self.router.register_node(reg["url"], reg["role"], reg["zmq_address"], "zmq"):
            log.info("discovery: registered %s %s", reg["role"], reg["url"])
        self.accepted += 1

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(200)):
                continue
            frames = self._sock.recv_multipart()
            # ROUTER frames: identity, [empty delimiter], payload.
            self.handle(frames[-1])
        self._sock.close(0)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ppd-discovery", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Blocks until interrupted (Ctrl-C) or stopped."""
        try:
            while not self._stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
