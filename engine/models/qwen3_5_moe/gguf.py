"""Qwen3.5/3.6 MoE from GGUF: llama.cpp's ``qwen35moe`` metadata and tensor names.

llama.cpp's converter (convert_hf_to_gguf.py, Qwen3_5MoeTextModel) writes the text model only
(the vision tower goes to a separate mmproj file, MTP blocks are appended as blocks
``num_hidden_layers..``) and changes what Qwen3-Next's converter changes (norms stored 1 + w,
``A_log`` as ``-exp``, conv1d squeezed; undone by engine.models.qwen3_next.gguf), except that
Qwen3.5's DeltaNet projections are already split in HF (``in_proj_qkv`` [all q | all k | all v],
``in_proj_z``, ``in_proj_a``, ``in_proj_b``), so there is no q/k/v/z re-interleave. New here:
with fewer key heads than value heads (nk < nv, r = nv / nk value heads per key head) it
re-orders the value heads from grouped by key head [nk, r] to tiled [r, nk] (what ggml's
broadcast wants) in every tensor indexed by value head:

    HF (model.language_model.layers.N.)   GGUF (blk.N.)            here
    linear_attn.in_proj_qkv   [2K+V, H]    attn_qkv   v rows tiled  v rows grouped again
    linear_attn.in_proj_z     [V, H]       attn_gate  rows tiled    rows grouped
    linear_attn.in_proj_a/b   [nv, H]      ssm_alpha/ssm_beta tiled rows grouped
    linear_attn.A_log, dt_bias [nv]        ssm_a (-exp), ssm_dt.bias log(-a) / as is, grouped
    linear_attn.conv1d.weight [C, 1, k]    ssm_conv1d [C, k]        [C, 1, k], v channels grouped
    linear_attn.out_proj      [H, V]       ssm_out  columns tiled   columns grouped

(V = nv x value head dim, K = nk x key head dim.) The rest (norms, attention with its gate,
router, stacked experts, shared expert, embeddings, head) is Qwen3-Next's mapping. Metadata:
Qwen3-Next's keys under ``qwen35moe.`` plus ``rope.dimension_sections`` (four entries, the
fourth 0 for text) giving ``mrope_section``; Qwen3.5 always interleaves the sections. The
config is built as the VLM config.json the file came from (``text_config`` nested) and read
by the one Qwen3.5-MoE parser. MTP (nextn) blocks, if present, are never read.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from engine.config import ModelConfig
from engine.configio.fields import gguf_keys
from engine.errors import ModelFormatError
from engine.models.qwen3_5_moe.config import HF_ARCHITECTURE, MODEL_TYPE, config_from_hf
from engine.models.qwen3_5_moe.names import merge_ba, merge_qkvz
from engine.models.qwen3_next import gguf as next_gguf

GGUF_ARCH = "qwen35moe"


def config_from_gguf(meta: Mapping[str, Any], source: object) -> ModelConfig:
    """The ModelConfig of a ``qwen35moe`` GGUF, parsed as its VLM config.json."""
    text = hf_text_dict(meta, GGUF_ARCH, source)
    tied = text.pop("tie_word_embeddings")
    text["model_type"] = "qwen3_5_moe_text"
    raw = {"architectures": [HF_ARCHITECTURE], "model_type": MODEL_TYPE,
           "text_config": text, "tie_word_embeddings": tied}
    return config_from_hf(raw, source)


def hf_text_dict(meta: Mapping[str, Any], arch: str, source: object) -> dict[str, Any]:
    """Qwen3-Next's text config.json fields of a GGUF under ``arch`` plus the multimodal-RoPE
    sections (``rope.dimension_sections``: the 3 text sections and a fourth 0, always
    interleaved): what ``qwen35moe`` and ``qwen4exp`` files share."""
    text = next_gguf.hf_text_dict(meta, arch, source)
    sections = gguf_keys(meta, arch, source)("rope.dimension_sections")
    if not isinstance(sections, list) or not 3 <= len(sections) <= 4 or sum(sections[3:]) != 0:
        raise ModelFormatError(source, f"{arch}.rope.dimension_sections must list the 3 text "
                                       f"sections (and a fourth 0), got {sections!r}")
    text["rope_parameters"].update(mrope_section=[int(s) for s in sections[:3]], mrope_interleaved=True)
    return text


def gguf_split(gname: str, shape: tuple[int, ...], config: ModelConfig):
    """[(canonical name, shape, expert None, load)] for the DeltaNet tensors (module doc; the
    canonical names are Qwen3-Next's: in_proj_qkvz and in_proj_ba fused as engine.models.
    qwen3_5_moe.names fuses HF's split projections), then Qwen3-Next's mapping (norms, MTP
    blocks skipped); [] for the partner read with another; None: the generic map."""
    m = next_gguf._NAME_RE.match(gname)
    la = config.linear_attn
    if m is None or la is None or int(m.group(1)) >= config.num_layers:
        return next_gguf.gguf_split(gname, shape, config)
    layer, rest = int(m.group(1)), m.group(2)
    p, b = f"model.layers.{layer}.linear_attn.", f"blk.{layer}."
    h, nv, kd, dv = config.hidden_size, la.num_value_heads, 2 * la.key_dim, la.value_head_dim
    if rest in ("attn_gate.weight", "ssm_alpha.weight"):
        return []  # read with attn_qkv / ssm_beta
    if rest == "attn_qkv.weight":
        def qkvz(src) -> torch.Tensor:
            qkv = _stored(src, b + "attn_qkv.weight", (kd + la.value_dim, h))
            z = _grouped(_stored(src, b + "attn_gate.weight", (la.value_dim, h)), la, dv)
            qkv = torch.cat([qkv[:kd], _grouped(qkv[kd:], la, dv)])
            return merge_qkvz(qkv, z, la.num_key_heads, la.key_head_dim, nv, dv)
        return [(p + "in_proj_qkvz.weight", (kd + 2 * la.value_dim, h), None, qkvz)]
    if rest == "ssm_beta.weight":
        def ba(src) -> torch.Tensor:
            beta, alpha = (_grouped(_stored(src, b + n, (nv, h)), la, 1) for n in ("ssm_beta.weight", "ssm_alpha.weight"))
            return merge_ba(beta, alpha, la.num_key_heads, nv)
        return [(p + "in_proj_ba.weight", (2 * nv, h), None, ba)]
    if rest == "ssm_a":
        return [(p + "A_log", (nv,), None, lambda src: torch.log(-_grouped(_stored(src, gname, (nv,)), la, 1)))]
    if rest == "ssm_dt.bias":
        return [(p + "dt_bias", (nv,), None, lambda src: _grouped(_stored(src, gname, (nv,)), la, 1))]
    if rest == "ssm_conv1d.weight":
        def conv(src) -> torch.Tensor:
            t = _stored(src, gname, (la.conv_dim, la.conv_kernel))
            return torch.cat([t[:kd], _grouped(t[kd:], la, dv)])[:, None, :]
        return [(p + "conv1d.weight", (la.conv_dim, 1, la.conv_kernel), None, conv)]
    if rest == "ssm_out.weight":
        return [(p + "out_proj.weight", (h, la.value_dim), None,
                 lambda src: _grouped(_stored(src, gname, (h, la.value_dim)).T, la, dv).T.contiguous())]
    return next_gguf.gguf_split(gname, shape, config)


def _stored(src, gname: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A GGUF tensor by name, decoded and shape-checked (ModelFormatError naming it)."""
    if gname not in src.tensor_infos:
        raise ModelFormatError(src.path, f"tensor {gname!r} is missing; the {GGUF_ARCH} layout needs "
                                         f"it with shape {list(shape)}")
    return next_gguf._checked(src.stored_tensor(gname), shape, gname)


def _grouped(t: torch.Tensor, la, head_dim: int) -> torch.Tensor:
    """Rows of ``t`` [nv x head_dim, ...] from llama.cpp's tiled value-head order [r, nk] back to
    HF's grouped order [nk, r] (the identity when nk == nv)."""
    nk, r = la.num_key_heads, la.num_value_heads // la.num_key_heads
    return t.reshape(r, nk, head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
