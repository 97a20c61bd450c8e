"""What operators see: the per-request JSON log line, request ids and trace context reaching every node call."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from ppd_router import Router
from tests.helpers import free_port, user
from tests.router.conftest import wait_healthy

MODEL = "m"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class StandIn:
    """A vLLM stand-in that records the headers of every completion call: a P answers with
    NIXL's kv_transfer_params, anything else with a short whole answer."""

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []
        calls = self.calls

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def reply(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.reply({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                calls.append({k.lower(): v for k, v in self.headers.items()})
                usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
                answer: dict[str, Any] = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "model": MODEL,
                    "usage": usage,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "hi there"}, "finish_reason": "stop"}
                    ],
                }
                if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                    answer["kv_transfer_params"] = {
                        "do_remote_prefill": True,
                        "remote_engine_id": "e",
                        "remote_block_ids": [1],
                        "remote_host": "127.0.0.1",
                        "remote_port": 1,
                        "remote_request_id": "x",
                    }
                self.reply(answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def p_and_d() -> Iterator[tuple[StandIn, StandIn]]:
    p, d = StandIn(), StandIn()
    yield p, d
    p.stop()
    d.stop()


def chat(url: str, headers: dict[str, str], text: str = "hello") -> httpx.Response:
    body = {"model": MODEL, "messages": [user(text)], "max_tokens": 4}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_the_request_id_and_trace_reach_p_and_d_and_come_back(p_and_d: tuple[StandIn, StandIn]) -> None:
    p, d = p_and_d
    settings = {"prefill": [p.url], "pd_capable": [d.url], "port": free_port(), "load_interval": 0}
    router = Router(json.dumps(settings))
    url = router.start()
    try:
        r = chat(url, {"x-request-id": "client-7", "traceparent": TRACEPARENT})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "client-7"
        assert r.headers["x-ppd-path"] == "pd"
        (to_p,), (to_d,) = p.calls, d.calls
        # One id per prefill attempt, the client's with a suffix, the same on P and D.
        assert to_p["x-request-id"].startswith("client-7-")
        assert to_d["x-request-id"] == to_p["x-request-id"]
        for call in (to_p, to_d):
            version, trace, span, flags = call["traceparent"].split("-")
            assert (version, trace, flags) == ("00", "4bf92f3577b34da6a3ce929d0e0e4736", "01")
            assert span != "00f067aa0ba902b7"

        # A header a client could use to smuggle garbage into node calls is replaced.
        r = chat(url, {"x-request-id": "x" * 300})
        made = r.headers["x-request-id"]
        assert len(made) == 32 and made != "x" * 300
        assert d.calls[-1]["x-request-id"].startswith(made + "-")
        assert "traceparent" not in d.calls[-1]
    finally:
        router.stop()


def test_one_json_line_per_request_without_prompt_text(p_and_d: tuple[StandIn, StandIn]) -> None:
    p, d = p_and_d
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "ppd_router.cli",
        "serve",
        "--prefill",
        p.url,
        "--pd-capable",
        d.url,
        "--port",
        str(port),
        "--load-interval",
        "0",
        "--log",
        "info",
        "--log-format",
        "json",
        "--admin-token",
        "tok-never-logged",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_healthy(url, proc=proc)
        ok = chat(url, {"x-request-id": "req-ok", "x-session-id": "conv-secret-id"}, "PROMPT-MARKER text")
        assert ok.status_code == 200, ok.text
        bad = httpx.post(
            url + "/v1/chat/completions",
            content=b"{",
            headers={"content-type": "application/json", "x-request-id": "req-bad"},
        )
        assert bad.status_code == 400
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    by_id = {x["request_id"]: x for x in lines if x.get("target") == "ppd_router::request"}
    line = by_id["req-ok"]
    assert (line["level"], line["path"], line["reason"], line["status"]) == ("INFO", "pd", "turn1", 200)
    assert (line["prefill_node"], line["node"], line["endpoint"]) == (p.url, d.url, "/v1/chat/completions")
    assert line["turn"] == 1
    assert len(line["conversation"]) == 16 and line["conversation"] != "conv-secret-id"
    assert 0 <= line["ttft_ms"] <= line["duration_ms"]
    refused = by_id["req-bad"]
    assert (refused["path"], refused["reason"], refused["status"]) == ("none", "rejected", 400)
    assert "conversation" not in refused and "node" not in refused
    start = next(x for x in lines if x.get("message") == "ppd-router starting")
    assert json.loads(start["settings"])["log_format"] == "json"
    for secret in ("PROMPT-MARKER", "conv-secret-id", "tok-never-logged"):
        assert secret not in err


TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]  # vLLM's vllm:time_to_first_token_seconds
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ppd-router.json"


def families(text: str, openmetrics: bool) -> dict[str, Any]:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_open
    from prometheus_client.parser import text_string_to_metric_families as parse_text

    parse = parse_open if openmetrics else parse_text
    return {f.name: f for f in parse(text)}


@pytest.fixture
def routed(p_and_d: tuple[StandIn, StandIn]) -> Iterator[str]:
    """A router over the stand-ins that has served one pd request."""
    p, d = p_and_d
    router = Router(json.dumps({"prefill": [p.url], "pd_capable": [d.url], "port": free_port(), "load_interval": 0}))
    url = router.start()
    try:
        assert chat(url, {}).status_code == 200
        yield url
    finally:
        router.stop()


def test_metrics_parse_typed_in_both_formats_with_vllms_buckets(routed: str, p_and_d: tuple[StandIn, StandIn]) -> None:
    d = p_and_d[1]
    text = httpx.get(routed + "/metrics")
    assert text.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    prometheus_accept = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
    open_ = httpx.get(routed + "/metrics", headers={"accept": prometheus_accept})
    assert open_.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    for body, is_open in ((text.text, False), (open_.text, True)):
        fams = families(body, is_open)
        untyped = sorted(n for n, f in fams.items() if f.type in ("untyped", "unknown"))
        assert not untyped, untyped
        assert fams["ppd_requests"].type == "counter"
        (served,) = [s for s in fams["ppd_requests"].samples if s.name == "ppd_requests_total"]
        assert served.labels == {"path": "pd", "reason": "turn1", "status": "200"} and served.value == 1
        ttft = fams["ppd_ttft_seconds"]
        assert ttft.type == "histogram"
        buckets = [s for s in ttft.samples if s.name == "ppd_ttft_seconds_bucket"]
        assert [float(s.labels["le"]) for s in buckets] == [*TTFT_BUCKETS, float("inf")]
        assert {(s.labels["path"], s.labels["model_name"]) for s in buckets} == {("pd", MODEL)}
        assert fams["ppd_e2e_request_latency_seconds"].type == "histogram"
        assert fams["ppd_requests_in_flight"].type == "gauge"
        states = {s.labels["state"]: s.value for s in fams["ppd_node_state"].samples if s.labels["node"] == d.url}
        assert states == {"healthy": 1, "unhealthy": 0, "breaker_open": 0}


def test_the_dashboard_plots_only_metrics_the_router_serves(routed: str, p_and_d: tuple[StandIn, StandIn]) -> None:
    # A P that is gone makes the failure families (upstream errors, retries) appear too.
    p_and_d[0].stop()
    assert chat(routed, {}).headers["x-ppd-reason"] == "p_unavailable"
    dashboard = json.loads(DASHBOARD.read_text())
    served = families(httpx.get(routed + "/metrics").text, openmetrics=False)
    names = set()
    for family in served.values():
        names |= {s.name for s in family.samples} | {family.name}
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bppd_[a-z0-9_]+", e)}
    # A counter that never moved (nothing pulled) is declared by its TYPE line.
    declared = set(re.findall(r"^# TYPE (\S+)", httpx.get(routed + "/metrics").text, re.M))
    missing = {m for m in used if m not in names and m not in declared and not m.endswith("_bucket")}
    missing |= {m for m in used if m.endswith("_bucket") and m.removesuffix("_bucket") not in served}
    assert not missing, missing
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("path", "reason", "ttft", "tpot", "kv bytes", "node state"):
        assert topic in titles, topic


class Collector:
    """An OTLP/HTTP collector stand-in: keeps the spans of every (JSON) export it receives."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                for resource in body.get("resourceSpans", []):
                    for scope in resource.get("scopeSpans", []):
                        spans.extend(scope.get("spans", []))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_spans_reach_an_otlp_collector_in_the_clients_trace(p_and_d: tuple[StandIn, StandIn]) -> None:
    p, d = p_and_d
    collector = Collector()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "ppd_router.cli",
        "serve",
        "--prefill",
        p.url,
        "--pd-capable",
        d.url,
        "--port",
        str(port),
        "--load-interval",
        "0",
        "--otlp-traces-endpoint",
        collector.url,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(url, proc=proc)
        assert chat(url, {"traceparent": TRACEPARENT, "x-request-id": "traced-1"}).status_code == 200
    finally:
        # Stopping flushes the batched spans.
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        collector.stop()
    by_name = {s["name"]: s for s in collector.spans}
    expected = {"request", "identity", "decision", "prefill", "kv_handoff", "decode_first_token"}
    assert expected <= set(by_name), (sorted(by_name), err[-2000:])
    request = by_name["request"]
    assert {s["traceId"].lower() for s in collector.spans} == {TRACEPARENT.split("-")[1]}
    assert request["parentSpanId"].lower() == TRACEPARENT.split("-")[2]
    for child in expected - {"request"}:
        assert by_name[child]["parentSpanId"] == request["spanId"], child
    # Each node call carries its own span as the parent of what the node does.
    assert p.calls[-1]["traceparent"].split("-")[2] == by_name["prefill"]["spanId"].lower()
    assert d.calls[-1]["traceparent"].split("-")[2] == by_name["decode_first_token"]["spanId"].lower()


def test_a_node_that_left_has_no_series_of_any_family(p_and_d: tuple[StandIn, StandIn]) -> None:
    p, d = p_and_d
    settings = {
        "prefill": [p.url],
        "pd_capable": [d.url],
        "port": free_port(),
        "load_interval": 0,
        "admin_token": "secret",
    }
    router = Router(json.dumps(settings))
    url = router.start()
    try:

        def nodes_in(family: str = "") -> set[str]:
            """The nodes named by the series of one family, or of every family."""
            fams = families(httpx.get(url + "/metrics").text, openmetrics=False)
            return {
                s.labels["node"]
                for name, fam in fams.items()
                if not family or name == family
                for s in fam.samples
                if "node" in s.labels
            }

        assert nodes_in("ppd_node_state") == {p.url, d.url}
        assert {p.url, d.url} <= nodes_in("ppd_residency_mode")
        gone = httpx.delete(url + "/admin/nodes", params={"url": p.url}, headers={"authorization": "Bearer secret"})
        assert gone.status_code == 200, gone.text
        # No per-node series of any family lingers: state, load figures, residency, KV events, restarts.
        assert nodes_in() == {d.url}
    finally:
        router.stop()
