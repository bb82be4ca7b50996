"""Qwen3-MoE: RMSNorm over head_dim on q and k before RoPE, no qkv bias, no shared expert,
``norm_topk_prob`` renormalises the top-k weights."""

from engine.models.spec import ArchSpec

SPEC = ArchSpec(
    key="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    gguf_arch="qwen3moe",
)
