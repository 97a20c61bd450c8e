"""Issue 17: ppd-live decides on the nodes' live state — an idle pD takes a Turn 2 locally, the same pD
busy with other decodes sends the same turn through P — and learns each node's speed from what it observes."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import httpx
import pytest

from ppd_router import Router
from ppd_router.errors import ConfigError
from tests.helpers import answer_text, assistant, user
from tests.router.conftest import Cluster, cluster_factory  # noqa: F401 - the fixture

LIVE = {"policy": "ppd-live", "load_interval": 0.2, "w_tpot": 3.0}
# Seconds of emulated decoding: the background answers stay in flight across several scrapes.
LONG = 600


def route_of(r: httpx.Response) -> tuple[str, str]:
    return r.headers["x-ppd-path"], r.headers["x-ppd-reason"]


def node_load(c: Cluster, url: str) -> dict[str, Any]:
    nodes = c.admin("GET", "/admin/nodes").json()["nodes"]
    return next(n for n in nodes if n["url"] == url)["load"]


def wait_for(what: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_an_idle_pd_appends_locally_and_a_busy_one_sends_the_turn_through_p(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, **LIVE)
    pd = c.nodes["pD"][0]
    sid = {"x-session-id": "live-1"}
    history = [user("the opening of a conversation about routing " * 20)]
    r1 = c.chat(history, headers=sid)
    assert r1.status_code == 200, r1.text
    # A long new input: a real prefill, which a busy decode batch would feel.
    turn2 = history + [assistant(answer_text(r1)), user("a long follow-up question " * 400)]
    wait_for(lambda: (node_load(c, pd.url)["scraped"] or {}).get("running", 1) == 0)
    r2 = c.chat(turn2, headers={"x-session-id": "live-1"})
    assert r2.status_code == 200, r2.text
    assert route_of(r2) == ("local", "cost_model")

    # The same turn of a twin conversation, with 48 others decoding on that pD.
    twin = {"x-session-id": "live-2"}
    assert c.chat(history, headers=twin).status_code == 200
    stop = threading.Event()
    background = [
        threading.Thread(
            target=lambda i=i: stop.is_set() or c.chat([user(f"someone else's long answer {i}")], max_tokens=LONG),
            daemon=True,
        )
        for i in range(48)
    ]
    for t in background:
        t.start()
    wait_for(lambda: (node_load(c, pd.url)["scraped"] or {}).get("running", 0) >= 40)
    twin2 = history + [assistant(answer_text(r1)), user("a long follow-up question " * 400)]
    r = c.chat(twin2, headers=twin)
    assert r.status_code == 200, r.text
    assert route_of(r) == ("pd", "cost_model")
    stop.set()
    for t in background:
        t.join(timeout=60)


def test_the_router_follows_each_streamed_decode_against_its_deadline(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, **LIVE, request_timeout=120)
    pd = c.nodes["pD"][0]
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": [user("a long answer, please")],
            "max_tokens": LONG, "stream": True, "temperature": 0}
    events: list[int] = []
    done = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", c.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    events.append(1)
        done.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()

    def nearest() -> list[dict[str, Any]]:
        nodes = c.admin("GET", "/admin/nodes").json()["nodes"]
        return next(n for n in nodes if n["url"] == pd.url)["nearest_deadlines"]

    wait_for(lambda: len(events) >= 20 and len(nearest()) == 1)
    first = nearest()[0]
    # The deadline is the router's request timeout from when D took the request; the tokens left
    # are max_tokens less the token events relayed so far.
    assert 100_000 < first["time_left_ms"] <= 120_000
    assert first["remaining_tokens"] <= LONG - 20
    wait_for(lambda: len(events) >= 60 or done.is_set())
    later = nearest()
    if not done.is_set():
        assert later and later[0]["remaining_tokens"] < first["remaining_tokens"]
        assert later[0]["time_left_ms"] < first["time_left_ms"]
    t.join(timeout=60)
    assert done.is_set() and len(events) > 60
    # An answer that has ended is no longer followed.
    wait_for(lambda: nearest() == [])


def test_the_model_learns_each_nodes_speed_and_shows_it(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, **LIVE)
    for i in range(4):
        sid = {"x-session-id": f"learn-{i}"}
        history = [user(f"conversation {i} opens here " * 10)]
        r1 = c.chat(history, headers=sid)
        r2 = c.chat(history + [assistant(answer_text(r1)), user("go on")], headers=sid)
        assert r2.status_code == 200, r2.text
    m = c.admin("GET", "/admin/model").json()
    assert m["policy"] == "ppd-live" and m["profile"] == "h100-llama3.1-8b"
    learnt = {n["node"]: n for n in m["nodes"]}
    pd = learnt[c.nodes["pD"][0].url]
    assert sum(pd["ttft_samples"]["local"]) == 4, pd
    # A factor is observed / predicted: positive, and not the untouched 1.0 of a node never seen.
    factor = pd["ttft_factor"]["local"][0]
    assert factor > 0 and factor != 1.0
    # /metrics carries the same factors, for the cells that have samples only.
    text = c.client.get(c.url + "/metrics").text
    node = c.nodes["pD"][0].url
    series = f'ppd_model_ttft_correction{{node="{node}",path="local",size_class="le_256"}}'
    line = next(x for x in text.splitlines() if x.startswith(series))
    assert float(line.split()[-1]) == pytest.approx(factor)
    assert f'ppd_model_ttft_correction{{node="{node}",path="pull"' not in text


def test_slo_mode_needs_both_objectives() -> None:
    with pytest.raises(ConfigError, match="slo_tpot_ms"):
        Router('{"policy": "ppd-live", "slo_ttft_ms": 200, "prefill": ["http://127.0.0.1:1"]}')
