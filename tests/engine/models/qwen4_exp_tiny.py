"""Tiny random Qwen4-Exp checkpoints (transformers' own classes, saved with save_pretrained):
the VLM layout (`Qwen4ExpForConditionalGeneration`: text model under `model.language_model.*`,
text config nested in `text_config`) or the text-only `Qwen4ExpForCausalLM` (`model.*`).

CASES are the parity configs the issue asks for: PLE on 0, 1 and 2 layers, n-gram orders 2
and 3, hc_count 2 and 4, different indexer budgets and compress ratios; every budget is far
below the contexts the tests run (>= 100 positions), so QSA selection drops blocks."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

from tests.engine.models.qwen3_5_moe_tiny import TINY_VISION, save_vlm

# name -> text_config overrides. Layers 1-3 are DeltaNet, 4 is QSA attention (interval 4); the
# 5-layer case has a second QSA layer's worth of DeltaNet first.
CASES: dict[str, dict] = {
    "ple2_ng3_hc2": dict(hc_count=2, ple_layer_ids=[1, 2], ngram_size=3, heads_per_ngram=2,
                         ple_embed_dim=16, indexer_budget=8, indexer_compress_ratio=4),
    "ple1_ng2_hc4": dict(hc_count=4, ple_layer_ids=[2], ngram_size=2, heads_per_ngram=4,
                         ple_embed_dim=32, indexer_budget=4, indexer_compress_ratio=2),
    "ple0_ng3_hc4": dict(hc_count=4, ple_layer_ids=[], ngram_size=3, indexer_budget=12,
                         indexer_compress_ratio=3, num_hidden_layers=8),
}


def text_config(vocab: int = 96, **overrides) -> dict:
    """A tiny text_config: head_dim 16 with partial rotary 0.5 (rotary dim 8, mrope [2, 1, 1]),
    indexer heads of 16 (>= the rotary dim, as the config requires), n-gram tables of a few
    hundred rows (primes from 50) split into 4 shards on disk."""
    kw = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=16, shared_expert_intermediate_size=24,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, hc_count=2, hc_lowrank=8,
              ple_layer_ids=[1], ple_embed_dim=16, ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=2,
              ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4,
              indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
              indexer_compress_ratio=4,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                   mrope_section=[2, 1, 1], mrope_interleaved=True))
    kw.update(overrides)
    return kw


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Every weight moves off its init (zero-centred norms, the zero PLE conv, unit dt_bias), so a
    wrongly loaded norm, gate, conv or decay changes the logits."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name.endswith(("A_log", "dt_bias")) else 0.3 if "ngram_embedding" in name else 0.05
            p.add_(torch.randn_like(p) * scale)


def make_qwen4_exp(out: Path, seed: int = 0, vocab: int = 96, *, case: str | None = None, vision: bool = True,
                   max_shard_size: str | None = None, dtype: torch.dtype = torch.float32,
                   **text_overrides) -> T.Qwen4ExpForConditionalGeneration:
    """save_pretrained a random Qwen4-Exp VLM (``case``: one of CASES, then ``text_overrides``);
    returns the transformers model (fp32, eval). vision=False drops `model.visual.*` from disk.
    dtype: the on-disk dtype (the returned model holds the values as written)."""
    tc = text_config(vocab, **{**(CASES[case] if case else {}), **text_overrides})
    cfg = T.Qwen4ExpConfig(text_config=tc, vision_config=dict(TINY_VISION, out_hidden_size=tc["hidden_size"]))
    torch.manual_seed(seed)
    model = T.Qwen4ExpForConditionalGeneration(cfg).eval()
    _perturb(model, seed)
    save_vlm(model, out, dtype, max_shard_size, vision)
    return model


def make_qwen4_exp_text(out: Path, seed: int = 0, vocab: int = 96, *, case: str | None = None,
                        **text_overrides) -> T.Qwen4ExpForCausalLM:
    """save_pretrained a random text-only Qwen4ExpForCausalLM (flat config, `model.*` names)."""
    tc = text_config(vocab, **{**(CASES[case] if case else {}), **text_overrides})
    cfg = T.Qwen4ExpTextConfig(**tc)
    torch.manual_seed(seed)
    model = T.Qwen4ExpForCausalLM(cfg).eval()
    _perturb(model, seed)
    model.save_pretrained(Path(out))
    return model


def prompt(vocab: int, n: int, seed: int = 1, eos: int = 2) -> list[int]:
    """n random token ids with two eos in the middle (n-grams must not reach across them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n,), generator=g).tolist()
    for at in (n // 3, n // 3 + 2):
        if at < n:
            ids[at] = eos
    return ids
