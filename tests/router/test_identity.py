"""Issue 16, item 5: identity. Conversations that open alike stay apart (history-keyed), aiperf's headers
name conversations, `user` only on the operator's say-so, an edited history of a named conversation goes
pd/prefix_mismatch, a client abort keeps the session, and `route_headers` hides what answers say."""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import httpx

from ppd_router import identify
from tests.helpers import answer_text, assistant, user
from tests.router.conftest import Cluster, cluster_factory  # noqa: F401 - the fixture

SAMPLED = {"temperature": 1.0}  # vLLM's default: each answer its own text


def route_of(r: httpx.Response) -> tuple[str, str]:
    return r.headers["x-ppd-path"], r.headers["x-ppd-reason"]


def streamed_text(c: Cluster, messages: list[dict[str, str]], **body: Any) -> tuple[httpx.Response, str]:
    """A streamed chat turn and its answer as the client assembles it from the deltas."""
    payload = {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": messages, "max_tokens": 8,
               "stream": True, **body}
    text = []
    with c.client.stream("POST", c.url + "/v1/chat/completions", json=payload) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    text.append(choice.get("delta", {}).get("content") or "")
    assert r.status_code == 200
    return r, "".join(text)


def sessions(c: Cluster) -> list[dict[str, Any]]:
    return list(c.admin("GET", "/admin/sessions?limit=1000").json()["sessions"])


def test_six_conversations_opening_with_hello_get_six_sessions(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 2}, policy="local")
    second = []
    for i in range(6):
        opener = [user("Hello")]
        if i % 2:  # streamed and whole answers must give the same keys
            r1, text = streamed_text(c, opener, **SAMPLED)
        else:
            r1 = c.chat(opener, **SAMPLED)
            text = answer_text(r1)
        assert route_of(r1) == ("pd", "turn1")
        r2 = c.chat([*opener, assistant(text), user(f"tell me more, {i}")], **SAMPLED)
        assert r2.status_code == 200, r2.text
        assert route_of(r2) == ("local", "forced")
        assert r2.headers["x-ppd-node"] == r1.headers["x-ppd-node"]
        second.append(r2.headers["x-ppd-session"])
    assert len(set(second)) == 6
    assert len(sessions(c)) >= 6


def test_a_retry_of_a_turn_still_finds_its_session(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, policy="local")
    r1 = c.chat([user("Hello")], **SAMPLED)
    history = [user("Hello"), assistant(answer_text(r1)), user("more")]
    r2 = c.chat(history, **SAMPLED)
    again = c.chat(history, **SAMPLED)  # the same Turn 2, regenerated
    assert route_of(r2) == route_of(again) == ("local", "forced")
    assert again.headers["x-ppd-session"] == r2.headers["x-ppd-session"]
    r3 = c.chat([*history, assistant(answer_text(again)), user("and more")], **SAMPLED)
    assert route_of(r3) == ("local", "forced")


def test_aiperf_headers_name_conversations_in_priority_order(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 2}, policy="local")
    for name in ("x-correlation-id", "x-session-affinity"):
        for i in range(3):
            h = {name: f"{name}-{i}"}
            r1 = c.chat([user("Hello")], headers=h, **SAMPLED)
            assert r1.headers["x-ppd-session"] == f"{name}-{i}"
            r2 = c.chat([user("Hello"), assistant(answer_text(r1)), user("go on")], headers=h, **SAMPLED)
            assert route_of(r2) == ("local", "forced")
            assert r2.headers["x-ppd-session"] == f"{name}-{i}"
            assert r2.headers["x-ppd-node"] == r1.headers["x-ppd-node"]
    every = {"x-session-id": "s", "x-correlation-id": "c", "x-session-affinity": "a"}
    body = {"conversation_id": "conv", "session_id": "sess"}
    order = [("x-session-id", "s"), ("x-correlation-id", "c"), ("x-session-affinity", "a"),
             ("conversation_id", "conv"), ("session_id", "sess")]
    for dropped in range(len(order)):
        headers = {k: v for k, v in every.items() if k not in dict(order[:dropped])}
        fields = {k: v for k, v in body.items() if k not in dict(order[:dropped])}
        r = c.chat([user("who am I?")], headers=headers, **fields)
        assert r.headers["x-ppd-session"] == order[dropped][1], (dropped, r.headers)


def test_user_names_the_conversation_only_when_the_operator_allows_it(cluster_factory) -> None:  # noqa: F811
    off = cluster_factory({"P": 1, "pD": 1}, policy="local")
    r = off.chat([user("Hello")], user="alice")
    assert r.headers["x-ppd-session"] != "alice"
    assert "alice" not in {s["id"] for s in sessions(off)}
    on = cluster_factory({"P": 1, "pD": 1}, policy="local", session_from_user=True)
    r = on.chat([user("Hello")], user="alice")
    assert r.headers["x-ppd-session"] == "alice"
    assert "alice" in {s["id"] for s in sessions(on)}
    # A header still outranks it.
    r = on.chat([user("Hello")], user="alice", headers={"x-session-id": "conv-7"})
    assert r.headers["x-ppd-session"] == "conv-7"


def test_an_edited_history_of_a_named_conversation_goes_pd(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, policy="local")
    sid = {"x-session-id": "edited-1"}
    r1 = c.chat([user("Hello")], headers=sid, **SAMPLED)
    text = answer_text(r1)
    first_edit = [user("Hello"), assistant(text + " (edited)"), user("next")]
    edited = c.chat(first_edit, headers=sid, **SAMPLED)
    assert route_of(edited) == ("pd", "prefix_mismatch")
    # The history as that answer left it continues the session again; so does a regeneration of the turn.
    history = [*first_edit, assistant(answer_text(edited)), user("then")]
    honest = c.chat(history, headers=sid, **SAMPLED)
    assert route_of(honest) == ("local", "forced")
    regenerated = c.chat(history, headers=sid, **SAMPLED)
    assert route_of(regenerated) == ("local", "forced")
    # Stripping a field the hash ignores (reasoning, names) is no edit.
    stripped = [*first_edit, {**assistant(answer_text(edited)), "name": "bot", "reasoning_content": "hmm"},
                user("then")]
    assert route_of(c.chat(stripped, headers=sid, **SAMPLED)) == ("local", "forced")
    stats = c.admin("GET", "/admin/stats").json()
    assert stats["by_reason"]["prefix_mismatch"] == 1


def wait_for_session(c: Cluster, sid: str, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        found = [s for s in sessions(c) if s["id"] == sid]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no session {sid} recorded"
        time.sleep(0.05)


def abort_after_first_chunk(c: Cluster, messages: list[dict[str, str]], headers: Optional[dict[str, str]]) -> str:
    """Streams a long turn and closes the connection after the first content; returns what arrived."""
    payload = {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": messages, "max_tokens": 2000,
               "stream": True, "temperature": 0}
    got = ""
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", c.url + "/v1/chat/completions", json=payload, headers=headers or {}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices", []):
                        got += choice.get("delta", {}).get("content") or ""
                    if got:
                        break
    return got


def test_a_client_abort_keeps_the_session(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, policy="local")
    sid = {"x-session-id": "aborted-1"}
    opener = [user("tell me a long story about decode nodes " * 4)]
    partial = abort_after_first_chunk(c, opener, sid)
    assert partial
    s = wait_for_session(c, "aborted-1")
    assert s["turns"] == 1 and s["d"] == c.nodes["pD"][0].url
    r2 = c.chat([*opener, assistant(partial), user("go on")], headers=sid)
    assert r2.status_code == 200, r2.text
    assert route_of(r2) == ("local", "forced")
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_route_headers_path_and_none_hide_what_answers_say(cluster_factory) -> None:  # noqa: F811
    for setting, shown in (("path", {"x-ppd-path"}), ("none", set())):
        c = cluster_factory({"P": 1, "pD": 1}, policy="local", route_headers=setting)
        whole = c.chat([user("Hello")])
        streamed, _ = streamed_text(c, [user("Hello")])
        for r in (whole, streamed):
            assert r.status_code == 200
            assert {k for k in r.headers if k.startswith("x-ppd-")} == shown, (setting, dict(r.headers))
        # The routing itself is unchanged: the next turn still finds its session.
        r2 = c.chat([user("Hello"), assistant(answer_text(whole)), user("more")])
        assert r2.status_code == 200
        by_reason = c.admin("GET", "/admin/stats").json()["by_reason"]
        assert by_reason.get("forced", 0) >= 1


def test_identify_matches_the_routers_key(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, policy="local")
    r1 = c.chat([user("Hello")], **SAMPLED)
    history = [user("Hello"), assistant(answer_text(r1)), user("x")]
    expect = identify(json.dumps({"messages": history}))
    assert expect["id_source"] == "history"
    assert expect["conversation_id"] in {s["id"] for s in sessions(c)}
