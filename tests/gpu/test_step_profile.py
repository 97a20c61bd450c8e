"""bench/gpu/step_profile.py: the step-time profiler meant for an H200, checked on the CPU.

The fit, grid and TOML helpers are tested in this interpreter (numpy only). The script
itself needs PyTorch, which the project's venv lacks: it runs as a subprocess under the
interpreter in PPD_VLLM_PYTHON (the real-vLLM tier's, which has torch) with tiny shapes.
Without that variable those tests are skipped, except under CI, where they fail.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ppd_router import _core
from tests.helpers import vllm_python

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu" / "step_profile.py"
BASE = REPO / "tables" / "engine-h100-llama3.1-8b.toml"

# What the tiny CPU run must reproduce: the fitted model's median |relative error| over all
# points (per kind a looser bound). Observed on a loaded 2-core VM: 6-15 % overall.
FIT_MEDIAN_TOL = 0.35
FIT_KIND_MEDIAN_TOL = 0.6


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("step_profile_under_test", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sp() -> ModuleType:
    return _load()


@pytest.fixture(scope="module")
def np() -> Any:
    return pytest.importorskip("numpy", reason="the NNLS fit needs numpy")


def run(python: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


# ---------------------------------------------------------------------------------------------
# Helpers, in this interpreter
# ---------------------------------------------------------------------------------------------


def test_importing_the_script_does_not_import_torch() -> None:
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('m', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); sys.modules['m'] = m; s.loader.exec_module(m); "
            "print('torch' in sys.modules, 'numpy' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["False", "False"], p.stderr


def test_the_coefficients_are_the_profiles_step_fields(sp: ModuleType) -> None:
    step = json.loads(_core.load_profile("default"))["step"]
    assert set(sp.COEFFS) == set(step)


def test_batch_shape_follows_the_emulators_add_prefill_and_add_decode(sp: ModuleType) -> None:
    # BatchShape::add_prefill(ctx, chunk): pairs += chunk * (ctx + chunk / 2); add_decode(ctx).
    s = sp.batch_shape([(1, 1008, 16), (4, 300, 1), (1, 0, 1024)])
    assert s == {"seqs": 6, "prefill_tokens": 1040, "prefill_pairs": 16 * 1016 + 1024 * 512,
                 "decode_seqs": 4, "decode_ctx_tokens": 1200}
    # The committed H100 profile, priced the way StepModel::step_ms does.
    step = json.loads(_core.load_profile("default"))["step"]
    want = (step["overhead_ms"] + step["per_token_ms"] * (1040 + 4) + step["per_seq_ms"] * 6
            + step["prefill_token_ms"] * 1040 + step["attn_ms_per_mpair"] * (16 * 1016 + 1024 * 512) / 1e6
            + step["decode_ctx_ms_per_ktoken"] * 1.2)
    assert sp.predict_ms(step, [(1, 1008, 16), (4, 300, 1), (1, 0, 1024)]) == pytest.approx(want)
    assert sp.predict_ms(step, []) == 0.0


def _brute_nnls(np: Any, A: Any, b: Any) -> Any:
    """The exact NNLS optimum: the best non-negative least-squares solution over every support."""
    n = A.shape[1]
    best, best_r = np.zeros(n), float(np.sum(b ** 2))
    for k in range(1, n + 1):
        for support in itertools.combinations(range(n), k):
            cols = list(support)
            x_s = np.linalg.lstsq(A[:, cols], b, rcond=None)[0]
            if (x_s < 0).any():
                continue
            x = np.zeros(n)
            x[cols] = x_s
            r = float(np.sum((A @ x - b) ** 2))
            if r < best_r - 1e-12:
                best, best_r = x, r
    return best


def test_numpy_nnls_finds_the_exact_optimum(sp: ModuleType, np: Any) -> None:
    rng = np.random.default_rng(7)
    clamped = 0
    for trial in range(60):
        m, n = int(rng.integers(4, 25)), int(rng.integers(1, 7))
        A = rng.normal(size=(m, n))
        b = rng.normal(size=m) * (3 if trial % 2 else 1) + A @ rng.normal(size=n)
        got = sp.nnls_numpy(A, b)
        want = _brute_nnls(np, A, b)
        assert (got >= 0).all()
        assert np.sum((A @ got - b) ** 2) == pytest.approx(np.sum((A @ want - b) ** 2), rel=1e-9, abs=1e-9)
        assert np.allclose(got, want, atol=1e-7)
        clamped += int((want == 0).any())
    assert clamped > 10, "the trials should exercise the constraint"


def test_numpy_nnls_edge_cases(sp: ModuleType, np: Any) -> None:
    assert np.allclose(sp.nnls_numpy(np.eye(3), np.array([1.0, -2.0, 3.0])), [1, 0, 3])
    assert np.allclose(sp.nnls_numpy(np.zeros((4, 2)), np.ones(4)), [0, 0])  # nothing to fit
    assert np.allclose(sp.nnls_numpy(np.ones((3, 1)), -np.ones(3)), [0])


def test_fit_recovers_a_known_step_model_from_its_own_grid(sp: ModuleType, np: Any) -> None:
    truth = {"overhead_ms": 3.5, "per_token_ms": 0.011, "prefill_token_ms": 0.02, "per_seq_ms": 0.004,
             "attn_ms_per_mpair": 0.9, "decode_ctx_ms_per_ktoken": 0.03}
    for grid in (sp.FULL_GRID, sp.TINY_GRID):
        pts = sp.plan(grid)
        got = sp.fit_step_model([(p.groups, sp.predict_ms(truth, p.groups)) for p in pts])
        for k in sp.COEFFS:
            assert got[k] == pytest.approx(truth[k], rel=1e-6), k
        rows = [{"kind": p.kind, "groups": p.groups, "step_ms": sp.predict_ms(truth, p.groups)} for p in pts]
        assert sp.fit_errors(got, rows)["all"]["max_rel_err"] < 1e-6


def test_fit_keeps_coefficients_non_negative(sp: ModuleType, np: Any) -> None:
    # Times that a least-squares fit would explain with a negative per-token cost.
    pts = sp.plan(sp.TINY_GRID)
    samples = [(p.groups, 5.0 + 1e-3 * sp.batch_shape(p.groups)["prefill_pairs"] / 1e3
                - 1e-4 * sp.batch_shape(p.groups)["prefill_tokens"]) for p in pts]
    got = sp.fit_step_model(samples)
    assert all(v >= 0 and math.isfinite(v) for v in got.values())
    with pytest.raises(ValueError):
        sp.fit_step_model([(((1, 0, 8),), 0.0)])
    with pytest.raises(ValueError):
        sp.fit_step_model([])


def test_the_plan_covers_every_kind_early_and_holds_the_interference_points(sp: ModuleType) -> None:
    for grid in (sp.FULL_GRID, sp.TINY_GRID):
        pts = sp.plan(grid)
        assert len(pts) == len(set(pts)), "no point twice"
        assert {p.kind for p in pts[:4]} == set(sp.KINDS), "a budget cut still leaves every kind"
        for row in sp.interference_rows(grid):
            for key in ("alone", "full_n", "full_ctx_n", "append"):
                assert row[key] in pts
        decode = [p for p in pts if p.kind == "decode"]
        assert {p.groups for p in decode[:2]} == {((min(grid.decode_batch), min(grid.decode_ctx), 1),),
                                                 ((max(grid.decode_batch), max(grid.decode_ctx), 1),)}
    full = sp.plan(sp.FULL_GRID)
    assert max(g[2] for p in full for g in p.groups if g[1] == 0) == 8192
    assert max(g[1] for p in full for g in p.groups) == 16384
    assert max(g[0] for p in full for g in p.groups) == 128


def test_render_profile_replaces_step_and_keeps_the_rest(sp: ModuleType, tmp_path: Path) -> None:
    coeffs = {"overhead_ms": 2.25, "per_token_ms": 0.0125, "prefill_token_ms": 0.0, "per_seq_ms": 0.003,
              "attn_ms_per_mpair": 0.5, "decode_ctx_ms_per_ktoken": 0.0175}
    text = sp.render_profile(BASE.read_text(), coeffs, name="h200-test", hardware="NVIDIA H200",
                             header=["made by a test", "second line"], model="Llama-3.1-8B",
                             kv_bytes_per_token=131072, kv_blocks=50000)
    assert text.startswith("# made by a test\n# second line\n")
    assert "bench/calibrate/fit.py" not in text, "the base's provenance header is dropped"
    out = tmp_path / "p.toml"
    out.write_text(text)
    got = json.loads(_core.load_profile(str(out)))
    base = json.loads(_core.load_profile(str(BASE)))
    assert got["step"] == pytest.approx(coeffs)
    assert (got["name"], got["hardware"], got["kv_blocks"]) == ("h200-test", "NVIDIA H200", 50000)
    for k in ("link", "api", "harness", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
              "kv_lease_s", "kv_bytes_per_token", "model"):
        assert got[k] == base[k], k
    assert tomllib.loads(text)["step"]["attn_ms_per_mpair"] == 0.5
    # Without kv_blocks the base's pool is kept, and says so.
    kept = sp.render_profile(BASE.read_text(), coeffs, name="x", hardware="y", header=[])
    assert "kv_blocks = 27000   # copied from the base profile" in kept
    with pytest.raises(ValueError, match="per_seq_ms"):
        sp.render_profile(BASE.read_text(), {**coeffs, "per_seq_ms": -1.0}, name="x", hardware="y", header=[])
    with pytest.raises(ValueError, match=r"\[step\]"):
        sp.render_profile('name = "a"\nhardware = "b"\n', coeffs, name="x", hardware="y", header=[])


def test_kv_pool_estimate_is_sane_for_an_h200(sp: ModuleType) -> None:
    assert sp.kv_bytes(sp.LLAMA_8B, 2) == 131072
    blocks = sp.estimate_kv_blocks(141 * 10**9, sp.LLAMA_8B, 2, 16)
    # ~141 GB x 0.9 - 16 GB weights - 4 GiB, in 2 MiB blocks: ~50k (the H100's 80 GB gave 27k).
    assert 45_000 < blocks < 55_000


def test_without_torch_the_script_says_so(tmp_path: Path) -> None:
    try:
        import torch  # noqa: F401
        pytest.skip("this interpreter has torch")
    except ImportError:
        pass
    p = run(sys.executable, "--device", "cpu", "--tiny", "--out", str(tmp_path / "p.toml"), timeout=60)
    assert p.returncode != 0
    assert "needs PyTorch" in p.stderr
    assert not (tmp_path / "p.toml").exists()


def test_bad_arguments_are_refused_before_any_work() -> None:
    for args, msg in ((["--layers", "0"], "--layers"), (["--device", "tpu"], "invalid choice"),
                      (["--host-overhead-ms", "-1"], "--host-overhead-ms")):
        p = run(sys.executable, *args, timeout=60)
        assert p.returncode == 2, args
        assert msg in p.stderr, p.stderr


# ---------------------------------------------------------------------------------------------
# The script, tiny shapes on the CPU, under the torch interpreter
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python = vllm_python()
    d = tmp_path_factory.mktemp("step-profile")
    out, js = d / "engine-cpu-tiny.toml", d / "step-profile.json"
    p = run(python, "--device", "cpu", "--tiny", "--budget-s", "60", "--out", str(out), "--json", str(js))
    assert p.returncode == 0, f"step_profile.py failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return {"toml": out, "doc": json.loads(js.read_text()), "stdout": p.stdout}


@pytest.mark.vllm
def test_tiny_run_writes_a_profile_the_emulator_loads(tiny_run: dict[str, Any]) -> None:
    doc = tiny_run["doc"]
    prof = json.loads(_core.load_profile(str(tiny_run["toml"])))
    base = json.loads(_core.load_profile(str(BASE)))
    assert prof["step"] == pytest.approx(doc["written_coefficients"], rel=1e-5)
    for k, v in prof["step"].items():
        assert math.isfinite(v) and v >= 0, k
    assert prof["step"]["overhead_ms"] + prof["step"]["per_token_ms"] > 0
    assert prof["name"] == "cpu-tiny-step-profile" and prof["model"] == "tiny-llama"
    assert prof["kv_bytes_per_token"] == 2 * 2 * 32 * 2 * 4  # tiny: 2 layers x 2 KV heads x 32 x (K,V) x fp32
    assert (prof["link"], prof["api"], prof["harness"]) == (base["link"], base["api"], base["harness"])
    text = tiny_run["toml"].read_text()
    for needle in ("Generated by bench/gpu/step_profile.py", "PyTorch", "hidden 128", "copied unchanged",
                   "TINY CPU SHAPES", "Fit |relative error|"):
        assert needle in text, needle
    meta = doc["meta"]
    assert meta["device"] == "cpu" and meta["tiny"] and meta["torch"]
    assert meta["points_measured"] == len(doc["points"]) >= 15


@pytest.mark.vllm
def test_tiny_run_fit_reproduces_the_measured_steps(tiny_run: dict[str, Any], sp: ModuleType) -> None:
    doc = tiny_run["doc"]
    err = doc["fit_errors"]
    assert set(sp.KINDS) <= set(err), "every kind of step measured"
    assert err["all"]["median_rel_err"] < FIT_MEDIAN_TOL, err
    for k in sp.KINDS:
        assert err[k]["median_rel_err"] < FIT_KIND_MEDIAN_TOL, (k, err[k])
    coeffs = doc["coefficients"]
    for p in doc["points"]:
        groups = [tuple(g) for g in p["groups"]]
        assert p["model_ms"] == pytest.approx(sp.predict_ms(coeffs, groups))
        assert 0 < p["step_ms_min"] <= p["step_ms_median"] <= p["step_ms_max"]
        assert p["step_ms"] == p["step_ms_median"]
    assert "fit: |relative error| per step kind" in tiny_run["stdout"]
    assert "planned 21 points" in tiny_run["stdout"]


@pytest.mark.vllm
def test_tiny_run_decode_grows_with_batch_and_context(tiny_run: dict[str, Any], sp: ModuleType) -> None:
    g = sp.TINY_GRID
    dec = {(p["groups"][0][0], p["groups"][0][1]): p["step_ms"] for p in tiny_run["doc"]["points"] if p["kind"] == "decode"}
    b_lo, b_hi = min(g.decode_batch), max(g.decode_batch)
    c_lo, c_hi = min(g.decode_ctx), max(g.decode_ctx)
    for c in g.decode_ctx:
        assert dec[(b_hi, c)] > dec[(b_lo, c)], (c, dec)
    for b in g.decode_batch[1:]:  # batch 1: one sequence's context barely shows at these sizes
        assert dec[(b, c_hi)] > dec[(b, c_lo)], (b, dec)
    coeffs = tiny_run["doc"]["coefficients"]
    assert sp.predict_ms(coeffs, [(b_hi, c_hi, 1)]) > sp.predict_ms(coeffs, [(b_lo, c_hi, 1)])
    assert sp.predict_ms(coeffs, [(b_hi, c_hi, 1)]) > sp.predict_ms(coeffs, [(b_hi, c_lo, 1)])


@pytest.mark.vllm
def test_tiny_run_full_prefill_slows_decode_more_than_append(tiny_run: dict[str, Any], sp: ModuleType) -> None:
    rows = tiny_run["doc"]["interference"]
    assert len(rows) == len(sp.interference_rows(sp.TINY_GRID))
    for r in rows:
        # The same conversation turn: without its cache (C + N tokens) vs appended (N over C).
        assert r["full_ctx_n_ms"] > r["append_ms"], r
        assert r["full_ctx_n_ratio"] > r["append_ratio"] > 1.0, r
        assert r["full_ctx_n_model_ratio"] > r["append_model_ratio"], r
    assert "Figure-2 style interference" in tiny_run["stdout"]


@pytest.mark.vllm
def test_cuda_requested_without_cuda_fails_clearly(tmp_path: Path) -> None:
    python = vllm_python()
    has_cuda = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"],
                              capture_output=True, text=True, timeout=120).stdout.strip()
    if has_cuda == "True":
        pytest.skip("this machine has CUDA")
    p = run(python, "--device", "cuda", "--tiny", "--out", str(tmp_path / "p.toml"), timeout=120)
    assert p.returncode != 0
    assert "--device cuda requested but torch.cuda.is_available() is False" in p.stderr, p.stderr
    assert not (tmp_path / "p.toml").exists()


@pytest.mark.vllm
def test_a_spent_budget_is_an_error_not_an_empty_fit(tmp_path: Path) -> None:
    p = run(vllm_python(), "--device", "cpu", "--tiny", "--budget-s", "0", "--out", str(tmp_path / "p.toml"))
    assert p.returncode == 1
    assert "points measured; need at least 6" in p.stderr
    assert not (tmp_path / "p.toml").exists()
