"""Issue 16 on real vLLM: a pD restarted between turns loses its residency (the router sees the new process)
and the conversation's next turn says so (`pd/kv_lost`). Runs last: it restarts a node of the shared cluster."""

from __future__ import annotations

import uuid

import pytest

from .conftest import (
    Tier,
    answer,
    assistant,
    conversation_start,
    node_entry,
    path_of,
    residency,
    user,
    wait_for,
)

pytestmark = [pytest.mark.vllm, pytest.mark.destructive]


def test_a_restarted_pd_loses_its_residency_and_the_next_turn_says_so(tier: Tier) -> None:
    tier.set_policy("local")
    session = str(uuid.uuid4())
    history = conversation_start("restart")
    r1 = tier.chat(history, session)
    holder = path_of(r1)[2]
    assert holder is not None
    history += [assistant(answer(r1)), user("Did he keep counting?")]
    wait_for(lambda: (residency(tier, history)[holder]["cached_tokens"] or 0) > 0)
    restarts = node_entry(tier, holder)["restarts"]
    victim = next(n for n in tier.nodes.nodes if n.url == holder)
    tier.nodes.restart(victim.plan.name)
    # The router sees the new process (its /metrics start time), or the events' reset.
    wait_for(lambda: node_entry(tier, holder)["restarts"] > restarts, timeout=60)
    assert (residency(tier, history)[holder]["cached_tokens"] or 0) == 0
    r2 = tier.chat(history, session)
    path, reason, _ = path_of(r2)
    assert (path, reason) == ("pd", "kv_lost"), (path, reason)
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 or path != "local"
