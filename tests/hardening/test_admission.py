"""Issue 15, defect 3: admission control. Per-node in-flight limits, a bounded wait queue with a
timeout, 503 (capacity) / 429 (rate) with Retry-After and OpenAI error JSON, and metrics for each
outcome, so an overloaded cluster answers at once instead of timing clients out."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.helpers import metric_sum, user
from tests.router.conftest import Cluster, cluster_factory  # noqa: F401 - the fixture
from tests.hardening.test_failover import set_faults


def burst(c: Cluster, n: int) -> list[httpx.Response]:
    def one(i: int) -> httpx.Response:
        return httpx.post(c.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [user(f"burst {i}")], "max_tokens": 2})
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def admission(c: Cluster, outcome: str) -> float:
    text = c.client.get(c.url + "/metrics").text
    return sum(metric_sum(line, "ppd_admission") for line in text.splitlines() if f'outcome="{outcome}"' in line)


def test_a_full_node_sheds_beyond_its_queue_and_after_the_queue_timeout(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"R": 1}, policy="replica", max_inflight_per_node=2, queue_size=2, queue_timeout=1.0)
    set_faults(c.nodes["R"][0], latency_ms=3000)  # each answer takes 3 s: the queue cannot drain in 1 s
    answers = burst(c, 6)
    codes = sorted(r.status_code for r in answers)
    assert codes == [200, 200, 503, 503, 503, 503], [r.text for r in answers]
    shed = [r for r in answers if r.status_code == 503]
    assert sorted(r.json()["error"]["code"] for r in shed) == ["queue_full", "queue_full", "queue_timeout", "queue_timeout"]
    assert all(r.headers["retry-after"] == "1" for r in shed)
    assert all(r.json()["error"]["type"] == "service_unavailable" for r in shed)
    assert admission(c, "admitted") == 2
    assert admission(c, "shed_queue_full") == 2 and admission(c, "shed_queue_timeout") == 2
    # The node only ever saw what was admitted.
    assert c.nodes["R"][0].served() == 2


def test_queued_requests_are_served_when_room_frees(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"R": 1}, policy="replica", max_inflight_per_node=2, queue_size=8, queue_timeout=20.0)
    set_faults(c.nodes["R"][0], latency_ms=500)
    answers = burst(c, 5)
    assert [r.status_code for r in answers] == [200] * 5, [r.text for r in answers]
    assert admission(c, "queued") >= 1
    assert admission(c, "admitted") + admission(c, "queued") == 5


def test_over_the_rate_limit_is_429_with_retry_after(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"R": 1}, policy="replica", rate_limit=1, rate_limit_burst=2)
    answers = [c.chat([user(f"rate {i}")], max_tokens=1) for i in range(5)]
    codes = [r.status_code for r in answers]
    assert codes.count(429) >= 2 and codes[:2] == [200, 200], codes
    limited = next(r for r in answers if r.status_code == 429)
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(limited.headers["retry-after"]) >= 1
    assert admission(c, "shed_rate") == codes.count(429)
