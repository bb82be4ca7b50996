"""Intra-op CPU threads per forward step.

A decode step is a chain of hundreds of tiny ops (a few token rows each): with more than one
intra-op thread every op pays a fork/join, and the worker threads compete with the expert
cache's copies and the decode loop itself for the same few cores. Measured on the 2-core dev
machine (demo store, 60% device budget): 2 threads 22.4 tok/s, 1 thread 38.6 tok/s; the 1.3B
random MoE store (bench/decode_cpu.py, bf16 dense) 41.6 -> 49.9. The price: a dense model loses
a little (SmolLM2 decode, 1 vs 2 threads: bf16 49.4 vs 51.3, int8 63.4 vs 66.9 tok/s), and its
256-token prefill needs both threads (fp32: 421 vs 759 tok/s). So steps of at most
``SMALL_STEP_TOKENS`` tokens run with ``MOESTREAM_DECODE_THREADS`` threads (default 1; set 2 for
a dense model) and larger steps with the process's setting. Only CPU models are affected;
toggling costs well under a microsecond.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from engine.options import options

SMALL_STEP_TOKENS = 8


def decode_threads() -> int:
    """The ``decode_threads`` runtime option (engine.options, ``MOESTREAM_DECODE_THREADS``)."""
    return options().decode_threads


@contextmanager
def step_threads(num_tokens: int, device: torch.device) -> Iterator[None]:
    """Run one forward of ``num_tokens`` tokens with the thread count its size calls for."""
    prev = torch.get_num_threads()
    want = min(prev, decode_threads()) if device.type == "cpu" and num_tokens <= SMALL_STEP_TOKENS else prev
    if want == prev:
        yield
        return
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
