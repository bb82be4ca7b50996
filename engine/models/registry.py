"""Registry of architectures, keyed by our architecture key (see engine.config.HF_ARCHITECTURES)."""

from __future__ import annotations

from engine.errors import UnsupportedArchitectureError
from engine.models import llama, mixtral, qwen2_moe, qwen3_moe
from engine.models import deepseek_v3, gpt_oss, qwen3_5_moe, qwen3_next_gguf
from engine.models.spec import ArchSpec

ARCHITECTURES: dict[str, ArchSpec] = {
    m.SPEC.key: m.SPEC for m in (llama, mixtral, qwen2_moe, qwen3_moe)
}
ARCHITECTURES.update({m.SPEC.key: m.SPEC for m in (gpt_oss, deepseek_v3, qwen3_5_moe)})


def _qwen3_next_class():
    """Late import: the model file imports the layers, which import engine.config."""
    from engine.models.qwen3_next import Qwen3NextForCausalLM

    return Qwen3NextForCausalLM


ARCHITECTURES["qwen3_next"] = ArchSpec(key="qwen3_next", hf_architectures=("Qwen3NextForCausalLM",),
                                       gguf_arch="qwen3next", model_class=_qwen3_next_class,
                                       config_from_gguf=qwen3_next_gguf.config_from_gguf,
                                       gguf_split=qwen3_next_gguf.gguf_split)


def get_spec(arch: str) -> ArchSpec:
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        raise UnsupportedArchitectureError(arch, list(ARCHITECTURES)) from None
