"""Issue 15: fuzzed request bodies and headers (bounded in count and time). Every answer is a 200
or a 4xx with an OpenAI error body, never a 5xx, and the router stays alive after every case."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.conftest import Cluster, start_cluster

TEXT = st.text(max_size=40)
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), TEXT)
JSONISH = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)
ROLE = st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "developer"]), TEXT)
CONTENT = st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3),
                    JSONISH)
MESSAGE = st.one_of(st.fixed_dictionaries({"role": ROLE, "content": CONTENT}), JSONISH)
BODY = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just("meta-llama/Llama-3.1-8B-Instruct"), TEXT, JSONISH),
        "messages": st.one_of(st.lists(MESSAGE, max_size=5), JSONISH),
        "prompt": st.one_of(TEXT, st.lists(st.integers(0, 1000), max_size=8), JSONISH),
        "max_tokens": st.one_of(st.integers(-5, 6), st.floats(allow_nan=False), TEXT, st.none()),
        "max_completion_tokens": st.one_of(st.integers(-5, 6), JSONISH),
        "stream": st.one_of(st.booleans(), JSONISH),
        "stream_options": JSONISH,
        "conversation_id": st.one_of(TEXT, JSONISH),
        "session_id": st.one_of(TEXT, JSONISH),
        "kv_transfer_params": JSONISH,
        "temperature": st.one_of(st.floats(allow_nan=False), TEXT),
    },
)
HEADERS = st.dictionaries(
    st.sampled_from(["x-session-id", "content-type", "accept", "x-request-id"]),
    # What an HTTP client lets through: visible ASCII (h11 refuses edge whitespace).
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=30),
    max_size=3,
)


@pytest.fixture(scope="module")
def cluster() -> Any:
    c = start_cluster({"P": 1, "pD": 1}, policy="local", request_timeout=10, first_token_timeout=10)
    yield c
    c.stop()


def check(c: Cluster, r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and "type" in err, r.text
    health = httpx.get(c.url + "/health", timeout=5)
    assert health.status_code == 200, health.text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=BODY, headers=HEADERS, endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_fuzzed_json_bodies_get_a_200_or_a_clear_4xx(cluster: Cluster, body: dict, headers: dict, endpoint: str) -> None:
    headers = {"content-type": "application/json", **headers}
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 0:
        body["max_tokens"] = min(body["max_tokens"], 4)
    r = cluster.client.post(cluster.url + endpoint, content=json.dumps(body), headers=headers, timeout=30)
    check(cluster, r)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300))
def test_fuzzed_raw_bytes_get_a_clear_4xx(cluster: Cluster, raw: bytes) -> None:
    r = cluster.client.post(cluster.url + "/v1/chat/completions", content=raw,
                            headers={"content-type": "application/json"}, timeout=30)
    check(cluster, r)
