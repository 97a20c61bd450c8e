#!/usr/bin/env python3
"""Time Llama-3.1-8B-shaped engine steps in plain PyTorch and fit the emulator's step-time model.

One prepared script for a GPU machine that has PyTorch but no vLLM and no network:
random weights, no checkpoint. It times the four kinds of engine step the emulator
prices (``rust/ppd-core/src/emu/profile.rs``, ``StepModel::step_ms``):

* ``prefill``  - a full prefill of N tokens (no cached context);
* ``append``   - an append-prefill: N new tokens over C cached tokens;
* ``decode``   - B sequences, one new token each, each over C cached tokens;
* ``mixed``    - a decode batch and one prefill or append-prefill chunk in the same
  step (the paper's Figure 2 interference: the chunk's tokens share the GEMMs).

then fits the six step coefficients by non-negative least squares (relative error)
and writes an engine profile TOML that ``ppd_router._core.load_profile`` and the
emulator load, plus a JSON file with every measurement and the fit.

How a step is timed
-------------------
* Shapes: Llama-3.1-8B (hidden 4096, 32 layers, 32 heads, 8 KV heads, head dim 128,
  intermediate 14336, vocab 128256), bf16 on CUDA. Only ``--layers`` decoder layers
  (default 4) are built; their time is scaled by 32 / layers. The embedding lookup,
  final norm, lm_head and greedy sampling (argmax) run once per step, for the
  sampled tokens only (the last token of each sequence), and are not scaled.
* Layer: RMSNorm, fused QKV projection, RoPE, attention, O projection, RMSNorm,
  fused gate/up projection, SiLU-and-mul, down projection; the new tokens' K/V are
  written into the cache.
* Attention: ``torch.nn.functional.scaled_dot_product_attention`` over a contiguous
  (not paged) KV cache of shape [batch, kv_heads, context + new, head_dim] per layer
  (one cache shared by all timed layers when per-layer caches would not fit).
  Varlen batches are handled by grouping: every grid point's sequences fall into a
  few groups of equal (context, new tokens), and each group is one batched SDPA call
  (no padding; a heterogeneous batch would be one call per distinct shape). Decode
  attends over each sequence's whole context, so its cost scales with context.
  Append-prefill uses a lower-right causal mask (``causal_lower_right``), GQA via
  ``enable_gqa`` when this PyTorch supports it (else K/V heads are expanded, and the
  JSON says so).
* Timing: on CUDA each step's layer stack and head are captured as CUDA graphs
  (like vLLM's, no Python launch overhead; ``--no-cuda-graphs`` times eagerly) and
  timed with CUDA events. On CPU with one torch thread (the ``--tiny`` default) the
  clock is the thread's CPU time (``time.thread_time``), which other jobs on a busy CI
  machine cannot inflate by preempting the run; with more threads, ``time.perf_counter``.
  ``--warmup`` untimed runs, then the median of ``--repeats`` (``--stat min`` takes the
  least disturbed repeat instead).

What it cannot measure: vLLM's host-side work per step (scheduler, sampler,
detokenizer, HTTP), which the H100 profile's fitted ``overhead_ms`` includes;
``--host-overhead-ms`` adds a constant to the written ``overhead_ms``. The profile's
other sections (KV link, API, harness, limits) are copied from the base profile
(default: the committed H100 one) and the file says so.

    python bench/gpu/step_profile.py --device cuda --out tables/engine-h200-llama3.1-8b.toml \\
        --json bench/results/gpu-step-profile.json
    python bench/gpu/step_profile.py --device cpu --tiny --out /tmp/p.toml --json /tmp/p.json  # CI check

The fitting and TOML helpers at the top need only numpy (and the standard library);
torch is imported when measuring.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
BASE_PROFILE = ROOT / "tables" / "engine-h100-llama3.1-8b.toml"

# The StepModel's fields, in the order of the design matrix's columns.
COEFFS = (
    "overhead_ms",
    "per_token_ms",
    "prefill_token_ms",
    "per_seq_ms",
    "attn_ms_per_mpair",
    "decode_ctx_ms_per_ktoken",
)
KINDS = ("prefill", "append", "decode", "mixed")


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    name: str


LLAMA_8B = ModelShape(4096, 32, 32, 8, 128, 14336, 128256, "Llama-3.1-8B")
TINY = ModelShape(128, 2, 4, 2, 32, 448, 1024, "tiny-llama")

# A group of equal sequences in one step: (batch, cached context before, new tokens).
Group = tuple[int, int, int]


@dataclass(frozen=True)
class Point:
    kind: str
    groups: tuple[Group, ...]

    @property
    def label(self) -> str:
        parts = []
        for b, ctx, new in self.groups:
            if new == 1:
                parts.append(f"decode B={b} ctx={ctx}")
            elif ctx == 0:
                parts.append(f"prefill {new}" if b == 1 else f"prefill {b}x{new}")
            else:
                parts.append(f"append {new}/ctx {ctx}" if b == 1 else f"append {b}x{new}/ctx {ctx}")
        return " + ".join(parts)


# ---------------------------------------------------------------------------------------------
# The step model (mirrors BatchShape / StepModel::step_ms in rust/ppd-core/src/emu/profile.rs)
# ---------------------------------------------------------------------------------------------


def batch_shape(groups: Sequence[Group]) -> dict[str, float]:
    """The emulator's BatchShape of a step: add_prefill per chunk, add_decode per decode."""
    s = {"seqs": 0, "prefill_tokens": 0, "prefill_pairs": 0.0, "decode_seqs": 0, "decode_ctx_tokens": 0}
    for b, ctx, new in groups:
        s["seqs"] += b
        if new == 1 and ctx > 0:  # a decode step of b sequences
            s["decode_seqs"] += b
            s["decode_ctx_tokens"] += b * ctx
        else:
            s["prefill_tokens"] += b * new
            s["prefill_pairs"] += b * new * (ctx + new / 2.0)
    return s


def design_row(shape: dict[str, float]) -> list[float]:
    """Features whose dot product with COEFFS is StepModel::step_ms."""
    return [
        1.0,
        float(shape["prefill_tokens"] + shape["decode_seqs"]),
        float(shape["prefill_tokens"]),
        float(shape["seqs"]),
        shape["prefill_pairs"] / 1e6,
        shape["decode_ctx_tokens"] / 1e3,
    ]


def predict_ms(coeffs: dict[str, float], groups: Sequence[Group]) -> float:
    shape = batch_shape(groups)
    if shape["seqs"] == 0:
        return 0.0
    return sum(coeffs[k] * f for k, f in zip(COEFFS, design_row(shape)))


def nnls_numpy(A: Any, b: Any, max_iter: Optional[int] = None) -> Any:
    """min ||A x - b||_2 subject to x >= 0 (Lawson-Hanson active set), numpy only."""
    import numpy as np

    A = np.asarray(A, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = A.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(np.abs(A).sum(axis=0).max(initial=0.0), 1.0)
    max_iter = max_iter or 30 * max(n, 1)
    w = A.T @ (b - A @ x)
    it = 0
    while (~passive).any() and w[~passive].max() > tol and it < max_iter:
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while it < max_iter:
            it += 1
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (s[passive] > tol).all():
                break
            bad = passive & (s <= tol)
            alpha = np.min(x[bad] / np.maximum(x[bad] - s[bad], 1e-300))
            x = x + alpha * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
        else:
            break
        x = s
        w = A.T @ (b - A @ x)
    return np.maximum(x, 0.0)


def nnls(A: Any, b: Any) -> Any:
    """scipy.optimize.nnls when scipy is installed, else :func:`nnls_numpy`."""
    try:
        from scipy.optimize import nnls as scipy_nnls  # type: ignore[import-not-found]
    except ImportError:
        return nnls_numpy(A, b)
    return scipy_nnls(A, b)[0]


def fit_step_model(samples: Sequence[tuple[Sequence[Group], float]]) -> dict[str, float]:
    """Non-negative coefficients minimising the squared *relative* error over (groups, ms) samples."""
    import numpy as np

    if not samples:
        raise ValueError("no measured steps to fit")
    X = np.array([design_row(batch_shape(g)) for g, _ in samples], dtype=float)
    y = np.array([ms for _, ms in samples], dtype=float)
    if not np.all(np.isfinite(y)) or (y <= 0).any():
        raise ValueError("measured step times must be positive and finite")
    Xw = X / y[:, None]  # relative error: (x.b - y) / y
    scale = np.linalg.norm(Xw, axis=0)
    scale[scale == 0] = 1.0  # a feature no sample exercises gets coefficient 0
    beta = nnls(Xw / scale, np.ones_like(y)) / scale
    return {k: float(v) for k, v in zip(COEFFS, beta)}


def fit_errors(coeffs: dict[str, float], rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median and max |relative error| of the fit, per step kind and over all rows."""
    by: dict[str, list[float]] = {}
    for r in rows:
        e = abs(predict_ms(coeffs, r["groups"]) - r["step_ms"]) / r["step_ms"]
        by.setdefault(r["kind"], []).append(e)
        by.setdefault("all", []).append(e)
    return {k: {"n": len(v), "median_rel_err": statistics.median(v), "max_rel_err": max(v)} for k, v in by.items()}


# ---------------------------------------------------------------------------------------------
# Grid
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    prefill: tuple[int, ...]
    append_new: tuple[int, ...]
    append_ctx: tuple[int, ...]
    decode_batch: tuple[int, ...]
    decode_ctx: tuple[int, ...]
    # Figure 2: a decode batch (each of `mix_decode_batch` at context `mix_decode_ctx`) alone,
    # + full prefill of N, + full prefill of C+N (the same conversation without its cache),
    # + append-prefill of N over C.
    mix_decode_batch: tuple[int, ...]
    mix_decode_ctx: int
    mix_new: tuple[int, ...]
    mix_ctx: int


FULL_GRID = Grid(
    prefill=(128, 256, 512, 1024, 2048, 4096, 8192),
    append_new=(32, 128, 512, 2048),
    append_ctx=(1024, 4096, 16384),
    decode_batch=(1, 8, 32, 64, 128),
    decode_ctx=(512, 2048, 8192, 16384),
    mix_decode_batch=(32, 128),
    mix_decode_ctx=2048,
    mix_new=(128, 512, 2048),
    mix_ctx=4096,
)
# Steps of at most ~15 ms on one CPU thread: shorter than a scheduler slice, so that on a
# busy CI machine some repeats run undisturbed (the CPU default statistic is the minimum).
TINY_GRID = Grid(
    prefill=(32, 128, 256, 512),
    append_new=(16, 128),
    append_ctx=(512, 2048),
    decode_batch=(1, 8, 32),
    decode_ctx=(256, 2048),
    mix_decode_batch=(16,),
    mix_decode_ctx=512,
    mix_new=(64, 256),
    mix_ctx=512,
)


def interference_rows(g: Grid) -> list[dict[str, Any]]:
    """The Figure-2 comparisons: which points make one row of the interference table."""
    rows = []
    for b in g.mix_decode_batch:
        dec: Group = (b, g.mix_decode_ctx, 1)
        for n in g.mix_new:
            rows.append({
                "decode_batch": b, "decode_ctx": g.mix_decode_ctx, "new": n, "ctx": g.mix_ctx,
                "alone": Point("decode", (dec,)),
                "full_n": Point("mixed", (dec, (1, 0, n))),
                "full_ctx_n": Point("mixed", (dec, (1, 0, g.mix_ctx + n))),
                "append": Point("mixed", (dec, (1, g.mix_ctx, n))),
            })
    return rows


def plan(g: Grid) -> list[Point]:
    """Every point, kinds interleaved so that a budget cut still leaves each kind measured."""
    by_kind: dict[str, list[Point]] = {k: [] for k in KINDS}
    by_kind["prefill"] = [Point("prefill", ((1, 0, n),)) for n in g.prefill]
    by_kind["append"] = [Point("append", ((1, c, n),)) for c in g.append_ctx for n in g.append_new]
    by_kind["decode"] = [Point("decode", ((b, c, 1),)) for c in g.decode_ctx for b in g.decode_batch]
    for row in interference_rows(g):
        for key in ("alone", "append", "full_ctx_n", "full_n"):
            p = row[key]
            if p not in by_kind[p.kind]:
                by_kind[p.kind].append(p)
    # Spread each kind's points (smallest and largest first) so a cut keeps its range.
    for k, pts in by_kind.items():
        by_kind[k] = _spread(sorted(pts, key=lambda p: p.groups))
    out: list[Point] = []
    for i in range(max(len(v) for v in by_kind.values())):
        for k in KINDS:
            if i < len(by_kind[k]):
                out.append(by_kind[k][i])
    return out


def _spread(pts: list[Point]) -> list[Point]:
    if len(pts) <= 2:
        return list(pts)
    order = [0, len(pts) - 1]
    step = len(pts) - 1
    while len(order) < len(pts):
        step = max(step // 2, 1)
        for i in range(0, len(pts), step):
            if i not in order:
                order.append(i)
    return [pts[i] for i in order]


# ---------------------------------------------------------------------------------------------
# Profile TOML
# ---------------------------------------------------------------------------------------------


def render_profile(base_text: str, coeffs: dict[str, float], *, name: str, hardware: str,
                   header: Sequence[str], model: Optional[str] = None, kv_bytes_per_token: Optional[int] = None,
                   kv_blocks: Optional[int] = None) -> str:
    """The base profile's text with [step] replaced by `coeffs`, a new name/hardware and header.

    `model`, `kv_bytes_per_token` and `kv_blocks` replace the base's when given; everything
    else (limits, [link], [api], [harness]) is kept as the base has it.
    """
    lines = base_text.splitlines()
    while lines and (lines[0].startswith("#") or not lines[0].strip()):
        lines.pop(0)  # the base's own provenance header
    text = "\n".join(lines) + "\n"

    def sub_key(text: str, key: str, value: str, comment: str = "") -> str:
        pat = re.compile(rf"^{key}\s*=.*$", re.M)
        if not pat.search(text.split("\n[", 1)[0]):
            raise ValueError(f"base profile has no top-level `{key}`")
        line = f"{key} = {value}" + (f"   # {comment}" if comment else "")
        return pat.sub(lambda _m: line, text, count=1)

    text = sub_key(text, "name", json.dumps(name))
    text = sub_key(text, "hardware", json.dumps(hardware))
    if model is not None:
        text = sub_key(text, "model", json.dumps(model))
    if kv_bytes_per_token is not None:
        text = sub_key(text, "kv_bytes_per_token", str(int(kv_bytes_per_token)),
                       "from the model shape: layers x KV heads x head dim x (K,V) x dtype bytes")
    if kv_blocks is not None:
        text = sub_key(text, "kv_blocks", str(int(kv_blocks)),
                       "estimated from device memory (vLLM-like, gpu_memory_utilization 0.9), not measured")
    else:
        m = re.search(r"^kv_blocks\s*=\s*(\d+)", text, re.M)
        if m:
            text = sub_key(text, "kv_blocks", m.group(1), "copied from the base profile")
    step = ["[step]", "# Fitted by bench/gpu/step_profile.py (NNLS, relative error) to the steps in the header."]
    for k in COEFFS:
        v = coeffs[k]
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"step.{k} = {v} is not a non-negative finite number")
        step.append(f"{k} = {v:.6g}")
    m = re.search(r"^\[step\]\n.*?(?=^\[|\Z)", text, re.M | re.S)
    if not m:
        raise ValueError("base profile has no [step] section")
    text = text[: m.start()] + "\n".join(step) + "\n\n" + text[m.end():]
    copied = ["# The settings below [step] and the limits above it (block_size, max_num_seqs,",
              "# max_num_batched_tokens, max_model_len, kv_lease_s) are copied unchanged from the base",
              "# profile: this script cannot measure the KV link, the API/router costs or the harness."]
    text = re.sub(r"^\[link\]", lambda _m: "\n".join(copied) + "\n[link]", text, count=1, flags=re.M)
    head = [f"# {h}" if h else "#" for h in header]
    return "\n".join(head) + "\n" + text


def estimate_kv_blocks(total_bytes: int, shape: ModelShape, dtype_bytes: int, block_size: int) -> int:
    """vLLM-like pool size: 90 % of memory, less the weights and ~4 GiB of activations/graphs."""
    per_layer = shape.hidden * (shape.heads + 2 * shape.kv_heads) * shape.head_dim + \
        shape.heads * shape.head_dim * shape.hidden + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden
    weights = (shape.layers * per_layer + 2 * shape.vocab * shape.hidden + shape.hidden) * dtype_bytes
    free = 0.9 * total_bytes - weights - 4 * 2**30
    per_block = block_size * kv_bytes(shape, dtype_bytes)
    return max(int(free // per_block), 1)


def kv_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    return shape.layers * shape.kv_heads * shape.head_dim * 2 * dtype_bytes


# ---------------------------------------------------------------------------------------------
# Measurement (torch)
# ---------------------------------------------------------------------------------------------


class StepBench:
    """Random-weight decoder layers and head; times one step (a tuple of groups) at a time."""

    def __init__(self, shape: ModelShape, n_layers: int, device: str, dtype: str, seed: int,
                 cuda_graphs: bool, log: Callable[[str], None]) -> None:
        import torch

        self.torch = torch
        self.F = torch.nn.functional
        self.shape = shape
        self.n_layers = n_layers
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.cuda = self.device.type == "cuda"
        self.cuda_graphs = cuda_graphs and self.cuda
        self.log = log
        torch.manual_seed(seed)
        if not self.cuda:
            torch.set_flush_denormal(True)
        h, hd = shape.hidden, shape.head_dim
        qkv = (shape.heads + 2 * shape.kv_heads) * hd

        def w(rows: int, cols: int) -> Any:
            return torch.randn(rows, cols, device=self.device, dtype=self.dtype) / math.sqrt(cols)

        self.layers = []
        for _ in range(n_layers):
            self.layers.append({
                "ln1": torch.ones(h, device=self.device, dtype=self.dtype),
                "qkv": w(qkv, h),
                "o": w(h, shape.heads * hd),
                "ln2": torch.ones(h, device=self.device, dtype=self.dtype),
                "gate_up": w(2 * shape.intermediate, h),
                "down": w(h, shape.intermediate),
            })
        # lm_head; the embedding lookup reads the same matrix (its cost does not depend on which).
        self.lm_head = w(shape.vocab, h)
        self.norm = torch.ones(h, device=self.device, dtype=self.dtype)
        self.attn_mode = self._detect_attention()
        log(f"attention: {self.attn_mode}")

    # -- attention ---------------------------------------------------------------------------

    def _sdpa(self, q: Any, k: Any, v: Any, ctx: int, new: int, mode: dict[str, Any]) -> Any:
        """q [B, H, new, D] over k, v [B, KV, ctx + new, D]: causal for prefill, lower-right for append."""
        F = self.F
        rep = q.shape[1] // k.shape[1]
        kw: dict[str, Any] = {}
        if rep > 1:
            if mode["gqa"]:
                kw["enable_gqa"] = True
            else:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
        if new == 1:
            return F.scaled_dot_product_attention(q, k, v, **kw)
        if ctx == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        if mode["lower_right"] == "causal_bias":
            from torch.nn.attention.bias import causal_lower_right

            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(new, ctx + new), **kw)
        mask = self.torch.ones(new, ctx + new, dtype=self.torch.bool, device=q.device).tril(diagonal=ctx)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)

    def _detect_attention(self) -> dict[str, Any]:
        """The fastest SDPA form this torch computes correctly: native GQA, lower-right causal bias."""
        torch = self.torch
        s = self.shape
        g = torch.Generator(device="cpu").manual_seed(1)
        ctx, new, b = 9, 5, 2
        q = torch.randn(b, s.heads, new, s.head_dim, generator=g)
        k = torch.randn(b, s.kv_heads, ctx + new, s.head_dim, generator=g)
        v = torch.randn(b, s.kv_heads, ctx + new, s.head_dim, generator=g)
        rep = s.heads // s.kv_heads
        kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        mask = torch.ones(new, ctx + new, dtype=torch.bool).tril(diagonal=ctx)
        ref_append = self.F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
        ref_decode = self.F.scaled_dot_product_attention(q[:, :, :1], kr, vr)
        dev = [t.to(self.device, self.dtype) for t in (q, k, v)]
        tol = 3e-2 if self.dtype != torch.float32 else 1e-4
        correct: list[dict[str, Any]] = []
        for mode in ({"gqa": True, "lower_right": "causal_bias"}, {"gqa": False, "lower_right": "causal_bias"},
                     {"gqa": True, "lower_right": "mask"}, {"gqa": False, "lower_right": "mask"}):
            try:
                with torch.inference_mode():
                    a = self._sdpa(dev[0], dev[1], dev[2], ctx, new, mode).float().cpu()
                    d = self._sdpa(dev[0][:, :, :1].contiguous(), dev[1], dev[2], ctx, 1, mode).float().cpu()
            except Exception as e:  # noqa: BLE001 - an unsupported form; try the next
                self.log(f"attention form {mode} unavailable: {type(e).__name__}: {str(e)[:120]}")
                continue
            if not (torch.allclose(a, ref_append, atol=tol, rtol=tol) and torch.allclose(d, ref_decode, atol=tol, rtol=tol)):
                self.log(f"attention form {mode} gives wrong results here; not used")
                continue
            mode = {**mode, "flash": self._flash_ok(dev, ctx, new, mode),
                    "kv_cache": "contiguous [B, kv_heads, ctx+new, head_dim]",
                    "varlen": "one SDPA call per group of equal (ctx, new)"}
            if mode["flash"]:
                return mode
            correct.append(mode)
        if correct:
            self.log("no attention form runs on the flash backend here; timing the first correct one")
            return correct[0]
        raise RuntimeError("no scaled_dot_product_attention form computes lower-right causal attention correctly")

    def _flash_ok(self, dev: list[Any], ctx: int, new: int, mode: dict[str, Any]) -> Optional[bool]:
        """Whether prefill, append and decode attention all run with only the flash backend enabled."""
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError:
            return None
        q, k, v = dev
        try:
            with self.torch.inference_mode(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                self._sdpa(q, k[:, :, :new], v[:, :, :new], 0, new, mode)
                self._sdpa(q, k, v, ctx, new, mode)
                self._sdpa(q[:, :, :1].contiguous(), k, v, ctx, 1, mode)
        except Exception:  # noqa: BLE001 - flash cannot run this form
            return False
        return True

    # -- one step ----------------------------------------------------------------------------

    def _rms(self, x: Any, w: Any) -> Any:
        F = self.F
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), w, 1e-5)
        xf = x.float()
        return (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w

    def _build(self, groups: Sequence[Group], shared_kv: bool) -> tuple[Callable[[], Any], Callable[[], Any], dict]:
        torch = self.torch
        s = self.shape
        dev, dt = self.device, self.dtype
        hd = s.head_dim
        total = sum(b * new for b, _, new in groups)
        positions, sample_idx, spans = [], [], []
        off = 0
        for b, ctx, new in groups:
            spans.append((off, off + b * new))
            positions.append(torch.arange(ctx, ctx + new).repeat(b))
            sample_idx.append(off + torch.arange(1, b + 1) * new - 1)
            off += b * new
        pos = torch.cat(positions).to(dev)
        idx = torch.cat(sample_idx).to(dev)
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
        ang = pos.float()[:, None] * inv[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(dt)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(dt)[:, None, :]
        ids = torch.randint(0, s.vocab, (total,), device=dev)
        x0 = self.lm_head[ids].clone()
        x_out = torch.empty_like(x0)
        n_caches = 1 if shared_kv else self.n_layers
        caches = []
        for _ in range(n_caches):
            per_group = []
            for b, ctx, new in groups:
                kc = torch.empty(b, s.kv_heads, ctx + new, hd, device=dev, dtype=dt).normal_()
                vc = torch.empty_like(kc).normal_()
                per_group.append((kc, vc))
            caches.append(per_group)
        attn_out = torch.empty(total, s.heads, hd, device=dev, dtype=dt)
        q_sz, kv_sz = s.heads * hd, s.kv_heads * hd
        F, mode = self.F, self.attn_mode

        def rope(t: Any) -> Any:
            half = t.shape[-1] // 2
            return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

        def layers() -> Any:
            x = x0
            for li, w in enumerate(self.layers):
                h = self._rms(x, w["ln1"])
                qkv = h @ w["qkv"].t()
                q = rope(qkv[:, :q_sz].view(total, s.heads, hd))
                k = rope(qkv[:, q_sz:q_sz + kv_sz].view(total, s.kv_heads, hd))
                v = qkv[:, q_sz + kv_sz:].view(total, s.kv_heads, hd)
                for (b, ctx, new), (a, e), (kc, vc) in zip(groups, spans, caches[li % n_caches]):
                    kc[:, :, ctx:].copy_(k[a:e].view(b, new, s.kv_heads, hd).transpose(1, 2))
                    vc[:, :, ctx:].copy_(v[a:e].view(b, new, s.kv_heads, hd).transpose(1, 2))
                    qg = q[a:e].view(b, new, s.heads, hd).transpose(1, 2)
                    o = self._sdpa(qg, kc, vc, ctx, new, mode)
                    attn_out[a:e].copy_(o.transpose(1, 2).reshape(b * new, s.heads, hd))
                x = x + attn_out.view(total, q_sz) @ w["o"].t()
                h = self._rms(x, w["ln2"])
                gate, up = (h @ w["gate_up"].t()).chunk(2, dim=-1)
                x = x + (F.silu(gate) * up) @ w["down"].t()
            x_out.copy_(x)
            return x_out

        def head() -> Any:
            emb = self.lm_head[ids]  # the step's embedding lookup
            last = self._rms(x_out[idx] + emb[idx], self.norm)
            return (last @ self.lm_head.t()).argmax(-1)

        keep = {"caches": caches, "x0": x0, "x_out": x_out, "attn_out": attn_out}
        return layers, head, keep

    def kv_bytes_needed(self, groups: Sequence[Group], layers: int) -> int:
        s = self.shape
        el = self.torch.finfo(self.dtype).bits // 8
        return layers * sum(2 * b * s.kv_heads * (ctx + new) * s.head_dim * el for b, ctx, new in groups)

    def cpu_clock(self) -> str:
        """CPU time of this thread when torch computes in it alone, else wall time."""
        return "thread" if self.torch.get_num_threads() == 1 else "wall"

    def free_bytes(self) -> int:
        if self.cuda:
            return int(self.torch.cuda.mem_get_info(self.device)[0])
        try:
            import os

            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return 1 << 62

    def measure(self, groups: Sequence[Group], warmup: int, repeats: int, stat: str = "median") -> dict[str, Any]:
        torch = self.torch
        free = self.free_bytes()
        one = self.kv_bytes_needed(groups, 1)
        if one > 0.7 * free:
            raise MemoryError(f"KV cache of {one / 2**30:.1f} GiB does not fit in {free / 2**30:.1f} GiB free")
        # Per-layer caches when they fit; else one cache that every timed layer reads
        # (at these sizes nothing of it stays in a cache between layers).
        shared_kv = self.kv_bytes_needed(groups, self.n_layers) > 0.6 * free
        with torch.inference_mode():
            layers, head, keep = self._build(groups, shared_kv)
            mode = "eager"
            if self.cuda:
                run_l, run_h = layers, head
                if self.cuda_graphs:
                    try:
                        run_l, run_h = self._capture(layers), self._capture(head)
                        mode = "cuda-graph"
                    except Exception as e:  # noqa: BLE001 - fall back to eager timing
                        self.log(f"  CUDA graph capture failed ({type(e).__name__}: {str(e)[:100]}); timing eagerly")
                        torch.cuda.synchronize()
                for _ in range(warmup):
                    run_l()
                    run_h()
                ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(repeats)]
                for e0, e1, e2 in ev:
                    e0.record()
                    run_l()
                    e1.record()
                    run_h()
                    e2.record()
                torch.cuda.synchronize()
                lay = [e0.elapsed_time(e1) for e0, e1, _ in ev]
                hd = [e1.elapsed_time(e2) for _, e1, e2 in ev]
                del run_l, run_h  # the graphs and their memory pools
            else:
                for _ in range(warmup):
                    layers()
                    head()
                lay, hd = [], []
                clock = time.thread_time if self.cpu_clock() == "thread" else time.perf_counter
                for _ in range(repeats):
                    t0 = clock()
                    layers()
                    t1 = clock()
                    head()
                    t2 = clock()
                    lay.append((t1 - t0) * 1e3)
                    hd.append((t2 - t1) * 1e3)
            del keep, layers, head
        if self.cuda:
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        scale = self.shape.layers / self.n_layers
        steps = [a * scale + b for a, b in zip(lay, hd)]
        if stat == "min":  # the least disturbed repeat
            i = min(range(len(steps)), key=steps.__getitem__)
            layers_ms, head_ms, step_ms = lay[i], hd[i], steps[i]
        else:
            layers_ms, head_ms, step_ms = statistics.median(lay), statistics.median(hd), statistics.median(steps)
        return {"layers_ms": layers_ms, "head_ms": head_ms, "step_ms": step_ms,
                "step_ms_median": statistics.median(steps), "step_ms_min": min(steps), "step_ms_max": max(steps),
                "timing": mode, "shared_kv": shared_kv}

    def _capture(self, fn: Callable[[], Any]) -> Callable[[], None]:
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def interference_table(rows_plan: list[dict[str, Any]], measured: dict[tuple, float],
                       coeffs: Optional[dict[str, float]]) -> list[dict[str, Any]]:
    out = []
    for r in rows_plan:
        keys = ("alone", "full_n", "full_ctx_n", "append")
        if not all(r[k].groups in measured for k in keys):
            continue
        row: dict[str, Any] = {k: r[k] for k in ("decode_batch", "decode_ctx", "new", "ctx")}
        alone = measured[r["alone"].groups]
        for k in keys:
            row[f"{k}_ms"] = measured[r[k].groups]
            row[f"{k}_ratio"] = measured[r[k].groups] / alone
            if coeffs is not None:
                row[f"{k}_model_ratio"] = predict_ms(coeffs, r[k].groups) / predict_ms(coeffs, r["alone"].groups)
        out.append(row)
    return out


def format_interference(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "interference table: no complete row measured (budget?)"
    lines = [
        "Figure-2 style interference: decode step time alone and with one prefill chunk in the same step",
        "(ratio = step / decode alone; 'model' = the fitted step model's ratio)",
        f"{'decode':>14} {'N':>6} {'C':>6} | {'alone ms':>9} | {'+full N':>16} | {'+full C+N':>16} | "
        f"{'+append N over C':>16} | model: full C+N, append",
    ]
    for r in rows:
        def cell(k: str) -> str:
            return f"{r[k + '_ms']:8.2f} (x{r[k + '_ratio']:.2f})"
        model = ""
        if "append_model_ratio" in r:
            model = f"x{r['full_ctx_n_model_ratio']:.2f}, x{r['append_model_ratio']:.2f}"
        lines.append(f"{'B=%d ctx=%d' % (r['decode_batch'], r['decode_ctx']):>14} {r['new']:>6} {r['ctx']:>6} | "
                     f"{r['alone_ms']:9.2f} | {cell('full_n'):>16} | {cell('full_ctx_n'):>16} | "
                     f"{cell('append'):>16} | {model}")
    return "\n".join(lines)


def format_errors(err: dict[str, dict[str, float]]) -> str:
    lines = ["fit: |relative error| per step kind"]
    for k in (*KINDS, "all"):
        if k in err:
            e = err[k]
            lines.append(f"  {k:8} n={e['n']:3d}  median {100 * e['median_rel_err']:6.2f} %  max {100 * e['max_rel_err']:6.2f} %")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="step_profile.py",
        description="Time Llama-3.1-8B-shaped engine steps (prefill, append-prefill, decode, mixed) with random "
        "weights in plain PyTorch, fit the emulator's step-time model and write a profile TOML.",
        allow_abbrev=False,
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where to run (default cuda)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and grid (CPU/CI check: hidden 128, 2 layers)")
    p.add_argument("--layers", type=int, help="decoder layers to build and time; scaled to the model's (default 4; tiny 2)")
    p.add_argument("--repeats", type=int, help="timed runs per point (default 20 on cuda, 7 on cpu)")
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="per-point statistic of the repeats (default median; min = the least disturbed repeat)")
    p.add_argument("--warmup", type=int, help="untimed runs per point first (default 5 on cuda, 1 on cpu)")
    p.add_argument("--seed", type=int, default=0, help="random weights/inputs seed (default 0)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="stop adding grid points once this many seconds of measuring have passed (default 300)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="weights/activations dtype (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="time eagerly on cuda instead of replaying CUDA graphs")
    p.add_argument("--out", help="write the fitted engine profile TOML here")
    p.add_argument("--json", help="write raw measurements, fit and interference table as JSON here")
    p.add_argument("--base-profile", default=str(BASE_PROFILE),
                   help="profile whose non-[step] sections are copied (default the committed H100 one)")
    p.add_argument("--name", help="profile name (default from the device)")
    p.add_argument("--host-overhead-ms", type=float, default=0.0,
                   help="add this to the fitted overhead_ms: vLLM's per-step host work not measured here (default 0)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default torch's; 1 with --tiny)")
    a = p.parse_args(argv)
    if a.layers is not None and a.layers < 1:
        p.error("--layers must be >= 1")
    if a.repeats is not None and a.repeats < 1:
        p.error("--repeats must be >= 1")
    if a.host_overhead_ms < 0 or not math.isfinite(a.host_overhead_ms):
        p.error("--host-overhead-ms must be a non-negative number")
    return a


def fail(msg: str, code: int = 2) -> int:
    print(f"step_profile: error: {msg}", file=sys.stderr)
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        import numpy  # noqa: F401
        import torch
    except ImportError as e:
        return fail(f"needs PyTorch and numpy in this interpreter ({sys.executable}): {e}")
    if args.device == "cuda" and not torch.cuda.is_available():
        return fail(f"--device cuda requested but torch.cuda.is_available() is False "
                    f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); use --device cpu --tiny for a CPU check")
    base_path = Path(args.base_profile)
    try:
        base_text = base_path.read_text()
    except OSError as e:
        return fail(f"cannot read the base profile {base_path}: {e}")
    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.device == "cpu" and args.tiny:
        # Tiny ops gain nothing from threads, and on a busy (CI) machine an OpenMP barrier that
        # waits for a descheduled thread inflates a step many times over.
        torch.set_num_threads(1)
    cuda = args.device == "cuda"
    shape = TINY if args.tiny else LLAMA_8B
    grid = TINY_GRID if args.tiny else FULL_GRID
    n_layers = min(args.layers or (2 if args.tiny else 4), shape.layers)
    repeats = args.repeats or (20 if cuda else 7)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    stat = args.stat
    dev_name = torch.cuda.get_device_name(0) if cuda else cpu_name()

    def log(msg: str) -> None:
        print(msg, flush=True)

    points = plan(grid)
    counts = {k: sum(p.kind == k for p in points) for k in KINDS}
    log(f"step_profile: {shape.name} on {args.device} ({dev_name}), torch {torch.__version__}, {dtype}, "
        f"{n_layers}/{shape.layers} layers timed (x{shape.layers / n_layers:g}), {stat} of {repeats} repeats "
        f"after {warmup} warm-up")
    log(f"planned {len(points)} points: " + ", ".join(f"{k} {v}" for k, v in counts.items())
        + f"; budget {args.budget_s:g} s (points after it are skipped)")
    t_start = time.monotonic()
    bench = StepBench(shape, n_layers, args.device, dtype, args.seed, not args.no_cuda_graphs, log)
    log(f"model built in {time.monotonic() - t_start:.1f} s")

    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    t_meas = time.monotonic()
    for i, pt in enumerate(points):
        elapsed = time.monotonic() - t_meas
        if elapsed > args.budget_s:
            skipped.extend({"kind": p.kind, "groups": p.groups, "why": "budget"} for p in points[i:])
            log(f"budget of {args.budget_s:g} s spent after {i} points; skipping {len(points) - i}")
            break
        try:
            r = bench.measure(pt.groups, warmup, repeats, stat)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: record and go on
            if cuda:
                torch.cuda.empty_cache()
            skipped.append({"kind": pt.kind, "groups": pt.groups, "why": f"{type(e).__name__}: {str(e)[:200]}"})
            log(f"[{i + 1}/{len(points)}] {pt.label}: skipped ({type(e).__name__}: {str(e)[:100]})")
            continue
        rows.append({"kind": pt.kind, "groups": pt.groups, "label": pt.label, **batch_shape(pt.groups), **r})
        done = time.monotonic() - t_meas
        eta = done / (i + 1) * (len(points) - i - 1)
        log(f"[{i + 1}/{len(points)}] {pt.label}: {r['step_ms']:.3f} ms "
            f"(layers {r['layers_ms']:.3f} x{shape.layers / n_layers:g} + head {r['head_ms']:.3f}, {r['timing']})"
            f"  {done:.0f} s, ~{eta:.0f} s left")
    wall_measure = time.monotonic() - t_meas
    if not cuda:
        torch.set_flush_denormal(False)  # numpy's float limits (the fit) expect the default FP mode
    if len(rows) < len(COEFFS):
        return fail(f"only {len(rows)} points measured; need at least {len(COEFFS)} to fit (raise --budget-s)", 1)

    coeffs = fit_step_model([(r["groups"], r["step_ms"]) for r in rows])
    for r in rows:
        r["model_ms"] = predict_ms(coeffs, r["groups"])
        r["rel_err"] = (r["model_ms"] - r["step_ms"]) / r["step_ms"]
    errors = fit_errors(coeffs, rows)
    written = dict(coeffs)
    written["overhead_ms"] += args.host_overhead_ms
    measured = {r["groups"]: r["step_ms"] for r in rows}
    interference = interference_table(interference_rows(grid), measured, coeffs)

    log("")
    log("fitted step model (ms): " + ", ".join(f"{k} = {coeffs[k]:.6g}" for k in COEFFS))
    log(format_errors(errors))
    log("")
    log(format_interference(interference))

    now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    dtype_bytes = torch.finfo(getattr(torch, dtype)).bits // 8
    meta = {
        "script": "bench/gpu/step_profile.py",
        "date": now,
        "device": args.device,
        "device_name": dev_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "host": platform.node(),
        "dtype": dtype,
        "model_shape": asdict(shape),
        "layers_timed": n_layers,
        "layer_scale": shape.layers / n_layers,
        "repeats": repeats,
        "stat": stat,
        "warmup": warmup,
        "seed": args.seed,
        "tiny": args.tiny,
        "attention": bench.attn_mode,
        "timing": "CUDA graphs + CUDA events" if cuda and not args.no_cuda_graphs else
                  ("CUDA events, eager" if cuda else
                   ("time.thread_time (CPU time, 1 thread)" if bench.cpu_clock() == "thread" else "time.perf_counter")
                   + ", eager"),
        "host_overhead_ms_added": args.host_overhead_ms,
        "points_measured": len(rows),
        "points_skipped": len(skipped),
        "measure_wall_s": wall_measure,
        "fit": "NNLS on relative error (" + ("scipy" if _has_scipy() else "numpy Lawson-Hanson") + ")",
    }
    name = args.name or ("cpu-tiny-step-profile" if args.tiny else
                         re.sub(r"[^a-z0-9]+", "-", dev_name.lower()).strip("-") + "-llama3.1-8b-step-profile")
    if args.out:
        kv_b = kv_bytes(shape, dtype_bytes)
        kv_blocks = None
        if cuda and not args.tiny:
            m = re.search(r"^block_size\s*=\s*(\d+)", base_text, re.M)
            block = int(m.group(1)) if m else 16
            kv_blocks = estimate_kv_blocks(torch.cuda.get_device_properties(0).total_memory, shape, dtype_bytes, block)
        kind_counts = ", ".join(f"{k} {sum(r['kind'] == k for r in rows)}" for k in KINDS)
        header = [
            f"Engine profile: {shape.name} shaped steps, PyTorch {torch.__version__}, {dtype}, on {dev_name} ({args.device}).",
            f"Generated by bench/gpu/step_profile.py on {now} (host {platform.node()}); random weights, no vLLM.",
            f"Model shape: hidden {shape.hidden}, {shape.layers} layers ({n_layers} timed, scaled x{shape.layers / n_layers:g}), "
            f"{shape.heads} heads, {shape.kv_heads} KV heads, head dim {shape.head_dim}, intermediate {shape.intermediate}, "
            f"vocab {shape.vocab}.",
            f"Timing: {meta['timing']}; {stat} of {repeats} after {warmup} warm-up; {len(rows)} points "
            f"({kind_counts}), {len(skipped)} skipped.",
            f"Attention: SDPA, GQA {'native' if bench.attn_mode['gqa'] else 'expanded'}, append mask "
            f"{bench.attn_mode['lower_right']}, flash backend {_yn(bench.attn_mode.get('flash'))}, contiguous KV cache, "
            "one call per group of equal (ctx, new).",
            "Fit |relative error|: " + "; ".join(
                f"{k} median {100 * errors[k]['median_rel_err']:.1f} % max {100 * errors[k]['max_rel_err']:.1f} %"
                for k in (*KINDS, "all") if k in errors) + ".",
            "overhead_ms is device time only (weights read, kernels, lm_head, argmax)"
            + (f" plus --host-overhead-ms {args.host_overhead_ms:g}" if args.host_overhead_ms else "")
            + "; vLLM's host-side per-step work is not in it.",
            f"Non-step sections copied from {_rel(base_path)}.",
        ]
        if args.tiny:
            header.append("TINY CPU SHAPES: a CI check of the script, not a calibration of any real engine.")
        text = render_profile(base_text, written, name=name, hardware=dev_name, header=header,
                              model=shape.name, kv_bytes_per_token=kv_b, kv_blocks=kv_blocks)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        log(f"\nwrote {args.out}")
        try:  # validate with the emulator's own loader when this interpreter has the package
            from ppd_router import _core  # type: ignore[import-not-found]
        except ImportError:
            pass
        else:
            try:
                _core.load_profile(str(Path(args.out).resolve()))
            except Exception as e:  # noqa: BLE001 - the loader's own message names the field
                return fail(f"the written profile {args.out} does not load: {e}", 1)
            log("  loads with ppd_router._core.load_profile")
    if args.json:
        doc = {
            "schema": "ppd-gpu-step-profile/1",
            "meta": meta,
            "profile_name": name,
            "coefficients": coeffs,
            "written_coefficients": written,
            "fit_errors": errors,
            "points": [{**r, "groups": [list(g) for g in r["groups"]]} for r in rows],
            "skipped": [{**s, "groups": [list(g) for g in s["groups"]]} for s in skipped],
            "interference": interference,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        log(f"wrote {args.json}")
    log(f"done in {time.monotonic() - t_start:.1f} s ({wall_measure:.1f} s measuring)")
    return 0


def _yn(v: Optional[bool]) -> str:
    return "unknown" if v is None else ("yes" if v else "no")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"CPU {platform.machine() or 'unknown'}"


def _has_scipy() -> bool:
    try:
        import scipy.optimize  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


if __name__ == "__main__":
    sys.exit(main())
