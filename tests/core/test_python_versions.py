"""The CLI on the other Pythons the package declares (3.10 and 3.12; the suite itself runs on 3.11).

One abi3 extension serves them all; the CLI must use nothing of the standard library newer
than 3.10 (it once needed 3.11's tomllib to read ``--config``). Each interpreter gets a venv
with the package's runtime dependencies under ``~/.cache/ppd-router/``, reused by later runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

import ppd_router

from ..conftest import REPO

CACHE = Path.home() / ".cache" / "ppd-router"


def runtime_dependencies() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def interpreter(version: str) -> str | None:
    """A working ``python{version}``: on PATH, or installed by pyenv (whose shims on PATH answer
    only for the versions selected)."""
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(str(p) for p in (Path.home() / ".pyenv" / "versions").glob(f"{version}.*/bin/python{version}"))
    for exe in filter(None, candidates):
        r = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == version:
            return exe
    return None


@pytest.fixture(scope="module", params=["3.10", "3.12"])
def python(request: pytest.FixtureRequest) -> str:
    exe = interpreter(request.param)
    if exe is None:
        pytest.skip(f"no Python {request.param} on this machine")
    venv = CACHE / f"cli-py{request.param}"
    deps = runtime_dependencies()
    stamp = venv / "ppd-deps.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == deps):
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([exe, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *deps], check=True)
        stamp.write_text(json.dumps(deps))
    return str(venv / "bin" / "python")


def cli(python: str, *args: str) -> subprocess.CompletedProcess[str]:
    # The package as built for this checkout (its abi3 extension included), on the other interpreter.
    package_root = Path(ppd_router.__file__).resolve().parent.parent
    return subprocess.run(
        [python, "-m", "ppd_router.cli", *args],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(package_root), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )


def test_serve_reads_its_toml_file_and_flags_override_it(python: str, tmp_path: Path) -> None:
    cfg = tmp_path / "router.toml"
    cfg.write_text('port = 9000\npolicy = "fraction:0.5"\nprefill = ["http://127.0.0.1:1"]\n')
    r = cli(python, "serve", "--config", str(cfg), "--port", "9100", "--print-config")
    assert r.returncode == 0, r.stderr
    settings = json.loads(r.stdout)
    assert (settings["port"], settings["policy"], settings["prefill"]) == (9100, "fraction:0.5", ["http://127.0.0.1:1"])


def test_a_bad_file_value_is_named_with_its_line(python: str, tmp_path: Path) -> None:
    cfg = tmp_path / "router.toml"
    cfg.write_text('port = 9000\nruntime = "fibers"\n')
    r = cli(python, "serve", "--config", str(cfg), "--print-config")
    assert r.returncode == 2
    assert "router.toml line 2: invalid setting `runtime`" in r.stderr, r.stderr


def test_the_other_commands_load(python: str) -> None:
    r = cli(python, "--help")
    assert r.returncode == 0, r.stderr
    for command in ("serve", "simulate", "table", "bench", "launch", "report"):
        assert command in r.stdout
