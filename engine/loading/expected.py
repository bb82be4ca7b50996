"""The canonical tensors a config implies, as ``(name, shape)`` (``[out, in]`` for matrices):
the shared decoder's list and its feed-forward part, which architectures with their own layers
reuse for theirs (ArchSpec.expected_tensors). Imports nothing of engine.models."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from engine.config import ModelConfig
from engine.loading.source import expert_name


def layered_tensors(c: ModelConfig, layer_tensors: Callable[[int], Iterable[tuple[str, tuple[int, ...]]]]
                    ) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The embedding, the final norm and (untied) the LM head, then per layer its two norms and
    ``layer_tensors(i)`` (its token mixer and feed-forward part): the frame every decoder shares."""
    V, H = c.vocab_size, c.hidden_size
    yield "model.embed_tokens.weight", (V, H)
    yield "model.norm.weight", (H,)
    if not c.tie_word_embeddings:
        yield "lm_head.weight", (V, H)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (H,)
        yield p + "post_attention_layernorm.weight", (H,)
        yield from layer_tensors(i)


def decoder_tensors(c: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every canonical tensor of the shared decoder (engine.models.base)
    ``c`` implies, lazily, in layer order."""
    H, D = c.hidden_size, c.head_dim
    q_out, kv_out = c.num_heads * D, c.num_kv_heads * D

    def layer(i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        p = f"model.layers.{i}."
        yield p + "self_attn.q_proj.weight", (q_out, H)
        yield p + "self_attn.k_proj.weight", (kv_out, H)
        yield p + "self_attn.v_proj.weight", (kv_out, H)
        yield p + "self_attn.o_proj.weight", (H, q_out)
        if c.attention_bias:
            yield p + "self_attn.q_proj.bias", (q_out,)
            yield p + "self_attn.k_proj.bias", (kv_out,)
            yield p + "self_attn.v_proj.bias", (kv_out,)
        if c.qk_norm:
            yield p + "self_attn.q_norm.weight", (D,)
            yield p + "self_attn.k_norm.weight", (D,)
        yield from mlp_tensors(c, i)

    return layered_tensors(c, layer)


def mlp_tensors(c: ModelConfig, i: int):
    """(name, shape) of layer ``i``'s feed-forward part: the router, every routed expert and the
    (gated) shared expert of a sparse layer, or a dense SwiGLU."""
    p, H = f"model.layers.{i}.", c.hidden_size
    if c.is_moe_layer(i):
        m = c.moe
        assert m is not None  # is_moe_layer is False without a MoE config
        I = m.expert_intermediate_size
        yield p + "mlp.gate.weight", (m.num_experts, H)
        for j in range(m.num_experts):
            yield expert_name(i, j, "gate_proj"), (I, H)
            yield expert_name(i, j, "up_proj"), (I, H)
            yield expert_name(i, j, "down_proj"), (H, I)
        S = m.shared_expert_intermediate_size
        if S:
            yield p + "mlp.shared_expert.gate_proj.weight", (S, H)
            yield p + "mlp.shared_expert.up_proj.weight", (S, H)
            yield p + "mlp.shared_expert.down_proj.weight", (H, S)
            if m.shared_expert_gate:
                yield p + "mlp.shared_expert_gate.weight", (1, H)
    else:
        I = c.intermediate_size
        yield p + "mlp.gate_proj.weight", (I, H)
        yield p + "mlp.up_proj.weight", (I, H)
        yield p + "mlp.down_proj.weight", (H, I)
