"""gpt-oss's ArchSpec: the router renamed to the canonical ``mlp.gate``; its own config
readers, tensor list and splitters, model class."""

from __future__ import annotations

from engine.models.gpt_oss import config, names
from engine.models.spec import ArchSpec


def _model_class():
    """Late import: the model file imports the layers and the native step's machinery."""
    from engine.models.gpt_oss.model import GptOssForCausalLM

    return GptOssForCausalLM


SPEC = ArchSpec(
    key="gpt_oss",
    hf_architectures=("GptOssForCausalLM",),
    hf_renames=((r"\.mlp\.router\.", ".mlp.gate."),),
    gguf_arch="gpt-oss",
    config_from_hf=config.config_from_hf,
    params_from_dict=config.params_from_dict,
    model_class=_model_class,
    expected_tensors=config.expected_tensors,
    hf_split=names.hf_split,
    config_from_gguf=config.config_from_gguf,
    gguf_split=names.gguf_split,
)
