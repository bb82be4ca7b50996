"""The Qwen4-Exp torch model (the reference path): Qwen3.5-MoE's Gated DeltaNet and gated
attention layers and MoE blocks, wired through hyper-connections (hyper.py), with PLE layers
(ple.py) and QSA on the attention layers (qsa_reference.py).

One step (tokens [T] flat over the batch):

    rows_p   = ngram_row_ids(...) for every PLE layer p, from each sequence's n-gram context
               (before layer 1; every table's ``prefetch`` is called with them)
    s        = embed(tokens) repeated hc_count times           [T, S H]
    per layer: s += PLE(s, gather(rows_p))        (PLE layers)
               in, inj = attn_hc.mix(s);  s += inj x mixer(in)   (DeltaNet or QSA attention)
               in, inj = mlp_hc.mix(s);   s += inj x moe(in)
    logits   = lm_head(final mixer(s))                          (no final norm)

``model.ple_tables[p]`` is what the PLE layer p gathers from (default: the checkpoint's shards
in RAM, engine.models.qwen4_exp.ple.ShardedTable); the PLE tier replaces them.

No native step: the native blocks (engine/csrc) fuse a pre-norm and a plain residual add into
each mixer and FFN call, which hyper-connections replace, so every step runs these torch layers
(``native_step_type`` builds nothing; engine.executor then runs ``run_layers``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kv.base import BatchLayout, KVCache
from engine.layers.centred_norm import GatedRMSNorm, _normalised
from engine.layers.deltanet import GatedDeltaNet
from engine.layers.gated_attention import GatedAttention, apply_partial_rotary
from engine.layers.moe import SparseMoE
from engine.layers.rope import Rotary
from engine.models.qwen3_next.model import Qwen3NextForCausalLM
from engine.models.qwen4_exp.hyper import HyperConnection
from engine.models.qwen4_exp.names import shard_rows
from engine.models.qwen4_exp.ngram import ngram_row_ids
from engine.models.qwen4_exp.ple import PLELayer, ShardedTable
from engine.models.qwen4_exp.qsa_reference import QSAIndexer, attend_selected


class SigmoidGatedRMSNorm(GatedRMSNorm):
    """The DeltaNet output norm with ``output_gate_type: sigmoid``: norm(x) w sigmoid(z)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = self.weight * _normalised(x, self.eps).to(x.dtype)
        return (y * torch.sigmoid(z.float())).to(x.dtype)


class QSAAttention(GatedAttention):
    """Gated attention whose queries attend only to the tokens their QSA indexer selects (without
    QSA configured: all of them)."""

    def __init__(self, cfg: ModelConfig, layer: int, kv_layer: int) -> None:
        super().__init__(cfg, layer, kv_layer)
        a = cfg.arch_params
        self.indexer = (QSAIndexer(cfg.hidden_size, a.indexer_heads, a.indexer_head_dim, a.indexer_budget,
                                   a.indexer_ratio, cfg.rms_norm_eps) if a.qsa else None)

    def forward(self, x, cos, sin, layout, kv, state=None, cos_of=None):
        if self.indexer is None:
            return super().forward(x, cos, sin, layout, kv)
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.nh, 2 * self.d).split(self.d, dim=-1)
        q = apply_partial_rotary(self.q_norm(q), cos, sin)
        k = apply_partial_rotary(self.k_norm(self.k_proj(x).view(t, self.nkv, self.d)), cos, sin)
        v = self.v_proj(x).view(t, self.nkv, self.d)
        iq, ik = self.indexer.project(x, cos, sin)
        out = torch.empty(t, self.nh, self.d, dtype=x.dtype, device=x.device)
        for seq_id, start, n, ctx in zip(layout.seq_ids, layout.offsets, layout.query_lens, layout.context_lens):
            sl = slice(start, start + n)
            keys, values = kv.store_and_load(self.kv_layer, seq_id, ctx, k[sl], v[sl])
            raw = state.index_keys(self.kv_layer, seq_id, ctx, ik[sl])
            mask = self.indexer.select(iq[sl], raw, ctx, cos_of)
            out[sl] = attend_selected(q[sl], keys, values, mask, self.nkv)
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(t, self.nh * self.d))


class Qwen4ExpLayer(nn.Module):
    graph_attention = False

    def __init__(self, cfg: ModelConfig, layer: int, kv_layer: int, state_layer: int) -> None:
        super().__init__()
        a = cfg.arch_params
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.linear = cfg.is_linear_attention_layer(layer)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, layer, state_layer)
            if a.output_gate == "sigmoid":
                self.linear_attn.norm = SigmoidGatedRMSNorm(self.linear_attn.dv, eps)
        else:
            self.self_attn = QSAAttention(cfg, layer, kv_layer)
        self.mlp = SparseMoE(cfg, layer)
        self.ple = None
        if layer in a.ple_layers:
            p = a.ple_layers.index(layer)
            rows = shard_rows(a.ngram_hash(cfg, p).num_rows, a.split_ngram_parts)
            self.ple = PLELayer(h, a.hc_count, a.ple_embed_dim, a.ple_conv_kernel, a.ngram_size, eps, rows,
                                a.ple_row_dim, p)
        self.attn_hyper_connection = HyperConnection(h, a.hc_count, a.hc_lowrank, eps)
        self.mlp_hyper_connection = HyperConnection(h, a.hc_count, a.hc_lowrank, eps)

    def forward(self, s, cos, sin, layout, kv, state, ple_rows=None, cos_of=None):
        if self.ple is not None:
            s = self.ple(s, ple_rows, layout, state)
        x, inj = self.attn_hyper_connection.mix(s)
        x = (self.linear_attn(x, layout, state) if self.linear
             else self.self_attn(x, cos, sin, layout, kv, state, cos_of))
        s = HyperConnection.inject(s, x, inj)
        x, inj = self.mlp_hyper_connection.mix(s)
        return HyperConnection.inject(s, self.mlp(x), inj)


class Qwen4ExpDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        a = cfg.arch_params
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers, kv_i, st_i = [], 0, 0
        for i in range(cfg.num_layers):
            layers.append(Qwen4ExpLayer(cfg, i, kv_i, st_i))
            st_i, kv_i = (st_i + 1, kv_i) if cfg.is_linear_attention_layer(i) else (st_i, kv_i + 1)
        self.layers = nn.ModuleList(layers)
        self.hyper_connection_mixer = HyperConnection(cfg.hidden_size, a.hc_count, a.hc_lowrank, cfg.rms_norm_eps,
                                                      inject=False)


class _NoNativeStep:
    """native_step_type() of a model the native blocks cannot run (module doc): builds nothing."""

    @classmethod
    def for_model(cls, model) -> None:
        return None


class Qwen4ExpForCausalLM(Qwen3NextForCausalLM):
    # transformers drops Qwen4-Exp's mtp.* weights: no reference to check a drafter against
    mtp_drafter = False

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = Qwen4ExpDecoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.rotary_dim, max_positions=min(cfg.max_position_embeddings, 4096))
        a = cfg.arch_params
        self.ple_layers = [self.model.layers[i] for i in a.ple_layers]
        self.ple_hashes = [a.ngram_hash(cfg, p) for p in range(len(a.ple_layers))]
        self.ple_tables: list = [ShardedTable(layer.ple.ngram) for layer in self.ple_layers]

    def native_step_type(self):
        return _NoNativeStep

    def ple_row_ids(self, tokens: torch.Tensor, layout: BatchLayout, state) -> list[torch.Tensor]:
        """Every PLE layer's row ids [T, G] of this step (each sequence's tokens after its n-gram
        context), handed to each table's ``prefetch``; the n-gram contexts move past the tokens."""
        if not self.ple_hashes:
            return []
        per_layer: list[list[torch.Tensor]] = [[] for _ in self.ple_hashes]
        cpu = tokens.cpu()
        for seq_id, start, n in zip(layout.seq_ids, layout.offsets, layout.query_lens):
            toks = cpu[start:start + n]
            ctx = state.ngram_context(seq_id).cpu()
            for p, h in enumerate(self.ple_hashes):
                per_layer[p].append(ngram_row_ids(ctx, toks, h))
            state.advance_ngram(seq_id, toks)
        ids = [torch.cat(parts) for parts in per_layer]
        for table, rows in zip(self.ple_tables, ids):
            table.prefetch(rows)
        return ids

    def run_layers(self, tokens: torch.Tensor, layout: BatchLayout, kv: KVCache, state, all_logits: bool,
                   rows: list[int] | None, run_layer=None) -> torch.Tensor:
        """The module doc's step; ``run_layer`` (CUDA graphs) is not used: these layers run as they are."""
        device = self.model.embed_tokens.weight.device
        tokens = tokens.to(device)
        cos, sin = self.rotary.cos_sin(layout.positions().to(device))
        row_ids = self.ple_row_ids(tokens, layout, state)

        def cos_of(positions: torch.Tensor):
            return self.rotary.cos_sin(positions.to(device))

        s = self.model.embed_tokens(tokens).repeat(1, self.config.arch_params.hc_count)
        p = 0
        for layer in self.model.layers:
            ple_rows = None
            if layer.ple is not None:
                ple_rows = self.ple_tables[p].gather(row_ids[p]).to(device)
                p += 1
            s = layer(s, cos, sin, layout, kv, state, ple_rows, cos_of)
        x, _ = self.model.hyper_connection_mixer.mix(s)
        self.tap_hidden(x, layout)
        return self.final_logits(x, layout, all_logits, rows)

    def final_logits(self, x, layout, all_logits, rows=None):
        """The LM head of the final mixer's output (no final norm) for every row, ``rows`` or
        each sequence's last."""
        if not all_logits:
            rows = rows if rows is not None else layout.last_rows()
            x = x[torch.tensor(rows, device=x.device)]
        return self.lm_head(x).float()

    def dense_linear_slots(self) -> list[tuple[nn.Module, str]]:
        """Qwen3-Next's slots (DeltaNet / attention projections, shared experts, LM head); the
        hyper-connection, PLE and indexer linears stay as loaded."""
        return super().dense_linear_slots()
