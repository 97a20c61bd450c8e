"""The emulator against real vLLM, differentially: the shared corpus of requests (valid and invalid)
goes to a vLLM pD node of the tier and to an emulator pD node serving the same model name; their
answers must agree in status and shape (error type and code, choices and their indices, keys and
value types, stream chunks, usage), never necessarily in text. vLLM's answers must also follow the
shape rules the emulator tier checks, so those rules are vLLM's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ppd_router import _core
from ppd_router.launch import VllmCluster
from tests.openai_shape import check_answer, differences, load_corpus, send

from .conftest import Tier

pytestmark = pytest.mark.vllm

MODEL = "tiny"  # the tier's served model name
CORPUS = load_corpus()


@pytest.fixture(scope="module")
def emulator() -> Iterator[str]:
    with _core.start_emulated_cluster("1pD", seed=11, served_model_name=MODEL) as c:
        yield c.urls[0]


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300) as c:
        yield c


@pytest.mark.parametrize("entry", CORPUS, ids=[e["name"] for e in CORPUS])
def test_the_emulator_answers_like_a_vllm_node(vllm_nodes: VllmCluster, emulator: str, client: httpx.Client,
                                               entry: dict[str, Any]) -> None:
    vllm_url = next(n.url for n in vllm_nodes.nodes if n.plan.role == "pD")
    theirs = send(client, vllm_url, entry, MODEL)
    check_answer(entry, theirs)
    ours = send(client, emulator, entry, MODEL)
    assert differences(ours, theirs) == []


VALID = [e for e in CORPUS if e["status"] == 200]


@pytest.mark.parametrize("policy", ["pd", "local"])
def test_the_router_relays_n_batches_and_logprobs_from_vllm(tier: Tier, policy: str) -> None:
    """Through the router on both paths, the valid requests get vLLM's own answer shapes: n > 1,
    batches and logprobs survive the pd split (P prefills with max_tokens 1, D pulls and decodes)."""
    tier.set_policy(policy)
    try:
        for entry in VALID:
            answer = send(tier.client, tier.url, entry, MODEL)
            assert answer.status == 200, (entry["name"], answer.body)
            check_answer(entry, answer)
    finally:
        tier.set_policy("local")
