"""Tiny random Qwen3-Next checkpoints (transformers' own model class, saved with save_pretrained)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T


def make_qwen3_next(out: Path, seed: int = 0, vocab: int = 96, **overrides) -> T.Qwen3NextForCausalLM:
    """save_pretrained a random Qwen3-Next; returns the transformers model (fp32, eval). Every
    weight is perturbed so that a wrongly loaded norm, gate or decay changes the logits."""
    kw = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              shared_expert_intermediate_size=24, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if name.endswith(("A_log", "dt_bias")) else 0.05))
    model.save_pretrained(out)
    return model
