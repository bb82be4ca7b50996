"""Parameter counts of a Qwen4-Exp config (Qwen4ExpParams.parameter_counts), from its expected
tensors, split into routed experts, the PLE tables and the rest (dense)."""

from __future__ import annotations

import math

from engine.config import ModelConfig
from engine.loading.source import parse_expert_name


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """total / active per token, with ``routed_*`` (experts), ``ple_*`` (n-gram tables: a token
    reads one row per hash head of each PLE layer) and ``dense``. Active counts the embedding as
    one row, the routed experts as top-k of each layer and the PLE tables as their rows read."""
    from engine.models.qwen4_exp.tensors import expected_tensors

    a, m = cfg.arch_params, cfg.moe
    routed = ple = dense = 0
    for name, shape in expected_tensors(cfg):
        n = math.prod(shape)
        if parse_expert_name(name) is not None:
            routed += n
        elif ".ple.ngram." in name:
            ple += n
        else:
            dense += n
    routed_active = routed * m.top_k // m.num_experts if m else 0
    ple_active = len(a.ple_layers) * a.ngram_heads * a.ple_row_dim
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size  # read one row, not whole
    return {"total": dense + routed + ple, "active": dense - embed + cfg.hidden_size + routed_active + ple_active,
            "dense": dense, "routed_total": routed, "routed_active": routed_active,
            "ple_total": ple, "ple_active": ple_active}
