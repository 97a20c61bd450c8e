"""Issue 15 on real vLLM: a client's kv_transfer_params never reach a node (defect 1), and KV that
P staged for a hand-off that did not happen is freed at once, not after P's KV lease (defect 8)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from ppd_router import Router
from tests.hardening.test_request_fields import Trap
from tests.helpers import free_port, metric_sum

from .conftest import Tier, answer, assistant, conversation_start, user

pytestmark = pytest.mark.vllm


def kv_usage(url: str) -> float:
    return metric_sum(httpx.get(url + "/metrics", timeout=10).text, "vllm:kv_cache_usage_perc")


def settles_to(url: str, idle: float, within: float) -> bool:
    """Whether the node's KV usage is back at `idle` within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if kv_usage(url) <= idle + 1e-9:
            return True
        time.sleep(0.2)
    return kv_usage(url) <= idle + 1e-9


def test_a_clients_kv_transfer_params_reach_no_vllm_node(tier: Tier) -> None:
    trap = Trap()
    try:
        tier.set_policy("local")
        idle = {u: kv_usage(u) for u in [tier.p, *tier.pd_nodes()]}
        start = conversation_start("hostile")
        hostile = {"do_remote_prefill": True, "do_remote_decode": True, "remote_host": "127.0.0.1",
                   "remote_port": trap.port, "remote_engine_id": "attacker", "remote_request_id": "x-1",
                   "remote_block_ids": [[0, 1]], "tp_size": 1}
        r1 = tier.chat(start, "hostile-1", kv_transfer_params=hostile)
        r2 = tier.chat([*start, assistant(answer(r1)), user("And the next night?")], "hostile-1",
                       kv_transfer_params=hostile)
        assert r2.headers["x-ppd-path"] == "local"
        for r in (r1, r2):
            assert "kv_transfer_params" not in r.json(), r.text
        assert trap.hits == 0, "a vLLM node connected to the client's host:port"
        # No node keeps blocks pinned for a remote decode the client asked for.
        for u, before in idle.items():
            assert settles_to(u, before, 5), f"{u} holds KV: {kv_usage(u)} > {before}"
    finally:
        trap.close()


class FailingDecode(BaseHTTPRequestHandler):
    """A decode node that looks healthy but answers every generation request with a 500."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        body = b'{"object":"list","data":[]}' if self.path.startswith("/v1/models") else b"ok"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = b'{"error":{"message":"broken","type":"InternalServerError","code":500}}'
        self.send_response(500)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def failing_decode() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), FailingDecode)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_kv_staged_for_a_d_that_failed_is_freed_at_once(tier: Tier, tiny_model: Path, failing_decode: str) -> None:
    # A router of its own: the failing D is listed first, so the pd path's first choice is it.
    pd0 = tier.pd_nodes()[0]
    router = Router(json.dumps({"prefill": [tier.p], "pd_capable": [failing_decode, pd0], "policy": "pd",
                                "port": free_port(), "tokenizer": str(tiny_model / "tokenizer.json"),
                                "breaker_failures": 100, "request_timeout": 120}))
    url = router.start()
    try:
        idle = kv_usage(tier.p)
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": "tiny", "messages": conversation_start("staged"), "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert (r.headers["x-ppd-path"], r.headers["x-ppd-reason"]) == ("pd", "node_failed")
        # P staged the prompt twice: for the failing D (released through pD0 by vLLM's rejection
        # cleanup) and for pD0 (pulled). Both free within seconds, not after P's 30 s lease.
        assert settles_to(tier.p, idle, 5), f"P still holds KV: {kv_usage(tier.p)} > {idle}"
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'ppd_kv_releases_total{result="sent"} 1' in metrics
    finally:
        router.stop()
