"""Rotary position embeddings (HF "rotate_half" layout) with the scaling variants our configs use.

Shapes: positions [T]; x [T, N, D]; cos/sin [T, D] (the D/2 frequencies repeated twice).
The tables are computed on the CPU whatever device context builds the model (on the meta device
they would run through torch's reference decompositions, whose first use imports torch._dynamo
and sympy: ~70 MB of RSS) and move to where the model runs on first use (``cos_sin``).
"""

from __future__ import annotations

import math

import torch

from engine.config import RopeConfig

CPU = torch.device("cpu")


def inv_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] (float32) and the factor that scales cos/sin."""
    inv, scale = _scaled_inv_frequencies(rope, head_dim)
    if rope.freq_factors:
        factors = torch.tensor(rope.freq_factors, dtype=torch.float32, device=CPU)
        if factors.numel() != inv.numel():
            from engine.errors import ConfigError

            raise ConfigError(f"rope freq_factors has {factors.numel()} entries; head_dim {head_dim} "
                              f"needs {inv.numel()}")
        inv = inv / factors
    return inv, scale


def _scaled_inv_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    d = head_dim
    base = rope.theta
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=CPU) / d))
    if rope.type == "default":
        return inv, 1.0
    if rope.type == "linear":
        return inv / rope.factor, 1.0
    if rope.type == "llama3":
        # Long wavelengths are interpolated by `factor`, short ones kept, a smooth blend between.
        old = rope.original_max_position_embeddings
        low_wl = old / rope.low_freq_factor
        high_wl = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, blended, scaled), 1.0
    if rope.type == "yarn":
        return _yarn(rope, d)
    raise AssertionError(rope.type)  # RopeConfig validates the type


def _yarn(rope: RopeConfig, d: int) -> tuple[torch.Tensor, float]:
    factor, base = rope.factor, rope.theta

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.attention_factor
    if attn is None:
        if rope.mscale and rope.mscale_all_dim:
            attn = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attn = mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=CPU) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, d, 2, dtype=torch.float32, device=CPU) / d)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv = (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
    return inv, float(attn)


class Rotary:
    """Precomputed cos/sin tables, grown on demand."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int = 4096) -> None:
        self.inv_freq, self.scale = inv_frequencies(rope, head_dim)
        self._cos = self._sin = torch.empty(0, device=CPU)
        self._grow(max_positions)

    def _grow(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32, device=CPU)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos() * self.scale, emb.sin() * self.scale

    def tables(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos/sin tables [>= need, D] (float32), grown to cover positions < need."""
        if need > self._cos.shape[0]:
            self._grow(max(need, 2 * self._cos.shape[0]))
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._cos.shape[0]:
            self._grow(max(need, 2 * self._cos.shape[0]))
        if self._cos.device != positions.device:  # tables live where the model runs
            self._cos, self._sin = self._cos.to(positions.device), self._sin.to(positions.device)
        return self._cos[positions], self._sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, N, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + rotated * sin
