"""Both I/O runtimes serve concurrent conversations correctly; thread-per-core starts and joins its threads."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ppd_router import ConfigError

from .conftest import answer_text, assistant, user


def io_threads() -> list[str]:
    """Names of this process's router I/O threads (the router is embedded in the test process)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except FileNotFoundError:  # the thread ended while listing
            continue
        if name.startswith("ppd-router-io-"):
            names.append(name)
    return sorted(names)


@pytest.mark.parametrize("runtime", ["thread-per-core", "work-stealing"])
def test_concurrent_conversations_keep_their_sessions_on_either_runtime(cluster_factory, runtime):
    c = cluster_factory({"P": 1, "pD": 2}, policy="local", runtime=runtime, worker_threads=3)

    def conversation(i: int) -> tuple[str, str, str, str]:
        # A client of its own per conversation: connections land on different I/O threads.
        with httpx.Client(timeout=30) as client:
            body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "max_tokens": 6, "temperature": 0}
            first = [user(f"conversation {i} opens with a question about batching " * 4)]
            r1 = client.post(c.url + "/v1/chat/completions", json={**body, "messages": first})
            assert r1.status_code == 200, r1.text
            history = first + [assistant(answer_text(r1)), user(f"and a follow-up {i}")]
            r2 = client.post(c.url + "/v1/chat/completions", json={**body, "messages": history})
            assert r2.status_code == 200, r2.text
            return (r1.headers["x-ppd-node"], r2.headers["x-ppd-node"], r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"])

    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(conversation, range(24)))

    for t1_node, t2_node, path, reason in results:
        assert (path, reason) == ("local", "forced")
        assert t2_node == t1_node  # Turn 2 found the D that holds the conversation
    # Least-load placement spread the 24 conversations over both pDs.
    assert {r[0] for r in results} == {n.url for n in c.nodes["pD"]}
    stats = c.admin("GET", "/admin/stats").json()
    assert stats["by_path"]["local"] == 24 and stats["by_path"]["pd"] == 24
    nodes = c.admin("GET", "/admin/nodes").json()
    assert all(n["inflight"] == 0 for n in nodes["nodes"])
    assert sum(n.served() for n in c.nodes["pD"]) == 48


def test_thread_per_core_starts_the_configured_threads_and_stop_joins_them(cluster_factory):
    assert io_threads() == []
    c = cluster_factory({"R": 1}, policy="replica", worker_threads=3)
    assert io_threads() == ["ppd-router-io-0", "ppd-router-io-1", "ppd-router-io-2"]
    assert c.chat([user("hello")]).status_code == 200
    c.stop()
    assert io_threads() == []
    with pytest.raises(httpx.ConnectError):
        httpx.post(c.url + "/v1/chat/completions", json={"messages": [user("x")]}, timeout=2)


def test_an_unknown_runtime_is_refused_with_its_field_named(cluster_factory):
    with pytest.raises(ConfigError, match="runtime"):
        cluster_factory({"R": 1}, policy="replica", runtime="fibers")
