"""The native Gated DeltaNet decode step of one token (``deltanet_step`` in
engine/csrc/deltanet_block.cpp, part of the native kernels of engine.quant.kernels, whose
``deltanet_block`` runs a whole layer in the native step: engine.models.qwen3_next.step). ``decode_step``
returns None when it cannot run here (no native build, the ``fused_step`` option off): the caller
then runs the torch reference (engine.layers.deltanet)."""

from __future__ import annotations

from typing import Any

import torch


def extension() -> Any:
    """The native kernels if they carry the DeltaNet step, else None (the torch path runs)."""
    from engine.quant.kernels import load_extension

    ext = load_extension()
    return ext if ext is not None and hasattr(ext, "deltanet_step") else None


def enabled() -> bool:
    from engine.options import options

    return options().fused_step


def decode_step(window, weight, x, state, g, beta, nk: int, dk: int, dv: int) -> torch.Tensor | None:
    """o [Nv, Dv] of one token (window and state advanced in place), or None: use the reference."""
    if x.device.type != "cpu" or not enabled():
        return None
    ext = extension()
    if ext is None:
        return None
    return ext.deltanet_step(window, weight, x, state, g, beta, nk, dk, dv)
