"""Failure and bad input: node crashes, P retry, timeouts, errors in OpenAI form, cancellation."""

from __future__ import annotations

import time

import httpx

from .conftest import answer_text, assistant, user


def test_killing_the_d_of_a_session_sends_its_next_turn_through_pd(cluster_factory):
    c = cluster_factory({"P": 1, "pD": 2}, policy="local")
    r1 = c.chat([user("a conversation whose node will die")])
    holder = r1.headers["x-ppd-node"]
    victim = next(n for n in c.nodes["pD"] if n.url == holder)
    survivor = next(n for n in c.nodes["pD"] if n.url != holder)
    victim.kill()
    time.sleep(1.2)  # health checks every 0.5 s mark it down
    r2 = c.chat([user("a conversation whose node will die"), assistant(answer_text(r1)), user("still there?")])
    assert r2.status_code == 200, r2.text
    assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"]) == ("pd", "d_unavailable")
    assert r2.headers["x-ppd-node"] == survivor.url
    r3 = c.chat([user("a conversation whose node will die"), assistant(answer_text(r1)), user("still there?"),
                 assistant(answer_text(r2)), user("and now?")])
    assert (r3.headers["x-ppd-path"], r3.headers["x-ppd-node"]) == ("local", survivor.url)


def test_a_d_that_died_since_the_last_health_check_is_replaced_without_an_error(cluster_factory):
    c = cluster_factory({"P": 1, "pD": 2}, policy="local", health_interval=60)
    r1 = c.chat([user("sudden death")])
    victim = next(n for n in c.nodes["pD"] if n.url == r1.headers["x-ppd-node"])
    victim.kill()
    r2 = c.chat([user("sudden death"), assistant(answer_text(r1)), user("hello?")])
    assert r2.status_code == 200, r2.text
    assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"]) == ("pd", "d_unavailable")
    assert r2.headers["x-ppd-node"] != victim.url


def test_a_dead_p_is_retried_on_the_other_p(cluster_factory):
    c = cluster_factory({"P": 2, "pD": 1}, policy="local", health_interval=60)
    dead, alive = c.nodes["P"]
    dead.kill()
    for i in range(4):
        r = c.chat([user(f"fresh conversation {i}")])
        assert r.status_code == 200, r.text
        assert r.headers["x-ppd-path"] == "pd"
    assert alive.served() == 4
    metrics = c.client.get(c.url + "/metrics").text
    assert "ppd_prefill_retries_total" in metrics


def test_no_eligible_node_is_503_with_retry_after(cluster_factory):
    c = cluster_factory({"P": 1, "pD": 1}, policy="local", health_interval=0.3)
    c.nodes["pD"][0].kill()
    time.sleep(0.8)
    r = c.chat([user("nobody can decode this")])
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "no_eligible_node"


def test_upstream_errors_come_back_in_openai_form(cluster_factory):
    c = cluster_factory({"P": 1, "pD": 1}, policy="local")
    d = c.nodes["pD"][0]
    assert httpx.post(d.url + "/admin/faults", json={"error_rate": 1.0}).status_code == 200
    r = c.chat([user("this will fail on D")])
    assert r.status_code >= 500
    err = r.json()["error"]
    assert err["message"]
    assert r.headers["x-ppd-path"] == "pd"


def test_bad_input_is_rejected_with_clear_errors(cluster_factory):
    c = cluster_factory({"P": 1, "pD": 1}, policy="local", max_body_bytes=2000)
    url = c.url + "/v1/chat/completions"
    r = c.client.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = c.client.post(url, json={"messages": [{"role": "user", "content": "x" * 5000}]})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    time.sleep(0.6)  # the model list comes with the first health round
    r = c.client.post(url, json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = c.client.post(url, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": -2})
    assert r.status_code == 400
    r = c.client.post(c.url + "/v1/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    r = c.client.get(c.url + "/v1/nothing")
    assert r.status_code == 404
    assert c.nodes["P"][0].served() == 0
    # Every request is counted, the refused ones under path "none".
    metrics = c.client.get(c.url + "/metrics").text
    rejected = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("ppd_requests_total{") and 'path="none"' in line)
    assert rejected == 5


def test_client_disconnect_aborts_the_upstream_request(cluster_factory):
    c = cluster_factory({"P": 1, "pD": 1}, policy="local")
    d = c.nodes["pD"][0]
    with c.client.stream("POST", c.url + "/v1/chat/completions",
                         json={"messages": [user("write at length")], "max_tokens": 4000, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert d.metric("vllm:num_requests_running") == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and d.metric("vllm:num_requests_running") > 0:
        time.sleep(0.1)
    assert d.metric("vllm:num_requests_running") == 0
    assert d.served() == 0  # aborted, not finished


def test_admin_api_refuses_without_the_token(cluster_factory):
    c = cluster_factory({"P": 1, "pD": 1})
    assert c.client.get(c.url + "/admin/nodes").status_code == 401
    assert c.client.get(c.url + "/admin/nodes", headers={"authorization": "Bearer wrong"}).status_code == 401
    nodes = c.admin("GET", "/admin/nodes").json()["nodes"]
    assert sorted(n["role"] for n in nodes) == ["P", "pD"]
    assert c.admin("PUT", "/admin/weights", json={"w_ttft": -1, "w_tpot": 1}).status_code == 400
    assert c.admin("PUT", "/admin/policy", json={"policy": "fraction:2"}).status_code == 400
    assert c.admin("PUT", "/admin/policy", json={"policy": "pd"}).json() == {"policy": "pd"}
    r = c.admin("POST", "/admin/table/reload", json={"path": "/nonexistent.json"})
    assert r.status_code == 422
    extra = c.admin("POST", "/admin/nodes", json={"url": "http://127.0.0.1:9", "role": "R"})
    assert extra.status_code == 201
    assert c.admin("DELETE", "/admin/nodes", params={"url": "http://127.0.0.1:9"}).status_code == 200
    assert c.admin("DELETE", "/admin/nodes", params={"url": "http://127.0.0.1:9"}).status_code == 404


def test_admin_is_disabled_without_a_configured_token(cluster_factory):
    c = cluster_factory({"P": 1, "pD": 1}, admin_token=None)
    r = c.client.get(c.url + "/admin/nodes", headers={"authorization": "Bearer secret"})
    assert r.status_code == 403
