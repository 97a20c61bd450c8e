"""Issue 16 (c), the pull path on real vLLM: P reads the conversation's KV back from the D that pinned it
(vLLM NIXL with ``bidirectional_kv_xfer``), prefills only the new tokens, and D decodes; checked against
vLLM's own /metrics, and the greedy answer against the ``local`` and ``pd`` paths' and a from-scratch one.

Its own small cluster (1 P + 1 pD, started bidirectionally by the launcher), since the tier's shared
nodes run without bidirectional transfer; the tier's conftest runs this module before the others, so
the two clusters never run at once on CI's two cores.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ppd_router.launch import VllmCluster
from tests.helpers import free_base_port, vllm_python

from .conftest import (
    VLLM_ARGS,
    Tier,
    answer,
    assistant,
    block_floor,
    by_source,
    conversation_start,
    delta,
    path_of,
    router_for,
    user,
)
from .test_stream import content, stream

pytestmark = [pytest.mark.vllm, pytest.mark.own_cluster]

TTL = 120  # seconds D pins a finished turn: far more than a test between two turns takes
# vLLM's P skips a pull of fewer than kv_recompute_threshold (64 by default) tokens beyond its own cache
# and computes them instead. P caches Turn 1's prompt (it prefilled it), so what it lacks is D's answer:
# 80 tokens (the tiny model never emits a stop token, so every answer runs to max_tokens).
TURN1_TOKENS = 80
FOLLOW_UP = user("And what did he do when the storm came?")
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@pytest.fixture(scope="module")
def pull_nodes(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    logs = tmp_path_factory.mktemp("vllm-pull-logs")
    cluster = VllmCluster(str(tiny_model), ["P", "pD"], device="cpu", base_port=free_base_port(2),
                          python=vllm_python(), vllm_args=VLLM_ARGS, log_dir=str(logs), served_model_name="tiny",
                          decoder_kv_blocks_ttl=TTL)
    with cluster:
        cluster.wait_healthy(timeout_s=900, progress=False)
        print("vLLM start-up, bidirectional (s): " + ", ".join(f"{n.plan.name} {n.ready_s:.1f}" for n in cluster.nodes))
        yield cluster


@pytest.fixture(scope="module")
def pull_tier(pull_nodes: VllmCluster, tiny_model: Path) -> Iterator[Tier]:
    with router_for(pull_nodes, tiny_model, policy="pull", bidirectional_kv_xfer=True,
                    decoder_kv_blocks_ttl=TTL) as t:
        yield t


@dataclass
class Pulled:
    """One conversation whose Turn 2 went the pull path, with what each node counted around that turn."""

    first: list[dict[str, str]]
    turn1: httpx.Response
    turn2: httpx.Response
    before: dict[str, dict[str, float]]
    after: dict[str, dict[str, float]]
    p_sources: dict[str, float]  # P's prompt tokens by source during Turn 2

    @property
    def history(self) -> list[dict[str, str]]:
        return [*self.first, assistant(answer(self.turn1)), FOLLOW_UP]


def salted(tier: Tier, messages: list[dict[str, str]], session: str, salt: str, max_tokens: int = 24,
           **kw: Any) -> httpx.Response:
    # vLLM's cache_salt keeps each path's run of the same conversation out of the others' prefix caches
    # (block hashes include it), so every answer below is computed along its own path.
    return tier.chat(messages, session, max_tokens, cache_salt=salt, **kw)


def sources(tier: Tier, url: str) -> dict[str, float]:
    return {s: by_source(tier, url, s) for s in SOURCES}


@pytest.fixture(scope="module")
def pulled(pull_tier: Tier) -> Pulled:
    t = pull_tier
    first = conversation_start("pull")
    session, salt = str(uuid.uuid4()), "pull-" + uuid.uuid4().hex
    r1 = salted(t, first, session, salt, max_tokens=TURN1_TOKENS)
    assert path_of(r1)[:2] == ("pd", "turn1")
    history = [*first, assistant(answer(r1)), FOLLOW_UP]
    before, p_before = t.snapshot(), sources(t, t.p)
    r2 = salted(t, history, session, salt)
    after, p_after = t.snapshot(), sources(t, t.p)
    return Pulled(first, r1, r2, before, after, {s: p_after[s] - p_before[s] for s in SOURCES})


def test_turn2_goes_the_pull_path_and_d_decodes_it(pull_tier: Tier, pulled: Pulled) -> None:
    path, reason, node = path_of(pulled.turn2)
    assert (path, reason) == ("pull", "forced")
    assert node == pull_tier.pd_nodes()[0]
    assert delta(pulled.before, pulled.after, node, "request_success") == 1
    assert delta(pulled.before, pulled.after, pull_tier.p, "request_success") == 1
    assert "kv_transfer_params" not in pulled.turn2.json(), "D's pin never reaches the client"


def test_p_reads_the_context_from_d_and_computes_only_the_new_tokens(pull_tier: Tier, pulled: Pulled) -> None:
    p = pull_tier.p
    prompt1 = pulled.turn1.json()["usage"]["prompt_tokens"]
    completion1 = pulled.turn1.json()["usage"]["completion_tokens"]
    n2 = pulled.turn2.json()["usage"]["prompt_tokens"]
    # D pinned Turn 1's prompt and its answer but the last sampled token, whose KV is never computed.
    context = prompt1 + completion1 - 1
    new = n2 - context
    got = pulled.p_sources
    print(f"pull turn: prompt {n2} = context {context} + new {new}; P by source {got}")
    assert delta(pulled.before, pulled.after, p, "prompt_tokens") == n2
    # P's own cache still holds Turn 1's prompt (whole blocks); the rest of the context came from D.
    assert got["local_cache_hit"] == block_floor(prompt1)
    assert got["external_kv_transfer"] == context - block_floor(prompt1)
    assert delta(pulled.before, pulled.after, p, "external_prefix_cache_hits") == got["external_kv_transfer"]
    assert got["local_compute"] == new, f"P computed {got['local_compute']} tokens; the new ones are {new}"


def test_d_keeps_the_context_and_takes_only_the_new_blocks_from_p(pull_tier: Tier, pulled: Pulled) -> None:
    d = pull_tier.pd_nodes()[0]
    prompt1 = pulled.turn1.json()["usage"]["prompt_tokens"]
    context = prompt1 + pulled.turn1.json()["usage"]["completion_tokens"] - 1
    n2 = pulled.turn2.json()["usage"]["prompt_tokens"]
    local = delta(pulled.before, pulled.after, d, "prefix_cache_hits")
    fetched = delta(pulled.before, pulled.after, d, "external_prefix_cache_hits")
    assert local == block_floor(context), f"D reused {local} of its own tokens; it holds {context}"
    assert fetched == n2 - local, f"D took {fetched} tokens from P; it lacked {n2 - local}"


def test_greedy_pull_answer_is_identical_to_the_local_pd_and_from_scratch_answers(
    pull_tier: Tier, pulled: Pulled
) -> None:
    t = pull_tier
    d = t.pd_nodes()[0]
    a1, a2_pull = answer(pulled.turn1), answer(pulled.turn2)

    def turn2(policy: str) -> str:
        t.set_policy(policy)
        session, salt = str(uuid.uuid4()), f"{policy}-{uuid.uuid4().hex}"
        r1 = salted(t, pulled.first, session, salt, max_tokens=TURN1_TOKENS)
        assert answer(r1) == a1
        r2 = salted(t, pulled.history, session, salt)
        assert path_of(r2)[0] == policy
        return answer(r2)

    try:
        a2_local, a2_pd = turn2("local"), turn2("pd")
    finally:
        t.set_policy("pull")
    # Turn 2 computed whole on D, from an empty cache (a salt of its own), with no transfer at all.
    scratch = answer(salted(t, pulled.history, "scratch", "scratch-" + uuid.uuid4().hex, url=d))
    assert a2_pull == a2_local == a2_pd == scratch
    # The agreement means the pulled KV was right only if the answer depends on the context: three
    # one-character changes early in it, of which at least one must change the answer.
    controls = [
        answer(salted(t, [user(pulled.first[0]["content"].replace(old, new, 1)), *pulled.history[1:]], "ctl",
                      "ctl-" + uuid.uuid4().hex, url=d))
        for old, new in (("Tell", "Tall"), ("lighthouse", "lighthousE"), ("every night", "every Night"))
    ]
    assert any(c != scratch for c in controls), "the answer ignores earlier context: the check above proves nothing"


def pins_asked(tier: Tier) -> float:
    m = re.search(r'^ppd_pin_requests_total\{result="pinned"\} ([0-9.e+]+)$', tier.client.get(tier.url + "/metrics").text,
                  re.M)
    return float(m.group(1)) if m else 0.0


def test_after_a_streamed_answer_the_router_asks_d_for_a_pin_and_p_computes_only_the_new_tokens(
    pull_tier: Tier,
) -> None:
    # vLLM 0.32 names D's pin only in a whole answer; after a streamed one the router asks D for a pin of
    # the history up to that answer (continue_final_message, one token) and the turn still pulls.
    t = pull_tier
    d = t.pd_nodes()[0]
    first = conversation_start("pull-after-stream")
    session, salt = str(uuid.uuid4()), "pull-stream-" + uuid.uuid4().hex
    headers, events = stream(t, first, session, max_tokens=TURN1_TOKENS, cache_salt=salt,
                             stream_options={"include_usage": True})
    assert headers["x-ppd-path"] == "pd"
    usage1 = events[-2]["usage"]
    assert "kv_transfer_params" not in events[-2]
    history = [*first, assistant(content(events)), FOLLOW_UP]
    asked = pins_asked(t)
    before, p_before = t.snapshot(), sources(t, t.p)
    r2 = salted(t, history, session, salt)
    after, p_after = t.snapshot(), sources(t, t.p)
    assert path_of(r2) == ("pull", "forced", d)
    assert pins_asked(t) == asked + 1
    got = {s: p_after[s] - p_before[s] for s in SOURCES}
    n2 = r2.json()["usage"]["prompt_tokens"]
    print(f"pull after a stream: prompt {n2}, turn 1 {usage1}, P by source {got}")
    # D pinned the history up to the streamed answer's end (Turn 1's prompt and its 80 answer tokens, as
    # the re-rendered history tokenizes them); P's cache held Turn 1's prompt, D's pin gave it the rest,
    # and P computed only what follows the answer.
    context = usage1["prompt_tokens"] + usage1["completion_tokens"]
    assert got["local_cache_hit"] == block_floor(usage1["prompt_tokens"])
    assert got["external_kv_transfer"] == context - block_floor(usage1["prompt_tokens"])
    assert got["local_compute"] == n2 - context, f"P computed {got['local_compute']} of {n2} tokens"
    # D answered the pin request and the turn: two requests.
    assert delta(before, after, d, "request_success") == 2
    # The pulled KV is right: the answer is the one computed from scratch on an empty cache.
    scratch = answer(salted(t, history, "scratch", "scratch-" + uuid.uuid4().hex, url=d))
    assert answer(r2) == scratch
