"""Hashed n-gram row ids of Qwen4-Exp's Per-Layer Embedding (PLE).

Each PLE layer (ple_layer_index p = 0..P-1, in layer order) has G = (N - 1) * heads_per_ngram
hash heads (N = ngram_size): heads_per_ngram for each n-gram order g = 2..N. A token at position
i forms, for order g, the id

    mixed_g(i) = XOR_{s=0..g-1} ( t(i - s) * m_p[s] )          (int64, no overflow: see below)
    row(i, head) = mixed_g(i) mod V_head + offset_head

where t(i - s) is the token s places back, replaced by ``eos`` when that place is before the
start of the sequence or when an ``eos`` lies in t(i - s) .. t(i - 1) (an n-gram never reaches
across a document boundary; t(i) itself may be eos). The V_head are distinct primes: head h of
layer p takes the (p G + h + 1)-th prime >= ngram_vocab_size_base; the heads' tables sit end to
end in one table of sum(V) rows padded up to a multiple of ``make_ngram_vocab_size_divisible_by``.

Multipliers m_p[s] (s = 0..N-1): odd numbers below (2^63 - 1) / vocab_size drawn from splitmix64
of (seed + 10007 p + 0x9E3779B97F4A7C15 (s + 1)) mod 2^64, so t * m < 2^63 for every token id
and the int64 products are exact.

Only the last N - 1 token ids of a sequence are needed to continue it (the n-gram context:
a per-sequence state, ``eos``-filled before the first token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_LAYER_STRIDE = 10007


def splitmix64(x: int) -> int:
    """One output of the splitmix64 generator whose state is ``x - golden`` (Steele et al.)."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> tuple[int, ...]:
    """m_p[0..N-1] of one PLE layer (module doc)."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_STRIDE * ple_layer_index
    return tuple(2 * (splitmix64((base + _GOLDEN * (s + 1)) & _MASK64) % half) + 1 for s in range(ngram_size))


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


@lru_cache(maxsize=64)
def primes_from(start: int, count: int) -> tuple[int, ...]:
    """The first ``count`` primes >= start."""
    out, n = [], start
    while len(out) < count:
        if _is_prime(n):
            out.append(n)
        n += 1
    return tuple(out)


@dataclass(frozen=True)
class NGramHash:
    """Everything needed to hash one PLE layer's n-grams (module doc)."""

    ngram_size: int
    heads_per_ngram: int
    multipliers: tuple[int, ...]  # [N]
    head_sizes: tuple[int, ...]  # [G] primes
    head_offsets: tuple[int, ...]  # [G] first row of each head
    num_rows: int  # sum(head_sizes) padded to the divisor
    eos: int

    @property
    def num_heads(self) -> int:
        return len(self.head_sizes)


def ngram_hash(*, vocab_size: int, ngram_size: int, heads_per_ngram: int, vocab_base: int, divisor: int,
               seed: int, ple_layer_index: int, eos: int) -> NGramHash:
    """The hash of PLE layer ``ple_layer_index`` (0-based among the PLE layers)."""
    g = (ngram_size - 1) * heads_per_ngram
    sizes = primes_from(vocab_base, (ple_layer_index + 1) * g)[ple_layer_index * g:]
    return stated_hash(multipliers(vocab_size, ngram_size, ple_layer_index, seed), sizes, heads_per_ngram,
                       divisor, eos)


def stated_hash(multipliers: tuple[int, ...], head_sizes: tuple[int, ...], heads_per_ngram: int, divisor: int,
                eos: int) -> NGramHash:
    """The hash of a PLE layer whose constants a file states (a GGUF: multipliers [N], head vocab
    sizes [G]); the heads' tables end to end, as ngram_hash lays them out."""
    offsets = tuple(sum(head_sizes[:h]) for h in range(len(head_sizes)))
    rows = math.ceil(sum(head_sizes) / divisor) * divisor
    return NGramHash(len(multipliers), heads_per_ngram, tuple(multipliers), tuple(head_sizes), offsets, rows, eos)


def shifted_tokens(history: torch.Tensor, shift: int, eos: int) -> torch.Tensor:
    """history [L] (int64) -> [L]: t(i - shift), or eos where that is before the start or an eos
    lies in history[i - shift .. i - 1]."""
    if shift == 0:
        return history
    n = history.shape[0]
    is_eos = (history == eos).long()
    before = torch.cat((is_eos.new_zeros(1), is_eos.cumsum(0)))  # before[j]: eos count in [0, j)
    i = torch.arange(n, device=history.device)
    src = i - shift
    ok = src >= 0
    srcc = src.clamp_min(0)
    ok &= (before[i] - before[srcc]) == 0
    return torch.where(ok, history[srcc], torch.full_like(history, eos))


def ngram_row_ids(context: torch.Tensor, tokens: torch.Tensor, h: NGramHash) -> torch.Tensor:
    """Row ids of n new tokens of one sequence: context [N-1] (the sequence's last N-1 token ids
    before them, eos-filled at its start), tokens [n] -> [n, G] int64 rows of the layer's table."""
    history = torch.cat((context.long(), tokens.long()))
    shifted = [shifted_tokens(history, s, h.eos) for s in range(h.ngram_size)]
    mult = torch.tensor(h.multipliers, dtype=torch.long, device=history.device)
    sizes = torch.tensor(h.head_sizes, dtype=torch.long, device=history.device)
    offsets = torch.tensor(h.head_offsets, dtype=torch.long, device=history.device)
    blocks, mixed = [], shifted[0] * mult[0]
    for g in range(2, h.ngram_size + 1):
        mixed = torch.bitwise_xor(mixed, shifted[g - 1] * mult[g - 1])
        a = (g - 2) * h.heads_per_ngram
        heads = slice(a, a + h.heads_per_ngram)
        blocks.append(torch.remainder(mixed[:, None], sizes[heads]) + offsets[heads])
    return torch.cat(blocks, dim=1)[context.shape[0]:]


def next_context(context: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The n-gram context after ``tokens``: the last N-1 ids of context + tokens."""
    k = context.shape[0]
    return torch.cat((context.long(), tokens.long()))[-k:] if k else context
