"""Issue 15, defects 4 and 10 (request level): bounded conversation ids, system-only chats,
and plain messages for bad counts."""

from __future__ import annotations

import pytest

from tests.helpers import user
from tests.router.conftest import cluster_factory  # noqa: F401 - the fixture


def test_a_huge_conversation_id_costs_bounded_memory_and_header_bytes(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"R": 1}, policy="replica")
    for i in range(8):
        r = c.chat([user("hi")], conversation_id=f"{i}" + "x" * (4 * 1024 * 1024))
        assert r.status_code == 200, r.text
        assert len(r.headers["x-ppd-session"]) <= 256
    stats = c.admin("GET", "/admin/sessions").json()["stats"]
    assert stats["live"] == 8
    assert stats["bytes"] < 8 * 1024, stats  # not 8 × 4 MiB


def test_the_session_table_is_bounded_in_bytes(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"R": 1}, policy="replica", session_max_bytes=64 * 1024)
    for i in range(250):
        r = c.chat([user("hi")], conversation_id=f"{i:04d}-" + "y" * 240, max_tokens=1)
        assert r.status_code == 200
    stats = c.admin("GET", "/admin/sessions").json()["stats"]
    assert stats["bytes"] <= 64 * 1024, stats
    assert 0 < stats["live"] < 250 and stats["evicted_lru"] > 0, stats


@pytest.mark.parametrize("bad", ["a\u0001b", "line\nbreak", "nul\u0000"])
def test_control_characters_in_an_id_are_refused(cluster_factory, bad: str) -> None:  # noqa: F811
    c = cluster_factory({"R": 1}, policy="replica")
    r = c.chat([user("hi")], conversation_id=bad)
    assert r.status_code == 400
    assert "control characters" in r.json()["error"]["message"]
    assert c.nodes["R"][0].served() == 0


def test_a_system_only_chat_is_answered(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory({"P": 1, "pD": 1}, policy="local")
    r = c.chat([{"role": "system", "content": "You are terse. Say hi."}])
    assert r.status_code == 200, r.text
    assert r.headers["x-ppd-reason"] == "turn1"


@pytest.mark.parametrize(("field", "value"), [("max_tokens", -2), ("max_tokens", 0), ("max_completion_tokens", 1.5)])
def test_a_bad_token_count_gets_a_plain_message(cluster_factory, field: str, value: float) -> None:  # noqa: F811
    c = cluster_factory({"R": 1}, policy="replica")
    r = c.chat([user("hi")], **{field: value})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert msg == f"bad request: {field} must be a whole number of at least 1, got {value}", msg
    assert "line 1 column" not in msg
