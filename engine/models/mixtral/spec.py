"""Mixtral: every layer sparse, softmax-then-top-k routing renormalised over the top-k, no
shared expert. HF stores experts as ``block_sparse_moe.experts.{j}.w1/w3/w2`` (gate/up/down)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from engine.config import MoEConfig
from engine.models.spec import ArchSpec


def hf_fields(raw: Mapping[str, Any], integer, source: object) -> dict[str, Any]:
    """Routed experts: ``num_local_experts`` of width ``intermediate_size``, top-k renormalised."""
    return {"moe": MoEConfig(num_experts=integer("num_local_experts"), top_k=integer("num_experts_per_tok"),
                             expert_intermediate_size=integer("intermediate_size"), norm_topk_prob=True)}


def gguf_accepts(meta: Mapping[str, Any]) -> bool:
    """llama.cpp writes Mixtral as "llama" with ``llama.expert_count`` > 0."""
    return int(meta.get("llama.expert_count", 0) or 0) > 0


def gguf_fields(get, fields: dict[str, Any]) -> dict[str, Any]:
    """Mixtral always renormalises the top-k weights (no metadata key says so)."""
    moe = fields["moe"] and dataclasses.replace(fields["moe"], norm_topk_prob=True)
    return {**fields, "moe": moe}


SPEC = ArchSpec(
    key="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    hf_renames=(
        (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
    ),
    gguf_arch="llama",
    gguf_qk_permuted=True,
    gguf_accepts=gguf_accepts,
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
)
