"""The tiny model the tier serves: its tokenizer round-trips any generated text, its chat template
renders a conversation's next turn as an extension of the last, and it is made the same each time."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from .conftest import TINYMODEL, VLLM_PYTHON

pytestmark = pytest.mark.vllm

CHECK = r"""
import json, random, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
rng = random.Random(7)
special = set(tok.all_special_ids)
plain = [i for i in range(len(tok)) if i not in special and tok.convert_ids_to_tokens(i) != "<|unk|>"]
text_ok = ids_ok = 0
for _ in range(300):
    s = "".join(rng.choice(" \n\tabcXYZ019{}[]()<>|!?.,;:'\"\\/-_=+*&^%$#@~`") for _ in range(rng.randint(1, 80)))
    text_ok += tok.decode(tok.encode(s, add_special_tokens=False)) == s
    ids = [rng.choice(plain) for _ in range(rng.randint(1, 60))]
    ids_ok += tok.encode(tok.decode(ids), add_special_tokens=False) == ids
u1 = [{"role": "user", "content": "Hello there, keeper."}]
answer = "  a [weird] answer\n\twith spaces  "
t1 = tok.apply_chat_template(u1, add_generation_prompt=True, tokenize=True)
t1 = list(t1["input_ids"] if hasattr(t1, "keys") else t1)
t2 = tok.apply_chat_template(u1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}],
                             add_generation_prompt=True, tokenize=True)
t2 = list(t2["input_ids"] if hasattr(t2, "keys") else t2)
a = tok.encode(answer, add_special_tokens=False)
print(json.dumps({"text_ok": text_ok, "ids_ok": ids_ok, "plain": len(plain), "vocab": len(tok),
                  "turn2_extends_turn1": t2[:len(t1) + len(a)] == t1 + a}))
"""


def test_tokenizer_round_trips_and_turn2_extends_turn1_plus_the_answer(tiny_model: Path) -> None:
    out = subprocess.run([VLLM_PYTHON, "-c", CHECK, str(tiny_model)], capture_output=True, text=True,
                         check=True, timeout=120)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["text_ok"] == 300, "some text did not survive encode -> decode"
    assert r["ids_ok"] == 300, "some generated token sequence re-tokenizes differently"
    assert r["plain"] >= 95  # every printable ASCII character is a token
    assert r["turn2_extends_turn1"]


def test_model_is_float32_llama_with_a_head_size_vllm_cpu_supports(tiny_model: Path) -> None:
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] in (32, 64, 80, 96, 112, 128)
    assert cfg.get("torch_dtype", cfg.get("dtype")) == "float32"
    summary = json.loads((tiny_model / "ppd-tiny-model.json").read_text())
    assert summary["vocab_size"] == cfg["vocab_size"]


def test_same_seed_makes_the_same_model(tiny_model: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    subprocess.run([VLLM_PYTHON, str(TINYMODEL), str(again)], check=True, capture_output=True, timeout=300)
    for name in ("model.safetensors", "tokenizer.json"):
        digest = [hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (tiny_model, again)]
        assert digest[0] == digest[1], f"{name} differs between two builds with seed 0"
    refused = subprocess.run([VLLM_PYTHON, str(TINYMODEL), str(again)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "not empty" in refused.stderr
