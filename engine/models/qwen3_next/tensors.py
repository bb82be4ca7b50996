"""The tensors a Qwen3-Next config implies (ArchSpec.expected_tensors): DeltaNet layers'
``linear_attn.*``, gated attention's doubled q_proj (q and its gate), the shared MLP part."""

from __future__ import annotations

from typing import Iterator

from engine.config import ModelConfig
from engine.loading.expected import layered_tensors, mlp_tensors


def expected_tensors(c: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(canonical name, shape) of every tensor a Qwen3-Next config implies, in layer order
    (engine.loading.validate)."""
    la = c.linear_attn
    assert la is not None
    H, D = c.hidden_size, c.head_dim

    def layer(i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        p = f"model.layers.{i}."
        if c.is_linear_attention_layer(i):
            a = p + "linear_attn."
            yield a + "in_proj_qkvz.weight", (2 * la.key_dim + 2 * la.value_dim, H)
            yield a + "in_proj_ba.weight", (2 * la.num_value_heads, H)
            yield a + "conv1d.weight", (la.conv_dim, 1, la.conv_kernel)
            yield a + "dt_bias", (la.num_value_heads,)
            yield a + "A_log", (la.num_value_heads,)
            yield a + "norm.weight", (la.value_head_dim,)
            yield a + "out_proj.weight", (H, la.value_dim)
        else:
            a = p + "self_attn."
            q_out, kv_out = c.num_heads * D, c.num_kv_heads * D
            yield a + "q_proj.weight", (2 * q_out, H)
            yield a + "k_proj.weight", (kv_out, H)
            yield a + "v_proj.weight", (kv_out, H)
            yield a + "o_proj.weight", (H, q_out)
            if c.attention_bias:
                yield a + "q_proj.bias", (2 * q_out,)
                yield a + "k_proj.bias", (kv_out,)
                yield a + "v_proj.bias", (kv_out,)
                yield a + "o_proj.bias", (H,)
            yield a + "q_norm.weight", (D,)
            yield a + "k_norm.weight", (D,)
        yield from mlp_tensors(c, i)

    return layered_tensors(c, layer)
