"""Issue 16 on real vLLM: the router's exact residency (from vLLM's own KV events, the tokenizer's chat
template and our block chaining) equals what vLLM then reports as cached for the conversation's next turn."""

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

pytestmark = pytest.mark.vllm


def test_router_residency_equals_vllms_cached_tokens_for_the_next_turn(tier: Tier) -> None:
    tier.set_policy("local")
    for i in range(3):
        session = str(uuid.uuid4())
        history = conversation_start(f"residency-{i}")
        history[0]["content"] += " Please go on about it." * (4 * i)
        r1 = tier.chat(history, session)
        holder = path_of(r1)[2]
        assert holder is not None
        history += [assistant(answer(r1)), user("What did the lighthouse keeper count next?")]
        wait_for(lambda: node_entry(tier, holder)["residency"]["mode"] == "exact")
        # D's events for the turn arrive asynchronously; wait until the count stops moving.
        seen: list[int] = []

        def settled() -> bool:
            seen.append(residency(tier, history)[holder]["cached_tokens"] or 0)
            return len(seen) >= 3 and seen[-1] > 0 and seen[-1] == seen[-2] == seen[-3]

        wait_for(settled)
        predicted = seen[-1]
        r2 = tier.chat(history, session)
        assert path_of(r2)[:1] + path_of(r2)[2:] == ("local", holder)
        cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == predicted, f"conversation {i}: vLLM cached {cached}, the router predicted {predicted}"
        other = tier.other_pd(holder)
        assert (residency(tier, history)[other]["cached_tokens"] or 0) == 0
    counts = node_entry(tier, holder)["residency"]["events"]
    assert counts["events"] > 0 and counts["malformed"] == 0, counts
