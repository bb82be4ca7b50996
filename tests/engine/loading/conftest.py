"""Fixtures shared by the GGUF tests: llama.cpp's own converter (bench/llama_cpp_converter.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.loading.converted import converter_module


@pytest.fixture(scope="session")
def converter(request) -> Path:
    """convert_hf_to_gguf.py, fetched once into the pytest cache; the test skips without it."""
    mod = converter_module()
    try:
        return mod.fetch_converter(request.config.cache.mkdir("llama_cpp_converter"))
    except mod.ConverterUnavailable as e:
        pytest.skip(str(e))
