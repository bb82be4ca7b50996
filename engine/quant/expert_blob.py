"""One routed expert's three weights (gate, up, down) packed into one blob in a QuantFormat, and
read back zero-copy: the unit the expert store writes and the expert cache loads. Here, not in
engine.quant.formats, because packing a float weight quantizes it (engine.quant.reference),
which itself builds on the formats."""

from __future__ import annotations

from typing import Any, Mapping

from engine.errors import ConfigError, ModelFormatError
from engine.quant.formats import ALIGN, LAYOUT_VERSION, QuantFormat, QuantizedTensor, _align_up, bytes_for
from engine.quant.reference import quantize

EXPERT_PROJ = ("gate", "up", "down")


def pack_expert(gate: Any, up: Any, down: Any, fmt: QuantFormat) -> tuple[bytes, dict[str, Any]]:
    """One blob holding an expert's three weights (float tensors or QuantizedTensors in ``fmt``).

    gate, up: ``[I, H]``; down: ``[H, I]``. Returns ``(blob, layout)``; layout = ``{"version",
    "format", "nbytes", "tensors": {"gate"|"up"|"down": {"offset": ..., **tensor layout}}}`` with
    every tensor starting at a multiple of :data:`ALIGN`.
    """
    qs = []
    for name, w in zip(EXPERT_PROJ, (gate, up, down)):
        q = w if isinstance(w, QuantizedTensor) else quantize(w, fmt)
        if q.fmt != fmt:
            raise ConfigError(f"expert {name} weight is in {q.fmt}, expected {fmt}")
        qs.append(q)
    (i, h), (i2, h2), (h3, i3) = (q.shape for q in qs)
    if (i, h) != (i2, h2) or (h3, i3) != (h, i):
        raise ConfigError(f"expert shapes must be gate [I, H], up [I, H], down [H, I]; got "
                          f"{list(qs[0].shape)}, {list(qs[1].shape)}, {list(qs[2].shape)}")
    tensors, off = {}, 0
    for name, q in zip(EXPERT_PROJ, qs):
        tensors[name] = {"offset": off, **q.layout()}
        off = _align_up(off + tensors[name]["nbytes"])
    blob = bytearray(off)
    for name, q in zip(EXPERT_PROJ, qs):
        q.write_into(blob, tensors[name]["offset"])
    return bytes(blob), {"version": LAYOUT_VERSION, "format": fmt.to_dict(), "nbytes": off, "tensors": tensors}


def expert_bytes_for(intermediate: int, hidden: int, fmt: QuantFormat) -> int:
    """Size of a :func:`pack_expert` blob for gate/up ``[I, H]`` and down ``[H, I]``."""
    return 2 * bytes_for((intermediate, hidden), fmt) + bytes_for((hidden, intermediate), fmt)


def unpack_expert(buf: Any, layout: Mapping[str, Any], *, offset: int = 0,
                  source: str = "<expert blob>") -> tuple[QuantizedTensor, QuantizedTensor, QuantizedTensor]:
    """Zero-copy ``(gate, up, down)`` from a :func:`pack_expert` blob at ``buf[offset]``."""
    try:
        fmt = QuantFormat.from_dict(layout["format"])
        tl = layout["tensors"]
        out = []
        for name in EXPERT_PROJ:
            t = tl[name]
            toff = t["offset"]
            if not isinstance(toff, int) or toff < 0 or toff % ALIGN:
                raise ModelFormatError(source, f"expert {name} offset {toff!r} is not a multiple of {ALIGN}")
            out.append(QuantizedTensor.from_buffer(buf, t, fmt=fmt, offset=offset + toff,
                                                   source=f"{source} ({name})"))
    except (KeyError, TypeError, ConfigError) as e:
        raise ModelFormatError(source, f"malformed expert layout: {e!r}") from e
    g, u, d = out
    if g.shape != u.shape or d.shape != (g.shape[1], g.shape[0]):
        raise ModelFormatError(source, f"expert shapes gate {list(g.shape)}, up {list(u.shape)}, "
                                       f"down {list(d.shape)} are inconsistent")
    return g, u, d
