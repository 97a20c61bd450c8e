"""Workloads: exact token counts, turn variants, determinism, WildChat-like statistics, files."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ppd_router import count_tokens
from ppd_router.bench.metrics import percentile
from ppd_router.bench.workloads import (
    SYNTHETIC_WORKLOADS,
    T1_SETTINGS,
    T2_SETTINGS,
    ConversationFilter,
    WildChatLikeWorkload,
    WorkloadError,
    load_workload,
    summarize,
    turns_from_messages,
)


def test_there_are_the_papers_eighteen_synthetic_workloads():
    assert len(SYNTHETIC_WORKLOADS) == 18
    assert SYNTHETIC_WORKLOADS[0] == "small_tiny" and SYNTHETIC_WORKLOADS[-1] == "large_huge_paste"


@pytest.mark.parametrize("name", SYNTHETIC_WORKLOADS)
def test_synthetic_turns_have_exact_token_counts(name):
    t1, t2 = name.split("_", 1)
    w = load_workload(name, seed=3)
    for conv in w.conversations(3):
        sizes = [(t.n_in, t.n_out) for t in conv.turns]
        assert sizes == [T1_SETTINGS[t1], T2_SETTINGS[t2]]
        for t in conv.turns:
            assert count_tokens(t.text) == t.n_in


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(SYNTHETIC_WORKLOADS), st.integers(2, 16), st.integers(0, 2**32),
       st.integers(0, 10**6))
def test_turn_variants_keep_counts_for_every_turn(name, turns, seed, index):
    conv = load_workload(name, turns=turns, seed=seed).conversation(index)
    assert len(conv.turns) == turns
    t2 = T2_SETTINGS[name.split("_", 1)[1]]
    assert all((t.n_in, t.n_out) == t2 for t in conv.turns[1:])
    assert all(count_tokens(t.text) == t.n_in for t in conv.turns)


@pytest.mark.parametrize("turns", [1, 17, 0])
def test_turns_outside_2_to_16_are_rejected(turns):
    with pytest.raises(WorkloadError, match="2..16"):
        load_workload("small_tiny", turns=turns)


def test_conversations_are_deterministic_and_do_not_share_a_first_message():
    a = load_workload("large_mid_bal", seed=5).conversations(50)
    assert a == load_workload("large_mid_bal", seed=5).conversations(50)
    assert len({c.turns[0].text for c in a}) == 50
    other = load_workload("large_mid_bal", seed=6).conversation(0)
    assert a[0].turns[0].text != other.turns[0].text


def test_context_tokens_accumulate_earlier_turns():
    conv = load_workload("small_big_paste", turns=3).conversation(0)
    assert [conv.context_tokens(k) for k in range(3)] == [128, 128 + 128 + 512,
                                                          128 + 128 + 512 + 64 + 512]


def test_plain_data_is_json_serialisable():
    plain = load_workload("small_tiny", turns=3).as_plain(2)
    assert json.loads(json.dumps(plain)) == plain
    assert [t["n_out"] for t in plain[0]["turns"]] == [128, 32, 32]


def test_unknown_workload_names_the_choices():
    with pytest.raises(WorkloadError, match="small_tiny"):
        load_workload("no_such_workload")


def test_turns_option_is_refused_for_recorded_workloads():
    with pytest.raises(WorkloadError, match="--max-turns"):
        load_workload("wildchat-like", turns=3)


def test_wildchat_like_matches_the_papers_statistics():
    s = summarize(WildChatLikeWorkload(seed=0).conversations(4000))
    assert abs(s.avg_turns - 3.1) < 0.1
    p90 = percentile(s.turn2plus_context, 90)
    assert abs(p90 - 5115) / 5115 < 0.06


def test_wildchat_like_counts_are_exact_and_multi_turn():
    for conv in WildChatLikeWorkload(seed=1).conversations(100):
        assert 2 <= len(conv.turns) <= 16
        assert all(count_tokens(t.text) == t.n_in and t.n_out >= 1 for t in conv.turns)


def _vllm_file(tmp_path: Path, records: list) -> Path:
    p = tmp_path / "convs.json"
    p.write_bytes(orjson.dumps(records))
    return p


VLLM_RECORDS = [
    {"id": "a", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi , how can i help ?"},
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": "once upon a time"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "the end"}]},
    {"id": "single", "messages": [
        {"role": "user", "content": "one shot"}, {"role": "assistant", "content": "ok"}]},
    {"id": "bad", "messages": [{"role": "narrator", "content": "?"}]},
]


def test_vllm_file_replays_user_turns_with_recorded_answer_lengths(tmp_path):
    w = load_workload(str(_vllm_file(tmp_path, VLLM_RECORDS)))
    assert len(w) == 1  # single-turn and malformed records are filtered out
    conv = w.conversation(0)
    assert conv.id == "a" and conv.system == "be brief"
    assert [(t.text, t.n_in, t.n_out) for t in conv.turns] == [
        ("hello there", 2, 7), ("tell me a story", 4, 4), ("more", 1, 2)]
    info = w.info()
    assert (info["records"], info["malformed"], info["too_few_turns"]) == (3, 1, 1)


def test_file_filters_cut_turns_and_context(tmp_path):
    path = str(_vllm_file(tmp_path, VLLM_RECORDS))
    assert len(load_workload(path, flt=ConversationFilter(max_turns=2)).conversation(0).turns) == 2
    # "be brief" (2) + turn 1 (2 + 7) = 11 fits; turn 2 would reach 19.
    with pytest.raises(WorkloadError, match="no usable conversation"):
        load_workload(path, flt=ConversationFilter(max_context=17))
    w = load_workload(path, flt=ConversationFilter(min_turns=1, max_context=17))
    assert [len(c.turns) for c in w.conversations(2)] == [1, 1]


def test_replayed_records_get_a_distinct_first_message(tmp_path):
    w = load_workload(str(_vllm_file(tmp_path, VLLM_RECORDS)))
    first, again = w.conversation(0), w.conversation(1)
    assert again.turns[0].text != first.turns[0].text
    assert again.turns[0].n_in == count_tokens(again.turns[0].text) == first.turns[0].n_in + 1
    assert again.turns[1:] == first.turns[1:]


def test_invalid_json_file_is_a_workload_error(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text('[{"id": 1, "messages": [')
    with pytest.raises(WorkloadError, match="not valid JSON"):
        load_workload(str(p))


def test_turn_pairing_stops_at_an_unanswered_or_doubled_user_message():
    msgs = [("assistant", "greeting first"), ("user", "a b"), ("assistant", "c"),
            ("user", "d"), ("user", "e"), ("assistant", "f")]
    system, turns = turns_from_messages(msgs, ConversationFilter())
    assert system is None and [(t.n_in, t.n_out) for t in turns] == [(2, 1)]
