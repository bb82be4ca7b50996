"""Llama (dense SwiGLU decoder; SmolLM2, Llama 2/3, Mistral). Canonical names are HF's own."""

from engine.models.spec import ArchSpec

SPEC = ArchSpec(
    key="llama",
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    gguf_arch="llama",
)
