"""Qwen4-Exp's Per-Layer Embedding layer (transformers' ``Qwen4ExpTextPLELayer``), before the
hyper-connection of the layers in ``ple_layers`` (all Gated DeltaNet layers).

Shapes: T tokens, S streams of H (s [T, S H]), E = ple_embed_dim = G heads x row_dim.
    e      [T, E]     the token's G n-gram rows (engine.models.qwen4_exp.ngram), concatenated
    key    = grouped norm(key_proj(e)) [T, S, H];  value = value_proj(e) [T, H]
    query  = grouped norm(s) [T, S, H]
    g      = (key . query) / sqrt(H) per stream, then sign(g) sqrt(max(|g|, 1e-6))
    v      = sigmoid(g) value  [T, S H];  c = grouped norm(v)
    out    = v + silu(conv(c))  added to s

conv: depthwise over the S H channels, kernel K, dilation ngram_size (N), causal: it reads the
previous W = (K - 1) N inputs of the sequence, kept per sequence as the PLE conv window
(engine.models.qwen4_exp.state; zeros before the first token).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv.base import BatchLayout
from engine.models.qwen4_exp.hyper import GroupedRMSNorm


class NGramShards(nn.Module):
    """The n-gram table's parameters as stored: ``shard_0 .. shard_{k-1}``, row chunks of the
    [rows, row_dim] table (engine.models.qwen4_exp.names)."""

    def __init__(self, rows: list[int], row_dim: int) -> None:
        super().__init__()
        self.rows = rows
        for k, n in enumerate(rows):
            self.register_parameter(f"shard_{k}", nn.Parameter(torch.zeros(n, row_dim)))

    def shards(self) -> list[torch.Tensor]:
        return [getattr(self, f"shard_{k}") for k in range(len(self.rows))]


class ShardedTable:
    """engine.models.qwen4_exp.ple_table.PLETable over the model's own shard parameters (read at
    gather time, so the table follows a load_state_dict that replaces them)."""

    def __init__(self, shards: NGramShards) -> None:
        self.module = shards
        self.chunk = shards.rows[0]
        self.num_rows = sum(shards.rows)
        self.row_dim = shards.shard_0.shape[1]

    def gather(self, row_ids: torch.Tensor) -> torch.Tensor:
        parts = self.module.shards()
        flat = row_ids.reshape(-1)
        out = torch.empty(flat.shape[0], self.row_dim, dtype=torch.float32, device=parts[0].device)
        which = torch.div(flat, self.chunk, rounding_mode="floor")
        for k in which.unique().tolist():
            sel = which == k
            out[sel] = parts[k][flat[sel] - k * self.chunk].float()
        return out.view(*row_ids.shape, self.row_dim)

    def prefetch(self, row_ids: torch.Tensor) -> None:
        return None


class PLELayer(nn.Module):
    """Parameter names are the checkpoint's (``ple.*``, the table ``ple.ngram.shard_k``)."""

    def __init__(self, hidden: int, streams: int, embed_dim: int, kernel: int, dilation: int, eps: float,
                 table_rows: list[int], row_dim: int, ple_index: int) -> None:
        super().__init__()
        self.hidden, self.streams, self.ple_index = hidden, streams, ple_index
        width = hidden * streams
        self.dilation, self.window = dilation, (kernel - 1) * dilation
        self.key_proj = nn.Linear(embed_dim, width, bias=False)
        self.value_proj = nn.Linear(embed_dim, hidden, bias=False)
        self.norm_key = GroupedRMSNorm(width, hidden, eps)
        self.norm_query = GroupedRMSNorm(width, hidden, eps)
        self.norm_conv = GroupedRMSNorm(width, hidden, eps)
        self.conv1d = nn.Conv1d(width, width, kernel, groups=width, dilation=dilation, bias=False)
        self.ngram = NGramShards(table_rows, row_dim)

    def forward(self, s: torch.Tensor, rows: torch.Tensor, layout: BatchLayout, state) -> torch.Tensor:
        """s [T, S H], rows [T, G, row_dim] (the gathered n-gram rows) -> s + the PLE output.
        ``state`` holds each sequence's conv window (advanced here; verify rows checkpointed)."""
        t = s.shape[0]
        e = rows.reshape(t, -1).to(s.dtype)
        key = self.norm_key(self.key_proj(e)).view(t, self.streams, self.hidden)
        query = self.norm_query(s).view(t, self.streams, self.hidden)
        g = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)
        g = g.abs().clamp_min(1e-6).sqrt() * g.sign()
        v = (torch.sigmoid(g) * self.value_proj(e)[:, None, :]).flatten(1)
        c = self.norm_conv(v)
        conv = torch.empty_like(c)
        weight = self.conv1d.weight.float()
        for seq_id, start, n in zip(layout.seq_ids, layout.offsets, layout.query_lens):
            window = state.ple_window(self.ple_index, seq_id)  # [S H, W] fp32
            full = torch.cat((window, c[start:start + n].float().t()), dim=1)  # [S H, W + n]
            out = F.conv1d(full[None], weight, groups=full.shape[0], dilation=self.dilation)[0]
            conv[start:start + n] = F.silu(out).t().to(c.dtype)
            ck = state.ple_checkpoint(self.ple_index, seq_id)
            if ck is not None:  # the window after each position, for a speculative rollback
                for j in range(n):
                    ck[j].copy_(full[:, j + 1:j + 1 + self.window])
            window.copy_(full[:, n:])
        return s + v + conv
