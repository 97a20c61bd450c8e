"""Streaming through the router on both paths: well-formed SSE from vLLM, ending in [DONE], with
usage exactly when the client asked for it, and the same text as the non-streamed answer."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from .conftest import Tier, answer, assistant, conversation_start, path_of, user

pytestmark = pytest.mark.vllm


def stream(tier: Tier, messages: list[dict[str, str]], session: str, **body: Any) -> tuple[dict[str, str], list[Any]]:
    """Headers and the SSE data payloads (JSON, or the final "[DONE]") of one streamed chat request."""
    payload = {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0, "stream": True, **body}
    with tier.client.stream("POST", tier.url + "/v1/chat/completions", json=payload,
                            headers={"x-session-id": session}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert text.endswith("\n\n"), "the stream must end with a complete event"
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), f"not an SSE data event: {block!r}"
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return dict(r.headers), events


def content(events: list[Any]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events if e != "[DONE]" for c in e["choices"])


@pytest.mark.parametrize("include_usage", [False, True])
def test_streams_on_pd_and_local_paths_end_in_done_with_usage_only_when_asked(tier: Tier, include_usage: bool) -> None:
    tier.set_policy("local")
    session = str(uuid.uuid4())
    first = conversation_start("stream")
    opts = {"stream_options": {"include_usage": True}} if include_usage else {}
    history = first
    for expected_path in ("pd", "local"):
        headers, events = stream(tier, history, session, **opts)
        assert headers["x-ppd-path"] == expected_path
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert len({c["id"] for c in chunks}) == 1
        finals = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
        assert finals == ["length"]
        with_usage = [c for c in chunks if c.get("usage")]
        if include_usage:
            # vLLM's usage chunk is the last one, with no choices.
            assert with_usage == [chunks[-1]] and chunks[-1]["choices"] == []
            usage = chunks[-1]["usage"]
            assert usage["completion_tokens"] == 16
            assert usage["prompt_tokens"] > 0 and "cached_tokens" in usage["prompt_tokens_details"]
        else:
            assert with_usage == [], "the usage chunk the router asked for reached the client"
        text = content(chunks)
        # Greedy: the streamed text is the answer the same request gets without streaming.
        assert text == answer(tier.chat(history, "nostream-" + session, max_tokens=16, url=headers["x-ppd-node"]))
        history = history + [assistant(text), user("Go on.")]
    _, reason, _ = path_of(tier.chat(history, session, max_tokens=4))
    assert reason  # the session is still known and routed after two streamed turns
