"""Issue 16: the pull path — P reads a conversation's KV back from its D (vLLM NIXL bidirectional transfer,
which the emulator implements) and prefills only the new tokens; the router names D's pin only from D's own
whole answer, once, asks D for one after a streamed answer, and falls back to pd (`no_pull_handle`) when it
cannot."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from tests.helpers import answer_text, assistant, user
from tests.router.conftest import Cluster, Node, kill_all, router_over, start_node

BIDIRECTIONAL = json.dumps({"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 60})


def start(n_pd: int = 1, **cfg: Any) -> Cluster:
    """1 P + n_pd pD emulated nodes with bidirectional transfer, and a router that pulls."""
    nodes: dict[str, list[Node]] = {"P": [], "pD": []}
    try:
        nodes["P"].append(start_node("P", "--kv-connector-extra-config", BIDIRECTIONAL))
        for _ in range(n_pd):
            nodes["pD"].append(start_node("D", "--kv-connector-extra-config", BIDIRECTIONAL))
    except Exception:
        kill_all(nodes)
        raise
    return router_over(nodes, **{"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 60, **cfg})


def by_source(url: str, source: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    m = re.search(rf'^vllm:prompt_tokens_by_source_total\{{[^}}]*source="{source}"\}} ([0-9.e+]+)$', text, re.M)
    assert m, f"no prompt_tokens_by_source {source}"
    return float(m.group(1))


def router_metric(c: Cluster, name: str, labels: str = "") -> float:
    text = c.client.get(c.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name}{labels} not in the router's metrics"
    return float(m.group(1))


def test_a_pulled_turn_prefills_only_its_new_tokens_and_decodes_where_the_kv_is() -> None:
    c = start(policy="pull")
    p, d = c.nodes["P"][0], c.nodes["pD"][0]
    try:
        sid = {"x-session-id": "pulled"}
        history = [user("tell me about the history of prefix caching in serving systems " * 20)]
        r1 = c.chat(history, headers=sid, max_tokens=16)
        assert r1.status_code == 200, r1.text
        assert (r1.headers["x-ppd-path"], r1.headers["x-ppd-reason"]) == ("pd", "turn1")
        assert "kv_transfer_params" not in r1.json(), "D's pin never reaches the client"
        assert router_metric(c, "ppd_pinned_kv", '{figure="handles"}') == 1
        prompt1 = r1.json()["usage"]["prompt_tokens"]

        history += [assistant(answer_text(r1)), user("and how does it interact with disaggregation?")]
        before = {s: by_source(p.url, s) for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
        r2 = c.chat(history, headers=sid, max_tokens=16)
        assert r2.status_code == 200, r2.text
        assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"]) == ("pull", "forced")
        assert r2.headers["x-ppd-node"] == d.url
        prompt2 = r2.json()["usage"]["prompt_tokens"]
        delta = {s: by_source(p.url, s) - v for s, v in before.items()}
        # D pinned turn 1's prompt and all but its last answer token; P still caches turn 1's prompt
        # (it prefilled it), so it read back only the rest — as vLLM's pull scheduler counts it.
        context = prompt1 + 16 - 1
        assert delta["external_kv_transfer"] > 0
        assert delta["local_cache_hit"] + delta["external_kv_transfer"] == context
        assert delta["local_compute"] == prompt2 - context, "P computed only the new tokens"
        # D then held the context already and took only the new blocks from P.
        assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt2 - 1
        assert router_metric(c, "ppd_kv_bytes_pulled_total") == context * 131072

        # The same turn through local gives the same answer (greedy, the same D).
        c.admin("PUT", "/admin/policy", json={"policy": "local"}).raise_for_status()
        r_local = c.chat(history, headers={"x-session-id": "pulled-twin"}, max_tokens=16)
        assert r_local.status_code == 200
        assert answer_text(r_local) == answer_text(r2)
    finally:
        c.stop()


def stream_turn(c: Cluster, history: list[dict[str, str]], sid: dict[str, str], max_tokens: int) -> str:
    """One streamed turn through the router; its answer's text."""
    with c.client.stream(
        "POST",
        c.url + "/v1/chat/completions",
        headers=sid,
        json={"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": history, "max_tokens": max_tokens,
              "stream": True, "temperature": 0},
    ) as s:
        body = "".join(s.iter_text())
    assert s.status_code == 200 and "[DONE]" in body
    # vLLM 0.32 names D's pin only in whole answers: a streamed turn carries none.
    assert "kv_transfer_params" not in body
    return "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in body.splitlines()
        if line.startswith("data: {") and json.loads(line[6:])["choices"]
    )


def test_after_a_streamed_answer_the_router_asks_d_for_a_pin_and_the_turn_pulls() -> None:
    c = start(policy="pull")
    p = c.nodes["P"][0]
    try:
        sid = {"x-session-id": "streamed"}
        history = [user("a conversation whose first answer streams " * 10)]
        streamed = stream_turn(c, history, sid, max_tokens=8)
        assert router_metric(c, "ppd_pinned_kv", '{figure="handles"}') == 0, "a stream names no pin"
        history += [assistant(streamed), user("next?")]
        before = {s: by_source(p.url, s) for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
        r2 = c.chat(history, headers=sid, max_tokens=8)
        assert r2.status_code == 200, r2.text
        assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"]) == ("pull", "forced")
        assert router_metric(c, "ppd_pin_requests_total", '{result="pinned"}') == 1
        # The pin covers the history up to the end of the streamed answer: P computed the rest only.
        delta = {s: by_source(p.url, s) - v for s, v in before.items()}
        prompt2 = r2.json()["usage"]["prompt_tokens"]
        assert delta["external_kv_transfer"] > 0
        context = delta["local_cache_hit"] + delta["external_kv_transfer"]
        assert delta["local_compute"] == prompt2 - context
        assert prompt2 - context < 12, "only the new message (and its template tokens) computed on P"

        # The same turn through local gives the same answer (greedy, the same D).
        c.admin("PUT", "/admin/policy", json={"policy": "local"}).raise_for_status()
        r_local = c.chat(history, headers={"x-session-id": "streamed-twin"}, max_tokens=8)
        assert answer_text(r_local) == answer_text(r2)
        c.admin("PUT", "/admin/policy", json={"policy": "pull"}).raise_for_status()

        # That whole answer pinned turn 2, so turn 3 pulls without asking; its handle is then spent.
        history += [assistant(answer_text(r2)), user("and then?")]
        r3 = c.chat(history, headers=sid)
        assert r3.headers["x-ppd-path"] == "pull", r3.headers["x-ppd-reason"]
        assert router_metric(c, "ppd_pin_requests_total", '{result="pinned"}') == 1
        # A client's own kv_transfer_params steer nothing.
        history += [assistant(answer_text(r3)), user("once more")]
        forged = {"do_remote_decode": True, "remote_host": "203.0.113.9", "remote_port": 1, "remote_block_ids": [1]}
        r4 = c.chat(history, headers=sid, kv_transfer_params=forged)
        assert r4.status_code == 200, r4.text
        assert r4.headers["x-ppd-path"] == "pull"
    finally:
        c.stop()


def test_a_streamed_plain_prompt_leaves_no_pin_to_ask_for_and_the_turn_goes_pd() -> None:
    c = start(policy="pull")
    try:
        sid = {"x-session-id": "plain-prompt"}
        body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "a plain prompt " * 20, "max_tokens": 8,
                "stream": True, "temperature": 0}
        with c.client.stream("POST", c.url + "/v1/completions", headers=sid, json=body) as s:
            text = "".join(s.iter_text())
        assert s.status_code == 200 and "[DONE]" in text
        # Without messages the router cannot render the history for a pin request.
        r2 = c.client.post(c.url + "/v1/completions", headers=sid,
                           json={**body, "prompt": body["prompt"] + " and more", "stream": False})
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-ppd-path"] == "pd", r2.headers["x-ppd-reason"]
        assert "ppd_pin_requests_total{" not in c.client.get(c.url + "/metrics").text
    finally:
        c.stop()


def test_a_router_without_bidirectional_nodes_never_pulls() -> None:
    c = start(policy="pull", bidirectional_kv_xfer=False)
    try:
        sid = {"x-session-id": "plain"}
        history = [user("plain nodes " * 30)]
        r1 = c.chat(history, headers=sid)
        history += [assistant(answer_text(r1)), user("more")]
        r2 = c.chat(history, headers=sid)
        assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"]) == ("pd", "no_pull_handle")
        assert router_metric(c, "ppd_pinned_kv", '{figure="handles"}') == 0
    finally:
        c.stop()


def test_a_conversation_keyed_by_its_history_pulls_too() -> None:
    c = start(policy="pull")
    try:
        history = [user("no id on this conversation, only its history " * 12)]
        r1 = c.chat(history, max_tokens=16)
        assert r1.status_code == 200, r1.text
        history += [assistant(answer_text(r1)), user("and the pin?")]
        r2 = c.chat(history)
        # D's pin is filed under the key the next turn presents (its history with the answer).
        assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"]) == ("pull", "forced")
    finally:
        c.stop()
