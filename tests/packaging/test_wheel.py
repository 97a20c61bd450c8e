"""The built wheel, installed where there is no Rust toolchain, and the source distribution.

scripts/test.sh builds the abi3 manylinux wheel into ``$PPD_WHEEL_DIR`` (target/wheels) with
the same Cargo target directory as the development build, so it costs a relink, not a rebuild.
Each Python the package declares (3.10-3.12, where this machine has them) gets a fresh venv
with only the wheel and its runtime dependencies from PyPI, and a PATH without cargo.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from ..conftest import REPO, TABLES
from ..core.test_python_versions import interpreter

WHEEL_DIR = Path(os.environ.get("PPD_WHEEL_DIR", REPO / "target" / "wheels"))
# A PATH with the system's tools but none of Rust's (cargo lives in ~/.cargo/bin here).
NO_RUST_PATH = "/usr/local/bin:/usr/bin:/bin"


@pytest.fixture(scope="module")
def wheel() -> Path:
    found = sorted(WHEEL_DIR.glob("ppd_router-*.whl"), key=lambda p: p.stat().st_mtime)
    if not found:
        if "PPD_WHEEL_DIR" in os.environ:  # scripts/test.sh built one: its absence is a failure
            pytest.fail(f"no wheel in {WHEEL_DIR}")
        pytest.skip(f"no wheel in {WHEEL_DIR} (scripts/test.sh builds one: maturin build --release -o {WHEEL_DIR})")
    return found[-1]


def test_the_wheel_is_abi3_manylinux_and_carries_the_license(wheel: Path) -> None:
    # One wheel for every CPython >= 3.10, installable on any glibc Linux of its tag.
    assert re.search(r"-cp310-abi3-manylinux_\d+_\d+_x86_64|-cp310-abi3-manylinux_\d+_\d+_aarch64", wheel.name), wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names
    assert any(re.fullmatch(r"ppd_router/_core\.abi3\.so", n) for n in names)


@pytest.fixture(scope="module", params=["3.10", "3.11", "3.12"])
def installed(request: pytest.FixtureRequest, wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv of one Python with the wheel installed; its bin directory."""
    exe = interpreter(request.param)
    if exe is None:
        pytest.skip(f"no Python {request.param} on this machine")
    venv = tmp_path_factory.mktemp(f"wheel-py{request.param}")
    subprocess.run([exe, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # --only-binary: nothing may be compiled on the user's side, the package least of all.
    subprocess.run([*pip, "--only-binary", ":all:", str(wheel)], check=True, env=no_rust_env(venv / "bin"))
    return venv / "bin"


def no_rust_env(bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CARGO", "RUSTUP", "PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{bin_dir}:{NO_RUST_PATH}"
    return env


def run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, env=no_rust_env(bin_dir), cwd=cwd, timeout=120)


def test_the_venv_has_no_rust_toolchain(installed: Path, tmp_path: Path) -> None:
    assert shutil.which("cargo", path=no_rust_env(installed)["PATH"]) is None
    assert shutil.which("rustc", path=no_rust_env(installed)["PATH"]) is None


def test_the_installed_package_imports_from_site_packages(installed: Path, tmp_path: Path) -> None:
    # cwd outside the checkout: the import must find the installed wheel, not python/ here.
    r = run(installed, str(installed / "python"), "-c", "import ppd_router, sys; print(ppd_router.__file__)", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "site-packages" in r.stdout and str(REPO) not in r.stdout


def test_the_installed_cli_helps_and_decides(installed: Path, tmp_path: Path) -> None:
    r = run(installed, str(installed / "ppd-router"), "--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "serve" in r.stdout and "table" in r.stdout
    table = str(TABLES / "h100-llama3.1-8b-2P2pD.json")
    args = ["table", "decide", table, "--turn", "2", "--n-in", "512", "--n-out", "64", "--ctx", "2000", "--qps", "16"]
    r = run(installed, str(installed / "ppd-router"), *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == "local"


def included_files() -> set[str]:
    """Every file the Rust crates embed at compile time (include_str!/include_bytes!), repo-relative."""
    found = set()
    for src in (REPO / "rust").rglob("*.rs"):
        for rel in re.findall(r'include_(?:str|bytes)!\(\s*"([^"]+)"', src.read_text()):
            found.add(str((src.parent / rel).resolve().relative_to(REPO)))
    return found


def test_the_sdist_carries_every_file_the_crates_embed(tmp_path: Path) -> None:
    maturin = shutil.which("maturin") or str(Path(sys.executable).parent / "maturin")
    r = subprocess.run([maturin, "sdist", "-o", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (sdist,) = tmp_path.glob("ppd_router-*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    embedded = included_files()
    assert "tables/h100-llama3.1-8b-2P2pD.json" in embedded  # the scan finds what it must
    assert embedded - members == set()
    assert {"LICENSE", "pyproject.toml", "Cargo.lock"} <= members
