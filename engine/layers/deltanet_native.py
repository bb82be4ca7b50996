"""The native Gated DeltaNet decode step (engine/csrc/deltanet.cpp): its own small extension,
built on first use like the other native kernels (cached in ~/.cache/moestream/torch_extensions,
keyed by the source, torch's version, the flags and the CPU), so adding it never rebuilds the
shared kernels. ``decode_step`` returns None when it cannot run here (no compiler, the
``fused_step`` option off): the caller then runs the torch reference (engine.layers.deltanet)."""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "deltanet.cpp"
FLAGS = (["-O3", "-march=native"], ["-O3"])
_lock = threading.Lock()
_ext: list = []  # [module or None] once tried


def _build(flags: list[str]) -> Any:
    from torch.utils.cpp_extension import load

    from engine.quant.kernels import _cpu_flags, extension_dir

    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join([torch.__version__, *flags, _cpu_flags()]).encode())
    d = extension_dir(f"moestream_deltanet_{h.hexdigest()[:12]}")
    d.mkdir(parents=True, exist_ok=True)
    return load(name=d.name, sources=[str(SOURCE)], extra_cflags=flags, build_directory=str(d))


def extension() -> Any:
    """The built module, or None (one log line on failure; the torch path runs)."""
    if _ext:
        return _ext[0]
    with _lock:
        if not _ext:
            ext = None
            for flags in FLAGS:
                try:
                    ext = _build(flags)
                    break
                except Exception as e:  # no compiler, or one that rejects -march=native
                    log.warning("native DeltaNet step not built with %s (%s: %s)", flags, type(e).__name__, e)
            _ext.append(ext)
    return _ext[0]


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
    return ext.decode_step(window, weight, x, state, g, beta, nk, dk, dv)
