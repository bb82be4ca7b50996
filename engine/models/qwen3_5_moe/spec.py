"""Qwen3.5-MoE's ArchSpec: its own config reader (the nested text_config, read by Qwen3-Next's
fields), the HF renames and splitters, the GGUF reader; Qwen3-Next's tensor list and model class."""

from __future__ import annotations

from engine.models.qwen3_5_moe import config, gguf, names
from engine.models.qwen3_next import tensors
from engine.models.spec import ArchSpec


def _model_class():
    """Late import: the model file imports the layers and the native step's machinery."""
    from engine.models.qwen3_next.model import Qwen3NextForCausalLM

    return Qwen3NextForCausalLM


SPEC = ArchSpec(
    key="qwen3_5_moe",
    hf_architectures=(config.HF_ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    hf_renames=names.HF_RENAMES,
    gguf_arch=gguf.GGUF_ARCH,
    config_from_hf=config.config_from_hf,
    params_from_dict=config.params_from_dict,
    model_class=_model_class,
    expected_tensors=tensors.expected_tensors,
    hf_split=names.hf_split,
    config_from_gguf=gguf.config_from_gguf,
    gguf_split=gguf.gguf_split,
)
