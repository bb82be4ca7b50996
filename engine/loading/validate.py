"""Check a TensorSource against the ModelConfig it claims to implement (shared by all loaders).

``expected_shapes`` lists every canonical tensor the config implies with its logical shape
(``[out, in]`` for matrices, see engine.loading.source). ``check_source`` compares a source's
names, shapes and storage dtypes against it *before* anything is read, so a config.json that
disagrees with the weights fails with a message naming the file and tensor instead of a shape
error deep inside a matmul (or, worse, a silently wrong broadcast).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection, Iterator

from engine.config import ModelConfig
from engine.errors import ModelFormatError
from engine.loading.expected import decoder_tensors
from engine.loading.source import TensorSource
from engine.models.registry import get_spec

log = logging.getLogger(__name__)

FLOAT_DTYPES = frozenset({"f32", "f16", "bf16"})
# Tensors every layer needs whatever its kind: two norms, q/k/v/o, and an MLP of at least three
# (gate/up/down; a sparse layer has a router plus three per expert).
MIN_TENSORS_PER_LAYER = 9
MIN_GLOBAL_TENSORS = 2  # embedding, final norm
TENSORS_PER_EXPERT = 3


@dataclass(frozen=True)
class CountFields:
    """Where a source's declared counts come from, for messages: the file and its fields."""

    file: str
    layers: str = "num_layers"
    experts: str = "num_experts"


def _gguf_dequantizable() -> frozenset[str]:
    """GGML storage types GGUFSource.get can dequantize (lower-case ggml names, "q4_k"...).
    A type outside this set is rejected here, before loading, not deep inside get()."""
    from engine.loading.gguf_quants import DEQUANTIZERS, GGML_TYPES

    return frozenset(GGML_TYPES[i].name for i in DEQUANTIZERS)


# mxfp4: gpt-oss's HF experts; f8_e4m3: DeepSeek's block-FP8 weights (both dequantized by get())
SUPPORTED_DTYPES = FLOAT_DTYPES | _gguf_dequantizable() | {"mxfp4", "f8_e4m3"}


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor name ``config`` implies -> its shape. Its size is proportional to
    the declared counts: call only after :func:`check_declared_counts`."""
    return dict(iter_expected(config))


def iter_expected(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every canonical tensor ``config`` implies, lazily, in layer order:
    the architecture's own list (ArchSpec.expected_tensors) or the shared decoder's."""
    own = get_spec(config.arch).expected_tensors
    yield from (own or decoder_tensors)(config)


def check_declared_counts(config: ModelConfig, source: TensorSource) -> None:
    """Refuse a config whose declared layer or expert count the source's tensors cannot supply,
    *before* anything proportional to the count (expected_shapes, per-expert lists) is built:
    a config.json or GGUF header declaring 10^9 layers or experts must cost nothing.

    Both bounds are necessary conditions of :func:`check_source` (which needs every tensor of
    every layer and expert to be present), so no valid checkpoint is refused here."""
    fields: CountFields = getattr(source, "count_fields", None) or CountFields(str(source.path))
    names = source.names()
    layers = config.num_layers
    problem = None
    if layers * MIN_TENSORS_PER_LAYER + MIN_GLOBAL_TENSORS > len(names):
        problem = (f"{fields.layers} declares {layers} layers, which need at least "
                   f"{layers * MIN_TENSORS_PER_LAYER + MIN_GLOBAL_TENSORS} tensors, but the "
                   f"checkpoint holds {len(names)}")
    elif config.moe is not None:
        sparse, experts = config.num_moe_layers, config.moe.num_experts
        needed = sparse * experts * TENSORS_PER_EXPERT
        if needed > len(names):
            problem = (f"{fields.experts} declares {experts} experts in each of {sparse} sparse "
                       f"layers ({needed} expert tensors), but the checkpoint holds only "
                       f"{len(names)} tensors")
    if problem is None:
        return
    # Some expected tensor must be absent; naming the first one costs at most len(names) steps.
    present = set(names)
    missing = next((n for n, _ in iter_expected(config) if n not in present), None)
    raise ModelFormatError(fields.file, problem + (f" (first missing: {missing!r})" if missing else ""))


def _where(source: TensorSource, name: str) -> str:
    """The most specific file to blame: the shard holding ``name`` if the source can tell."""
    file_of = getattr(source, "file_of", None)
    if callable(file_of):
        try:
            return str(file_of(name))
        except KeyError:
            pass
    return str(source.path)


def check_source(config: ModelConfig, source: TensorSource,
                 allowed_dtypes: Collection[str] | None = None) -> None:
    """Raise ModelFormatError (file + tensor) on the first missing tensor, wrong shape or
    unsupported storage dtype. Extra tensors (rotary ``inv_freq`` buffers, lm_head of a tied
    model, ...) are ignored with a debug log. Reads only metadata."""
    allowed = SUPPORTED_DTYPES if allowed_dtypes is None else frozenset(allowed_dtypes)
    check_declared_counts(config, source)
    expected = expected_shapes(config)
    present = set(source.names())
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFormatError(
            source.path,
            f"tensor {missing[0]!r} is missing{more}; the config ({config.arch}, "
            f"{config.num_layers} layers) implies it with shape {list(expected[missing[0]])}",
        )
    for name, shape in expected.items():
        info = source.info(name)
        if tuple(info.shape) != shape:
            raise ModelFormatError(
                _where(source, name),
                f"tensor {name!r} has shape {list(info.shape)} but the config implies {list(shape)}",
            )
        if info.dtype not in allowed:
            raise ModelFormatError(
                _where(source, name),
                f"tensor {name!r} has unsupported dtype {info.dtype!r}; supported: "
                f"{', '.join(sorted(allowed))}",
            )
    extra = sorted(present - expected.keys())
    if extra:
        log.debug("%s: ignoring %d tensors the config does not use (e.g. %s)",
                  source.path, len(extra), ", ".join(extra[:3]))
