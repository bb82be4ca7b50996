"""Mixtral: every layer sparse, softmax-then-top-k routing renormalised over the top-k, no
shared expert. HF stores experts as ``block_sparse_moe.experts.{j}.w1/w3/w2`` (gate/up/down)."""

from engine.models.spec import ArchSpec

SPEC = ArchSpec(
    key="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    hf_renames=(
        (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
    ),
    gguf_arch="llama",  # llama.cpp writes Mixtral as "llama" with expert_count > 0
)
