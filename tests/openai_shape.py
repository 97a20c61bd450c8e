"""What vLLM's OpenAI answers look like, as rules and as comparable shapes, for one corpus of requests.

tests/data/openai_corpus.json holds requests (valid and invalid) with the status vLLM gives each.
The emulator tier checks an emulator node's answers against the rules here (:func:`check_answer`);
the real-vLLM tier sends the same corpus to a vLLM node and an emulator node and compares the
answers' shapes (:func:`shape`): status, keys, value types, choice counts and indices, error
types, never texts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import httpx

CORPUS = Path(__file__).resolve().parent / "data" / "openai_corpus.json"
MODEL_PLACEHOLDER = "$MODEL"


def load_corpus() -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = json.loads(CORPUS.read_text())["requests"]
    return entries


@dataclass
class Answer:
    """One answer: its status, and its JSON body or the JSON of its SSE events (``[DONE]`` kept as text)."""

    status: int
    body: Any
    events: Optional[list[Any]] = None


def request_bytes(entry: dict[str, Any], model: str) -> bytes:
    if "raw" in entry:
        return str(entry["raw"]).encode()
    body = entry["body"]
    if isinstance(body, dict) and body.get("model") == MODEL_PLACEHOLDER:
        body = {**body, "model": model}
    return json.dumps(body).encode()


def send(client: httpx.Client, url: str, entry: dict[str, Any], model: str) -> Answer:
    r = client.post(url + entry["path"], content=request_bytes(entry, model),
                    headers={"content-type": "application/json"})
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        data = [line[len("data: "):] for line in r.text.split("\n") if line.startswith("data: ")]
        events = [d if d == "[DONE]" else json.loads(d) for d in data]
        return Answer(r.status_code, None, events)
    try:
        body = r.json()
    except ValueError:
        body = r.text
    return Answer(r.status_code, body, None)


# ---- the rules ------------------------------------------------------------------------------------


def expected_choices(entry: dict[str, Any]) -> int:
    """vLLM's number of choices: one per prompt of a batch, times n."""
    body = entry["body"]
    n = int(body.get("n", 1))
    prompt = body.get("prompt")
    prompts = 1
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompts = len(prompt)
    return prompts * n


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_error(answer: Answer, status: int) -> None:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}`` with code = status."""
    assert answer.status == status, (answer.status, answer.body)
    err = answer.body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] == status


def check_completion_logprobs(lp: dict[str, Any], top: int) -> int:
    """A completion's logprobs (whole or one chunk's); returns its token count."""
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}, lp
    k = len(lp["tokens"])
    assert len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(lp["top_logprobs"]) == k
    assert all(isinstance(t, str) for t in lp["tokens"])
    assert all(_is_number(x) and x <= 0 for x in lp["token_logprobs"])
    assert all(isinstance(o, int) for o in lp["text_offset"])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for tok, alts in zip(lp["tokens"], lp["top_logprobs"]):
        assert isinstance(alts, dict) and all(_is_number(v) and v <= 0 for v in alts.values())
        # The sampled token, plus up to `top` others.
        assert tok in alts and max(top, 1) <= len(alts) <= top + 1, (tok, alts, top)
    return k


def check_chat_logprobs(lp: dict[str, Any], top: int) -> int:
    """A chat choice's logprobs (whole or one chunk's); returns its token count."""
    content = lp["content"]
    assert isinstance(content, list)
    for c in content:
        assert isinstance(c["token"], str) and _is_number(c["logprob"]) and c["logprob"] <= 0
        assert c["bytes"] == list(c["token"].encode())
        assert len(c["top_logprobs"]) == top, (c, top)
        for alt in c["top_logprobs"]:
            assert set(alt) == {"token", "logprob", "bytes"} and alt["logprob"] <= 0
    return len(content)


def logprobs_asked(entry: dict[str, Any]) -> Optional[int]:
    """How many alternatives per token the request asks for (None: no logprobs)."""
    body = entry["body"]
    if entry["path"].endswith("/chat/completions"):
        return int(body.get("top_logprobs") or 0) if body.get("logprobs") else None
    lp = body.get("logprobs")
    return None if lp is None else int(lp)


def check_usage(usage: dict[str, Any]) -> None:
    assert all(isinstance(usage[k], int) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def check_whole(entry: dict[str, Any], answer: Answer) -> None:
    body = answer.body
    chat = entry["path"].endswith("/chat/completions")
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert isinstance(body["id"], str) and isinstance(body["created"], int)
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(expected_choices(entry)))
    top = logprobs_asked(entry)
    tokens = 0
    for c in choices:
        assert isinstance(c["finish_reason"], str)
        text = c["message"]["content"] if chat else c["text"]
        assert isinstance(text, str)
        if top is None:
            assert c["logprobs"] is None
        elif chat:
            tokens += check_chat_logprobs(c["logprobs"], top)
        else:
            tokens += check_completion_logprobs(c["logprobs"], top)
            assert "".join(c["logprobs"]["tokens"]) == text
    check_usage(body["usage"])
    if top is not None:
        assert body["usage"]["completion_tokens"] == tokens


def check_stream(entry: dict[str, Any], answer: Answer) -> None:
    events = answer.events or []
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = events[:-1]
    chat = entry["path"].endswith("/chat/completions")
    want = expected_choices(entry)
    top = logprobs_asked(entry)
    finishes: dict[int, int] = {}
    usage = [c for c in chunks if c.get("usage")]
    for c in chunks:
        assert c["object"] == ("chat.completion.chunk" if chat else "text_completion")
        for ch in c["choices"]:
            i = ch["index"]
            assert 0 <= i < want, (i, want)
            if ch.get("finish_reason") is not None:
                finishes[i] = finishes.get(i, 0) + 1
            text = (ch["delta"].get("content") if chat else ch["text"])
            if top is not None and text and ch.get("finish_reason") is None:
                if chat:
                    check_chat_logprobs(ch["logprobs"], top)
                else:
                    check_completion_logprobs(ch["logprobs"], top)
    assert finishes == dict.fromkeys(range(want), 1), finishes
    wants_usage = bool((entry["body"].get("stream_options") or {}).get("include_usage"))
    if wants_usage:
        assert len(usage) == 1 and chunks[-1] is usage[0] and chunks[-1]["choices"] == []
        check_usage(usage[0]["usage"])
    else:
        assert usage == []


def check_answer(entry: dict[str, Any], answer: Answer) -> None:
    """The answer to ``entry`` follows vLLM's rules: its status, and its shape for that status."""
    status = entry["status"]
    if status != 200:
        check_error(answer, status)
    elif entry["body"].get("stream"):
        assert answer.status == 200, answer.body
        check_stream(entry, answer)
    else:
        assert answer.status == 200, answer.body
        check_whole(entry, answer)


# ---- the differential comparison -----------------------------------------------------------------


def _merge(a: Any, b: Any) -> Any:
    """One structure that holds the keys of both (lists: their elements merged into one)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _merge(out[k], v) if k in out else v
        return out
    if isinstance(a, list) and isinstance(b, list):
        items = [*a, *b]
        if not items:
            return []
        merged = items[0]
        for x in items[1:]:
            merged = _merge(merged, x)
        return [merged]
    return b if a is None else a


def _kind(x: Any) -> str:
    if isinstance(x, bool):
        return "bool"
    if _is_number(x):
        return "number"
    return type(x).__name__


def _outside(ours: Any, ref: Any, path: str, token_keys: bool = False) -> list[str]:
    """Where ``ours`` has a key ``ref`` lacks, or a value of another type (null matches anything)."""
    if ours is None or ref is None:
        return []
    if _kind(ours) != _kind(ref):
        return [f"{path}: {_kind(ours)} where vLLM has {_kind(ref)}"]
    diffs: list[str] = []
    if isinstance(ours, dict):
        if token_keys:
            # A completion's alternatives map token texts to logprobs: the keys are data.
            ref_values = list(ref.values())[:1]
            return [d for v in ours.values() for d in _outside(v, ref_values[0], f"{path}.*")] if ref_values else []
        for k, v in ours.items():
            if k not in ref:
                diffs.append(f"{path}.{k}: not in vLLM's answer")
            else:
                alternatives = k == "top_logprobs" and isinstance(v, list) and path.endswith("logprobs")
                diffs += _outside(v, ref[k], f"{path}.{k}", token_keys=alternatives)
    elif isinstance(ours, list) and ref:
        r = ref[0]
        for i, v in enumerate(ours):
            diffs += _outside(v, r, f"{path}[{i}]", token_keys=token_keys)
    return diffs


def _finishes(events: list[Any]) -> dict[int, int]:
    out: dict[int, int] = {}
    for c in events:
        if c == "[DONE]":
            continue
        for ch in c.get("choices", []):
            if ch.get("finish_reason") is not None:
                out[ch["index"]] = out.get(ch["index"], 0) + 1
    return out


def differences(ours: Answer, vllm: Answer) -> list[str]:
    """How an answer differs from vLLM's to the same request in status and shape (never in text):
    the error's type, code and param presence; the number and indices of choices; a key vLLM does
    not send, or a value of another type; for streams, the choices each chunk names, one finish per
    choice, the usage chunk and ``[DONE]``."""
    if ours.status != vllm.status:
        return [f"status {ours.status}, vLLM {vllm.status}: {ours.body!r:.300} / {vllm.body!r:.300}"]
    if (ours.events is None) != (vllm.events is None):
        return ["one streamed, the other did not"]
    if ours.events is None:
        a, b = ours.body, vllm.body
        if isinstance(b, dict) and isinstance(b.get("error"), dict):
            ea, eb = a["error"], b["error"]
            return [f"error {k}: {ea.get(k)!r}, vLLM {eb.get(k)!r}" for k in ("type", "code")
                    if ea.get(k) != eb.get(k)] + \
                (["error param: given by one only"] if (ea.get("param") is None) != (eb.get("param") is None) else [])
        ia = [c["index"] for c in a["choices"]]
        ib = [c["index"] for c in b["choices"]]
        if ia != ib:
            return [f"choice indices {ia}, vLLM {ib}"]
        return _outside(a, _merge(b, b), "")
    ea, eb = ours.events, vllm.events or []
    diffs = []
    if ea[-1:] != ["[DONE]"] or eb[-1:] != ["[DONE]"]:
        diffs.append("a stream does not end with [DONE]")
    fa, fb = _finishes(ea), _finishes(eb)
    if fa != fb:
        diffs.append(f"finishes per choice {fa}, vLLM {fb}")
    ua = [bool(c.get("usage")) for c in ea if c != "[DONE]"]
    ub = [bool(c.get("usage")) for c in eb if c != "[DONE]"]
    if any(ua) != any(ub) or (any(ua) and not (ua[-1] and ub[-1])):
        diffs.append("the usage chunk differs")
    union: Any = {}
    for c in eb:
        if c != "[DONE]":
            union = _merge(union, c)
    for i, c in enumerate(ea):
        if c != "[DONE]":
            diffs += _outside(c, union, f"chunk{i}")
    return diffs
