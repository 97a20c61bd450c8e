"""The session table through the Python API: TTL, LRU, reassignment, concurrency."""

from __future__ import annotations

import threading

import pytest

from ppd_router import ConfigError, QpsEstimator, SessionTable


def test_ttl_expires_idle_sessions():
    t = SessionTable(ttl_s=60)
    t.record_turn("c", turn=1, d="d0", now=1000.0)
    assert t.get("c", now=1059.0)["turns"] == 1
    assert t.get("c", now=1200.0) is None
    assert t.stats()["expired"] == 1


def test_sweep_counts_what_it_evicts():
    t = SessionTable(ttl_s=10, shards=4)
    for i in range(10):
        t.record_turn(f"c{i}", turn=1, d="d", now=float(i))
    assert t.evict_expired(now=15.5) == 6
    assert len(t) == 4


def test_capacity_evicts_the_least_recently_used():
    t = SessionTable(capacity=2, shards=1)
    t.record_turn("a", turn=1, d="d", now=1.0)
    t.record_turn("b", turn=1, d="d", now=2.0)
    t.get("a", now=3.0)
    t.record_turn("c", turn=1, d="d", now=4.0)
    assert t.get("b", now=5.0) is None
    assert t.get("a", now=5.0) is not None
    assert t.stats()["evicted_lru"] == 1


def test_reassign_clears_the_departed_d():
    t = SessionTable()
    t.record_turn("a", turn=2, d="d0", p="p0", prompt_tokens=10, completion_tokens=5)
    t.record_turn("b", turn=1, d="d1")
    assert t.reassign("d0", "d1") == 1
    a = t.get("a")
    assert a["d"] == "d1"
    assert a["context_tokens"] is None  # the new D holds none of its KV
    assert a["p"] == "p0"


def test_record_turn_keeps_the_running_mean():
    t = SessionTable()
    for turn, out in enumerate([100, 200, 300], start=1):
        s = t.record_turn("a", turn=turn, d="d", prompt_tokens=50, completion_tokens=out)
    assert s["mean_output_tokens"] == 200
    assert s["context_tokens"] == 350


def test_concurrent_record_turns_lose_nothing():
    t = SessionTable(shards=8)

    def work(k):
        for i in range(500):
            t.record_turn(f"{k}-{i}", turn=1, d=f"d{k}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(t) == 2000
    assert len({k for k, _ in t.page(0, 5000)}) == 2000


@pytest.mark.parametrize("kwargs", [{"ttl_s": 0}, {"ttl_s": float("nan")}, {"capacity": 0}])
def test_bad_settings_raise(kwargs):
    with pytest.raises(ConfigError):
        SessionTable(**kwargs)


def test_half_usage_is_rejected():
    with pytest.raises(ValueError):
        SessionTable().record_turn("a", turn=1, d="d", prompt_tokens=3)


def test_qps_estimator_tracks_a_steady_rate():
    q = QpsEstimator(window_s=10)
    for i in range(100):
        q.record(now=1000.0 + i * 0.25)  # 4 per second
    assert q.rate(now=1025.0) == pytest.approx(4.0, rel=0.05)
    assert q.rate(now=1100.0) == 0.0
