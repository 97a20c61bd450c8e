"""Issue 15, defects 5-7: no P ⇒ the pD prefills (p_unavailable); a node that accepts but never
answers (a gray failure) is timed out at its first token and the turn is served elsewhere; a node
failure before the first byte is retried once on another node; no node address reaches a client."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.helpers import answer_text, assistant, user
from tests.router.conftest import Cluster, Node, cluster_factory  # noqa: F401 - the fixture


def set_faults(node: Node, **faults: object) -> None:
    r = httpx.post(node.url + "/admin/faults", json=faults, timeout=5)
    assert r.status_code == 200, r.text


def stream_chat(c: Cluster, messages: list[dict[str, str]], timeout: float = 30) -> tuple[httpx.Response, str]:
    payload = {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": messages, "max_tokens": 8, "stream": True}
    with c.client.stream("POST", c.url + "/v1/chat/completions", json=payload, timeout=timeout) as r:
        return r, r.read().decode()


def holder_of(c: Cluster, r: httpx.Response) -> Node:
    return next(n for n in c.nodes["pD"] if n.url == r.headers["x-ppd-node"])


def test_with_every_p_down_new_conversations_prefill_on_a_pd(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, policy="local")
    c.nodes["P"][0].kill()
    for i in range(3):
        r = c.chat([user(f"new conversation {i}")])
        assert r.status_code == 200, r.text
        assert (r.headers["x-ppd-path"], r.headers["x-ppd-reason"]) == ("pd", "p_unavailable")
    # Its KV is on the pD now: the next turn goes local as usual.
    r1 = c.chat([user("new conversation 0")])
    r2 = c.chat([user("new conversation 0"), assistant(answer_text(r1)), user("more")])
    assert (r2.status_code, r2.headers["x-ppd-path"]) == (200, "local")


def test_health_says_degraded_while_serving_and_503_when_nothing_can(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, policy="local")
    h = httpx.get(c.url + "/health", timeout=5)
    assert (h.status_code, h.json()["status"]) == (200, "ok")
    c.nodes["P"][0].kill()
    time.sleep(1.5)  # two health rounds
    h = httpx.get(c.url + "/health", timeout=5)
    assert (h.status_code, h.json()["status"]) == (200, "degraded")
    assert h.json()["nodes"]["P"] == {"available": 0, "total": 1}
    c.nodes["pD"][0].kill()
    time.sleep(1.5)
    h = httpx.get(c.url + "/health", timeout=5)
    assert h.status_code == 503
    assert h.json()["status"] == "unavailable" and h.json()["error"]["code"] == "no_eligible_node"


def test_a_p_that_fails_every_prefill_is_replaced_by_the_pd(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, policy="local")
    set_faults(c.nodes["P"][0], error_rate=1.0)
    r = c.chat([user("hello")])
    assert r.status_code == 200, r.text
    assert r.headers["x-ppd-reason"] == "p_unavailable"


@pytest.mark.parametrize("stream", [True, False])
def test_a_node_that_accepts_but_never_answers_is_replaced(cluster_factory, stream: bool) -> None:  # noqa: F811
    # first_token_timeout bounds a stream's first token; request_timeout a whole answer.
    c = cluster_factory({"P": 1, "pD": 2}, policy="local", first_token_timeout=1.0, request_timeout=3.0,
                        breaker_failures=3)
    convs = [[user(f"gray failure {i}")] for i in range(4)]
    firsts = [c.chat(m) for m in convs]
    victim = holder_of(c, firsts[0])
    set_faults(victim, hang=True)
    answered = 0
    started = time.monotonic()
    for m, r1 in zip(convs, firsts):
        turn2 = [*m, assistant(answer_text(r1)), user("next")]
        if stream:
            r, body = stream_chat(c, turn2)
            ok = r.status_code == 200 and body.rstrip().endswith("data: [DONE]") and '"error"' not in body
        else:
            r = c.chat(turn2)
            ok = r.status_code == 200 and bool(answer_text(r))
        assert ok, (r.status_code, r.headers)
        assert r.headers["x-ppd-node"] != victim.url
        answered += 1
    assert answered == len(convs)
    # Bounded: each turn waits at most one timeout for the hung node, never the 600 s default.
    assert time.monotonic() - started < 60
    set_faults(victim, hang=False)


def test_a_decode_failure_before_the_first_byte_is_retried_once_elsewhere(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 2}, policy="local", breaker_failures=100)
    r1 = c.chat([user("retry me")])
    victim = holder_of(c, r1)
    set_faults(victim, error_rate=1.0)
    turn2 = [user("retry me"), assistant(answer_text(r1)), user("again")]
    r2 = c.chat(turn2)
    assert r2.status_code == 200, r2.text
    assert r2.headers["x-ppd-node"] != victim.url
    assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"]) == ("pd", "d_unavailable")
    # The pd path too: a D answering 500 is replaced by another D (node_failed).
    other = next(n for n in c.nodes["pD"] if n is not victim)
    set_faults(victim, error_rate=0.0)
    set_faults(other, error_rate=1.0)
    fresh = [c.chat([user(f"pd retry {i}")]) for i in range(4)]
    assert all(r.status_code == 200 for r in fresh), [r.text for r in fresh]
    assert all(r.headers["x-ppd-node"] == victim.url for r in fresh)
    assert any(r.headers["x-ppd-reason"] == "node_failed" for r in fresh)


def test_when_the_retry_fails_too_the_error_names_no_node(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 2}, policy="local", breaker_failures=100)
    for n in c.nodes["pD"]:
        n.kill()
    r = c.chat([user("nobody home")])
    assert r.status_code in (502, 503), r.text
    assert "127.0.0.1" not in r.text and "http://" not in r.text, r.text
    assert "x-ppd-node" not in r.headers or r.headers["x-ppd-node"] == ""


def test_node_addresses_are_internal_unless_the_operator_asks(cluster_factory) -> None:  # noqa: F811
    hidden = cluster_factory({"R": 1}, policy="replica", expose_node_header=False)
    r = hidden.chat([user("hi")])
    assert r.status_code == 200 and "x-ppd-node" not in r.headers
    assert hidden.nodes["R"][0].url not in r.text
    shown = cluster_factory({"R": 1}, policy="replica", expose_node_header=True)
    assert shown.chat([user("hi")]).headers["x-ppd-node"] == shown.nodes["R"][0].url
