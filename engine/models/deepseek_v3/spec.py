"""DeepSeek-V3's ArchSpec: its own config readers, tensor list and splitters, model class."""

from __future__ import annotations

from engine.models.deepseek_v3 import config, names
from engine.models.spec import ArchSpec


def _model_class():
    """Late import: the model file imports the layers and the native step's machinery."""
    from engine.models.deepseek_v3.model import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM


SPEC = ArchSpec(
    key="deepseek_v3",
    hf_architectures=("DeepseekV3ForCausalLM",),
    hf_renames=names.HF_RENAMES,
    gguf_arch="deepseek2",
    config_from_hf=config.config_from_hf,
    params_from_dict=config.params_from_dict,
    model_class=_model_class,
    expected_tensors=config.expected_tensors,
    hf_split=names.hf_split,
    config_from_gguf=config.config_from_gguf,
    gguf_split=names.gguf_split,
)
