"""Issue 16: the decision sees the cluster live — a restarted pD's lost KV, each node's load as the
router counts it and as the node reports it, and the load veto on local."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import httpx

from tests.helpers import answer_text, assistant, user
from tests.router.conftest import Cluster, Node, cluster_factory, wait_healthy  # noqa: F401 - the fixture

LIVE = {"policy": "local", "load_interval": 0.2}
# Long enough (seconds of emulated decoding) that a running request is seen by several scrapes.
LONG = 400


def node_info(c: Cluster, url: str) -> dict[str, Any]:
    nodes = c.admin("GET", "/admin/nodes").json()["nodes"]
    return next(n for n in nodes if n["url"] == url)


def wait_for(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def restart(node: Node) -> None:
    """The same node address, a new process with an empty cache."""
    node.kill()
    cmd = [sys.executable, "-m", "ppd_router.cli", "emulate", "--role", node.role, "--port", str(node.port)]
    node.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    wait_healthy(node.url, proc=node.proc)


def cached_tokens(r: httpx.Response) -> int:
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def route_of(r: httpx.Response) -> tuple[str, str]:
    return r.headers["x-ppd-path"], r.headers["x-ppd-reason"]


def test_a_restarted_pd_is_not_asked_for_kv_it_lost(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 2}, **LIVE)
    sid = {"x-session-id": "restart-1"}
    history = [user("tell me about the restart of a decode node " * 8)]
    r1 = c.chat(history, headers=sid)
    assert r1.status_code == 200, r1.text
    holder = next(n for n in c.nodes["pD"] if n.url == r1.headers["x-ppd-node"])
    history += [assistant(answer_text(r1)), user("and then?")]
    r2 = c.chat(history, headers=sid)
    assert route_of(r2) == ("local", "forced")
    assert cached_tokens(r2) > 0

    restart(holder)
    # Seen restarted, and healthy again (else the turn is pd for d_unavailable instead).
    wait_for(lambda: (lambda n: n["restarts"] >= 1 and n["state"] == "healthy")(node_info(c, holder.url)))
    history += [assistant(answer_text(r2)), user("once more")]
    r3 = c.chat(history, headers=sid)
    assert r3.status_code == 200, r3.text
    assert route_of(r3) == ("pd", "kv_lost")
    # Turn 3 put the conversation's KV back on a D: Turn 4 is local again, from a real cache hit.
    history += [assistant(answer_text(r3)), user("and the last one")]
    r4 = c.chat(history, headers=sid)
    assert route_of(r4) == ("local", "forced")
    assert cached_tokens(r4) > 0
    assert 'ppd_node_restarts_total{node="' + holder.url + '"} 1' in c.admin("GET", "/metrics").text


def test_each_node_shows_its_own_figures_and_the_routers_work(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, **LIVE)
    pd = c.nodes["pD"][0]
    wait_for(lambda: node_info(c, pd.url)["load"]["scraped"] is not None)
    idle = node_info(c, pd.url)["load"]
    assert idle["inflight"] == 0 and idle["decode_tokens"] == 0
    assert idle["scraped"]["running"] == 0 and 0 <= idle["scraped"]["kv_usage"] <= 1

    # A long answer stays in flight for seconds, across several scrapes.
    sent = threading.Thread(target=lambda: c.chat([user("a long answer please")], max_tokens=LONG), daemon=True)
    sent.start()
    seen: dict[str, Any] = {}

    def busy() -> bool:
        load = node_info(c, pd.url)["load"]
        seen.update(load)
        return load["inflight"] == 1 and bool(load["scraped"]) and load["scraped"]["running"] >= 1

    wait_for(busy)
    assert seen["decode_tokens"] == LONG  # the request's max_tokens, counted while it runs
    sent.join(timeout=30)
    assert node_info(c, pd.url)["load"]["decode_tokens"] == 0
    assert node_info(c, pd.url)["scrape_failures"] == 0


def test_a_pd_reporting_a_full_cache_gets_no_append_prefill(cluster_factory) -> None:  # noqa: F811
    # A threshold of 1e-6 makes any KV a running request holds "full", so a slow request on the
    # session's pD is enough to trip the veto.
    c = cluster_factory({"P": 1, "pD": 1}, overload_kv_usage=1e-6, **LIVE)
    pd = c.nodes["pD"][0]
    sid = {"x-session-id": "busy-1"}
    history = [user("a conversation on a busy node " * 8)]
    r1 = c.chat(history, headers=sid)
    history += [assistant(answer_text(r1)), user("next")]
    wait_for(lambda: (node_info(c, pd.url)["load"]["scraped"] or {}).get("kv_usage", 1) == 0)
    assert route_of(c.chat(history, headers=sid)) == ("local", "forced")

    other = threading.Thread(target=lambda: c.chat([user("someone else's long answer")], max_tokens=LONG), daemon=True)
    other.start()
    wait_for(lambda: (node_info(c, pd.url)["load"]["scraped"] or {}).get("kv_usage", 0) > 0)
    r = c.chat(history, headers=sid)
    assert route_of(r) == ("pd", "d_overloaded")
    other.join(timeout=60)


def test_scraping_can_be_turned_off(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, policy="local", load_interval=0)
    time.sleep(0.5)
    info = node_info(c, c.nodes["pD"][0].url)
    assert info["load"]["scraped"] is None and info["scrape_failures"] == 0
