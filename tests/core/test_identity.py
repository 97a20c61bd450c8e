"""Conversation identity and request features through the Python API."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppd_router import BadRequest, SessionTable, TokenCounter, count_tokens, identify


def chat(*msgs, **extra):
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in msgs], **extra})


def test_identity_order_header_then_fields_then_history():
    body = chat(("user", "hello"), conversation_id="conv", session_id="sess", user="alice")
    assert identify(body, "hdr")["conversation_id"] == "hdr"
    assert identify(body)["conversation_id"] == "conv"
    assert identify(chat(("user", "hello"), session_id="sess"))["conversation_id"] == "sess"
    assert identify(chat(("user", "hello"), user="alice"), session_from_user=True)["conversation_id"] == "alice"
    f = identify(chat(("user", "hello"), user="alice"))
    assert f["conversation_id"] != "alice"
    assert f["id_source"] == "opening"


def test_conversations_that_open_alike_part_at_their_first_answer():
    t1 = identify(chat(("system", "s"), ("user", "Hello")))
    a = identify(chat(("system", "s"), ("user", "Hello"), ("assistant", "hi"), ("user", "and PPD?")))
    b = identify(chat(("system", "s"), ("user", "Hello"), ("assistant", "good day"), ("user", "and PPD?")))
    assert (t1["id_source"], a["id_source"]) == ("opening", "history")
    assert len({t1["conversation_id"], a["conversation_id"], b["conversation_id"]}) == 3
    # The key depends on the history through the last assistant message only.
    a_other_question = identify(chat(("system", "s"), ("user", "Hello"), ("assistant", "hi"), ("user", "else")))
    assert a_other_question["conversation_id"] == a["conversation_id"]
    assert (t1["turn"], a["turn"]) == (1, 2)


def test_token_split_at_the_last_assistant_message():
    f = identify(chat(("user", "one two three"), ("assistant", "four five"), ("user", "six"), max_tokens=77))
    # ctx = 1 + (4+3) + (4+2); in = (4+1) + 3
    assert (f["n_ctx"], f["n_in"], f["n_out"], f["out_source"]) == (14, 8, 77, "request")


def test_session_usage_makes_context_exact_and_gives_the_output_mean():
    sessions = SessionTable()
    body = chat(("user", "a"), ("assistant", "b"), ("user", "c"))
    cid = identify(body)["conversation_id"]
    sessions.record_turn(cid, turn=1, d="http://d0", p="http://p0", prompt_tokens=900, completion_tokens=100)
    f = identify(body, sessions=sessions)
    assert (f["n_ctx"], f["ctx_source"]) == (1000, "session_usage")
    assert (f["n_out"], f["out_source"]) == (100, "session_mean")


def test_content_parts_are_counted_and_hashed_as_text():
    parts = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]})
    assert identify(parts)["conversation_id"] == identify(chat(("user", "hello")))["conversation_id"]


def test_completions_prompt_is_identified_by_its_first_block():
    a = identify(json.dumps({"prompt": "Intro.\n\nQ: one"}))
    b = identify(json.dumps({"prompt": "Intro.\n\nQ: one\n\nA: x\n\nQ: two"}))
    assert a["conversation_id"] == b["conversation_id"]
    assert a["id_source"] == "prompt_block"


@pytest.mark.parametrize("body", [
    "not json", "{}", '{"messages": []}',
    '{"messages": [{"role": "user", "content": 5}]}', '{"messages": "x"}',
    '{"messages": [{"role": "user", "content": "a"}], "max_tokens": -1}', b"\xff\xfe",
])
def test_bad_bodies_raise_bad_request(body):
    with pytest.raises(BadRequest):
        identify(body)


def test_word_rule_counts():
    assert count_tokens("Hello, world!") == 4
    assert TokenCounter.word_rule().count("a b c") == 3


def test_tokenizer_json_counter_loads_a_real_tokenizer(tmp_path):
    # A minimal WordLevel tokenizer.json with whitespace pre-tokenization.
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2}, "unk_token": "[UNK]"},
    }
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(tok))
    c = TokenCounter.from_tokenizer_json(str(p))
    assert c.name == "tokenizer.json"
    assert c.count("hello world hello") == 3
    with pytest.raises(OSError):
        TokenCounter.from_tokenizer_json(str(tmp_path / "missing.json"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]), st.text(max_size=40)), min_size=1, max_size=8))
def test_arbitrary_conversations_identify_or_raise_bad_request(msgs):
    body = chat(*msgs)
    f = identify(body)
    # A chat without user messages (system only, say) is a Turn 1.
    assert f["turn"] == max(1, sum(r == "user" for r, _ in msgs))
    # Keyed by its history through the last assistant message, or new without one.
    assert f["id_source"] == ("history" if any(r == "assistant" for r, _ in msgs) else "opening")
    total = 1 + 3 + sum(4 + count_tokens(c) for _, c in msgs)
    assert f["n_ctx"] + f["n_in"] == total
