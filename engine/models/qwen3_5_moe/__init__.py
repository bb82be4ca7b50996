"""Qwen3.5 / Qwen3.6 MoE (``Qwen3_5MoeForConditionalGeneration``, model_type ``qwen3_5_moe``;
35B-A3B, 122B-A10B, 397B-A17B): Qwen3-Next's text model (Gated DeltaNet + gated full attention,
routed experts + a sigmoid-gated shared expert, zero-centred norms, partial RoPE) shipped as a
vision-language checkpoint. Served text-only by Qwen3-Next's layers (engine.models.qwen3_next,
engine.step_hybrid): what differs is the config (config.py: nested ``text_config``, multimodal
RoPE sections, an always-renormalised router) and the tensor names (names.py: the
``model.language_model.`` prefix, split DeltaNet projections fused on load, the vision tower and
MTP head never read by the model). The MTP head drafts for ``--speculative mtp`` (mtp.py,
mtp_draft.py). A request carrying images is refused (services.http.chat_content).
"""

from __future__ import annotations

from engine.models.qwen3_5_moe import gguf
from engine.models.qwen3_5_moe.config import config_from_hf, params_from_dict
from engine.models.qwen3_5_moe.names import HF_RENAMES, hf_split
from engine.models.spec import ArchSpec

HF_ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
MODEL_TYPE = "qwen3_5_moe"


def _model_class():
    """Late import: the model file imports the layers, which import engine.config."""
    from engine.models.qwen3_next import Qwen3NextForCausalLM

    return Qwen3NextForCausalLM


SPEC = ArchSpec(key="qwen3_5_moe", hf_architectures=(HF_ARCHITECTURE,), hf_renames=HF_RENAMES,
                config_from_hf=config_from_hf, params_from_dict=params_from_dict,
                model_class=_model_class, hf_split=hf_split, gguf_arch=gguf.GGUF_ARCH,
                config_from_gguf=gguf.config_from_gguf, gguf_split=gguf.gguf_split)
