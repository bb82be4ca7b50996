"""Qwen3.5-MoE's multi-token-prediction head (``mtp.*``), the drafter of ``--speculative mtp``.

One MTP block predicts token p+2 from the target's hidden state at position p and token p+1:

    h_p   [T, H]  the target's final hidden state after its final norm (what its LM head reads)
    e     [T, H]  embed_tokens(x_{p+1}) (the target's embedding)
    u = fc(concat(pre_fc_norm_embedding(e), pre_fc_norm_hidden(h_p)))      fc [H, 2H]
    u = one gated full-attention + MoE decoder layer (Qwen3-Next's HybridLayer, reused), at RoPE
        position p+1, on the head's own KV cache
    g = norm(u)                      -> the hidden a further draft step feeds back as its h
    logits = lm_head(g)              (the target's LM head)

Norms are zero-centred (1 + w) as the model's. This is llama.cpp's
``llama_model_qwen35moe::graph_mtp`` (vendored in llama-cpp-python 0.3.36) and vLLM's Qwen3-Next
MTP; transformers has no forward for it.

KV layout: the pair (x_{p+1}, h_p) is cache slot p (slots are contiguous from 0; the RoPE
position is p + 1, so relative positions match the reference exactly).

Weights: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` and
``mtp.layers.0.*`` named as a text layer (``self_attn.*``, ``mlp.gate``, ``mlp.shared_expert*``,
per-expert ``mlp.experts.{j}.*``), read from an HF checkpoint (engine.loading.hf.HFSource).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.config import ModelConfig
from engine.errors import ConfigError, ModelFormatError, quote
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.layers.centred_norm import CentredRMSNorm
from engine.layers.embedding import compute_dtype
from engine.layers.moe import DenseExpert, ResidentExperts
from engine.models.qwen3_next.model import HybridLayer

PREFIX = "mtp."
_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^mtp\.layers\.0\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class MTPHead(nn.Module):
    """The MTP block of a Qwen3.5-MoE (or Qwen3-Next) target; ``target`` lends its embedding,
    LM head and rotary tables (not submodules: the head owns only the mtp.* weights)."""

    def __init__(self, cfg: ModelConfig, target: nn.Module) -> None:
        super().__init__()
        if not cfg.attention_layers or cfg.moe is None:
            raise ConfigError("an MTP head needs a model with full-attention and MoE layers")
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.config = cfg
        self.pre_fc_norm_embedding = CentredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = CentredRMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        # a full-attention MoE layer: built as text layer ``attention_layers[0]`` so that
        # HybridLayer picks gated attention and SparseMoE; kv layer 0 of the head's own cache
        self.layer_index = cfg.attention_layers[0]
        self.layer = HybridLayer(cfg, self.layer_index, kv_layer=0, state_layer=0)
        self.norm = CentredRMSNorm(h, eps)
        self.__dict__["target"] = target  # not a submodule

    def new_cache(self) -> ContiguousKVCache:
        c = self.config
        return ContiguousKVCache(1, c.num_kv_heads, c.head_dim, dtype=self.fc.weight.dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, layout: BatchLayout,
                kv: ContiguousKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T] (x_{p+1}), hidden [T, H] (h_p, post final norm), layout over cache slots p
        -> (logits [T, V] float32, the head's own normed hidden g [T, H])."""
        t = self.target
        dtype = self.fc.weight.dtype
        e = t.model.embed_tokens(tokens.to(self.fc.weight.device)).to(dtype)
        u = self.fc(torch.cat((self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden.to(dtype))), -1))
        positions = layout.positions().to(u.device) + 1  # slot p holds RoPE position p + 1
        cos, sin = t.rotary.cos_sin(positions)
        u = self.layer(u, cos, sin, layout, kv, None)
        g = self.norm(u)
        return t.lm_head(g).float(), g


def mtp_names(source) -> list[str]:
    """The stored ``mtp.*`` tensor names of an HF checkpoint source (empty: no MTP head)."""
    located = getattr(source, "_located", None)
    return sorted(n for n in (located or {}) if n.startswith(PREFIX))


def load_mtp_head(target: nn.Module, source, dtype: torch.dtype | None = None) -> MTPHead:
    """The target's MTP head from an HF checkpoint (HFSource); ModelFormatError when the
    checkpoint has none or more than one MTP layer, or a tensor is missing or misshapen."""
    cfg: ModelConfig = target.config
    if not getattr(target, "mtp_drafter", True):  # a family whose MTP head has no reference here
        raise ConfigError(f"{cfg.arch}: `--speculative mtp` is not supported for this architecture "
                          f"(use --speculative ngram or a draft model)")
    names = mtp_names(source)
    where = getattr(source, "path", "<checkpoint>")
    if not names:
        raise ModelFormatError(where, "no MTP head (mtp.* tensors) in this checkpoint; `--speculative mtp` "
                                      "needs one (GGUF files: not supported, use the HF checkpoint)")
    layers = {int(m.group(1)) for n in names if (m := _LAYER_RE.match(n))}
    if layers != {0}:
        raise ModelFormatError(where, f"MTP layers {sorted(layers)}; exactly one (mtp.layers.0) is supported")
    dtype = dtype or compute_dtype(target)
    with torch.device("meta"):
        head = MTPHead(cfg, target)
    state, experts = {}, {}
    for n in names:
        m = _EXPERT_RE.match(n)
        if m is not None:
            experts.setdefault(int(m.group(1)), {})[m.group(2)] = source._stored_get(n).to(dtype)
        elif n.startswith(PREFIX + "layers.0."):
            state["layer." + n[len(PREFIX + "layers.0."):]] = source._stored_get(n)
        else:
            state[n[len(PREFIX):]] = source._stored_get(n)
    wanted = head.state_dict()
    missing = sorted(set(wanted) - set(state))
    extra = sorted(set(state) - set(wanted))
    if missing or extra:
        what = ("missing " + ", ".join(quote(PREFIX + k.replace("layer.", "layers.0.", 1)) for k in missing[:4])
                if missing else "unexpected " + ", ".join(quote(PREFIX + k) for k in extra[:4]))
        raise ModelFormatError(where, f"MTP head: {what}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(wanted[k].shape):
            raise ModelFormatError(where, f"MTP tensor {quote(k)} has shape {list(v.shape)}, the config "
                                          f"needs {list(wanted[k].shape)}")
    head.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=True)
    n_exp = cfg.moe.num_experts  # type: ignore[union-attr]
    parts = ("gate_proj", "up_proj", "down_proj")
    if sorted(experts) != list(range(n_exp)) or any(sorted(p) != sorted(parts) for p in experts.values()):
        raise ModelFormatError(where, f"MTP head: needs gate/up/down of experts 0..{n_exp - 1} in mtp.layers.0.mlp")
    li = head.layer_index
    head.layer.mlp.provider = ResidentExperts(
        {(li, e): DenseExpert(*(p[k] for k in parts)) for e, p in experts.items()})
    return head.to(target.model.embed_tokens.weight.device).eval()
