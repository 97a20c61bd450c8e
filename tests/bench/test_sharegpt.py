"""ShareGPT recovery from a JSON array cut short, record by record."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ppd_router.bench import sharegpt as sg
from ppd_router.bench.workloads import ConversationFilter, load_sharegpt


def _record(i: int, turns: int) -> dict:
    conv = []
    for k in range(turns):
        conv.append({"from": "human", "value": f"question {i} part {k} with \"quotes\" and ]"})
        conv.append({"from": "gpt", "value": f"answer {i} {k} " + "word " * (k + 1)})
    return {"id": f"r{i}", "conversations": conv}


RECORDS = [_record(0, 2), _record(1, 1), _record(2, 3), _record(3, 2), _record(4, 2)]


def _dump() -> tuple[str, list[int]]:
    """ShareGPT's layout (indented array) and the offset just after each record."""
    text = json.dumps(RECORDS, indent=2)
    ends, dec, pos = [], json.JSONDecoder(), 1
    for _ in RECORDS:
        while text[pos] in " \n,":
            pos += 1
        _, pos = dec.raw_decode(text, pos)
        ends.append(pos)
    return text, ends


def test_complete_file_recovers_everything_untruncated():
    text, _ = _dump()
    recs, stats = sg.recover_text(text)
    assert recs == RECORDS and stats.records == 5 and not stats.truncated


def test_file_cut_inside_a_record_keeps_the_complete_ones():
    text, ends = _dump()
    cut = (ends[2] + ends[3]) // 2
    recs, stats = sg.recover_text(text[:cut])
    assert recs == RECORDS[:3]
    assert stats.truncated


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_cut_recovers_exactly_the_records_that_end_before_it(data):
    text, ends = _dump()
    cut = data.draw(st.integers(1, len(text)))
    chunk = data.draw(st.sampled_from([3, 17, 1 << 20]))
    expected = [r for r, end in zip(RECORDS, ends, strict=True) if end <= cut]
    old = sg._CHUNK_BYTES
    sg._CHUNK_BYTES = chunk  # small chunks exercise records spanning reads
    try:
        stats = sg.RecoveryStats()
        recs = list(sg.iter_records(io.BytesIO(text[:cut].encode()), stats))
    finally:
        sg._CHUNK_BYTES = old
    assert recs == expected
    assert stats.truncated == (cut < len(text))


@pytest.mark.parametrize("text", ["", "   ", '{"id": 1}', "[1,,2]", "[1 2]", "[1,]", '["\\q", 1]', '[trux, 1]'])
def test_non_array_input_is_an_error(text):
    with pytest.raises(sg.RecoveryError):
        sg.recover_text(text)


@pytest.mark.parametrize("tail", ['"x\\', '"x\\u00', "tr", "1.", "-", '"\u20ac'])
def test_a_cut_inside_the_last_token_is_truncation_not_an_error(tail):
    text = '[{"a": 1}, [' + tail
    cut = len(text.encode()) - (1 if tail.startswith('"\u20ac') else 0)  # inside the euro sign's UTF-8 bytes
    recs, stats = sg.recover_records(io.BytesIO(text.encode()[:cut]))
    assert recs == [{"a": 1}] and stats.truncated


def test_sharegpt_workload_reports_recovery_and_keeps_multi_turn(tmp_path: Path):
    text, ends = _dump()
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: ends[3] + 5])  # record 3 complete, the tail cut
    w = load_sharegpt(path, ConversationFilter())
    info = w.info()
    assert info["recovered_records"] == 4 and info["truncated"] is True
    assert info["too_few_turns"] == 1  # record 1 is single-turn
    assert sorted(c.id for c in w.conversations(3)) == ["r0", "r2", "r3"]
    r2 = next(c for c in w.conversations(3) if c.id == "r2")
    assert [t.n_out for t in r2.turns] == [4, 5, 6]  # "answer 2 k" + k+1 words


def test_sharegpt_max_turns_truncates(tmp_path: Path):
    text, _ = _dump()
    path = tmp_path / "sharegpt.json"
    path.write_text(text)
    w = load_sharegpt(path, ConversationFilter(max_turns=2))
    assert max(len(c.turns) for c in w.conversations(len(w))) == 2
