"""gpt-oss's tensor names: its stored HF expert tensors (fused, interleaved, MXFP4 blocks) and
its llama.cpp GGUF names, split into canonical per-expert tensors (module doc of
engine.models.gpt_oss.model for the layouts)."""

from __future__ import annotations

import re

from engine.config import ModelConfig
from engine.errors import ModelFormatError
from engine.loading.source import expert_name

_EXPERTS_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)"
                         r"(_bias|_blocks|_scales)?$")


def hf_split(stored: str, shape: tuple[int, ...], dtype: str, get, config: ModelConfig):
    """Canonical tensors of one stored gpt-oss expert tensor (see the module docstring); None for
    tensors that are canonical after ``hf_renames``."""
    m = _EXPERTS_RE.match(stored)
    if m is None:
        return None
    layer, kind, suffix = int(m.group(1)), m.group(2), m.group(3) or ""
    moe = config.moe
    E, I, H = moe.num_experts, moe.expert_intermediate_size, config.hidden_size
    p = f"model.layers.{layer}.mlp."
    if suffix == "_scales":
        return []  # read together with its _blocks tensor
    if suffix == "_bias":
        want = (E, 2 * I) if kind == "gate_up_proj" else (E, H)
        _check(stored, shape, want)
        if kind == "down_proj":
            return [(p + "down_proj_bias", (E, H), dtype, lambda: get(stored))]
        return [(p + "gate_proj_bias", (E, I), dtype, lambda: get(stored)[:, 0::2].contiguous()),
                (p + "up_proj_bias", (E, I), dtype, lambda: get(stored)[:, 1::2].contiguous())]
    if suffix == "_blocks":
        from engine.quant.mxfp4 import hf_expert_matrix

        out, inp = (2 * I, H) if kind == "gate_up_proj" else (H, I)
        _check(stored, shape, (E, out, inp // 32, 16))
        scales = stored.removesuffix("_blocks") + "_scales"

        def mx(j: int, rows: slice):
            from engine.quant.mxfp4 import MXFP4, from_hf_blocks

            def load():
                return hf_expert_matrix(get(stored)[j], get(scales)[j], rows)

            def quantized():  # the same bytes as an mxfp4 QuantizedTensor (no re-quantization)
                return from_hf_blocks(get(stored)[j][rows], get(scales)[j][rows])
            quantized.fmt = MXFP4
            load.quantized = quantized
            return load
        if kind == "down_proj":
            return [(expert_name(layer, j, "down_proj"), (H, I), "mxfp4", mx(j, slice(None)))
                    for j in range(E)]
        return [part for j in range(E) for part in (
            (expert_name(layer, j, "gate_proj"), (I, H), "mxfp4", mx(j, slice(0, None, 2))),
            (expert_name(layer, j, "up_proj"), (I, H), "mxfp4", mx(j, slice(1, None, 2))))]
    if kind == "down_proj":  # [E, I, H] input-major
        _check(stored, shape, (E, I, H))
        return [(expert_name(layer, j, "down_proj"), (H, I), dtype,
                 (lambda j=j: get(stored)[j].T.contiguous())) for j in range(E)]
    _check(stored, shape, (E, H, 2 * I))  # gate_up_proj [E, H, 2I], interleaved columns
    return [part for j in range(E) for part in (
        (expert_name(layer, j, "gate_proj"), (I, H), dtype,
         (lambda j=j: get(stored)[j][:, 0::2].T.contiguous())),
        (expert_name(layer, j, "up_proj"), (I, H), dtype,
         (lambda j=j: get(stored)[j][:, 1::2].T.contiguous())))]


def _check(stored: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(want):
        raise ModelFormatError(stored, f"gpt-oss expert tensor has shape {list(shape)}; the config "
                                       f"implies {list(want)}")


# ------------------------------------------------------------------------------------- GGUF
# llama.cpp's converter (arch "gpt-oss"): the generic names plus attention sinks, a post-attention
# norm named post_attention_norm, stacked experts ffn_{gate,up,down}_exps (gate and up already
# de-interleaved; MXFP4 as GGML type 39) with their biases as ffn_*_exps.bias [E, I|H].

_GGUF_RE = re.compile(r"^blk\.(\d+)\.(attn_sinks\.weight|post_attention_norm\.weight|"
                      r"ffn_(gate|up|down)_exps\.bias)$")


def gguf_split(gname: str, shape: tuple[int, ...], config: ModelConfig):
    m = _GGUF_RE.match(gname)
    if m is None:
        return None
    p = f"model.layers.{m.group(1)}."
    if m.group(2) == "attn_sinks.weight":
        return [(p + "self_attn.sinks", shape, None)]
    if m.group(2) == "post_attention_norm.weight":
        return [(p + "post_attention_layernorm.weight", shape, None)]
    return [(p + f"mlp.{m.group(3)}_proj_bias", shape, None)]
