"""Routers beyond the softmax-over-all-experts one of engine.layers.moe (same Routing output).

Shape legend: x [T, H]; logits/scores [T, E]; weights [T, K] float32; ids [T, K] int64.

- :class:`BiasedSoftmaxRouter` (gpt-oss): ``logits = x W^T + b``; the top-k logits, softmax over
  those k only (equal to a softmax over all experts renormalised over the top-k).
- :class:`GroupLimitedSigmoidRouter` (DeepSeek-V3): ``scores = sigmoid(x W^T)`` in float32;
  selection uses ``scores + e_score_correction_bias``: the experts are cut into ``n_group``
  equal groups, each group is scored by the sum of its two best biased scores, only the
  ``topk_group`` best groups stay eligible, and the top-k biased scores among them are picked.
  The weights are the *unbiased* scores of the picks, normalised over the top-k when
  ``norm_topk_prob``, times ``routed_scaling_factor``.

``allowed`` (self-speculative drafting) restricts the picks to those experts, as in Router.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.moe import Routing


def _mask_allowed(logits: torch.Tensor, allowed: list[int] | None, top_k: int) -> tuple[torch.Tensor, int]:
    if allowed is None:
        return logits, top_k
    mask = torch.full_like(logits, float("-inf"))
    mask[:, allowed] = 0.0
    return logits + mask, max(1, min(top_k, len(allowed)))


class BiasedSoftmaxRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor, allowed: list[int] | None = None) -> Routing:
        logits = F.linear(x, self.weight, self.bias).float()
        logits, top_k = _mask_allowed(logits, allowed, self.top_k)
        top, ids = torch.topk(logits, top_k, dim=-1)
        return Routing(torch.softmax(top, dim=-1), ids)


class GroupLimitedSigmoidRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 normalize: bool, scaling: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.normalize, self.scaling = normalize, scaling

    def forward(self, x: torch.Tensor, allowed: list[int] | None = None) -> Routing:
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        choice, top_k = _mask_allowed(choice, allowed, self.top_k)
        t, e = choice.shape
        if self.topk_group < self.n_group:
            per_group = choice.view(t, self.n_group, e // self.n_group)
            group_scores = per_group.topk(min(2, e // self.n_group), dim=-1)[0].sum(dim=-1)  # [T, G]
            keep = torch.topk(group_scores, self.topk_group, dim=-1)[1]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            eligible = group_mask[:, :, None].expand(t, self.n_group, e // self.n_group).reshape(t, e)
            choice = choice.masked_fill(~eligible, float("-inf"))
        ids = torch.topk(choice, top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(weights * self.scaling, ids)
