"""Qwen2-MoE: qkv bias, optional top-k renormalisation, a shared expert scaled by
``sigmoid(x @ shared_expert_gate)``, ``decoder_sparse_step`` / ``mlp_only_layers``."""

from engine.models.spec import ArchSpec

SPEC = ArchSpec(
    key="qwen2_moe",
    hf_architectures=("Qwen2MoeForCausalLM",),
    gguf_arch="qwen2moe",
)
