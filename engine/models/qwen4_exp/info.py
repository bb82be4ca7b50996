"""`moestream info` lines of a Qwen4-Exp (after Qwen3-Next's DeltaNet lines): the PLE tables and
QSA, and the bytes one decoded token reads by part."""

from __future__ import annotations

from engine.config import ModelConfig


def info_lines(cfg: ModelConfig, human) -> list[str]:
    from engine.kv.state import slot_bytes

    a, c = cfg.arch_params, cfg.parameter_counts()
    la = cfg.linear_attn
    n_attn = len(cfg.attention_layers)
    deltanet_state = (cfg.num_layers - n_attn) * sum(la.state_elements()) * 4
    ple_state = a.extra_state_bytes(cfg)
    kv = n_attn * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    index_keys = n_attn * a.indexer_head_dim * 2 if a.qsa else 0
    dense_active = c["active"] - c["routed_active"] - c["ple_active"]
    out = [f"hyper-conn.   {a.hc_count} residual streams (low rank {a.hc_lowrank}) around every mixer and MoE "
           f"block, final mixer before the LM head"]
    if a.ple_layers:
        out.append(f"PLE           layers {[i + 1 for i in a.ple_layers]}: {a.ngram_heads} hashed n-gram heads "
                   f"(orders 2..{a.ngram_size}) x {a.ple_row_dim} dims; tables {human(c['ple_total'])} parameters = "
                   f"{human(c['ple_total'], 'B')} at FP8, {human(2 * c['ple_total'], 'B')} at bf16 (a disk tier, "
                   f"never loaded whole); {len(a.ple_layers) * a.ngram_heads} rows per token")
    if a.qsa:
        out.append(f"QSA           {n_attn} indexed attention layers: {a.indexer_heads} index heads x "
                   f"{a.indexer_head_dim}, each query attends to the top {a.indexer_budget // a.indexer_ratio} "
                   f"blocks of {a.indexer_ratio} tokens ({a.indexer_budget} tokens) plus the incomplete tail")
    out += [
        f"parameters    without the PLE tables: total {human(c['total'] - c['ple_total'])}, active "
        f"{human(c['active'] - c['ple_active'])}",
        f"per token     experts {human(c['routed_active'] * 4.5 / 8, 'B')} (4.5 b/w) | dense "
        f"{human(dense_active * 2, 'B')} (bf16) | PLE rows {human(c['ple_active'], 'B')} (FP8; "
        f"{human(2 * c['ple_active'], 'B')} bf16) | KV {human(kv + index_keys, 'B')} written per token "
        f"(bf16 K/V {human(kv, 'B')} + index keys {human(index_keys, 'B')})",
        f"per sequence  state {human(slot_bytes(cfg), 'B')} (DeltaNet {human(deltanet_state, 'B')} + PLE conv "
        f"windows and n-gram context {human(ple_state, 'B')}, fp32) + KV {human(kv + index_keys, 'B')} "
        f"per context token",
    ]
    return out
