"""Group-wise weight formats (int4, nf4, int8, bf16) with torch references and fast CPU kernels.

See ``formats.py`` for the formats and on-disk layout, ``expert_blob.py`` for an expert's packed
blob, ``reference.py`` for the reference math and ``kernels.py`` for the fast paths (and their
fallbacks).
"""

from engine.quant.formats import (
    ALIGN,
    FORMATS,
    GROUP_SIZES,
    NF4_CODEBOOK,
    QuantFormat,
    QuantizedTensor,
    bits_per_weight,
    bytes_for,
    payload_bytes,
)
from engine.quant.expert_blob import expert_bytes_for, pack_expert, unpack_expert
from engine.quant.kernels import backend_for, expert_forward, qlinear, set_backend
from engine.quant.reference import dequantize, expert_ref, linear_ref, quant_error, quantize

__all__ = [
    "ALIGN", "FORMATS", "GROUP_SIZES", "NF4_CODEBOOK", "QuantFormat", "QuantizedTensor",
    "bits_per_weight", "bytes_for", "expert_bytes_for", "pack_expert", "payload_bytes",
    "unpack_expert", "backend_for", "expert_forward", "qlinear", "set_backend", "dequantize", "expert_ref",
    "linear_ref", "quant_error", "quantize",
]
