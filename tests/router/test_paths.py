"""Routing over real HTTP against emulator processes: Turn 1 P→D, Turn 2 local / pd / by the table, fractions, TTL."""

from __future__ import annotations

import json
import time

import pytest

from ppd_router import DecisionEngine, Table, identify

from .conftest import answer_text, assistant, user


def two_turns(c, first: str, second: str, **body):
    r1 = c.chat([user(first)], **body)
    assert r1.status_code == 200, r1.text
    history = [user(first), assistant(answer_text(r1)), user(second)]
    return r1, history


def test_turn_one_flows_p_to_d_and_d_pulls_the_kv(cluster_factory):
    c = cluster_factory({"P": 1, "pD": 1}, policy="local")
    p, d = c.nodes["P"][0], c.nodes["pD"][0]
    r = c.chat([user("tell me about prefill and decode on separate nodes " * 8)])
    assert r.status_code == 200, r.text
    assert (r.headers["x-ppd-path"], r.headers["x-ppd-reason"]) == ("pd", "turn1")
    assert r.headers["x-ppd-node"] == d.url
    assert p.served() == 1 and d.served() == 1
    assert d.metric("vllm:external_prefix_cache_hits") > 0


def test_turn_two_is_local_under_local_and_hits_the_prefix_cache(cluster_factory):
    c = cluster_factory({"P": 1, "pD": 1}, policy="local")
    p, d = c.nodes["P"][0], c.nodes["pD"][0]
    r1, history = two_turns(c, "a first question about caches " * 10, "and a follow up")
    r2 = c.chat(history)
    assert r2.status_code == 200, r2.text
    assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"]) == ("local", "forced")
    # Keyed by its history: Turn 2 presents the key recorded after Turn 1's answer.
    assert r2.headers["x-ppd-session"] == identify(json.dumps({"messages": history}))["conversation_id"]
    assert r2.headers["x-ppd-session"] != r1.headers["x-ppd-session"]
    recorded = {s["id"] for s in c.admin("GET", "/admin/sessions").json()["sessions"]}
    assert r2.headers["x-ppd-session"] in recorded
    assert p.served() == 1  # P saw only Turn 1
    assert d.served() == 2
    cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= r1.json()["usage"]["prompt_tokens"] - 16


def test_turn_two_goes_through_p_under_pd(cluster_factory):
    c = cluster_factory({"P": 1, "pD": 1}, policy="pd")
    p, d = c.nodes["P"][0], c.nodes["pD"][0]
    _, history = two_turns(c, "the first turn " * 10, "second turn")
    pulled_after_t1 = d.metric("vllm:external_prefix_cache_queries")
    r2 = c.chat(history)
    assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"]) == ("pd", "forced")
    assert p.served() == 2
    assert d.metric("vllm:external_prefix_cache_queries") > pulled_after_t1


def write_table(path, x1_ttft: float, x1_tpot: float):
    cells = []
    for ctx in ("small", "large"):
        for name in ("tiny", "mid_bal", "huge_paste"):
            for q in (0.5, 4.0, 20.0):
                cells.append({"context": ctx, "workload": name, "qps": q,
                              "x0": {"ttft_ms": 100.0, "tpot_ms": 10.0, "n": 9},
                              "x1": {"ttft_ms": x1_ttft, "tpot_ms": x1_tpot, "n": 9}})
    table = {"schema": "ppd-table/1", "deployment": "test",
             "axes": {"context_bins": [512, 4096],
                      "workloads": [{"name": "tiny", "n_in": 16, "n_out": 32}, {"name": "mid_bal", "n_in": 128, "n_out": 128},
                                    {"name": "huge_paste", "n_in": 1024, "n_out": 32}],
                      "qps": [0.5, 4.0, 20.0]},
             "cells": cells}
    path.write_text(json.dumps(table))
    return path


def test_ppd_follows_the_table_and_a_weights_put_flips_it_live(cluster_factory, tmp_path):
    # Local: TTFT 40% better, TPOT 20% worse -> local at (1, 1), pd at (0, 1).
    table = write_table(tmp_path / "t.json", 60.0, 12.0)
    c = cluster_factory({"P": 1, "pD": 1}, policy="ppd", table=str(table))
    _, history = two_turns(c, "ppd first turn " * 6, "next")
    r2 = c.chat(history)
    assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"]) == ("local", "score_positive")
    put = c.admin("PUT", "/admin/weights", json={"w_ttft": 0.0, "w_tpot": 1.0})
    assert put.status_code == 200 and put.json() == {"w_ttft": 0.0, "w_tpot": 1.0}
    history += [assistant(answer_text(r2)), user("third")]
    r3 = c.chat(history)
    assert (r3.headers["x-ppd-path"], r3.headers["x-ppd-reason"]) == ("pd", "score_negative")
    stats = c.admin("GET", "/admin/stats").json()
    assert stats["by_reason"]["score_positive"] == 1 and stats["by_reason"]["score_negative"] == 1
    assert sum(cell["local"] for cell in stats["by_cell"]) == 1


def test_fraction_policy_sends_exactly_the_hashed_share_local(cluster_factory, tmp_path):
    table = write_table(tmp_path / "t.json", 60.0, 12.0)
    c = cluster_factory({"P": 1, "pD": 2}, policy="fraction:0.5", table=str(table))
    engine = DecisionEngine(Table.load(table), "fraction:0.5")
    seen = []
    for i in range(16):
        _, history = two_turns(c, f"conversation number {i} opens", "then continues")
        r2 = c.chat(history)
        assert r2.status_code == 200
        cid = identify(json.dumps({"messages": history}))["conversation_id"]
        expect = engine.decide(2, 10, 8, 30, 1.0, conversation_id=cid).path
        assert r2.headers["x-ppd-path"] == expect
        seen.append(expect)
    assert "local" in seen and "pd" in seen


def test_session_expires_after_its_ttl(cluster_factory):
    c = cluster_factory({"P": 1, "pD": 1}, policy="local", session_ttl=0.3)
    _, history = two_turns(c, "short lived session", "too late")
    time.sleep(0.6)
    r2 = c.chat(history)
    assert r2.status_code == 200
    assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"]) == ("pd", "no_session")


def test_replica_policy_uses_replicas_only(cluster_factory):
    c = cluster_factory({"R": 2}, policy="replica")
    r1, history = two_turns(c, "replica conversation", "again")
    r2 = c.chat(history)
    assert r1.headers["x-ppd-path"] == r2.headers["x-ppd-path"] == "replica"
    assert r1.headers["x-ppd-node"] == r2.headers["x-ppd-node"]  # sticky: its KV is there
    assert sum(n.served() for n in c.nodes["R"]) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_usage_updates_the_session_context(cluster_factory, stream):
    c = cluster_factory({"P": 1, "pD": 1}, policy="local")
    messages = [user("count my tokens please")]
    r1 = c.chat(messages, stream=stream)
    assert r1.status_code == 200
    (s,) = c.admin("GET", "/admin/sessions").json()["sessions"]
    assert s["turns"] == 1
    f = identify(json.dumps({"messages": messages}))
    # The word rule is the emulator's tokenizer: prompt = n_ctx + n_in exactly; 8 tokens generated.
    assert s["context_tokens"] == f["n_ctx"] + f["n_in"] + 8
    if not stream:
        u = r1.json()["usage"]
        assert s["context_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_hybrid_deployment_puts_the_replica_share_of_conversations_on_r(cluster_factory, tmp_path):
    table = write_table(tmp_path / "t.json", 60.0, 12.0)
    c = cluster_factory({"P": 1, "pD": 1, "R": 1}, policy="ppd", table=str(table), replica_share=0.5)
    engine = DecisionEngine(Table.load(table), "ppd")
    paths = []
    for i in range(12):
        first = f"hybrid conversation {i}"
        r1, history = two_turns(c, first, "next turn")
        cid = r1.headers["x-ppd-session"]
        expect = engine.decide(1, 5, 8, 0, 1.0, conversation_id=cid, replica_share=0.5)
        assert (r1.headers["x-ppd-path"], r1.headers["x-ppd-reason"]) == (expect.path, expect.reason)
        r2 = c.chat(history)
        if expect.path == "replica":
            assert (r2.headers["x-ppd-path"], r2.headers["x-ppd-reason"]) == ("replica", "replica_session")
            assert r2.headers["x-ppd-node"] == c.nodes["R"][0].url
        else:
            assert r2.headers["x-ppd-path"] == "local"
        paths.append(expect.path)
    assert "replica" in paths and "pd" in paths
