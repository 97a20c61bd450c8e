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
