"""gpt-oss (OpenAI's open-weight MoE, 20b/120b): every layer sparse; attention with sinks, biases
on q/k/v/o, alternating sliding-window and full layers (``layer_types``), YaRN RoPE; a router
with a bias and a softmax over its top-k; experts with biases and a clamped SwiGLU:

    gate = min(x W_g^T + b_g, limit);  up = clamp(x W_u^T + b_u, -limit, limit)
    out  = ((up + 1) * gate * sigmoid(alpha * gate)) W_d^T + b_d      (alpha 1.702, limit 7.0)

HF layout (transformers 5): ``mlp.router.{weight,bias}``, fused experts
``mlp.experts.gate_up_proj`` [E, H, 2I] (input-major, gate and up *interleaved* along the last
dim: column 2i is gate row i, 2i+1 up row i), ``gate_up_proj_bias`` [E, 2I] (interleaved too),
``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]; the released checkpoints hold the expert
matrices as MXFP4 instead: ``*_blocks`` [E, out, in/32, 16] uint8 + ``*_scales`` [E, out, in/32]
(output-major). Both are split here into canonical per-expert ``[out, in]`` matrices; the expert
biases stay dense tensors (``mlp.{gate,up,down}_proj_bias`` [E, I|H]), so any expert store
format carries them (they live in the store's dense file, beside the router).

The torch layers are the reference; on the CPU the native step runs it (engine.step_gpt_oss).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import REQUIRED, ModelConfig, MoEConfig, _number, _rope_from_hf, gguf_keys, token_ids
from engine.errors import ModelFormatError
from engine.layers.moe import Expert, SparseMoE
from engine.layers.routing import BiasedSoftmaxRouter
from engine.layers.sinks_attention import SinkAttention
from engine.loading.source import expert_name
from engine.models.base import CausalLM, DecoderLayer
from engine.models.spec import ArchSpec

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssParams:
    sliding_window: int
    layer_types: tuple[str, ...]
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        from engine.errors import ConfigError

        if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"layer_types entry {bad[0]!r} is not one of {', '.join(LAYER_TYPES)}")

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def expected_tensors(self, c: ModelConfig):
        return _expected_tensors(c)

    def parameter_counts(self, c: ModelConfig) -> dict[str, int]:
        return _parameter_counts(c)


def params_from_dict(d: Mapping[str, Any]) -> GptOssParams:
    d = dict(d)
    d["layer_types"] = tuple(d.get("layer_types", ()))
    return GptOssParams(**d)


def _int(raw: Mapping[str, Any], key: str, source: object, default: int | None = None) -> int:
    v = raw.get(key)
    if v is None:
        if default is None:
            raise ModelFormatError(source, f"missing required field {key!r}")
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ModelFormatError(source, f"{key} must be an integer")
    return v


def config_from_hf(raw: Mapping[str, Any], source: object) -> ModelConfig:
    layers = _int(raw, "num_hidden_layers", source)
    heads = _int(raw, "num_attention_heads", source)
    hidden = _int(raw, "hidden_size", source)
    types = raw.get("layer_types")
    if types is None:  # transformers' default: sliding on even layers, full on odd ones
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not (isinstance(types, list) and len(types) == layers):
        raise ModelFormatError(source, f"layer_types must list one of {', '.join(LAYER_TYPES)} for "
                                       f"each of the {layers} layers")
    if raw.get("attention_bias", True) is not True:
        raise ModelFormatError(source, "gpt-oss attention without biases (attention_bias false) is "
                                       "not supported")
    vocab = _int(raw, "vocab_size", source)
    bos = token_ids(raw.get("bos_token_id"), "bos_token_id", source, vocab)
    eos = token_ids(raw.get("eos_token_id"), "eos_token_id", source, vocab, allow_list=True)
    return ModelConfig(
        arch="gpt_oss",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=0,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_int(raw, "num_key_value_heads", source, heads),
        head_dim=_int(raw, "head_dim", source, 0) or hidden // heads,
        max_position_embeddings=_int(raw, "max_position_embeddings", source, 131072),
        rms_norm_eps=_number(raw.get("rms_norm_eps", 1e-5), "rms_norm_eps", source),
        rope=_rope_from_hf(raw, source),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=True,
        moe=MoEConfig(num_experts=_int(raw, "num_local_experts", source),
                      top_k=_int(raw, "num_experts_per_tok", source),
                      expert_intermediate_size=_int(raw, "intermediate_size", source),
                      norm_topk_prob=True),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=eos,
        arch_params=GptOssParams(
            sliding_window=_int(raw, "sliding_window", source, 128),
            layer_types=tuple(types),
            swiglu_alpha=_number(raw.get("swiglu_alpha", 1.702), "swiglu_alpha", source),
            swiglu_limit=_number(raw.get("swiglu_limit", 7.0), "swiglu_limit", source)),
    )


# ---------------------------------------------------------------------------------- tensors

def _expected_tensors(c: ModelConfig):
    V, H, D, E = c.vocab_size, c.hidden_size, c.head_dim, c.moe.num_experts
    I = c.moe.expert_intermediate_size
    q_out, kv_out = c.num_heads * D, c.num_kv_heads * D
    yield "model.embed_tokens.weight", (V, H)
    yield "model.norm.weight", (H,)
    if not c.tie_word_embeddings:
        yield "lm_head.weight", (V, H)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (H,)
        yield p + "post_attention_layernorm.weight", (H,)
        for name, out, inp in (("q", q_out, H), ("k", kv_out, H), ("v", kv_out, H), ("o", H, q_out)):
            yield p + f"self_attn.{name}_proj.weight", (out, inp)
            yield p + f"self_attn.{name}_proj.bias", (out,)
        yield p + "self_attn.sinks", (c.num_heads,)
        yield p + "mlp.gate.weight", (E, H)
        yield p + "mlp.gate.bias", (E,)
        yield p + "mlp.gate_proj_bias", (E, I)
        yield p + "mlp.up_proj_bias", (E, I)
        yield p + "mlp.down_proj_bias", (E, H)
        for j in range(E):
            yield expert_name(i, j, "gate_proj"), (I, H)
            yield expert_name(i, j, "up_proj"), (I, H)
            yield expert_name(i, j, "down_proj"), (H, I)


def _parameter_counts(c: ModelConfig) -> dict[str, int]:
    h, hd, m = c.hidden_size, c.head_dim, c.moe
    nh, nkv = c.num_heads, c.num_kv_heads
    attn = h * hd * (2 * nh + 2 * nkv) + hd * (nh + 2 * nkv) + h + nh  # q/k/v/o, biases, sinks
    per_layer = attn + 2 * h + m.num_experts * (h + 1)  # norms, router with bias
    per_expert = 3 * h * m.expert_intermediate_size + 2 * m.expert_intermediate_size + h  # + biases
    dense = c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h + c.num_layers * per_layer
    routed_total = c.num_layers * m.num_experts * per_expert
    routed_active = c.num_layers * m.top_k * per_expert
    embed_read = c.vocab_size * h if not c.tie_word_embeddings else 0
    return {"total": dense + routed_total, "active": dense + routed_active - embed_read + h,
            "dense": dense, "routed_total": routed_total, "routed_active": routed_active}


_EXPERTS_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)"
                         r"(_bias|_blocks|_scales)?$")


def hf_split(stored: str, shape: tuple[int, ...], dtype: str, get, config: ModelConfig):
    """Canonical tensors of one stored gpt-oss expert tensor (see the module docstring); None for
    tensors that are canonical after ``hf_renames``."""
    m = _EXPERTS_RE.match(stored)
    if m is None:
        return None
    layer, kind, suffix = int(m.group(1)), m.group(2), m.group(3) or ""
    moe = config.moe
    E, I, H = moe.num_experts, moe.expert_intermediate_size, config.hidden_size
    p = f"model.layers.{layer}.mlp."
    if suffix == "_scales":
        return []  # read together with its _blocks tensor
    if suffix == "_bias":
        want = (E, 2 * I) if kind == "gate_up_proj" else (E, H)
        _check(stored, shape, want)
        if kind == "down_proj":
            return [(p + "down_proj_bias", (E, H), dtype, lambda: get(stored))]
        return [(p + "gate_proj_bias", (E, I), dtype, lambda: get(stored)[:, 0::2].contiguous()),
                (p + "up_proj_bias", (E, I), dtype, lambda: get(stored)[:, 1::2].contiguous())]
    if suffix == "_blocks":
        from engine.quant.mxfp4 import hf_expert_matrix

        out, inp = (2 * I, H) if kind == "gate_up_proj" else (H, I)
        _check(stored, shape, (E, out, inp // 32, 16))
        scales = stored.removesuffix("_blocks") + "_scales"

        def mx(j: int, rows: slice):
            from engine.quant.mxfp4 import MXFP4, from_hf_blocks

            def load():
                return hf_expert_matrix(get(stored)[j], get(scales)[j], rows)

            def quantized():  # the same bytes as an mxfp4 QuantizedTensor (no re-quantization)
                return from_hf_blocks(get(stored)[j][rows], get(scales)[j][rows])
            quantized.fmt = MXFP4
            load.quantized = quantized
            return load
        if kind == "down_proj":
            return [(expert_name(layer, j, "down_proj"), (H, I), "mxfp4", mx(j, slice(None)))
                    for j in range(E)]
        return [part for j in range(E) for part in (
            (expert_name(layer, j, "gate_proj"), (I, H), "mxfp4", mx(j, slice(0, None, 2))),
            (expert_name(layer, j, "up_proj"), (I, H), "mxfp4", mx(j, slice(1, None, 2))))]
    if kind == "down_proj":  # [E, I, H] input-major
        _check(stored, shape, (E, I, H))
        return [(expert_name(layer, j, "down_proj"), (H, I), dtype,
                 (lambda j=j: get(stored)[j].T.contiguous())) for j in range(E)]
    _check(stored, shape, (E, H, 2 * I))  # gate_up_proj [E, H, 2I], interleaved columns
    return [part for j in range(E) for part in (
        (expert_name(layer, j, "gate_proj"), (I, H), dtype,
         (lambda j=j: get(stored)[j][:, 0::2].T.contiguous())),
        (expert_name(layer, j, "up_proj"), (I, H), dtype,
         (lambda j=j: get(stored)[j][:, 1::2].T.contiguous())))]


def _check(stored: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(want):
        raise ModelFormatError(stored, f"gpt-oss expert tensor has shape {list(shape)}; the config "
                                       f"implies {list(want)}")


# ----------------------------------------------------------------------------------- layers

def expert_linear(x: torch.Tensor, w: Any) -> torch.Tensor:
    """x @ w.T for a float weight or a QuantizedTensor (computed where the weight lives)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w.to(x.dtype))
    from engine.quant.kernels import qlinear

    return qlinear(x.to(w.device), w).to(x.device, x.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssMoE(SparseMoE):
    """SparseMoE with gpt-oss's router and experts (biases, clamped SwiGLU); experts come from
    the provider as usual (resident, or the expert cache's quantized slots)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        nn.Module.__init__(self)
        m, p = cfg.moe, cfg.arch_params
        self.layer = layer
        self.gate = BiasedSoftmaxRouter(cfg.hidden_size, m.num_experts, m.top_k)
        self.shared_expert = self.shared_expert_gate = None
        self.gate_proj_bias = nn.Parameter(torch.empty(m.num_experts, m.expert_intermediate_size))
        self.up_proj_bias = nn.Parameter(torch.empty(m.num_experts, m.expert_intermediate_size))
        self.down_proj_bias = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size))
        self.alpha, self.limit = p.swiglu_alpha, p.swiglu_limit
        self.provider = None
        self.observers = []

    def run_expert(self, e: int, expert: Expert, x: torch.Tensor) -> torch.Tensor:
        g = expert_linear(x, expert.gate) + self.gate_proj_bias[e]
        u = expert_linear(x, expert.up) + self.up_proj_bias[e]
        return expert_linear(clamped_swiglu(g, u, self.alpha, self.limit), expert.down) + self.down_proj_bias[e]


def gpt_oss_layer(cfg: ModelConfig, layer: int) -> DecoderLayer:
    """Sinks attention (windowed on alternate layers) and the biased, clamped-SwiGLU MoE."""
    return DecoderLayer(cfg, layer,
                        attn=SinkAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                           layer, cfg.arch_params.window(layer)),
                        mlp=GptOssMoE(cfg, layer))


class GptOssForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, gpt_oss_layer)

    def native_step_type(self):
        """The native step with sinks, windows, the biased router and the experts' biases and
        clamped SwiGLU (engine.step_gpt_oss)."""
        from engine.step_gpt_oss import GptOssNativeStep

        return GptOssNativeStep

    def dense_linear_slots(self) -> list[tuple[nn.Module, str]]:
        """(parent, name) of every dense linear engine.quant.linear may quantize."""
        out = [(l.self_attn, n) for l in self.model.layers for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        return out + [(self, "lm_head")]




# ------------------------------------------------------------------------------------- GGUF
# llama.cpp's converter (arch "gpt-oss"): the generic names plus attention sinks, a post-attention
# norm named post_attention_norm, stacked experts ffn_{gate,up,down}_exps (gate and up already
# de-interleaved; MXFP4 as GGML type 39) with their biases as ffn_*_exps.bias [E, I|H].

_GGUF_RE = re.compile(r"^blk\.(\d+)\.(attn_sinks\.weight|post_attention_norm\.weight|"
                      r"ffn_(gate|up|down)_exps\.bias)$")


def gguf_split(gname: str, shape: tuple[int, ...], config: ModelConfig):
    m = _GGUF_RE.match(gname)
    if m is None:
        return None
    p = f"model.layers.{m.group(1)}."
    if m.group(2) == "attn_sinks.weight":
        return [(p + "self_attn.sinks", shape, None)]
    if m.group(2) == "post_attention_norm.weight":
        return [(p + "post_attention_layernorm.weight", shape, None)]
    return [(p + f"mlp.{m.group(3)}_proj_bias", shape, None)]


def config_from_gguf(meta: Mapping[str, Any], source: object) -> ModelConfig:
    get = gguf_keys(meta, "gpt-oss", source)

    layers, hidden, heads = int(get("block_count")), int(get("embedding_length")), int(get("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(get("vocab_size", len(tokens) if tokens is not None else REQUIRED))
    scaling = get("rope.scaling.type", "none")
    from engine.config import RopeConfig

    rope = RopeConfig(theta=float(get("rope.freq_base", 150000.0)),
                      type={"none": "default", "yarn": "yarn"}.get(scaling, scaling),
                      factor=float(get("rope.scaling.factor", 1.0) or 1.0),
                      original_max_position_embeddings=int(get("rope.scaling.original_context_length", 4096)),
                      beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                      beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
                      truncate=False)  # gpt-oss's YaRN does not round the correction range
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = [int(meta[f"tokenizer.ggml.{k}"]) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
           if f"tokenizer.ggml.{k}" in meta]
    return ModelConfig(
        arch="gpt_oss", vocab_size=vocab, hidden_size=hidden, intermediate_size=0, num_layers=layers,
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        max_position_embeddings=int(get("context_length", 131072)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)), rope=rope,
        tie_word_embeddings=bool(meta.get("_tied_embeddings", False)), attention_bias=True,
        moe=MoEConfig(num_experts=int(get("expert_count")), top_k=int(get("expert_used_count")),
                      expert_intermediate_size=int(get("expert_feed_forward_length")), norm_topk_prob=True),
        bos_token_id=None if bos is None else int(bos), eos_token_ids=tuple(dict.fromkeys(eos)),
        # llama.cpp: sliding-window attention on every other layer, starting with layer 0
        arch_params=GptOssParams(sliding_window=int(get("attention.sliding_window", 128)),
                                 layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                                   for i in range(layers))),
    )


SPEC = ArchSpec(
    key="gpt_oss",
    hf_architectures=("GptOssForCausalLM",),
    hf_renames=((r"\.mlp\.router\.", ".mlp.gate."),),
    gguf_arch="gpt-oss",
    config_from_hf=config_from_hf,
    params_from_dict=params_from_dict,
    model_class=lambda: GptOssForCausalLM,
    hf_split=hf_split,
    config_from_gguf=config_from_gguf,
    gguf_split=gguf_split,
)
