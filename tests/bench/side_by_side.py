"""What the tests of the GGUF side-by-side benches (bench/qwen35_vs_llama_cpp.py,
bench/qwen4exp_vs_llama_cpp.py) share: the bench as a module, one greedy run of both systems."""

from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@contextmanager
def bench_module(name: str) -> Iterator[object]:
    """bench/<name>.py imported (bench/ is not a package; its modules import each other)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def greedy_both(B, build, request, tmp_path: Path, n_prompt: int, new: int):
    """The bench's TINY shape built by ``build(dir, shape)``, converted, run greedily by both:
    (moestream model, GGUF path, prompt, moestream's (tokens, prefill tok/s, decode tok/s),
    llama.cpp's tokens, from a child process). Skips without llama_cpp, without the converter, or
    where llama.cpp dies on this CPU."""
    pytest.importorskip("llama_cpp")
    build(tmp_path / "hf", B.TINY)
    try:
        path = B.to_gguf(tmp_path / "hf", tmp_path / "f32.gguf", request.config.cache.mkdir("llama_cpp_converter"))
    except B.ConverterUnavailable as e:
        pytest.skip(str(e))
    ours = B.load_fp32(path)
    prompt = B.make_prompt(n_prompt, ours.config.vocab_size)
    from llama_child import LlamaCppChild, LlamaCppDied

    try:  # in a child: a wheel built for instructions this CPU lacks dies of SIGILL (AVX2-only EPYC)
        theirs = LlamaCppChild(path, 2, n_prompt + new + 24, n_prompt)
        try:
            want, _, _ = theirs.greedy(prompt, new)
        finally:
            theirs.close()
    except LlamaCppDied as e:
        pytest.skip(str(e))
    return ours, path, prompt, B.moestream_greedy(ours, prompt, new), want
