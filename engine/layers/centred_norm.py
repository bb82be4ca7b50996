"""The two RMSNorm variants of Qwen3-Next, in float32 like the reference.

CentredRMSNorm   weight stored zero-centred, applied as (1 + w); checkpoints initialise w = 0
GatedRMSNorm     normalise, times w, times silu(z) (the Gated DeltaNet output norm, per head)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class CentredRMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalised(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z [..., dim]: the norm over the last dim of x, gated by silu(z)."""
        y = self.weight * _normalised(x, self.eps).to(x.dtype)
        return (y * F.silu(z.float())).to(x.dtype)
