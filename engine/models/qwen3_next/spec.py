"""Qwen3-Next's ArchSpec: HF tensor names are already canonical; its own config fields, tensor
list, GGUF reader and model class."""

from __future__ import annotations

from engine.models.qwen3_next import config, gguf, tensors
from engine.models.spec import ArchSpec


def _model_class():
    """Late import: the model file imports the layers and the native step's machinery."""
    from engine.models.qwen3_next.model import Qwen3NextForCausalLM

    return Qwen3NextForCausalLM


SPEC = ArchSpec(
    key="qwen3_next",
    hf_architectures=("Qwen3NextForCausalLM",),
    gguf_arch="qwen3next",
    hf_fields=config.hf_fields,
    model_class=_model_class,
    expected_tensors=tensors.expected_tensors,
    config_from_gguf=gguf.config_from_gguf,
    gguf_split=gguf.gguf_split,
)
