"""Tiny random transformers checkpoints for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

ARCH_CLASSES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM),
    "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM),
}


def make_checkpoint(arch: str, out: Path, seed: int = 0, vocab: int = 96, **overrides):
    """save_pretrained a random model; returns the transformers model (fp32, eval)."""
    cfg_cls, model_cls = ARCH_CLASSES[arch]
    kw = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "mixtral":
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    elif arch in ("qwen2_moe", "qwen3_moe"):
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        if arch == "qwen2_moe":
            kw.update(shared_expert_intermediate_size=24)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).eval()
    # Random init leaves norms at 1 and some weights tiny; perturb everything so that every
    # weight matters (a wrongly loaded norm or bias must change the logits).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    return model


def add_mixtral_tokenizer(out: Path) -> None:
    """Mixtral-8x7B's real sentencepiece tokenizer (32000 pieces, from mistral-common)."""
    import json
    import shutil

    from engine.assets import mixtral_tokenizer_model

    shutil.copy(mixtral_tokenizer_model(), out / "tokenizer.model")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "chat_template": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                         "[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}</s>"
                         "{% endif %}{% endfor %}",
    }))
