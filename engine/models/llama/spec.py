"""Llama (dense SwiGLU decoder; SmolLM2, Llama 2/3, Mistral). Canonical names are HF's own;
every config field is a shared-decoder default (engine.configio.hf / .gguf)."""

from engine.models.spec import ArchSpec

SPEC = ArchSpec(
    key="llama",
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    hf_model_types=("llama", "mistral"),
    gguf_arch="llama",
    gguf_qk_permuted=True,
)
