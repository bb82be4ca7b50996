"""The seam between file formats and the model: a lazy, validated source of named tensors.

Every loader (HF safetensors directory, GGUF file, expert store) exposes its tensors under
*canonical names* (below), in the orientation torch's ``F.linear`` expects (``[out, in]``), and
reads nothing large until :meth:`TensorSource.get` is called, so a 100 GB checkpoint can be
converted tensor by tensor.

Canonical names (Hugging Face Qwen2-MoE spelling, whatever the source format)::

    model.embed_tokens.weight                          [V, H]
    model.norm.weight                                  [H]
    lm_head.weight                                     [V, H]   absent when embeddings are tied
    model.layers.{i}.input_layernorm.weight            [H]
    model.layers.{i}.post_attention_layernorm.weight   [H]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   q: [Nh*D, H], k/v: [Nkv*D, H], o: [H, Nh*D]
    model.layers.{i}.self_attn.{q,k,v}_proj.bias       optional (Qwen2-MoE)
    model.layers.{i}.self_attn.{q,k}_norm.weight       [D]  (Qwen3-MoE)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight    dense layers
    model.layers.{i}.mlp.gate.weight                   [E, H]  router of a sparse layer
    model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight   routed expert j
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight shared expert
    model.layers.{i}.mlp.shared_expert_gate.weight     [1, H]
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def parse_expert_name(name: str) -> tuple[int, int, str] | None:
    """``(layer, expert, proj)`` for a routed-expert tensor name, else None."""
    m = EXPERT_RE.match(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


@dataclass(frozen=True)
class TensorInfo:
    name: str  # canonical name
    shape: tuple[int, ...]  # logical shape, [out, in] for matrices
    dtype: str  # storage type as the file has it: "f32", "f16", "bf16", "q4_k", ...


class TensorSource(ABC):
    """Lazy read access to a checkpoint's tensors under canonical names."""

    path: str

    @abstractmethod
    def names(self) -> list[str]:
        """All canonical tensor names, sorted."""

    @abstractmethod
    def info(self, name: str) -> TensorInfo:
        """Shape and storage dtype of one tensor, without reading it."""

    @abstractmethod
    def get(self, name: str) -> torch.Tensor:
        """The tensor as float (f32/f16/bf16 as stored; quantized GGUF types dequantized to f32).

        Raises KeyError for an unknown name, ModelFormatError for data that cannot be read."""

    def close(self) -> None:
        """Release file handles and mappings."""

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SHORT_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


class DictSource(TensorSource):
    """Tensors already in memory under canonical names (tests, freshly built checkpoints)."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: str = "<memory>") -> None:
        self.tensors, self.path = tensors, path

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def info(self, name: str) -> TensorInfo:
        t = self.tensors[name]
        return TensorInfo(name, tuple(t.shape), _SHORT_DTYPES.get(t.dtype, str(t.dtype)))

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]
