"""Gated DeltaNet (Qwen3-Next's linear attention) over a flat token batch with per-sequence state.

Shape legend:
    T  tokens of the forward     n  new tokens of one sequence
    Nk key heads, Dk their dim   Nv value heads, Dv their dim (r = Nv / Nk value heads per key head)
    C  conv channels = 2 Nk Dk + Nv Dv (q, k, v side by side)     K  conv kernel (4)

Per token, per value head h (q, k L2-normalised, q scaled by Dk^-1/2, decay g = -exp(A_log) *
softplus(a + dt_bias) <= 0, beta = sigmoid(b)), the state S [Dk, Dv] follows the gated delta rule

    S <- exp(g) S;   S <- S + beta k (v - S^T k)^T;   o = S^T q

State of one sequence and layer: the conv window [C, K-1] (its last K-1 inputs) and S per value
head [Nv, Dk, Dv], both float32, kept by engine.kv.state.RecurrentState.

Two forms of the same rule: ``recurrent_delta_rule`` steps token by token (decode) and
``chunked_delta_rule`` processes chunks of 64 tokens with a few matmuls each (prefill): inside
a chunk with cumulative log-decay G_i, the values actually written (u_i) solve the unit lower
triangular system (I + A) U = beta V - (beta exp(G) K) S0, A_ij = beta_i exp(G_i - G_j) k_i.k_j
for j < i, after which the outputs and the chunk's final state are matmuls of U.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.kv.base import BatchLayout
from engine.layers.centred_norm import GatedRMSNorm
from engine.layers.deltanet_native import decode_step

CHUNK = 64


def _use_triton(device: torch.device) -> bool:
    """The decode step runs as the Triton kernels (engine.layers.deltanet_triton) on CUDA."""
    if device.type != "cuda":
        return False
    from engine.layers import deltanet_triton

    return deltanet_triton.supports(device)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU of n new inputs x [n, C] (float32) after the window [C, K-1]
    of the previous ones, with weight [C, K]; the window is advanced in place. -> [n, C]."""
    k = weight.shape[1]
    full = torch.cat((window, x.t()), dim=1)  # [C, K-1+n]
    out = F.conv1d(full[None], weight[:, None, :], groups=weight.shape[0])[0]  # [C, n]
    window.copy_(full[:, full.shape[1] - (k - 1):])
    return F.silu(out).t()


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """q, k [n, Nv, Dk]; v [n, Nv, Dv]; g, beta [n, Nv]; state [Nv, Dk, Dv] (updated in place).
    -> o [n, Nv, Dv]. One token at a time (the decode form)."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state.mul_(g[t].exp()[:, None, None])
        remembered = torch.einsum("hkv,hk->hv", state, k[t])
        delta = (v[t] - remembered) * beta[t][:, None]
        state.add_(k[t][:, :, None] * delta[:, None, :])
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The same as :func:`recurrent_delta_rule` (same shapes, state updated in place), computed
    ``chunk`` tokens at a time with matmuls (the prefill form); the last chunk may be shorter."""
    qh, kh, vh = (x.transpose(0, 1) for x in (q, k, v))  # [Nv, n, D]
    gh, bh = g.t(), beta.t()  # [Nv, n]
    s = state.clone()
    out = torch.empty_like(vh)
    n = q.shape[0]
    for a in range(0, n, chunk):
        e = min(a + chunk, n)
        c = e - a
        qc, kc, vc, bc = qh[:, a:e], kh[:, a:e], vh[:, a:e], bh[:, a:e]
        cum = gh[:, a:e].cumsum(-1)  # [Nv, c]: log decay from the chunk start through i
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        kb = kc * bc[..., None]
        system = (kb @ kc.transpose(1, 2) * decay).tril(-1)
        system = system + torch.eye(c, dtype=system.dtype, device=system.device)
        rhs = vc * bc[..., None] - (kb * cum.exp()[..., None]) @ s  # [Nv, c, Dv]
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        scores = (qc @ kc.transpose(1, 2)) * decay  # [Nv, c, c], j <= i
        out[:, a:e] = (qc * cum.exp()[..., None]) @ s + scores @ u
        last = cum[:, -1:]  # [Nv, 1]
        s = s * last.exp()[..., None] + (kc * (last - cum).exp()[..., None]).transpose(1, 2) @ u
    state.copy_(s)
    return out.transpose(0, 1)


def reference_step(window: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, state: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor, nk: int, dk: int, dv: int) -> torch.Tensor:
    """One decode step of the Triton kernels (engine.layers.deltanet_triton.decode_step) computed
    by the torch reference (causal_conv, l2norm, recurrent_delta_rule), on any device: for tests
    and bench/gpu_check.py."""
    nv = state.shape[0]
    r = nv // nk
    conv = causal_conv(x[None], window, weight)
    q, k, v = conv.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q = l2norm(q.reshape(1, nk, dk)).repeat_interleave(r, dim=1) * dk ** -0.5
    k = l2norm(k.reshape(1, nk, dk)).repeat_interleave(r, dim=1)
    return recurrent_delta_rule(q, k, v.reshape(1, nv, dv), g[None], beta[None], state)[0]


class GatedDeltaNet(nn.Module):
    """Parameter names are the checkpoint's (``linear_attn.*``)."""

    def __init__(self, cfg: ModelConfig, layer: int, state_layer: int) -> None:
        super().__init__()
        la = cfg.linear_attn
        assert la is not None
        self.layer, self.state_layer = layer, state_layer  # state_layer: index among DeltaNet layers
        self.nk, self.nv, self.dk, self.dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
        self.key_dim, self.value_dim = la.key_dim, la.value_dim
        h, c = cfg.hidden_size, la.conv_dim
        self.in_proj_qkvz = nn.Linear(h, 2 * la.key_dim + 2 * la.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(h, 2 * la.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(c, c, la.conv_kernel, groups=c, bias=False, padding=la.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(la.value_dim, h, bias=False)

    def forward(self, x: torch.Tensor, layout: BatchLayout, state) -> torch.Tensor:
        """x [T, H] -> [T, H]; ``state`` (engine.kv.state.RecurrentState) holds each sequence's
        conv window and delta-rule matrices, already positioned at its context length."""
        t, r = x.shape[0], self.nv // self.nk
        qkvz = self.in_proj_qkvz(x).view(t, self.nk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.nk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1).float()
        beta = torch.sigmoid(b.reshape(t, self.nv).float())
        g = -self.A_log.float().exp() * F.softplus(a.reshape(t, self.nv).float() + self.dt_bias.float())
        weight = self.conv1d.weight[:, 0, :].float().contiguous()
        out = torch.empty(t, self.nv, self.dv, dtype=torch.float32, device=x.device)
        for seq_id, start, n in zip(layout.seq_ids, layout.offsets, layout.query_lens):
            window, matrix = state.layer_state(self.state_layer, seq_id)
            ck = state.checkpoint(self.state_layer, seq_id)
            if n == 1 or ck is not None:
                # decode, or a speculative verify row: token by token in the decode form (the
                # numbers of plain decoding), keeping the state after each for a rollback
                for i in range(start, start + n):
                    out[i] = self._token(mixed[i], window, weight, matrix, g[i], beta[i])
                    if ck is not None:
                        ck[0][i - start].copy_(window)
                        ck[1][i - start].copy_(matrix)
                continue
            out[start:start + n] = self._tokens(mixed[start:start + n], window, weight, matrix,
                                                g[start:start + n], beta[start:start + n])
        y = self.norm(out.to(x.dtype), z.reshape(t, self.nv, self.dv))
        return self.out_proj(y.reshape(t, self.value_dim))

    def _token(self, x, window, weight, matrix, g, beta) -> torch.Tensor:
        """One token [C] -> o [Nv, Dv]: the fused native step where it runs
        (deltanet_step in engine/csrc/deltanet_block.cpp), the Triton step on CUDA
        (engine.layers.deltanet_triton), else the torch reference; window and matrix advance."""
        if _use_triton(x.device):
            from engine.layers import deltanet_triton

            return deltanet_triton.decode_step(window, weight, x.contiguous(), matrix, g.contiguous(),
                                               beta.contiguous(), self.nk, self.dk, self.dv)
        o = decode_step(window, weight, x, matrix, g.contiguous(), beta.contiguous(), self.nk, self.dk, self.dv)
        if o is not None:
            return o
        return self._tokens(x[None], window, weight, matrix, g[None], beta[None])[0]

    def _tokens(self, x, window, weight, matrix, g, beta) -> torch.Tensor:
        """n tokens [n, C] of one sequence -> o [n, Nv, Dv] (torch; the chunked rule for n > 1)."""
        n, r = x.shape[0], self.nv // self.nk
        conv = causal_conv(x, window, weight)
        qs, ks, vs = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        qs = l2norm(qs.reshape(n, self.nk, self.dk)).repeat_interleave(r, dim=1) * self.dk ** -0.5
        ks = l2norm(ks.reshape(n, self.nk, self.dk)).repeat_interleave(r, dim=1)
        rule = recurrent_delta_rule if n == 1 else chunked_delta_rule
        return rule(qs, ks, vs.reshape(n, self.nv, self.dv), g, beta, matrix)
