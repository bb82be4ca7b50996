"""Qwen4-Exp's ArchSpec: its own config reader, renames and splitters (the VLM layout, the PLE
table's shards, Qwen3.5-MoE's DeltaNet projections and block-FP8), tensor list and model."""

from __future__ import annotations

from engine.models.qwen4_exp import config, gguf, names, tensors
from engine.models.spec import ArchSpec


def _model_class():
    """Late import: the model file imports the layers."""
    from engine.models.qwen4_exp.model import Qwen4ExpForCausalLM

    return Qwen4ExpForCausalLM


SPEC = ArchSpec(
    key="qwen4_exp",
    hf_architectures=config.HF_ARCHITECTURES,
    hf_model_types=config.MODEL_TYPES,
    hf_renames=names.HF_RENAMES,
    config_from_hf=config.config_from_hf,
    params_from_dict=config.params_from_dict,
    model_class=_model_class,
    expected_tensors=tensors.expected_tensors,
    hf_split=names.hf_split,
    gguf_arch=gguf.GGUF_ARCH,
    config_from_gguf=gguf.config_from_gguf,
    gguf_split=gguf.gguf_split,
)
