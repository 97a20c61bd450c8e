"""Issue 16 on real vLLM: two conversations that open with the same message, without any id, are two
sessions — keyed by their history, they diverge at their first (sampled) answer — and each next turn finds
its own session on the node that holds it."""

from __future__ import annotations

import uuid

import pytest

from .conftest import Tier, answer, assistant, path_of, user

pytestmark = pytest.mark.vllm


def test_two_conversations_with_the_same_opener_get_two_sessions(tier: Tier) -> None:
    tier.set_policy("local")
    opener = [user(f"Hello [{uuid.uuid4().hex[:8]}]")]
    turns = []
    for _ in range(2):
        # No session header and vLLM's own sampling (temperature 1): the answers differ.
        r1 = tier.client.post(tier.url + "/v1/chat/completions",
                              json={"model": "tiny", "messages": opener, "max_tokens": 24, "temperature": 1.0})
        assert r1.status_code == 200, r1.text
        turns.append(r1)
    assert answer(turns[0]) != answer(turns[1]), "sampled answers came out equal"
    sessions = set()
    for r1 in turns:
        history = [*opener, assistant(answer(r1)), user("And then?")]
        r2 = tier.client.post(tier.url + "/v1/chat/completions",
                              json={"model": "tiny", "messages": history, "max_tokens": 8, "temperature": 0})
        assert r2.status_code == 200, r2.text
        path, reason, node = path_of(r2)
        assert (path, node) == ("local", path_of(r1)[2]), (path, reason)
        sessions.add(r2.headers["x-ppd-session"])
    assert len(sessions) == 2
