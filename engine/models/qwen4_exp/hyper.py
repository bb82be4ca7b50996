"""Hyper-connections of Qwen4-Exp (transformers' ``Qwen4ExpTextGatedResidual``).

The residual is S = hc_count streams of width H side by side: s [T, S H]. Before each mixer and
each MoE block (and once more before the LM head):

    n   = grouped RMSNorm of s (each stream normalised on its own, times (1 + w), w [S H])
    a   = sigmoid(up(silu(down(n) / S)))                 [T, S H]  (down: S H -> hc_lowrank)
    in  = mean over streams of a * n                      [T, H]    the block's input
    inj = 2 sigmoid(block_inject(n) / S)                  [T, S]    (not in the final mixer)

and after the block: s <- s + inj[:, :, None] * out[:, None, :] (flattened back to [T, S H]).
The streams exist only inside a step: the first layer's are S copies of the token embedding,
the final mixer's ``in`` goes to the LM head (no other final norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ConfigError


class GroupedRMSNorm(nn.Module):
    """RMSNorm over groups of ``group`` features ([..., G group] -> same), weight (1 + w) [G group],
    in float32 like the reference."""

    def __init__(self, dim: int, group: int, eps: float) -> None:
        super().__init__()
        if dim % group:
            raise ConfigError(f"grouped RMSNorm: width {dim} is not a multiple of the group {group}")
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float().unflatten(-1, (-1, self.group))
        y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class HyperConnection(nn.Module):
    """One gated residual (module doc); ``inject`` False: the final mixer."""

    def __init__(self, hidden: int, streams: int, lowrank: int, eps: float, inject: bool = True) -> None:
        super().__init__()
        self.hidden, self.streams = hidden, streams
        width = hidden * streams
        self.hc_norm = GroupedRMSNorm(width, hidden, eps)
        self.input_mix_weight_down = nn.Linear(width, lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(lowrank, width, bias=False)
        self.block_inject_weight = nn.Linear(width, streams, bias=False) if inject else None

    def mix(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """s [T, S H] -> (the block's input [T, H], injection weights [T, S] or None)."""
        n = self.hc_norm(s)
        a = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(n) / self.streams)))
        mixed = (a * n).unflatten(-1, (self.streams, self.hidden)).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(n) / self.streams)

    @staticmethod
    def inject(s: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """s [T, S H] + weights [T, S] x out [T, H] per stream."""
        return s + (weights[:, :, None] * out[:, None, :]).flatten(1)
