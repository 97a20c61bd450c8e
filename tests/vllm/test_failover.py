"""A pD that dies between turns: the conversation's next turn still succeeds, through P, onto the
surviving pD, which then holds the conversation. Runs last: it kills a node of the shared cluster."""

from __future__ import annotations

import time
import uuid

import pytest

from .conftest import ADMIN, Tier, answer, assistant, conversation_start, delta, path_of, user

pytestmark = [pytest.mark.vllm, pytest.mark.destructive]


def router_sees_down(tier: Tier, url: str, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = tier.client.get(tier.url + "/admin/nodes", headers={"authorization": f"Bearer {ADMIN}"}).json()
        node = next(n for n in nodes["nodes"] if n["url"] == url)
        if node["state"] != "healthy":
            return True
        time.sleep(0.2)
    return False


def test_killing_the_pd_between_turns_moves_the_next_turn_through_p_to_a_survivor(tier: Tier) -> None:
    tier.set_policy("local")
    session = str(uuid.uuid4())
    first = conversation_start("failover")
    r1 = tier.chat(first, session)
    _, _, holder = path_of(r1)
    survivor = tier.other_pd(holder)
    victim = next(n for n in tier.nodes.nodes if n.url == holder)
    victim.kill()
    assert not victim.alive()

    history = first + [assistant(answer(r1)), user("What happened next?")]
    before = tier.snapshot()  # the dead node is left out
    r2 = tier.chat(history, session)  # sent at once: the router may not have seen the death yet
    after = tier.snapshot()
    path, reason, node = path_of(r2)
    assert (path, reason, node) == ("pd", "d_unavailable", survivor)
    assert answer(r2), "empty answer"
    assert delta(before, after, tier.p, "request_success") == 1
    assert delta(before, after, survivor, "external_prefix_cache_hits") > 0
    assert router_sees_down(tier, holder)

    # The conversation now lives on the survivor: the turn after goes local there.
    r3 = tier.chat(history + [assistant(answer(r2)), user("And then?")], session)
    assert path_of(r3)[0] == "local" and path_of(r3)[2] == survivor
