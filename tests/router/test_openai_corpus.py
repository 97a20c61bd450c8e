"""The router relays what vLLM's API allows: n > 1, batches of prompts and logprobs pass through on
the pd and local paths, whole and streamed, and the client gets vLLM's answer shapes (the shared
corpus and its rules, tests/openai_shape.py); refused requests keep vLLM's status."""

from __future__ import annotations

from typing import Any

import pytest

from tests.openai_shape import check_answer, load_corpus, send

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the emulator's default served model name
# The router answers malformed bodies and unknown models itself (OpenAI's own error codes); the
# refusals below are the nodes', relayed.
CORPUS = [e for e in load_corpus() if e["status"] == 200 or e["name"] in (
    "cmpl-temperature-string", "chat-temperature-too-hot", "cmpl-n-zero", "cmpl-logprobs-too-many",
    "chat-top-logprobs-without-logprobs", "cmpl-greedy-n2")]


@pytest.fixture(scope="module", params=["pd", "local"])
def router(request: pytest.FixtureRequest) -> Any:
    from .conftest import start_cluster

    c = start_cluster({"P": 1, "pD": 1}, policy=request.param)
    yield c
    c.stop()


@pytest.mark.parametrize("entry", CORPUS, ids=[e["name"] for e in CORPUS])
def test_the_router_relays_vllms_answer_shapes(router: Any, entry: dict[str, Any]) -> None:
    answer = send(router.client, router.url, entry, MODEL)
    check_answer(entry, answer)
