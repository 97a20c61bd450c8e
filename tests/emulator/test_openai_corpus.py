"""The emulator answers vLLM's OpenAI requests as vLLM does: the shared corpus (valid and invalid
requests, with vLLM's status for each) against one emulator node, checked by the shape rules that
the real-vLLM tier's differential test shares (tests/openai_shape.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ppd_router import _core
from tests.openai_shape import Answer, check_answer, load_corpus, send

MODEL = "tiny"
CORPUS = load_corpus()


@pytest.fixture(scope="module")
def node() -> Iterator[str]:
    with _core.start_emulated_cluster("1R", seed=5, served_model_name=MODEL) as c:
        yield c.urls[0]


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


@pytest.mark.parametrize("entry", CORPUS, ids=[e["name"] for e in CORPUS])
def test_the_emulator_answers_the_corpus_as_vllm_does(node: str, client: httpx.Client, entry: dict[str, Any]):
    check_answer(entry, send(client, node, entry, MODEL))


def entry(name: str) -> dict[str, Any]:
    return next(e for e in CORPUS if e["name"] == name)


def test_a_batch_answers_each_prompt_in_order_and_counts_each_prompt_once(node: str, client: httpx.Client):
    one = [send(client, node, {**entry("cmpl-one"), "body": {**entry("cmpl-one")["body"], "prompt": p}}, MODEL).body
           for p in ("Hello", "World")]
    both: Answer = send(client, node, entry("cmpl-two-prompts-n2"), MODEL)
    usage = both.body["usage"]
    assert usage["prompt_tokens"] == sum(o["usage"]["prompt_tokens"] for o in one)
    assert usage["completion_tokens"] == 4 * 3


def test_greedy_choices_of_a_batch_are_each_prompts_own_answer(node: str, client: httpx.Client):
    body = {"model": MODEL, "prompt": ["Hello", "World"], "max_tokens": 5, "temperature": 0}
    batch = client.post(node + "/v1/completions", json=body).json()["choices"]
    for i, p in enumerate(("Hello", "World")):
        alone = client.post(node + "/v1/completions", json={**body, "prompt": p}).json()["choices"][0]
        assert batch[i]["text"] == alone["text"]


def test_the_samples_of_one_prompt_differ(node: str, client: httpx.Client):
    r = client.post(node + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "n": 3, "seed": 1})
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    assert len(set(texts)) == 3, texts


def test_logprobs_name_the_generated_tokens(node: str, client: httpx.Client):
    r = client.post(node + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
        "logprobs": True, "top_logprobs": 3}).json()
    choice = r["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    for c in content:
        # The sampled token leads its alternatives, as greedy decoding picks the likeliest.
        assert c["top_logprobs"][0]["token"] == c["token"]
        assert [a["logprob"] for a in c["top_logprobs"]] == sorted((a["logprob"] for a in c["top_logprobs"]),
                                                                    reverse=True)


def test_a_streamed_batch_carries_the_same_texts_as_the_whole_answer(node: str, client: httpx.Client):
    body = {"model": MODEL, "prompt": ["Hello", "World"], "max_tokens": 4, "temperature": 0}
    whole = client.post(node + "/v1/completions", json=body).json()["choices"]
    streamed = send(client, node, {"path": "/v1/completions", "body": {**body, "stream": True}}, MODEL)
    texts = ["", ""]
    for e in streamed.events or []:
        if e != "[DONE]":
            for ch in e["choices"]:
                texts[ch["index"]] += ch["text"]
    assert texts == [c["text"] for c in whole]
