"""Fixtures shared by the GGUF tests: llama.cpp's own converter (bench/llama_cpp_converter.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[3] / "bench" / "llama_cpp_converter.py"


def converter_module():
    """bench/llama_cpp_converter.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("llama_cpp_converter", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def converter(request) -> Path:
    """convert_hf_to_gguf.py, fetched once into the pytest cache; the test skips without it."""
    mod = converter_module()
    try:
        return mod.fetch_converter(request.config.cache.mkdir("llama_cpp_converter"))
    except mod.ConverterUnavailable as e:
        pytest.skip(str(e))
